"""The kernels' contract (folio/ops.py, folio/csrc/folio_kernels.h): every entry point one extension
calls in another is declared once, in the header, published under that name by exactly one extension,
and taken back only under that name; and one switch scheme turns kernels off.
"""

from __future__ import annotations

import re
from types import ModuleType

import pytest
import torch

from folio import ops

HEADER = ops.SOURCES / "folio_kernels.h"
# Capsules are made and opened only by the header's add_entry / entry.
RAW_CAPSULE = re.compile(r"py::capsule|PyCapsule_|get_pointer|reinterpret_cast<[^>]*\(\*\)")


@pytest.fixture(scope="module")
def modules() -> dict[str, ModuleType]:
    loaded = {name: ops.load(name) for name in ops.KERNELS}
    assert None not in loaded.values(), loaded  # a C++ compiler is part of the project's setup
    return loaded


def _declared_names() -> list[str]:
    return re.findall(r'static constexpr const char\* name = "([^"]+)";', HEADER.read_text())


def test_every_declared_entry_is_published_once_under_its_name(modules):
    published: dict[str, list[str]] = {}
    for kernel, module in modules.items():
        for key, capsule in getattr(module, "entries", {}).items():
            assert type(capsule).__name__ == "PyCapsule", (kernel, key)
            published.setdefault(key, []).append(kernel)
    declared = _declared_names()
    assert len(declared) == len(set(declared)) > 0
    assert sorted(published) == sorted(declared)
    for name, kernels in published.items():
        assert kernels == [name.split(".")[1]], (name, kernels)  # folio.<extension>.<entry>


def test_every_extension_builds_against_the_header_and_no_other_makes_capsules():
    for source in sorted(ops.SOURCES.glob("*.cpp")):
        text = source.read_text()
        assert '#include "folio_kernels.h"' in text, source.name
        assert not RAW_CAPSULE.search(text), f"{source.name}: capsules go through folio_kernels.h"


def _stack(modules: dict[str, ModuleType], entries: dict) -> object:
    return modules["decode_stack"].DecodeStack(entries, 4, 2, 16, 4, 0.25, 1e-6, 0.0, False, False)


def test_the_decode_step_takes_the_entries_it_is_given(modules):
    entries = ops.entries(modules["fused_ops"], modules["int8_dot"], modules["paged_decode"])
    assert _stack(modules, entries) is not None


def test_a_capsule_under_another_entrys_name_is_refused(modules):
    entries = ops.entries(modules["fused_ops"], modules["int8_dot"], modules["paged_decode"])
    # the attention kernel where the 4-bit matmul belongs: called, it would read tensors as the wrong arguments
    entries["folio.int8_dot.int4_linear"] = entries["folio.paged_decode.paged_decode_attention"]
    with pytest.raises(RuntimeError, match="folio.int8_dot.int4_linear: refused a capsule named "
                                           "folio.paged_decode.paged_decode_attention"):  # fmt: skip
        _stack(modules, entries)


def test_a_missing_entry_names_itself(modules):
    entries = ops.entries(modules["fused_ops"], modules["paged_decode"])  # no int8_dot
    with pytest.raises(RuntimeError, match="no kernel entry point folio.int8_dot.int4_linear"):
        _stack(modules, entries)


def test_a_non_capsule_is_refused(modules):
    entries = ops.entries(modules["fused_ops"], modules["int8_dot"], modules["paged_decode"])
    entries["folio.fused_ops.rotary"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="folio.fused_ops.rotary is not a capsule"):
        _stack(modules, entries)


def test_switches_turn_named_kernels_off(monkeypatch):
    monkeypatch.setenv("FOLIO_DISABLE_KERNELS", " paged_decode, decode_stack ")
    assert ops.disabled_kernels() == {"paged_decode", "decode_stack"}
    assert ops.load.__wrapped__("paged_decode") is None  # the uncached loader; the process's cache is left alone
    monkeypatch.setenv("FOLIO_KERNELS", "none")
    assert ops.disabled_kernels() == set(ops.KERNELS)
    assert all(ops.load.__wrapped__(name) is None for name in ops.KERNELS)
    monkeypatch.delenv("FOLIO_KERNELS")
    monkeypatch.delenv("FOLIO_DISABLE_KERNELS")
    assert ops.disabled_kernels() == set()


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("FOLIO_KERNELS", "torch", "expected 'all' or 'none'"),
    ("FOLIO_DISABLE_KERNELS", "fused_ops,attention", r"unknown kernels \['attention'\]"),
])  # fmt: skip
def test_a_switch_naming_nothing_known_is_an_error(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        ops.disabled_kernels()
