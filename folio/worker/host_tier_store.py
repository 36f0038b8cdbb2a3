"""The runner's half of the host-RAM KV tier (the scheduler's half: kv_cache/host_tier.py): the bytes
of each tier slot, and the copies between them and the pool's blocks that each step's `TierCopy`
batches ask for, made in order before anything else in the step touches the cache.

A slot holds one block of every layer, in the cache's own format (8-bit codes with their scales, float8
as bytes), so a block comes back bit for bit as it left.
"""

from __future__ import annotations

import torch

from folio.kv_cache.tier_ops import TierCopy
from folio.layers.attention.kv_tensors import LayerKV, lazy_zeros


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def block_bytes(kv_caches: list[LayerKV], slots_per_block: int) -> int:
    """Bytes of one block of every layer's K/V (and scales)."""
    return sum(t[0].numel() * t.element_size() * slots_per_block for layer in kv_caches for t in layer.tensors())


class HostTierStore:
    def __init__(self, kv_caches: list[LayerKV], num_slots: int, slots_per_block: int) -> None:
        self.slots_per_block = slots_per_block
        # Per layer, per tensor: the pool's blocks as [blocks, slots_per_block, ...] and the tier's slots alike.
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in kv_caches:
            for tensor in layer.tensors():
                raw = _raw(tensor)
                blocks = raw.view(-1, slots_per_block, *raw.shape[1:])
                shape = (num_slots, *blocks.shape[1:])
                if raw.device.type == "cpu":
                    host = lazy_zeros(shape, raw.dtype, raw.device)  # pages taken as slots fill
                else:
                    host = torch.empty(shape, dtype=raw.dtype, pin_memory=True)
                self.pairs.append((blocks, host))

    @property
    def slot_bytes(self) -> int:
        return sum(host[0].numel() * host.element_size() for _, host in self.pairs)

    @torch.inference_mode()
    def run(self, copies: tuple[TierCopy, ...]) -> None:
        for copy in copies:
            device = self.pairs[0][0].device
            block_ids = torch.tensor(copy.blocks, dtype=torch.long, device=device)
            slot_ids = torch.tensor(copy.slots, dtype=torch.long)
            for blocks, host in self.pairs:
                if copy.load:
                    blocks[block_ids] = host[slot_ids].to(blocks.device, non_blocking=True)
                else:
                    host[slot_ids] = blocks[block_ids].to("cpu")

    @torch.inference_mode()
    def block_payloads(self, block_ids: list[int]) -> torch.Tensor:
        """Pool blocks `block_ids` of every layer as one new uint8 tensor [len(block_ids), slot_bytes] on the
        CPU, row i in slot layout: one gather per layer tensor, however many blocks."""
        out = torch.empty(len(block_ids), self.slot_bytes, dtype=torch.uint8)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.pairs[0][0].device)
        offset = 0
        for blocks, _ in self.pairs:
            part = blocks[ids].to("cpu").reshape(len(block_ids), -1).view(torch.uint8)
            out[:, offset : offset + part.shape[1]] = part
            offset += part.shape[1]
        return out

    @torch.inference_mode()
    def fill_slot(self, slot: int, payload: torch.Tensor) -> None:
        """Slot `slot` from a `block_payload` (uint8, slot_bytes long)."""
        offset = 0
        for _, host in self.pairs:
            target = host[slot].reshape(-1).view(torch.uint8)
            target.copy_(payload[offset : offset + target.numel()])
            offset += target.numel()
