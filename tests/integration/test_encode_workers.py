"""E/P/D through `deepinfer serve --encode-workers 1 --prefill-workers 1 --decode-workers 1`
(tiny CLIP LLaVA, official openai client, data URLs): greedy tokens equal the offline engine's
(LLM.chat with the same images); the same image sent again is an encode-cache hit
(deepinfer:encode_cache_hits) and its image tokens are cached prompt tokens; a different image of
the same size shares no block; every bad-image case gets a 400 with a message and a good request
succeeds afterwards. The colocated server's side of these checks is test_llava_serve.py (one
server start here, not two)."""
from __future__ import annotations

import io

import openai
import pytest
from PIL import Image

from deepinfer import LLM, SamplingParams
from tests.integration.llava_checkpoints import synthetic_image
from tests.integration.serve_process import ServeProcess
from tests.integration.test_llava_serve import MEDIA_ARGS, bad_image_cases, data_url

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
BLOCK_SIZE = 16
SERVER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE),
               "--threads", "1", "--seed", "0", "--enable-prompt-tokens-details", *MEDIA_ARGS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def image_parts(*urls: str, text: str = "Describe.") -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]


def chat(client: openai.OpenAI, content) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def token_ids(response) -> list[int]:
    choice = response.choices[0]
    ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
    assert ids, f"the server returned no token ids: {choice}"
    return list(ids)


def cached_tokens(response) -> int:
    details = response.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


@pytest.fixture(scope="module")
def servers(llava_checkpoints, tmp_path_factory):
    """{"epd": E1/P1/D1 server, "offline": the offline engine on the same checkpoint}."""
    directory = llava_checkpoints["clip"]
    store = tmp_path_factory.mktemp("epd-store")
    epd = ServeProcess("--model", directory, *SERVER_ARGS, "--encode-workers", "1", "--prefill-workers", "1",
                       "--decode-workers", "1", "--kv-store", f"fs://{store}")
    try:
        # Loaded while the workers start (the server's start-up dominates).
        offline = LLM(model=directory, dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE, seed=0)
        epd.wait_ready(300)
        yield {"epd": epd, "offline": offline}
    finally:
        epd.stop()


def offline_tokens(llm: LLM, *images, text: str = "Describe.") -> list[int]:
    """The offline engine's greedy tokens for the chat `image_parts` sends (images as the
    server decodes them: a JPEG is compared after its lossy round trip)."""
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    out, = llm.chat([[{"role": "user", "content": parts}]], GREEDY, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def jpeg_round_trip(image):
    buf = io.BytesIO()
    image.save(buf, format="JPEG")
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def client_for(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def encode_metric(server: ServeProcess, name: str, label: str = "") -> float:
    import httpx
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"deepinfer:encode_{name}") and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_epd_matches_the_offline_engine_and_reuses_cached_images(servers):
    epd, offline = client_for(servers["epd"]), servers["offline"]
    a, b, c = synthetic_image(20), synthetic_image(21), synthetic_image(22, (50, 30))
    assert token_ids(chat(epd, image_parts(data_url(a)))) == offline_tokens(offline, a)
    assert token_ids(chat(epd, image_parts(data_url(b), data_url(c, "JPEG"), text="Compare."))) \
        == offline_tokens(offline, b, jpeg_round_trip(c), text="Compare.")
    assert encode_metric(servers["epd"], "images_encoded_total") == 3
    assert encode_metric(servers["epd"], "cache_hits_total", 'tier="local"') == 0

    first = chat(epd, image_parts(data_url(a)))
    assert encode_metric(servers["epd"], "cache_hits_total", 'tier="local"') == 1  # not encoded again
    assert encode_metric(servers["epd"], "images_encoded_total") == 3
    num_prompt = first.usage.prompt_tokens
    # The image's tokens are cached prompt tokens: every full block but the last token's.
    assert cached_tokens(first) == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE >= BLOCK_SIZE

    # A different image of the same size: equal prompt length, its first block already holds
    # image tokens, so nothing is shared, and the tokens are the offline engine's for that image.
    d = synthetic_image(23)
    other = chat(epd, image_parts(data_url(d)))
    assert other.usage.prompt_tokens == num_prompt and cached_tokens(other) == 0
    assert token_ids(other) == offline_tokens(offline, d)
    assert token_ids(other) != token_ids(first)  # the image rows reach the logits


def test_bad_images_get_400_then_a_good_request_succeeds(servers):
    client = client_for(servers["epd"])
    for name, (url, words) in bad_image_cases().items():
        urls = url if isinstance(url, list) else [url]
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, image_parts(*urls))
        assert words in str(info.value), (name, str(info.value))
    good = chat(client, image_parts(data_url(synthetic_image(8))))
    assert good.choices[0].finish_reason == "length" and len(token_ids(good)) == MAX_TOKENS
