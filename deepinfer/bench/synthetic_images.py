"""Synthetic images for the `images` workload, rendered on the client as PNG data URLs.

The same `ImageSpec` always gives the same bytes (its seed draws the pixels), so a repeated
spec is the same image to the server (same content hash: an embedding-cache hit). Random
pixels barely compress, so PNG size follows the image size as a real photo's would.
"""
from __future__ import annotations

import base64
import functools
import io

import numpy as np

from deepinfer.bench.workloads import ImageSpec


@functools.lru_cache(maxsize=256)
def image_data_url(spec: ImageSpec) -> str:
    from PIL import Image

    rng = np.random.default_rng(spec.seed)
    pixels = rng.integers(0, 256, (spec.height, spec.width, 3), dtype=np.uint8)  # [H, W, RGB]
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
