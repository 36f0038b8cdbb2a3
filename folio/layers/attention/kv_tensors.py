"""One layer's slice of the paged KV cache: K and V by slot, in the model's dtype or 8-bit with
per-token, per-head scales (folio/kv_cache/quant.py). Writing, gathering and block copies go
through here, so attention code never cares which."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.kv_cache.quant import SCALE_DTYPE, KVFormat


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as raw bytes: indexing and copies work for every dtype (float8 included)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


@dataclass
class LayerKV:
    k: torch.Tensor  # [slots, Hkv, D]: the model dtype, int8 or float8_e4m3fn
    v: torch.Tensor
    fmt: KVFormat | None = None  # None: K/V kept in the model's dtype
    k_scales: torch.Tensor | None = None  # [slots, Hkv] float16, for 8-bit formats
    v_scales: torch.Tensor | None = None

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        if self.fmt is None:
            self.k.index_copy_(0, slots, key.to(self.k.dtype))
            self.v.index_copy_(0, slots, value.to(self.v.dtype))
            return
        assert self.k_scales is not None and self.v_scales is not None
        for cache, scales, rows in ((self.k, self.k_scales, key), (self.v, self.v_scales, value)):
            codes, row_scales = self.fmt.quantize(rows)
            _bytes(cache).index_copy_(0, slots, _bytes(codes))
            scales.index_copy_(0, slots, row_scales)

    def gather(self, which: str, block_tables: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[b, num_blocks] tables -> [b, num_blocks * block_size, Hkv, D] in `dtype`, dequantized."""
        cache = self.k if which == "k" else self.v
        heads, dim = cache.shape[1], cache.shape[2]
        blocks = _bytes(cache).view(-1, block_size, heads, dim)[block_tables].view(cache.dtype)
        if self.fmt is None:
            return blocks.flatten(1, 2).to(dtype)
        scales = (self.k_scales if which == "k" else self.v_scales).view(-1, block_size, heads)[block_tables]
        return KVFormat.dequantize(blocks, scales, dtype).flatten(1, 2)

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What the C++ decode kernel takes: float8 codes as bytes, int8 as is, scales or None."""
        if self.fmt is not None and self.fmt.name == "fp8":
            return self.k.view(torch.uint8), self.v.view(torch.uint8), self.k_scales, self.v_scales
        return self.k, self.v, self.k_scales, self.v_scales

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scales, self.v_scales) if t is not None]

    def read_blocks(self, blocks: torch.Tensor, block_size: int) -> list[torch.Tensor]:
        """Copies of whole blocks of K, V and their scales, in the cache's own format (float8 as bytes),
        each [len(blocks), block_size, ...]: what another engine's `write_blocks` takes."""
        return [_bytes(t).view(-1, block_size, *t.shape[1:])[blocks].clone() for t in self.tensors()]

    def write_blocks(self, blocks: torch.Tensor, block_size: int, parts: list[torch.Tensor]) -> None:
        """`parts` as `read_blocks` returns them, or as raw bytes (the last dimension widened)."""
        for tensor, part in zip(self.tensors(), parts, strict=True):
            raw = _bytes(tensor)
            raw.view(-1, block_size, *raw.shape[1:])[blocks] = part.to(raw.device).view(raw.dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
        """Copy-on-write: whole blocks of K, V and their scales."""
        for tensor in self.tensors():
            raw = _bytes(tensor)
            blocks = raw.view(-1, block_size, *raw.shape[1:])
            blocks[dst] = blocks[src]


def scale_zeros(slots: int, heads: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(slots, heads, dtype=SCALE_DTYPE, device=device)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On CPU, numpy's calloc-backed zeros map pages lazily, so a multi-GiB pool
    costs nothing until used (torch.zeros would touch every page up front). Zeros matter: padded key
    slots are masked, but garbage NaNs in V would still poison the attention product."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


def allocate_layer_kv(
    num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, fmt: KVFormat | None, device: torch.device
) -> LayerKV:
    """One attention layer's K and V for `num_slots` tokens (and their scales if 8-bit), zeroed lazily."""
    shape = (num_slots, num_kv_heads, head_dim)
    code_dtype = dtype if fmt is None else fmt.dtype
    layer_kv = LayerKV(lazy_zeros(shape, code_dtype, device), lazy_zeros(shape, code_dtype, device), fmt)
    if fmt is not None:
        layer_kv.k_scales = lazy_zeros(shape[:2], SCALE_DTYPE, device)
        layer_kv.v_scales = lazy_zeros(shape[:2], SCALE_DTYPE, device)
    return layer_kv
