import msgspec
import numpy as np
import pytest

from deepinfer.wire.mm_inputs import ImagePlaceholder, MultiModalInputs, PixelArray


def test_mm_inputs_round_trip_over_msgpack():
    pixels = np.arange(3 * 4 * 4, dtype=np.float32).reshape(3, 4, 4)
    mm = MultiModalInputs(
        placeholders=[ImagePlaceholder("aa", 2, 4), ImagePlaceholder("bb", 8, 4)],
        pixel_values=[PixelArray.from_numpy(pixels), PixelArray.from_numpy(pixels[:, ::-1])],
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(mm), type=MultiModalInputs)
    assert back.image_hashes == ["aa", "bb"]
    np.testing.assert_array_equal(back.pixel_values[0].to_numpy(), pixels)
    np.testing.assert_array_equal(back.pixel_values[1].to_numpy(), pixels[:, ::-1])
    assert back.without_pixels().pixel_values is None


def test_mm_inputs_rejects_mismatched_or_overlapping_placeholders():
    px = PixelArray.from_numpy(np.zeros((3, 2, 2), np.float32))
    with pytest.raises(ValueError, match="pixel arrays"):
        MultiModalInputs([ImagePlaceholder("a", 0, 4)], [px, px])
    with pytest.raises(ValueError, match="disjoint"):
        MultiModalInputs([ImagePlaceholder("a", 0, 4), ImagePlaceholder("b", 3, 4)])
