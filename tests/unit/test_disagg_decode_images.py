"""The front tells the decode worker where a request's images are (placeholders, no pixels), so
its block hashes match the prefill worker's and a recompute there can splice the embeddings
(fake workers, real ZMQ sockets; see test_disagg_client_faults)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deepinfer.wire.worker_messages import DecodeRequest, PrefillRequest
from deepinfer.wire.mm_inputs import ImagePlaceholder, MultiModalInputs, PixelArray
from tests.unit.test_disagg_client_faults import PARAMS, first_token, run_front, until

pytestmark = pytest.mark.timeout(60)


def test_decode_request_carries_the_image_placeholders_without_pixels():
    mm = MultiModalInputs([ImagePlaceholder("ab" * 32, 3, 5), ImagePlaceholder("cd" * 32, 10, 5)],
                          [PixelArray.from_numpy(np.zeros((3, 4, 4), np.float32))] * 2)

    async def test(client, workers):
        async def consume():
            async for _ in client.generate("img", list(range(1, 40)), PARAMS, mm_inputs=mm):
                pass
        task = asyncio.create_task(consume())
        await until(lambda: "img" in client.placements, "the request routed")
        p = workers[client.placements["img"][0]]
        assert (await p.expect(PrefillRequest)).mm_inputs == mm  # no encode stage: pixels too
        first_token("img", p)
        await until(lambda: client.placements["img"][1] is not None, "decode routing")
        sent = await workers[client.placements["img"][1]].expect(DecodeRequest)
        assert sent.mm_inputs == mm.without_pixels() and sent.mm_inputs.pixel_values is None
        task.cancel()
    run_front(test)
