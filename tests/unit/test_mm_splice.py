"""Image rows land at the right batch rows when a chunk covers part of an image, and image
token runs split into per-image placeholders."""
import pytest
import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.multimodal.embed_splice import RequestImages, splice_input_embeds
from deepinfer.wire.mm_inputs import ImagePlaceholder
from deepinfer.multimodal.processor import image_token_spans
from deepinfer.sampling_params import SamplingParams

HIDDEN = 4


def _sched(rid: str, start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(rid, [0] * n, start, [], False, SamplingParams(), 0)


def test_chunks_take_the_overlapping_rows_of_each_image():
    embed = torch.nn.Embedding(10, HIDDEN)
    torch.nn.init.zeros_(embed.weight)
    image_a = torch.arange(1, 7, dtype=torch.float32)[:, None].expand(6, HIDDEN)  # rows 1..6
    image_b = -torch.arange(1, 4, dtype=torch.float32)[:, None].expand(3, HIDDEN)  # rows -1..-3
    images = {"r1": RequestImages([ImagePlaceholder("a", 2, 6), ImagePlaceholder("b", 9, 3)], [image_a, image_b])}
    # A decode of another request first, then r1's chunk over positions [5, 10): image a's
    # rows 3..5 (positions 5..7), text at 8, image b's row 0 at 9.
    scheduled = [_sched("other", 30, 1), _sched("r1", 5, 5)]
    out = splice_input_embeds(embed, torch.zeros(6, dtype=torch.long), scheduled, images)
    assert out[:, 0].tolist() == [0, 4, 5, 6, 0, -1]


def test_no_image_in_the_step_means_no_input_embeds():
    embed = torch.nn.Embedding(10, HIDDEN)
    images = {"r1": RequestImages([ImagePlaceholder("a", 2, 6)], [None])}  # not encoded: not needed
    assert splice_input_embeds(embed, torch.zeros(2, dtype=torch.long), [_sched("r1", 8, 2)], images) is None
    with pytest.raises(RuntimeError, match="before it was encoded"):
        splice_input_embeds(embed, torch.zeros(2, dtype=torch.long), [_sched("r1", 6, 2)], images)


def test_image_token_spans_split_adjacent_images_evenly():
    ids = [1, 9, 9, 9, 9, 2, 9, 9]
    assert image_token_spans(ids, 9, 3) == [(1, 2), (3, 2), (6, 2)]
    with pytest.raises(ValueError, match="do not split"):
        image_token_spans(ids, 9, 4)
    with pytest.raises(ValueError, match="contiguous"):
        image_token_spans([9, 1, 9], 9, 1)
