"""Gated activations over a fused [gate | up] projection; on CPU one fused op (fused_ops.py) each.
Plain (ungated) activations for MLPs without a gate (GPT-2, BLOOM)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from folio.layers.fused_ops import fused_ops_for

Activation = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _fused(reference: Activation, gelu: bool) -> Activation:
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


def get_gated_activation(name: str) -> Activation:
    return _lookup(ACTIVATIONS, name)


gelu_tanh = functools.partial(F.gelu, approximate="tanh")

# config.json names of ungated activations: GPT-2's "gelu_new" and BLOOM's GELU are the tanh form.
PLAIN_ACTIVATIONS: dict[str, Activation] = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str) -> Activation:
    return _lookup(PLAIN_ACTIVATIONS, name)


def _lookup(known: dict[str, Activation], name: str) -> Activation:
    if name not in known:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(known)}")
    return known[name]
