"""Image placeholders in block hashes: equal token ids with different images never share blocks."""
from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.prefix_hash import block_extra_keys, hash_request_blocks
from deepinfer.core.request import Request
from deepinfer.wire.mm_inputs import ImagePlaceholder
from deepinfer.sampling_params import SamplingParams

IMAGE_TOKEN = 9
BLOCK = 4
# 3 text tokens, a 16-token image at [3, 19), then text: blocks 0..4 overlap the image.
PROMPT = [5, 6, 7] + [IMAGE_TOKEN] * 16 + [8, 10, 11, 12, 13]


def _request(rid: str, image_hash: str | None) -> Request:
    req = Request(rid, list(PROMPT), SamplingParams(max_tokens=1))
    if image_hash is not None:
        req.mm_placeholders = [ImagePlaceholder(image_hash, 3, 16)]
    return req


def test_block_extra_keys_name_image_and_offset_of_each_overlapping_image():
    images = [ImagePlaceholder("a", 3, 16), ImagePlaceholder("b", 19, 2)]
    assert block_extra_keys(0, 4, images) == ["a", 0]
    assert block_extra_keys(4, 8, images) == ["a", 1]
    assert block_extra_keys(16, 20, images) == ["a", 13, "b", 0]
    assert block_extra_keys(20, 24, images) == ["b", 1]
    assert block_extra_keys(24, 28, images) == []


def test_hash_request_blocks_agrees_with_the_cache_manager():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    req = _request("r", "img-a")
    kv.update_block_hashes(req)
    assert req.block_hashes == hash_request_blocks(PROMPT, BLOCK, images=req.mm_placeholders)
    assert hash_request_blocks(PROMPT, BLOCK) != req.block_hashes  # the image changes them


def _schedule_and_finish(kv: KVCacheManager, req: Request) -> int:
    """Allocate the whole prompt (after any prefix hit), register its blocks, free it;
    returns the number of prefix-hit tokens."""
    hit = kv.find_prefix(req)
    assert kv.allocate_slots(req, len(PROMPT) - hit.num_tokens, hit)
    kv.free(req)
    kv.check_invariants()
    return hit.num_tokens


def test_same_image_shares_blocks_different_image_of_equal_tokens_does_not():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    assert _schedule_and_finish(kv, _request("a1", "img-a")) == 0
    # The same image again: every full block but the last prompt token's is a hit.
    assert _schedule_and_finish(kv, _request("a2", "img-a")) == 20
    # Same token ids, another image: only the text block before the image could match, and it
    # overlaps the image too (positions 3..), so nothing is shared.
    assert _schedule_and_finish(kv, _request("b1", "img-b")) == 0
    # Text-only prompt with the same ids shares nothing with either image request.
    assert _schedule_and_finish(kv, _request("t1", None)) == 0
