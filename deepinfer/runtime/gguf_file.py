"""A lean reader of the GGUF container: metadata, tensor infos, memory-mapped tensor data.

`gguf.GGUFReader` materialises every element of every metadata array (the 49k-token vocab,
48k merges) as numpy views, which takes seconds; serving only needs the scalars and the
tensors, so arrays are skipped (their length is kept) unless asked for by key.

Layout (little-endian, GGUF v2/v3):

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x   (string key, u32 type, value)          string = u64 len + utf-8 bytes
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

`ne[0]` is the innermost (contiguous) dimension, so the torch shape is `ne` reversed.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NATIVE_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class GGUFArrayInfo:
    """A metadata array that was skipped: its element type and length."""

    element_type: int
    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # F32/F16: typed view in `shape`; others: uint8 [*shape[:-1], bytes per row]


class GGUFFile:
    """Parsed header of a GGUF file. `metadata` maps keys to values; arrays not listed in
    `load_arrays` appear as `GGUFArrayInfo`. Raises ValueError if the file is not GGUF."""

    def __init__(self, path: str, load_arrays: tuple[str, ...] = ()):
        self.path = path
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mmap)
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (big-endian or too old?)")
        num_tensors, num_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._read_string()
            self.metadata[key] = self._read_value(self._unpack("<I"), load=key in load_arrays)
        raw_infos = [self._read_tensor_info() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in raw_infos]

    # ---- primitive readers --------------------------------------------------------------

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._unpack("<Q")
        value = bytes(self._buf[self._pos:self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return value

    def _read_value(self, value_type: int, load: bool = True) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self._read_string()
        if value_type == _ARRAY:
            element_type, length = self._unpack("<I"), self._unpack("<Q")
            if load:
                return [self._read_value(element_type) for _ in range(length)]
            self._skip_array(element_type, length)
            return GGUFArrayInfo(element_type, length)
        raise ValueError(f"corrupt GGUF metadata: unknown value type {value_type}")

    def _skip_array(self, element_type: int, length: int) -> None:
        if element_type in _SCALAR_FORMATS:
            self._pos += struct.calcsize(_SCALAR_FORMATS[element_type]) * length
        elif element_type == _STRING:
            buf, pos = self._buf, self._pos
            for _ in range(length):  # each string: u64 length + bytes
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            self._pos = pos
        else:
            for _ in range(length):
                self._read_value(element_type, load=False)

    def _read_tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._read_string()
        num_dims = self._unpack("<I")
        ne = tuple(self._unpack("<Q") for _ in range(num_dims))
        return name, ne, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, data_start: int, name: str, ne: tuple[int, ...], type_id: int, offset: int) -> GGUFTensorInfo:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown GGML type {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(ne))
        num_bytes = math.prod(ne) // block_size * type_size
        start = data_start + offset
        if start + num_bytes > self._mmap.shape[0]:
            raise ValueError(f"GGUF file is truncated (tensor {name!r} extends past the end)")
        raw = self._mmap[start:start + num_bytes].view(np.ndarray)  # plain views: memmap ops are slow
        if qtype in _NATIVE_DTYPES:
            data = raw.view(_NATIVE_DTYPES[qtype]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], ne[0] // block_size * type_size)
        return GGUFTensorInfo(name, shape, qtype, data)
