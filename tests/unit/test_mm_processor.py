"""Chat image parts: image_url parts are loaded under the media policy (the limit counts images
across every message), PIL parts pass through, and checkpoints are told apart by architecture."""
import base64
import io
import json

import pytest
from PIL import Image

from deepinfer.multimodal.image_input import ImageInputError, MediaPolicy
from deepinfer.multimodal.processor import load_message_images, split_chat_images, vision_language_checkpoint


def _data_url(color) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_url_parts_become_loaded_image_parts_in_order():
    pil = Image.new("RGB", (2, 2), (0, 0, 255))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url((255, 0, 0))}},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": _data_url((0, 255, 0))}]},
        {"role": "user", "content": [{"type": "image", "image": pil}]},
    ]
    loaded = load_message_images(messages)
    converted, images = split_chat_images(loaded)
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    assert converted[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    assert converted[0] == messages[0]


def test_image_limit_counts_images_across_messages():
    part = {"type": "image_url", "image_url": {"url": _data_url((1, 2, 3))}}
    messages = [{"role": "user", "content": [part]}, {"role": "user", "content": [part, part]}]
    with pytest.raises(ImageInputError, match="At most 2"):
        load_message_images(messages, MediaPolicy(limit_per_prompt=2))
    with pytest.raises(ImageInputError):
        load_message_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_vision_language_checkpoint_by_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"]}))
    assert vision_language_checkpoint(str(tmp_path)) == str(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert vision_language_checkpoint(str(tmp_path)) is None
    assert vision_language_checkpoint(None) is None
