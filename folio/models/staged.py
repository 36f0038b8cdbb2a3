"""The body every model shares in shape: embed, run the decoder layers, apply the final norm; split
into pipeline stages, each runs its part.

A model body subclasses `StagedBody` and supplies the three parts (`embed`, `run_layers`, `finish`; the
last two have defaults for layers that add their own residuals).
Parts another stage holds are `HeldElsewhere` placeholders (no parameters, so they load nothing and
allocate nothing); the layer list keeps its length so that every layer keeps its index and its
checkpoint name. Between stages travels a `StageCarry`: the hidden states, and the residual stream
where the architecture fuses its add into the next norm (the Llama family).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.pipeline_parallel import PipelineStage, current_stage
from folio.layers.attention.metadata import AttentionMetadata


class HeldElsewhere(nn.Module):
    """A part of the model that another pipeline stage holds."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this part of the model is held by another pipeline stage")


@dataclass
class StageCarry:
    hidden: torch.Tensor  # [T, hidden]
    residual: torch.Tensor | None  # [T, hidden], or None where the layers add their own residuals

    def packed(self) -> torch.Tensor:
        """One tensor to send: [1 or 2, T, hidden]."""
        parts = [self.hidden] if self.residual is None else [self.hidden, self.residual]
        return torch.stack(parts)

    @staticmethod
    def unpacked(tensor: torch.Tensor) -> StageCarry:
        return StageCarry(tensor[0], tensor[1] if tensor.shape[0] == 2 else None)


class StagedBody(nn.Module):
    # Whether a carry between stages holds the residual stream too (set by bodies that fuse it).
    carries_residual: bool = False
    layers: nn.ModuleList
    norm: nn.Module  # the final norm

    def __init__(self) -> None:
        super().__init__()
        self.stage: PipelineStage = current_stage()

    def build_layers(self, config: ModelConfig, make: Callable[[int], nn.Module]) -> nn.ModuleList:
        """All `config.num_layers` slots, this stage's layers built and the others placeholders."""
        held = self.stage.layer_range(config)
        return nn.ModuleList(make(i) if i in held else HeldElsewhere() for i in range(config.num_layers))

    def on_first(self, make: Callable[[], nn.Module]) -> nn.Module:
        return make() if self.stage.is_first else HeldElsewhere()

    def on_last(self, make: Callable[[], nn.Module]) -> nn.Module:
        return make() if self.stage.is_last else HeldElsewhere()

    def held_layers(self) -> Iterator[nn.Module]:
        return (layer for layer in self.layers if not isinstance(layer, HeldElsewhere))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, carried: StageCarry | None
    ) -> torch.Tensor | StageCarry:
        """The final hidden states on the last stage; what the next stage continues from on the others."""
        if carried is None:
            hidden, residual = self.embed(input_ids, positions), None
        else:
            hidden, residual = carried.hidden, carried.residual
        hidden, residual = self.run_layers(hidden, residual, positions, meta)
        if not self.stage.is_last:
            return StageCarry(hidden, residual)
        return self.finish(hidden, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_layers(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """By default, layers that add their own residuals and read no positions (GPT-2's, BLOOM's)."""
        for layer in self.held_layers():
            hidden = layer(hidden, meta)
        return hidden, None

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(hidden)
