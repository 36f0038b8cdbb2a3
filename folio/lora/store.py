"""The runner's LoRA adapters: registered by name (read from disk once, kept in host memory), and for
each step the ones its requests use placed in the layers' slots (at most `max_loras` at once, the least
recently used adapter giving up its slot), with each token row told its slot."""

from __future__ import annotations

from collections import OrderedDict

import torch

from folio.layers.linear import Linear
from folio.layers.lora import LoRABatch, LoRASlots
from folio.lora.adapter import LoRAAdapter, LoRARequest, layer_parts, read_adapter
from folio.models.base import CausalLM


class LoRAStore:
    def __init__(self, model: CausalLM, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.batch = LoRABatch()
        model.model.lora_batch = self.batch  # the C++ decode step reads it too
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._layers = dict(model.named_modules())

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter (ValueError: why it cannot serve this model); again under a known
        name replaces it."""
        adapter = read_adapter(request.name, request.path, self.model)
        if adapter.rank > self.max_rank:
            raise ValueError(f"the adapter {request.name!r} has rank {adapter.rank}, above --max-lora-rank "
                             f"{self.max_rank}")  # fmt: skip
        self.remove(request.name)
        self.adapters[request.name] = adapter
        return adapter

    # Slots are made and written under inference mode, as the step that first needs them runs: every change
    # to them must be too (an inference tensor cannot be written outside it).
    @torch.inference_mode()
    def remove(self, name: str) -> bool:
        slot = self.slots.pop(name, None)
        if slot is not None:
            self._clear(slot)
        return self.adapters.pop(name, None) is not None

    @torch.inference_mode()
    def prepare(self, rows: list[tuple[int, str | None]]) -> None:
        """This step's chunks as (token rows, adapter name or None), in batch order."""
        needed = {name for _, name in rows if name is not None}
        if len(needed) > self.max_loras:
            raise ValueError(f"a step uses {len(needed)} adapters; at most {self.max_loras} fit (--max-loras)")
        for name in needed:
            self._place(name)
        token_slots = [self.slots[name] if name is not None else -1 for count, name in rows for _ in range(count)]
        self.batch.set(token_slots, self.device)

    def _place(self, name: str) -> None:
        if name in self.slots:
            self.slots.move_to_end(name)
            return
        adapter = self.adapters.get(name)
        if adapter is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        in_use = set(self.slots.values())
        free = [slot for slot in range(self.max_loras) if slot not in in_use]
        if free:
            slot = free[0]
        else:  # the least recently used adapter's slot (never one of this step's: placed ones move to the end)
            _, slot = self.slots.popitem(last=False)
            self._clear(slot)
        for part in adapter.parts:
            self._slots_of(part.module).load(slot, part.part, part.a, part.b, part.scale)
        self.slots[name] = slot

    def _slots_of(self, module: str) -> LoRASlots:
        layer = self._layers[module]
        assert isinstance(layer, Linear)
        if layer.lora is None:
            layer.lora = LoRASlots(layer.in_features, layer.out_features, layer_parts(layer), self.max_loras,
                                   self.max_rank, self.batch, self.dtype, self.device)  # fmt: skip
        return layer.lora

    def _clear(self, slot: int) -> None:
        for layer in self._layers.values():
            if isinstance(layer, Linear) and layer.lora is not None:
                layer.lora.clear(slot)
