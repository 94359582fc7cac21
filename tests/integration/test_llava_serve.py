"""LLaVA through `deepinfer serve` (colocated) with the official `openai` client sending PNG
data URLs: greedy tokens equal transformers fp32 for one and two images; the same image again
is a prefix hit (its image tokens are cached prompt tokens); a different image shares no block;
every bad-image case gets a 400 with its message and the server keeps serving (the same cases
as the E/P/D server in test_encode_workers.py, which shares `data_url` and `bad_image_cases`)."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.integration.llava_checkpoints import hf_greedy, hf_llava, synthetic_image
from tests.integration.serve_process import running_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


MAX_IMAGE_PIXELS = 10000
# The served flags the bad-image cases rely on (at most 2 images, MAX_IMAGE_PIXELS pixels).
MEDIA_ARGS = ("--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", str(MAX_IMAGE_PIXELS))


def bad_image_cases() -> dict:
    """name -> (url or list of urls, words the 400's message must contain)."""
    good = data_url(synthetic_image(5))
    big = io.BytesIO()
    synthetic_image(6, (200, 100)).save(big, format="PNG")  # 20000 pixels > MAX_IMAGE_PIXELS
    gif = io.BytesIO()
    synthetic_image(7).save(gif, format="GIF")
    return {
        "corrupt base64": ("data:image/png;base64,@@not-base64@@", "not valid base64"),
        "not an image": ("data:image/png;base64," + base64.b64encode(b"plain text").decode(),
                         "not a PNG, JPEG or WebP"),
        "too many pixels": ("data:image/png;base64," + base64.b64encode(big.getvalue()).decode(),
                            "too many pixels"),
        "unsupported format": ("data:image/png;base64," + base64.b64encode(gif.getvalue()).decode(),
                               "Unsupported image format GIF"),
        "remote url": ("https://example.com/cat.png", "Remote image URLs are refused"),
        "local file": ("file:///etc/hostname", "--allowed-local-media-path"),
        "too many images": ([good, good, good], "At most 2 image"),
    }


@pytest.fixture(scope="module")
def llava_server(llava_checkpoints):
    with running_server("--model", llava_checkpoints["siglip"], "--dtype", "float32",
                        "--threads", "1", "--kv-cache-memory", "16MiB",
                        "--enable-prompt-tokens-details", *MEDIA_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def reference(llava_checkpoints):
    """(HF model, our MultiModalProcessor) for the served checkpoint."""
    from deepinfer.multimodal.processor import MultiModalProcessor
    directory = llava_checkpoints["siglip"]
    return hf_llava(directory)[0], MultiModalProcessor.from_pretrained(directory)


def _chat(client, *images, text="Describe."):
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, temperature=0.0,
        messages=[{"role": "user", "content": parts + [{"type": "text", "text": text}]}],
        extra_body={"ignore_eos": True, "return_token_ids": True})


def _expected(reference, *images, text="Describe."):
    hf, processor = reference
    parts = [{"type": "image", "image": im} for im in images]
    token_ids, mm = processor.process_chat([{"role": "user", "content": parts + [{"type": "text", "text": text}]}])
    pixels = np.stack([p.to_numpy() for p in mm.pixel_values])
    return token_ids, hf_greedy(hf, token_ids, pixels, MAX_TOKENS), mm


def test_openai_client_image_chats_match_transformers_and_hit_the_prefix_cache(llava_server, reference):
    import openai

    client = openai.OpenAI(base_url=f"{llava_server.url}/v1", api_key="unused")
    one, two, other = synthetic_image(21, (50, 40)), synthetic_image(22, (30, 30)), synthetic_image(23, (50, 40))
    for images in ((one,), (one, two)):
        response = _chat(client, *images)
        prompt_ids, expected, _ = _expected(reference, *images)
        assert response.model_extra["prompt_token_ids"] == prompt_ids
        assert response.choices[0].model_extra["token_ids"] == expected
    # `one` was sent twice already: its blocks are cached, image tokens included.
    again = _chat(client, one)
    _, _, mm = _expected(reference, one)
    image = mm.placeholders[0]
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= image.end - 16 and cached > image.offset
    # Another image of the same size: the same prompt token ids, but no block is shared.
    different = _chat(client, other)
    assert different.usage.prompt_tokens == again.usage.prompt_tokens
    assert image.offset < 16 and different.usage.prompt_tokens_details.cached_tokens == 0


def test_bad_images_get_a_400_then_a_good_request_succeeds(llava_server):
    import openai

    client = openai.OpenAI(base_url=f"{llava_server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for name, (url, words) in bad_image_cases().items():
        urls = url if isinstance(url, list) else [url]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}])
        assert words in str(info.value), (name, str(info.value))
    assert len(_chat(client, synthetic_image(40)).choices[0].model_extra["token_ids"]) == MAX_TOKENS
