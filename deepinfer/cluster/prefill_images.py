"""What a prefill worker does for prompts with images (E/P/D).

The engine's `EmbeddingCache` gets the shared store as its second tier, so embeddings an encode
worker published under the image's hash are found by `get`. Before a prompt enters the engine
its embeddings are fetched into the local tier (a prompt whose embeddings are nowhere fails
with a clear error rather than mid-step), and its image placeholders go into the block hashes
of the shared prefix store, as they do in the device prefix cache.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def attach_embedding_store(engine, store_url: str | None) -> None:
    """Give the engine's embedding cache (vision-language models only) the store tier."""
    cache = getattr(engine, "embedding_cache", None)
    if cache is None or store_url is None or getattr(cache, "store", None) is not None:
        return
    from deepinfer.multimodal.embedding_store import open_embedding_tier
    cache.store = open_embedding_tier(store_url, engine.source)


def image_spans(message) -> tuple:
    """The prompt's image placeholders (offset, length, image hash), or () without images."""
    mm = getattr(message, "mm_inputs", None)
    return tuple(mm.placeholders) if mm is not None else ()


def missing_embeddings(engine, message) -> str | None:
    """None when every image of `message` can be spliced in (its pixels came along, or its
    embeddings are in the engine's cache, fetched from the store if need be); else why not."""
    mm = getattr(message, "mm_inputs", None)
    if mm is None or mm.pixel_values is not None:
        return None
    cache = getattr(engine, "embedding_cache", None)
    if cache is None:
        return "this model takes no images"
    missing = [h for h in mm.image_hashes if cache.get(h) is None]
    if not missing:
        return None
    return (f"the embeddings of {len(missing)} image(s) were not found in the encode cache or "
            f"the shared store (image {missing[0][:12]}...); send the request again")
