"""folio's C++ CPU kernels, loaded by name: the one place that knows them, builds them (once per machine,
folio/cpp_extension.py) and applies the switches that turn them off.

Every kernel is one source, folio/csrc/<name>.cpp, compiled into its own extension module on first use.
The extensions that call each other (the decode step calls the norm, rotary, activation, 4-bit and
attention kernels) exchange entry points through each module's `entries`, named and typed by
folio/csrc/folio_kernels.h. A kernel that is switched off or cannot be built is None, and its caller
takes the PyTorch path it replaces (which is also its test oracle).

Switches (read when a kernel is first loaded in a process):
    FOLIO_KERNELS=all|none         all (the default) builds kernels on demand; none takes every PyTorch path
    FOLIO_DISABLE_KERNELS=a,b,...  turns off the named kernels (names as in KERNELS, e.g. paged_decode)
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, NamedTuple, get_args

from folio.cpp_extension import compiler, load_extension

SOURCES = Path(__file__).parent / "csrc"

KernelName = Literal["paged_decode", "fused_ops", "decode_stack", "int8_dot", "q8_linear", "nf4_linear", "json_shape"]


class Kernel(NamedTuple):
    """One extension: its source is csrc/<name>.cpp, its module folio_<name>."""

    what: str  # for people: what the compile and failure messages call it
    fallback: str  # what the caller does instead when it is None


KERNELS: dict[KernelName, Kernel] = {
    "paged_decode": Kernel(
        "decode-attention kernel",
        "decode attention gathers each sequence's K/V cache in PyTorch instead (slower on long contexts)",
    ),
    "fused_ops": Kernel(
        "fused norm/rotary/activation kernel",
        "norms, rotary embeddings and activations run as separate PyTorch ops instead (slower decode)",
    ),
    "decode_stack": Kernel(
        "C++ decode-step kernel", "decode steps run the Python layers instead (slower at small batches)"
    ),
    "int8_dot": Kernel(
        "int8 dot-product kernel",
        "4-bit weights are widened for PyTorch matmuls, 8-bit ones take the float kernel (slower decode)",
    ),
    "q8_linear": Kernel(
        "int8 weight kernel", "8-bit weights are widened for a PyTorch matmul instead (slower at small batches)"
    ),
    "json_shape": Kernel(
        "JSON body scanner",
        "large request bodies are parsed whole before their shape is checked (a hostile body of a few MiB "
        "holds the interpreter for tens of milliseconds)",
    ),
    "nf4_linear": Kernel(
        "NF4 weight kernel", "NF4 weights are widened for a PyTorch matmul instead (3-4x slower matmuls at batch 1)"
    ),
}
assert set(KERNELS) == set(get_args(KernelName))


def disabled_kernels() -> frozenset[str]:
    """The kernels the environment turns off; a value that names nothing folio knows is an error."""
    scope = os.environ.get("FOLIO_KERNELS", "all").strip().lower() or "all"
    if scope not in ("all", "none"):
        raise ValueError(f"FOLIO_KERNELS={scope!r}: expected 'all' or 'none'")
    if scope == "none":
        return frozenset(KERNELS)
    named = {part.strip() for part in os.environ.get("FOLIO_DISABLE_KERNELS", "").split(",") if part.strip()}
    unknown = sorted(named - set(KERNELS))
    if unknown:
        raise ValueError(f"FOLIO_DISABLE_KERNELS names unknown kernels {unknown}; known: {', '.join(KERNELS)}")
    return frozenset(named)


def compiler_available() -> bool:
    """Whether a kernel that is not built yet can be (built ones load without a compiler)."""
    return compiler() is not None


@cache
def load(name: KernelName) -> ModuleType | None:
    """The compiled extension `name` (built on first use), or None when switched off or it cannot be built
    (reported once, naming the slower path). Cached per process; `load.__wrapped__` reads the switches again."""
    if name in disabled_kernels():
        return None
    return load_extension(name, f"folio_{name}", SOURCES / f"{name}.cpp", *KERNELS[name])


def entries(*modules: ModuleType) -> dict[str, Any]:
    """The C++ entry points the given extensions publish (capsules by their folio_kernels.h names)."""
    merged: dict[str, Any] = {}
    for module in modules:
        merged.update(module.entries)
    return merged
