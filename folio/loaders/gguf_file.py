"""A fast, read-only view of a GGUF file: metadata as Python values, tensors as memory-mapped bytes.

The `gguf` package's GGUFReader builds a numpy view per array element; on Gemma 3's 262k-token
vocabulary that takes ~9 s. This parser reads string arrays with one pass of `struct` and numeric
arrays with `np.frombuffer`, so opening a file takes well under a second. Type codes and block
sizes come from the `gguf` package, which stays the source of truth for the format.

A file is untrusted input: every count is checked against what the rest of the file could hold
before anything loops on it or allocates for it, and the tensor directory is bounded the way
llama.cpp's gguf.cpp bounds it. Whatever is wrong, the caller gets one GGUFFormatError naming the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # real files nest arrays one deep; this bounds the recursion on a hostile one
INT64_MAX = 2**63 - 1

_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")  # element type, count
_TENSOR_TAIL = struct.Struct("<IQ")  # ggml type, data offset

_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_NUMPY_DTYPES = {vtype: np.dtype(fmt.format) for vtype, fmt in _SCALARS.items()}  # numpy reads struct codes
# The fewest bytes one item can take: a count is plausible only if count * this fits in the bytes left.
_MIN_VALUE_BYTES = {**{vtype: fmt.size for vtype, fmt in _SCALARS.items()},
                    GGUFValueType.STRING: _U64.size, GGUFValueType.ARRAY: _ARRAY_HEAD.size}  # fmt: skip
_MIN_KV_BYTES = _U64.size + _U32.size + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = _U64.size + _U32.size + _TENSOR_TAIL.size  # name length, n_dims, type, offset


class GGUFFormatError(ValueError):
    """The file is not a GGUF file or is truncated/corrupt."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major (PyTorch) order: the reverse of GGML's dims
    ggml_type: GGMLQuantizationType
    data: np.ndarray  # raw bytes (uint8), memory-mapped

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


def _quote(text: str, limit: int = 60) -> str:
    """A name from the file, safe for a one-line message however long or strange it is."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


class GGUFFile:
    """Parses header, metadata and tensor directory; tensor bytes stay on disk until touched."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._size = os.fstat(f.fileno()).st_size
            if self._size < _HEADER.size:  # mmap refuses an empty file; say what is wrong instead
                self._reject_short(f.read(len(GGUF_MAGIC)))
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        self._where = "the header"  # what is being read, for the message if the file ends inside it
        try:
            try:
                self._parse()
            except struct.error as exc:  # unpack_from past the end: the file stops mid-field
                raise self._error(f"truncated: the file ends at byte {self._size} inside {self._where}") from exc
        except BaseException:
            with suppress(BufferError):  # unmap now rather than whenever the traceback is dropped
                self._map.close()
            raise

    def _error(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {what}")

    def _reject_short(self, head: bytes) -> None:
        if not head:
            raise self._error("empty file (0 bytes), not a GGUF file")
        if not GGUF_MAGIC.startswith(head):
            raise self._error("not a GGUF file (bad magic)")
        raise self._error(f"truncated: {self._size} bytes, shorter than the {_HEADER.size}-byte GGUF header")

    def _check_count(self, count: int, min_bytes: int, what: str) -> None:
        left = self._size - self._pos
        if count * min_bytes > left:
            raise self._error(f"{what} is {count}, more than the {left} bytes left in the file could hold")

    # -- metadata ----------------------------------------------------------------------------------
    def _value_type(self, raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self._error(f"unknown value type {raw} in {self._where}") from None

    def _read_str(self) -> str:
        return self._read_strings(1)[0]

    def _read_strings(self, count: int) -> list[str]:
        # The hot loop for vocabularies (262k strings for Gemma 3): locals only, one bounds check each.
        data, pos, size, unpack = self._map, self._pos, self._size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (length,) = unpack(data, pos)
            pos += 8
            if pos + length > size:
                raise self._error(f"a string of {length} bytes in {self._where} runs past the end of the file")
            append(data[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self._pos = pos
        return out

    def _read_value(self, vtype: GGUFValueType, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._read_str()
        if vtype != GGUFValueType.ARRAY:
            fmt = _SCALARS[vtype]
            value = fmt.unpack_from(self._map, self._pos)[0]
            self._pos += fmt.size
            return value
        if depth >= MAX_ARRAY_DEPTH:
            raise self._error(f"arrays nested more than {MAX_ARRAY_DEPTH} deep in {self._where}")
        raw_type, count = _ARRAY_HEAD.unpack_from(self._map, self._pos)
        self._pos += _ARRAY_HEAD.size
        elem_type = self._value_type(raw_type)
        self._check_count(count, _MIN_VALUE_BYTES[elem_type], f"the length of an array in {self._where}")
        if elem_type == GGUFValueType.STRING:
            return self._read_strings(count)
        if elem_type == GGUFValueType.ARRAY:
            return [self._read_value(GGUFValueType.ARRAY, depth + 1) for _ in range(count)]
        dtype = _NUMPY_DTYPES[elem_type]
        arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
        self._pos += count * dtype.itemsize
        return arr

    def _read_metadata(self, kv_count: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for index in range(kv_count):
            self._where = f"metadata entry {index}"
            key = self._read_str()
            self._where = f"metadata key {_quote(key)}"
            if key in metadata:
                raise self._error(f"duplicate {self._where}")
            (raw_type,) = _U32.unpack_from(self._map, self._pos)
            self._pos += _U32.size
            metadata[key] = self._read_value(self._value_type(raw_type))
        return metadata

    def _alignment(self) -> int:
        value = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(value) is not int or value <= 0 or value & (value - 1):
            raise self._error(f"general.alignment is {_quote(repr(value))}; it must be a power of two")
        return value

    # -- tensor directory --------------------------------------------------------------------------
    def _read_tensor_info(self, index: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
        """(name, GGML dims, type, offset, byte size) of one directory entry, each field checked."""
        self._where = f"tensor info {index}"
        name = self._read_str()
        self._where = f"tensor {_quote(name)}"
        (n_dims,) = _U32.unpack_from(self._map, self._pos)
        self._pos += _U32.size
        if n_dims > MAX_DIMS:
            raise self._error(f"{self._where} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
        dims = struct.unpack_from(f"<{n_dims}Q", self._map, self._pos)
        self._pos += n_dims * _U64.size
        if any(d > INT64_MAX for d in dims):  # int64 on disk: a negative dimension
            raise self._error(f"{self._where} has a negative dimension")
        num_elements = math.prod(dims)
        if num_elements > INT64_MAX:
            raise self._error(f"{self._where} has dimensions {list(dims)} whose product overflows int64")
        raw_type, offset = _TENSOR_TAIL.unpack_from(self._map, self._pos)
        self._pos += _TENSOR_TAIL.size
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self._error(f"{self._where} has unknown ggml type {raw_type}") from None
        if ggml_type not in GGML_QUANT_SIZES:
            raise self._error(f"{self._where} has ggml type {ggml_type.name}, which has no known block layout")
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        row = dims[0] if dims else 1  # GGML's first dim is the row; blocks never span rows
        if row % block_size:
            raise self._error(f"{self._where} has rows of {row} elements, not a multiple of the "
                              f"{ggml_type.name} block size {block_size}")  # fmt: skip
        return name, dims, ggml_type, offset, num_elements // block_size * type_size

    def _read_tensors(self, tensor_count: int, alignment: int) -> dict[str, GGUFTensor]:
        infos = {}
        for index in range(tensor_count):
            info = self._read_tensor_info(index)
            if info[0] in infos:
                raise self._error(f"duplicate tensor name {_quote(info[0])}")
            infos[info[0]] = info
        data_start = -(-self._pos // alignment) * alignment
        # Each tensor's bytes must be aligned, inside the file, and overlap no other tensor's.
        previous, previous_end = "", 0
        for name, _dims, _type, offset, nbytes in sorted(infos.values(), key=lambda info: info[3]):
            start, end = data_start + offset, data_start + offset + nbytes
            if offset % alignment:
                raise self._error(f"tensor {_quote(name)} has offset {offset}, not a multiple of {alignment}")
            if end > self._size:
                raise self._error(f"tensor {_quote(name)} (bytes {start}..{end}) runs past the end of the file "
                                  f"({self._size} bytes; truncated?)")  # fmt: skip
            if nbytes and start < previous_end:
                raise self._error(f"tensor {_quote(name)} overlaps tensor {_quote(previous)}")
            if end > previous_end:
                previous, previous_end = name, end
        data = np.frombuffer(self._map, dtype=np.uint8)
        tensors = {}
        for name, dims, ggml_type, offset, nbytes in infos.values():
            start = data_start + offset
            tensors[name] = GGUFTensor(name, tuple(reversed(dims)), ggml_type, data[start : start + nbytes])
        return tensors

    def _parse(self) -> None:
        magic, self.version, tensor_count, kv_count = _HEADER.unpack_from(self._map, 0)
        if magic != GGUF_MAGIC:
            raise self._error("not a GGUF file (bad magic)")
        if self.version not in SUPPORTED_VERSIONS:
            swapped = " (a big-endian file?)" if self.version and not self.version & 0xFFFF else ""
            raise self._error(f"GGUF version {self.version}{swapped} is not supported; folio reads versions 2 and 3")
        self._pos = _HEADER.size
        self._check_count(kv_count, _MIN_KV_BYTES, "the metadata count")
        self._check_count(tensor_count, _MIN_TENSOR_INFO_BYTES, "the tensor count")
        self.metadata: dict[str, Any] = self._read_metadata(kv_count)
        alignment = self._alignment()
        self._where = "the tensor directory"
        self._check_count(tensor_count, _MIN_TENSOR_INFO_BYTES, "the tensor count")
        self.tensors: dict[str, GGUFTensor] = self._read_tensors(tensor_count, alignment)

    # -- convenience -------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """Metadata under the architecture's prefix, e.g. arch_get('block_count') -> 'llama.block_count'."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def quantization_summary(self) -> str:
        """The file type the converter declared (e.g. 'Q4_K_M'), else the dominant 2-D tensor type."""
        file_type = self.metadata.get("general.file_type")
        if file_type is not None:
            try:
                return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
            except (ValueError, TypeError, OverflowError):  # not a file type this gguf package knows
                pass
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            if len(tensor.shape) >= 2:
                counts[tensor.ggml_type.name] = counts.get(tensor.ggml_type.name, 0) + tensor.num_elements
        return max(counts, key=counts.__getitem__) if counts else "unknown"
