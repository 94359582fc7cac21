"""Image embedding rows -> the token embeddings of one step's flat batch.

The runner lays the scheduled chunks out back to back (request r's chunk covers prompt positions
[num_computed_tokens, num_computed_tokens + num_new_tokens)). An image whose placeholder
[offset, offset + length) overlaps a chunk contributes the overlapping rows of its embeddings;
every other position keeps its token embedding.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer.wire.mm_inputs import ImagePlaceholder


@dataclass
class RequestImages:
    """One request's placeholders and (once encoded or fetched) their embeddings."""

    placeholders: list[ImagePlaceholder]
    embeds: list[Tensor | None]  # [length, hidden] per image; None until resolved


def image_rows(scheduled: Sequence, images: Mapping[str, RequestImages]) -> list[tuple[int, Tensor]]:
    """(batch row of the first spliced token, embedding rows [n, hidden]) for every image
    overlapping a scheduled chunk; `scheduled` in the runner's batch order."""
    rows = []
    first = 0
    for r in scheduled:
        entry = images.get(r.request_id)
        if entry is not None:
            start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens
            for i, (p, embeds) in enumerate(zip(entry.placeholders, entry.embeds)):
                lo, hi = max(start, p.offset), min(end, p.end)
                if lo >= hi:
                    continue
                if embeds is None:
                    raise RuntimeError(f"request {r.request_id}: image {i} was scheduled before it was encoded")
                rows.append((first + lo - start, embeds[lo - p.offset:hi - p.offset]))
        first += r.num_new_tokens
    return rows


def splice_input_embeds(embed_tokens: torch.nn.Module, input_ids: Tensor, scheduled: Sequence,
                        images: Mapping[str, RequestImages]) -> Tensor | None:
    """input_embeds [T, hidden] for the step with image rows in place, or None when no
    scheduled chunk covers an image (the model then embeds `input_ids` itself)."""
    rows = image_rows(scheduled, images)
    if not rows:
        return None
    embeds = embed_tokens(input_ids)  # [T, hidden]
    for row, values in rows:
        embeds[row:row + values.shape[0]] = values.to(device=embeds.device, dtype=embeds.dtype)
    return embeds
