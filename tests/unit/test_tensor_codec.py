"""Torch adapter: a paged-cache block round-trips bit-exactly through the store."""
from __future__ import annotations

import pytest
import torch

from deepinfer.kvstore import KVBlockLayout, open_store
from deepinfer.kvstore.tensor_codec import kv_block_from_bytes, kv_block_to_bytes, layout_of


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_round_trips_through_a_store(dtype):
    layout = KVBlockLayout.for_paged_cache(num_layers=3, num_kv_heads=2, block_size=4,
                                           head_dim=8, dtype=str(dtype).removeprefix("torch."))
    cache = torch.randn(3, 2, 2, 10, 4, 8).to(dtype)  # [layer, K|V, head, block, slot, dim]
    block = cache[:, :, :, 7]  # non-contiguous view of block 7
    assert layout_of(block) == layout
    store = open_store("memory", layout.store_salt("model"), layout=layout.descriptor)
    store.put(b"h" * 16, kv_block_to_bytes(block, layout))
    back = kv_block_from_bytes(store.get(b"h" * 16), layout)
    assert back.dtype == dtype and back.shape == block.shape
    assert torch.equal(back.view(torch.uint8), block.contiguous().view(torch.uint8))


def test_layout_mismatches_are_rejected():
    layout = KVBlockLayout("float16", (2, 2, 1, 4, 8))
    with pytest.raises(ValueError, match="does not match layout"):
        kv_block_to_bytes(torch.zeros(2, 2, 1, 4, 8), layout)  # float32
    with pytest.raises(ValueError, match="needs"):
        kv_block_from_bytes(b"\0" * 10, layout)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVBlockLayout("complex64", (1, 2, 1, 1, 1))


def test_salt_separates_models_dtypes_and_block_sizes():
    base = KVBlockLayout.for_paged_cache(30, 3, 16, 64, "float16")
    salts = {base.store_salt("m"), base.store_salt("other"),
             KVBlockLayout.for_paged_cache(30, 3, 16, 64, "bfloat16").store_salt("m"),
             KVBlockLayout.for_paged_cache(30, 3, 32, 64, "float16").store_salt("m")}
    assert len(salts) == 4
    assert base.block_size == 16 and base.num_bytes == 30 * 2 * 3 * 16 * 64 * 2
    assert base.descriptor == "layer,kv,head,slot,dim:float16:30x2x3x16x64"
