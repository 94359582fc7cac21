"""E/P/D through `deepinfer serve --encode-workers 1 --prefill-workers 1 --decode-workers 1`
(tiny CLIP LLaVA, official openai client, data URLs): greedy tokens equal colocated serving's;
the same image sent again is an encode-cache hit (deepinfer:encode_cache_hits) and its image
tokens are cached prompt tokens; a different image of the same size shares no block; every
bad-image case gets a 400 with a message and a good request succeeds afterwards, on the E/P/D
server and on a colocated one."""
from __future__ import annotations

import base64
import io

import openai
import pytest

from deepinfer import LLM, SamplingParams
from tests.integration.llava_checkpoints import synthetic_image
from tests.integration.serve_process import ServeProcess

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
BLOCK_SIZE = 16
SERVER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE),
               "--threads", "1", "--seed", "0", "--limit-mm-per-prompt", '{"image": 2}',
               "--max-image-pixels", "10000")


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


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


def start(model_dir: str, *extra: str) -> ServeProcess:
    server = ServeProcess("--model", model_dir, *SERVER_ARGS, *extra)
    try:
        server.wait_ready(300)
    except Exception:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def servers(llava_checkpoints, tmp_path_factory):
    """{"epd": E1/P1/D1 server, "colocated": one engine process}, started together."""
    directory = llava_checkpoints["clip"]
    store = tmp_path_factory.mktemp("epd-store")
    epd = ServeProcess("--model", directory, *SERVER_ARGS, "--encode-workers", "1", "--prefill-workers", "1",
                       "--decode-workers", "1", "--kv-store", f"fs://{store}")
    colocated = ServeProcess("--model", directory, *SERVER_ARGS)
    try:
        epd.wait_ready(300)
        colocated.wait_ready(300)
        yield {"epd": epd, "colocated": colocated, "model_dir": directory}
    finally:
        epd.stop()
        colocated.stop()


def client_for(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def encode_metric(server: ServeProcess, name: str, label: str = "") -> float:
    import httpx
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"deepinfer:encode_{name}") and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_epd_matches_colocated_and_reuses_cached_images(servers):
    epd, colocated = client_for(servers["epd"]), client_for(servers["colocated"])
    a, b, c = synthetic_image(20), synthetic_image(21), synthetic_image(22, (50, 30))
    for content in (image_parts(data_url(a)),
                    image_parts(data_url(b), data_url(c, "JPEG"), text="Compare.")):
        assert token_ids(chat(epd, content)) == token_ids(chat(colocated, content))
    assert encode_metric(servers["epd"], "images_encoded_total") == 3
    assert encode_metric(servers["epd"], "cache_hits_total", 'tier="local"') == 0

    first = chat(epd, image_parts(data_url(a)))
    assert encode_metric(servers["epd"], "cache_hits_total", 'tier="local"') == 1  # not encoded again
    assert encode_metric(servers["epd"], "images_encoded_total") == 3
    num_prompt = first.usage.prompt_tokens
    # The image's tokens are cached prompt tokens: every full block but the last token's.
    assert cached_tokens(first) == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE >= BLOCK_SIZE

    # A different image of the same size: equal prompt length, its first block already holds
    # image tokens, so nothing is shared, and the tokens are colocated serving's for that image.
    d = image_parts(data_url(synthetic_image(23)))
    other = chat(epd, d)
    assert other.usage.prompt_tokens == num_prompt and cached_tokens(other) == 0
    assert token_ids(other) == token_ids(chat(colocated, d))


def test_offline_engine_agrees_with_the_epd_server(servers):
    """The E/P/D tokens are also those of the offline engine (LLM.chat with PIL images)."""
    image = synthetic_image(24)
    llm = LLM(model=servers["model_dir"], dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE, seed=0)
    ref, = llm.chat([[{"role": "user", "content": [{"type": "image", "image": image},
                                                   {"type": "text", "text": "Describe."}]}]],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert token_ids(chat(client_for(servers["epd"]), image_parts(data_url(image)))) == ref.outputs[0].token_ids


def _bad_cases():
    good = data_url(synthetic_image(5))
    big = io.BytesIO()
    synthetic_image(6, (200, 100)).save(big, format="PNG")  # 20000 pixels > --max-image-pixels
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


@pytest.mark.parametrize("mode", ["epd", "colocated"])
def test_bad_images_get_400_then_a_good_request_succeeds(servers, mode):
    client = client_for(servers[mode])
    for name, (url, words) in _bad_cases().items():
        urls = url if isinstance(url, list) else [url]
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, image_parts(*urls))
        assert words in str(info.value), (name, str(info.value))
    good = chat(client, image_parts(data_url(synthetic_image(8))))
    assert good.choices[0].finish_reason == "length" and len(token_ids(good)) == MAX_TOKENS
