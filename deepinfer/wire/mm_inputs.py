"""Image inputs of one request as plain data (no torch): where each image's embedding rows go in the
prompt, and optionally the preprocessed pixels.

These travel inside the msgspec zmq messages (front -> engine, front -> encode/prefill workers), so
pixel arrays are raw bytes + shape + dtype rather than numpy objects. `pixel_values` is None when the
receiver already holds the embeddings under each placeholder's image_hash (its embedding cache).
"""
from __future__ import annotations

import msgspec
import numpy as np


class ImagePlaceholder(msgspec.Struct, frozen=True):
    """The image's embedding rows fill prompt positions [offset, offset + length)."""

    image_hash: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class PixelArray(msgspec.Struct, frozen=True):
    """One image's preprocessed pixels (e.g. float32 [3, H, W]) as raw C-order bytes."""

    data: bytes
    shape: list[int]
    dtype: str

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "PixelArray":
        array = np.ascontiguousarray(array)
        return cls(data=array.tobytes(), shape=list(array.shape), dtype=str(array.dtype))

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class MultiModalInputs(msgspec.Struct):
    """One entry per image, in prompt order; pixel_values[i] belongs to placeholders[i]."""

    placeholders: list[ImagePlaceholder]
    pixel_values: list[PixelArray] | None = None

    def __post_init__(self) -> None:
        if self.pixel_values is not None and len(self.pixel_values) != len(self.placeholders):
            raise ValueError(
                f"{len(self.pixel_values)} pixel arrays for {len(self.placeholders)} image placeholders"
            )
        prev_end = 0
        for p in self.placeholders:
            if p.length <= 0 or p.offset < prev_end:
                raise ValueError(f"image placeholders must be non-empty, sorted and disjoint: {self.placeholders}")
            prev_end = p.end

    @property
    def image_hashes(self) -> list[str]:
        return [p.image_hash for p in self.placeholders]

    def without_pixels(self) -> "MultiModalInputs":
        """The same placeholders for a receiver that already holds the embeddings."""
        return MultiModalInputs(placeholders=list(self.placeholders), pixel_values=None)
