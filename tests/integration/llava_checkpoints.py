"""Tiny random-weight LLaVA checkpoints (CLIP and SigLIP towers) written by transformers
`save_pretrained` together with their processor, for the vision reference tests.

The tokenizer is the default model's (SmolLM2, ChatML template) plus an `<image>` token, so the
text vocabulary is len(tokenizer) and every sampled id decodes. Every parameter is redrawn from
a seeded generator (tests.integration.tiny_models.seeded_random_model); the LM head is drawn
wide so greedy picks are decisive, the projector so image rows move the logits.
"""
from __future__ import annotations

import os

import numpy as np

from tests.integration.tiny_models import seeded_random_model

IMAGE_TOKEN = "<image>"

# ChatML like SmolLM2's, with image parts (OpenAI `image_url` parts become {"type": "image"}).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> (tower, image size, patch, vision_feature_layer, select strategy)
LLAVA_KINDS = {
    "clip": ("clip", 32, 8, -2, "default"),        # 16 patches + CLS, CLS dropped -> 16 tokens
    "siglip": ("siglip", 32, 8, -1, "full"),       # 16 patches, no CLS -> 16 tokens
    "clip_full_multi": ("clip", 24, 8, [-3, -1], "full"),  # 9 patches + CLS kept, 2 layers concatenated
}


def _std(name: str) -> float:
    if name.endswith("lm_head.weight"):
        return 0.4
    if "multi_modal_projector" in name:
        return 0.3
    if name.endswith(".bias"):
        return 0.05
    return 0.08


def write_tiny_llava(directory: str, kind: str, tokenizer, seed: int = 0) -> str:
    """Save a seeded LLaVA model of `kind` (see LLAVA_KINDS) and its LlavaProcessor to
    `directory`; returns it."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, SiglipImageProcessor,
                              SiglipVisionConfig)

    tower, size, patch, layer, strategy = LLAVA_KINDS[kind]
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision_args = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                       image_size=size, patch_size=patch)
    if tower == "clip":
        vision = CLIPVisionConfig(**vision_args, projection_dim=32)
        image_processor = CLIPImageProcessor(size={"shortest_edge": size},
                                             crop_size={"height": size, "width": size})
    else:
        vision = SiglipVisionConfig(**vision_args)
        image_processor = SiglipImageProcessor(size={"height": size, "width": size})
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                         image_seq_length=(size // patch) ** 2)
    model, _ = seeded_random_model(config, seed, _std, model_class=LlavaForConditionalGeneration)
    model.save_pretrained(directory)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                               vision_feature_select_strategy=strategy, chat_template=CHAT_TEMPLATE,
                               image_token=IMAGE_TOKEN, num_additional_image_tokens=int(tower == "clip"))
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def synthetic_image(seed: int, size: tuple[int, int] = (40, 36)):
    """A random RGB PIL image (not square, so resizing and cropping matter)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def hf_llava(directory: str):
    """transformers' fp32 LlavaForConditionalGeneration and processor for `directory`."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(directory)


def hf_greedy(model, input_ids: list[int], pixel_values, max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([input_ids]),
                             pixel_values=None if pixel_values is None else torch.tensor(np.asarray(pixel_values)),
                             attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(input_ids):].tolist()


def llava_dirs(root: str, tokenizer_factory) -> dict[str, str]:
    """Write every LLAVA_KINDS checkpoint under `root`; `tokenizer_factory()` gives a fresh
    tokenizer each time (adding the image token mutates it)."""
    dirs = {}
    for i, kind in enumerate(LLAVA_KINDS):
        dirs[kind] = write_tiny_llava(os.path.join(root, f"llava-{kind}"), kind, tokenizer_factory(), seed=i)
    return dirs


IDEFICS3_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]


def write_tiny_idefics3(directory: str, tokenizer, seed: int = 0) -> str:
    """A seeded Idefics3 (SmolVLM-shaped) model and its processor: 32x32 crops of 8x8 patches,
    pixel shuffle 2 -> 4 tokens per crop; images up to 64 px split into 2x2 crops + a global view."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    std = lambda name: 0.4 if name.endswith("lm_head.weight") else 0.3 if "connector" in name else _std(name)  # noqa: E731
    model, _ = seeded_random_model(config, seed, std, model_class=Idefics3ForConditionalGeneration)
    model.save_pretrained(directory)
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                             do_image_splitting=True)
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                      chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def hf_idefics3(directory: str):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
