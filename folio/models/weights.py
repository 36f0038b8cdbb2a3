"""Routes checkpoint tensors (Hugging Face names) onto a model's parameters.

A model lists how separate checkpoint tensors fuse into its layers, e.g. ("qkv_proj", "q_proj", "q");
every parameter's own `weight_loader` then copies its slice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from folio.layers.linear import default_weight_loader
from folio.layers.weight_narrowing import LazyWeight
from folio.weight_formats.int4 import Int4Groups
from folio.weight_formats.int8 import Int8Groups

StackedMapping = list[tuple[str, str, object]]  # (fused name, checkpoint name, shard id)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | Int4Groups | Int8Groups]],
    stacked: StackedMapping,
    skip_prefixes: tuple[str, ...] = (),
) -> set[str]:
    """Load every tensor; return the names of parameters that were filled."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        target, shard_id = _route(name, stacked)
        param = params.get(target)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        if isinstance(tensor, LazyWeight) and not getattr(param, "loads_slices", False):
            tensor = tensor.load()  # a loader that takes the whole tensor
        # Quantized groups go to the layer as they are; it keeps them or widens them itself.
        loader(param, tensor.to(param.dtype) if isinstance(tensor, torch.Tensor) else tensor, shard_id)
        loaded.add(target)
    return loaded


def _route(name: str, stacked: StackedMapping) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id); unfused names map to themselves."""
    for fused, part, shard_id in stacked:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    # Tied parameters appear under two names; either one being loaded is enough.
    seen_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in loaded}
    missing = [n for n, p in model.named_parameters() if id(p) not in seen_ids]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
