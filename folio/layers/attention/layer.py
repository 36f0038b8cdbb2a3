"""The attention layer a model holds: writes new K/V into its slice of the paged cache, then attends.

Decode groups go to the compiled CPU kernel (folio/csrc/paged_decode.cpp) when it is available, and
so do prefill chunks over a cache in the query's dtype: the kernel attends a sequence's consecutive
rows together, 16 at a time, reading each block of keys once for them (about twice ATen's CPU flash
attention on a 512-token prompt). Everything else, and every group when the kernel is off, takes the
pure-PyTorch path, the oracle. The cache may be 8-bit (kv_tensors.py); both paths read it.
"""

from __future__ import annotations

import torch
from torch import nn

from folio import ops
from folio.layers.attention.context_attention import attend_split_context
from folio.layers.attention.kv_tensors import LayerKV
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.attention.torch_paged import attend_group


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        """`alibi_slopes` [num_heads] float32: ALiBi biases on the scores (BLOOM), in both paths."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        # Bound by the model runner once the pool is sized.
        self.cache: LayerKV | None = None
        self.block_size = 0
        self.kv_group = 0  # whose block tables this layer reads (kv_cache/groups.py)
        self.decode_kernel = None

    def bind_cache(self, cache: LayerKV, block_size: int, kv_group: int = 0) -> None:
        self.cache, self.block_size, self.kv_group = cache, block_size, kv_group
        self.decode_kernel = ops.load("paged_decode") if cache.k.device.type == "cpu" else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]."""
        cache = self.cache
        if cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner binds it at start-up")
        if meta.context is not None:  # the context split over ranks: each holds some of every sequence's keys
            return attend_split_context(q, k, v, meta, cache, self.scale, self.sliding_window, self.alibi_slopes)
        meta = meta.for_kv_group(self.kv_group)
        cache.write(k, v, meta.slot_mapping)
        kernel_ok = self.decode_kernel is not None and (cache.fmt is not None or q.dtype == cache.k.dtype)
        groups = meta.groups
        if len(groups) == 1 and groups[0].is_decode and kernel_ok:  # a pure decode step: no gather, no scatter
            return self._decode(q.contiguous(), groups[0].block_tables, groups[0].seq_lens, cache)
        # Prefill chunks: 8-bit caches take the PyTorch path (the kernel's 8-bit path attends row by row).
        chunks_ok = kernel_ok and cache.fmt is None
        out = q.new_empty(meta.num_tokens, self.num_heads * self.head_dim)
        for group in groups:
            if group.is_decode and kernel_ok:
                attended = self._decode(q[group.token_rows].contiguous(), group.block_tables, group.seq_lens, cache)
            elif chunks_ok:
                attended = self._decode(q[group.token_rows].contiguous(), *group.as_decode_rows(), cache)
            else:
                attended = attend_group(
                    group, q, k, v, cache, self.block_size, self.scale, self.sliding_window, self.alibi_slopes
                )
            out[group.token_rows] = attended
        return out

    def _decode(self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        """The compiled kernel on query rows [n, H, D], each seeing the keys of its table up to its length:
        -> [n, H * D]."""
        k_cache, v_cache, k_scales, v_scales = cache.kernel_args()
        args = (q, k_cache, v_cache, tables, lens, self.block_size, self.scale, self.sliding_window or 0, k_scales,
                v_scales)  # fmt: skip
        if self.alibi_slopes is None:
            attended = self.decode_kernel.paged_decode_attention(*args)
        else:
            attended = self.decode_kernel.paged_decode_attention_alibi(*args, self.alibi_slopes)
        return attended.view(-1, self.num_heads * self.head_dim)
