"""A fast, read-only view of a GGUF file: metadata as Python values, tensors as memory-mapped bytes.

The `gguf` package's GGUFReader builds a numpy view per array element; on Gemma 3's 262k-token
vocabulary that takes ~9 s. This parser reads string arrays with one pass of `struct` and numeric
arrays with `np.frombuffer`, so opening a file takes well under a second. Type codes and block
sizes come from the `gguf` package, which stays the source of truth for the format.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


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
        return int(np.prod(self.shape))


class GGUFFile:
    """Parses header, metadata and tensor directory; tensor bytes stay on disk until touched."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mmap)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{self.path}: corrupt or truncated GGUF file ({exc})") from exc

    # -- parsing -----------------------------------------------------------------------------------
    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        length = self._read("<Q")
        if self._pos + length > len(self._buf):
            raise GGUFFormatError(f"{self.path}: string runs past end of file")
        raw = bytes(self._buf[self._pos : self._pos + length])
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _read_value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._read_str()
        if vtype == GGUFValueType.ARRAY:
            elem_type = GGUFValueType(self._read("<I"))
            count = self._read("<Q")
            if elem_type == GGUFValueType.STRING:
                return [self._read_str() for _ in range(count)]
            if elem_type == GGUFValueType.ARRAY:
                return [self._read_value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY_DTYPES[elem_type])
            arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += count * dtype.itemsize
            return arr
        return self._read(_SCALAR_FORMATS[vtype])

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._read("<I")
        if self.version < 2:
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} is not supported")
        tensor_count = self._read("<Q")
        kv_count = self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._read_str()
            self.metadata[key] = self._read_value(GGUFValueType(self._read("<I")))

        infos = []
        for _ in range(tensor_count):
            name = self._read_str()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            ggml_type = GGMLQuantizationType(self._read("<I"))
            offset = self._read("<Q")
            infos.append((name, dims, ggml_type, offset))

        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, ggml_type, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            num_elements = int(np.prod(dims))
            nbytes = num_elements // block_size * type_size
            start = data_start + offset
            if start + nbytes > len(self._mmap):
                raise GGUFFormatError(f"{self.path}: tensor {name} runs past end of file (truncated?)")
            self.tensors[name] = GGUFTensor(
                name=name,
                shape=tuple(reversed(dims)),
                ggml_type=ggml_type,
                data=self._mmap[start : start + nbytes],
            )

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
            except ValueError:
                pass
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            if len(tensor.shape) >= 2:
                counts[tensor.ggml_type.name] = counts.get(tensor.ggml_type.name, 0) + tensor.num_elements
        return max(counts, key=counts.__getitem__) if counts else "unknown"
