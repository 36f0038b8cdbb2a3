"""8-bit KV cache: each token's K (and V) row of each KV head is stored as 8-bit codes with one float16
scale, so a slot takes head_dim + 2 bytes per head instead of 2 * head_dim (bf16) or 4 * head_dim.

- int8: codes = round(x / scale), scale = max|x| / 127 (symmetric, per token and head);
- fp8: codes = float8_e4m3fn(x / scale), scale = max|x| / 448 (e4m3's largest finite value).

Writes quantize, reads dequantize; the attention math itself stays in the query's dtype (the
pure-PyTorch path) or float32 (the CPU decode kernel, which applies the scales itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.config import check_kv_cache_dtype

SCALE_DTYPE = torch.float16
_TINY = 1e-6  # an all-zero row still gets a usable scale


@dataclass(frozen=True)
class KVFormat:
    name: str  # "int8" or "fp8"
    dtype: torch.dtype  # of the codes
    qmax: float

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [T, Hkv, D] -> codes [T, Hkv, D] and scales [T, Hkv]."""
        amax = rows.abs().amax(dim=-1).float()
        scales = (amax / self.qmax).clamp_min(_TINY).to(SCALE_DTYPE)
        scaled = rows.float() / scales.float().unsqueeze(-1)
        if self.dtype == torch.int8:
            codes = scaled.round().clamp(-self.qmax, self.qmax).to(torch.int8)
        else:
            codes = scaled.clamp(-self.qmax, self.qmax).to(self.dtype)
        return codes, scales

    @staticmethod
    def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8": KVFormat("fp8", torch.float8_e4m3fn, 448.0),
}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """None for "auto" (the model's dtype)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return FORMATS.get(kv_cache_dtype)


def slot_bytes_per_head(head_dim: int, model_dtype: torch.dtype, fmt: KVFormat | None) -> int:
    """Bytes one token's K (or V) row of one KV head takes in the cache."""
    if fmt is None:
        return head_dim * torch.finfo(model_dtype).bits // 8
    return head_dim + torch.finfo(SCALE_DTYPE).bits // 8
