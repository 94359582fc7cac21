"""Prompt + images -> token ids with expanded image tokens and the images' pixels and placeholders.

Uses the checkpoint's own Hugging Face processor (image processor, chat template, and its rule
for how many `<image>` tokens one image becomes), so prompts match what transformers builds.

Chat messages are OpenAI-shaped; an image part is `{"type": "image", "image": <PIL.Image>}`
(the caller has already loaded `image_url` parts, see multimodal.image_input.load_image).
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from deepinfer.multimodal.image_input import (ImageInputError, MediaPolicy, check_image_count,
                                              image_content_hash, load_image)
from deepinfer.wire.mm_inputs import ImagePlaceholder, MultiModalInputs, PixelArray

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


class MultiModalProcessor:
    def __init__(self, hf_processor: Any, image_token_id: int) -> None:
        self.hf_processor = hf_processor
        self.tokenizer = hf_processor.tokenizer
        self.image_token_id = image_token_id

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "MultiModalProcessor":
        from transformers import AutoConfig, AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(model_dir)
            config = AutoConfig.from_pretrained(model_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the image processor of {model_dir}: {e}") from e
        image_token_id = getattr(config, "image_token_id", None)
        if image_token_id is None:
            image_token_id = getattr(config, "image_token_index", None)
        if image_token_id is None or not hasattr(processor, "image_processor"):
            raise ValueError(f"{model_dir} is not a vision-language checkpoint with an image processor")
        return cls(processor, int(image_token_id))

    # ---- chat --------------------------------------------------------------------------------
    def process_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                     chat_template: str | None = None) -> tuple[list[int], MultiModalInputs | None]:
        """Apply the chat template (image parts become the model's image marker) and process."""
        converted, images = split_chat_images(messages)
        kwargs = {"chat_template": chat_template} if chat_template else {}
        prompt = self.hf_processor.apply_chat_template(
            converted, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.process_prompt(prompt, images)

    # ---- prompt ------------------------------------------------------------------------------
    def process_prompt(self, text: str, images: list[Any]) -> tuple[list[int], MultiModalInputs | None]:
        """`text` holds one image marker (`<image>`) per image, in order. Returns the token ids
        (image markers expanded) and the images' placeholders and pixels (None without images)."""
        if not images:
            ids = [int(t) for t in self.hf_processor(text=text, return_tensors="np")["input_ids"][0]]
            if self.image_token_id in ids:
                raise ValueError("the prompt has an image marker but no image was given")
            return ids, None
        marker = getattr(self.hf_processor, "image_token", "<image>")
        marker = str(marker)
        if text.count(marker) != len(images):
            raise ValueError(f"the prompt has {text.count(marker)} image markers ({marker!r}) "
                             f"for {len(images)} images")
        encoded = self.hf_processor(text=text, images=list(images), return_tensors="np")
        token_ids = [int(t) for t in encoded["input_ids"][0]]
        pixel_values = np.asarray(encoded["pixel_values"], dtype=np.float32)  # [N, 3, H, W]
        if pixel_values.ndim == 5:  # Idefics3: [1, crops, 3, H, W]; each crop is one unit
            pixel_values = pixel_values[0]
        spans = image_token_spans(token_ids, self.image_token_id, len(pixel_values))
        if len(pixel_values) == len(images):
            hashes = [image_content_hash(image) for image in images]
        else:  # crops of images: hashed by their pixels (the same image gives the same crops)
            hashes = [hashlib.sha256(p.tobytes() + str(p.shape).encode()).hexdigest() for p in pixel_values]
        placeholders = [ImagePlaceholder(h, start, length) for h, (start, length) in zip(hashes, spans)]
        pixels = [PixelArray.from_numpy(p) for p in pixel_values]
        return token_ids, MultiModalInputs(placeholders, pixels)


def load_message_images(messages: list[dict[str, Any]],
                        policy: MediaPolicy | None = None) -> list[dict[str, Any]]:
    """OpenAI messages with every `image_url` part loaded: {"type": "image", "image": PIL}.
    Raises ImageInputError (a ValueError) for a refused or bad image or too many images."""
    policy = policy or MediaPolicy()
    out, num_images = [], 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                num_images += 1
                check_image_count(num_images, policy)
                parts.append({"type": "image", "image": load_image(url, policy)})
            elif kind in ("image", "image_pil"):
                image = part.get("image", part.get("image_pil"))
                if image is None or not hasattr(image, "size"):
                    raise ImageInputError("an image part must carry a PIL image")
                num_images += 1
                check_image_count(num_images, policy)
                parts.append({"type": "image", "image": image})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out


def split_chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages with image parts as {"type": "image"} (what HF chat templates expect) and the
    images in prompt order."""
    images: list[Any] = []
    converted = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") in IMAGE_PART_TYPES:
                    image = part.get("image", part.get(part.get("type")))
                    if image is None or not hasattr(image, "size"):
                        raise ValueError("an image content part carries no loaded image")
                    images.append(image)
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        converted.append(message)
    return converted, images


def image_token_spans(token_ids: list[int], image_token_id: int, num_images: int) -> list[tuple[int, int]]:
    """(offset, length) of each image's run of image tokens. Every image of a LLaVA prompt has
    the same number of tokens, so adjacent images (one long run) split evenly."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if num_images == 0 or len(positions) % num_images:
        raise ValueError(f"{len(positions)} image tokens do not split into {num_images} images")
    length = len(positions) // num_images
    spans = []
    for k in range(num_images):
        run = positions[k * length:(k + 1) * length]
        if run[-1] - run[0] != length - 1:
            raise ValueError("an image's tokens are not contiguous in the prompt")
        spans.append((run[0], length))
    return spans


def vision_language_checkpoint(model: str | None) -> str | None:
    """`model` if it is a Hugging Face directory of a vision-language checkpoint, else None."""
    import json
    import os

    from deepinfer.models.model_config import VISION_LANGUAGE_ARCHITECTURES

    if model is None or not os.path.isdir(os.path.expanduser(model)):
        return None
    path = os.path.expanduser(model)
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            architectures = json.load(f).get("architectures") or ()
    except (OSError, ValueError):
        return None
    return path if any(a in VISION_LANGUAGE_ARCHITECTURES for a in architectures) else None
