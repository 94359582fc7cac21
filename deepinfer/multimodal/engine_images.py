"""The engine's side of images: check a request's images, hold their embeddings, encode the
ones a step needs (batched, through the embedding cache) and splice them in the runner.

Life of an image in one engine:
  add_request   placeholders checked against the prompt and the model; embeddings already in
                the cache are taken (held for the request); otherwise its pixels are kept.
                No embeddings and no pixels -> ValueError (nothing queued).
  step          before the runner runs, every image overlapping a scheduled chunk that has no
                embeddings yet is encoded (one tower batch per pixel shape) and put in the cache.
                Images wholly inside a prefix-cache hit are never encoded.
  runner        `input_embeds` = token embeddings with the image rows spliced in.
Entries of requests the scheduler no longer holds are dropped at the next step.
"""
from __future__ import annotations

import logging
from collections.abc import Container, Sequence

import torch
from torch import Tensor

from deepinfer.multimodal.embed_splice import RequestImages, splice_input_embeds
from deepinfer.multimodal.embedding_cache import EmbeddingCache
from deepinfer.wire.mm_inputs import MultiModalInputs, PixelArray

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_CACHE_BYTES = 512 * 1024 * 1024


class EngineImages:
    def __init__(self, model: torch.nn.Module, device: torch.device,
                 cache: EmbeddingCache | None = None) -> None:
        self.model = model
        self.device = device
        self.cache = cache if cache is not None else EmbeddingCache(DEFAULT_EMBEDDING_CACHE_BYTES)
        self.image_token_id: int = model.image_token_id
        self.num_image_tokens: int = model.num_image_tokens()
        self.pixel_shape = tuple(model.image_pixel_shape())
        self._requests: dict[str, RequestImages] = {}
        self._pixels: dict[str, list[PixelArray | None]] = {}
        self.num_images_encoded = 0
        self.num_encode_batches = 0

    # ---- add_request -----------------------------------------------------------------------
    def check(self, prompt_token_ids: Sequence[int], mm_inputs: MultiModalInputs,
              require_embeddings: bool = True) -> RequestImages:
        """Validate `mm_inputs` against the prompt and this model and take the embeddings the
        cache holds. Raises ValueError (the request must not be queued). A disaggregated
        decode worker passes `require_embeddings=False`: its prompt KV arrives computed, and
        the embeddings are needed (and fetched, `fetch_missing`) only if it is recomputed."""
        placeholders = list(mm_inputs.placeholders)
        covered = 0
        for p in placeholders:
            if p.length != self.num_image_tokens:
                raise ValueError(f"an image placeholder has {p.length} tokens; this model gives each "
                                 f"image {self.num_image_tokens}")
            if p.end > len(prompt_token_ids) or any(
                    t != self.image_token_id for t in prompt_token_ids[p.offset:p.end]):
                raise ValueError(f"image placeholder [{p.offset}, {p.end}) does not cover image tokens "
                                 "of the prompt")
            covered += p.length
        if sum(t == self.image_token_id for t in prompt_token_ids) != covered:
            raise ValueError("the prompt has image tokens that no image placeholder covers")
        pixels = mm_inputs.pixel_values or [None] * len(placeholders)
        embeds: list[Tensor | None] = []
        for p, px in zip(placeholders, pixels):
            if px is not None and tuple(px.shape) != self.pixel_shape:
                raise ValueError(f"image pixel_values have shape {tuple(px.shape)}; this model takes "
                                 f"{self.pixel_shape}")
            found = self.cache.get(p.image_hash)
            if found is None and px is None and require_embeddings:
                raise ValueError(f"no pixels and no cached embeddings for image {p.image_hash[:16]}")
            embeds.append(found)
        return RequestImages(placeholders, embeds)

    def add(self, request_ids: Sequence[str], images: RequestImages, mm_inputs: MultiModalInputs) -> None:
        """Hold `images` for every sequence id of one request (n > 1 children share them)."""
        pixels = list(mm_inputs.pixel_values or [None] * len(images.placeholders))
        for request_id in request_ids:
            self._requests[request_id] = images
            self._pixels[request_id] = pixels

    def fetch_missing(self, request_id: str) -> list[str]:
        """Take the embeddings `request_id` still lacks from the cache (its store tier too);
        returns the hashes of images that have neither embeddings nor pixels to encode."""
        entry = self._requests.get(request_id)
        if entry is None:
            return []
        pixels = self._pixels.get(request_id) or [None] * len(entry.placeholders)
        missing = []
        for i, p in enumerate(entry.placeholders):
            if entry.embeds[i] is None and pixels[i] is None:
                entry.embeds[i] = self.cache.get(p.image_hash)
                if entry.embeds[i] is None:
                    missing.append(p.image_hash)
        return missing

    # ---- each step -------------------------------------------------------------------------
    def prepare(self, scheduled: Sequence, live_request_ids: Container[str]) -> None:
        """Drop finished requests' entries; encode the images this step's chunks cover."""
        for request_id in [r for r in self._requests if r not in live_request_ids]:
            del self._requests[request_id]
            self._pixels.pop(request_id, None)
        pending: dict[str, PixelArray] = {}
        for r in scheduled:
            entry = self._requests.get(r.request_id)
            if entry is None:
                continue
            start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens
            for i, p in enumerate(entry.placeholders):
                if entry.embeds[i] is None and p.offset < end and start < p.end:
                    if p.image_hash in self.cache:
                        entry.embeds[i] = self.cache.get(p.image_hash)
                    elif self._pixels[r.request_id][i] is not None:
                        pending[p.image_hash] = self._pixels[r.request_id][i]
                    elif (found := self.cache.get(p.image_hash)) is not None:  # store tier
                        entry.embeds[i] = found
                    else:  # never computed from token embeddings in their place
                        raise RuntimeError(f"request {r.request_id}: the embeddings of image "
                                           f"{p.image_hash[:16]} are gone and it has no pixels")
        encoded = self._encode(pending) if pending else {}
        for r in scheduled:
            entry = self._requests.get(r.request_id)
            if entry is not None:
                for i, p in enumerate(entry.placeholders):
                    if entry.embeds[i] is None and p.image_hash in encoded:
                        entry.embeds[i] = encoded[p.image_hash]

    def _encode(self, pending: dict[str, PixelArray]) -> dict[str, Tensor]:
        """Run the tower on `pending` images (hash -> pixels); puts each in the cache."""
        out: dict[str, Tensor] = {}
        hashes = list(pending)
        pixels = torch.stack([torch.from_numpy(pending[h].to_numpy().copy()) for h in hashes])  # [N, 3, H, W]
        embeds = self.model.encode_images(pixels.to(self.device))  # [N, tokens, hidden]
        self.num_encode_batches += 1
        for k, image_hash in enumerate(hashes):
            out[image_hash] = embeds[k].clone()
            self.cache.put(image_hash, out[image_hash])
        self.num_images_encoded += len(hashes)
        logger.debug("encoded %d images", len(hashes))
        return out

    def input_embeds(self, model: torch.nn.Module, ordered: Sequence, input_ids: Tensor) -> Tensor | None:
        """The runner's hook: this step's token embeddings with image rows, or None."""
        if not self._requests:
            return None
        return splice_input_embeds(model.model.embed_tokens, input_ids, ordered, self._requests)
