"""Gated activations over a fused [gate | up] projection; on CPU one fused op (fused_ops.py) each.
Plain (ungated) activations for MLPs without a gate (GPT-2, BLOOM)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from folio.layers.fused_ops import fused_ops_for


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _fused(reference: Callable[[torch.Tensor], torch.Tensor], gelu: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def activation(x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x)
        if ops is None or x.dim() != 2:
            return reference(x)
        return ops.gated_activation(x, gelu)

    return activation


silu_and_mul = _fused(silu_and_mul_reference, gelu=False)
gelu_tanh_and_mul = _fused(gelu_tanh_and_mul_reference, gelu=True)

ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}


def get_gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json names of ungated activations: GPT-2's "gelu_new" and BLOOM's GELU are the tanh form.
PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return PLAIN_ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(PLAIN_ACTIVATIONS)}") from None
