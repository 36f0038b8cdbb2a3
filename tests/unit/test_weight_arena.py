"""A loaded model's weights gathered into huge-page arenas (folio/loaders/weight_arena.py): every tensor
keeps its values, views and ties, now lives in an arena, and the model generates exactly what it did
with its weights where the loader left them."""

from __future__ import annotations

import ctypes
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch
from torch import nn

import folio.loaders.model_loader as model_loader
from folio import LLM, SamplingParams
from folio.memory import ARENA_BYTES, HUGE_PAGE, gather_weights, model_tensors
from folio.weight_formats.int4 import PackedInt4, rtn_groups
from tests.tiny_models import make_tiny_model


def _within(tensor: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> bool:
    first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    return any(start <= first and last <= start + length for start, length in spans)


def _module() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(64, 32, generator=generator), requires_grad=False)
    module.register_buffer("transposed", module.weight.data.t())  # a view of the weight's memory
    module.packed = PackedInt4(rtn_groups(torch.randn(48, 64, generator=generator)))
    module.child = nn.Module()
    module.child.same_packed = module.packed  # one packed weight held twice (tied)
    module.child.table = torch.arange(10, dtype=torch.int64)  # a plain tensor attribute
    return module


def test_every_tensor_moves_into_an_arena_with_its_values_views_and_ties():
    module = _module()
    tensors = model_tensors(module)
    packed = module.packed
    assert {id(t) for t in tensors} >= {id(module.weight), id(module.transposed), id(packed.tiles), id(packed.scales),
                                        id(module.child.table)}  # fmt: skip
    before = {id(t): t.clone() for t in tensors}
    report = gather_weights(module)
    assert report is not None and len(report.spans) == 1
    assert all(start % HUGE_PAGE == 0 for start, _ in report.spans)
    for tensor in tensors:
        assert torch.equal(tensor, before[id(tensor)])
        assert tensor.numel() == 0 or _within(tensor, report.spans)
    assert report.bytes == sum(t.nbytes for t in tensors if t is not module.transposed)
    # still a view of the weight: a write to one shows in the other
    assert module.transposed.data_ptr() == module.weight.data_ptr()
    module.weight.data[3, 5] = 42.0
    assert module.transposed[5, 3] == 42.0
    assert module.child.same_packed is packed and isinstance(module.weight, nn.Parameter)


def test_memory_torch_was_lent_stays_where_it_is():
    """A tensor over shared memory (tensor-parallel ranks reduce through one) is another process's view
    too: moved, the ranks would stop seeing each other's writes."""
    shared = shared_memory.SharedMemory(create=True, size=4096)
    try:
        module = _module()
        module.exchange = torch.frombuffer(shared.buf, dtype=torch.uint8)
        report = gather_weights(module)
        assert report is not None and _within(module.weight, report.spans)
        assert not _within(module.exchange, report.spans)
        assert module.exchange.data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(shared.buf))
        shared.buf[7] = 42  # still the same memory
        assert module.exchange[7] == 42
        del module
    finally:
        shared.close()
        shared.unlink()


def test_weights_larger_than_an_arena_take_several(monkeypatch):
    monkeypatch.setattr("folio.memory.ARENA_BYTES", 4096)
    module = nn.Module()
    for index in range(3):
        module.register_buffer(f"b{index}", torch.full((1000,), float(index)))  # 4,000 bytes each
    report = gather_weights(module)
    assert report is not None and len(report.spans) == 3
    for index in range(3):
        buffer = getattr(module, f"b{index}")
        assert _within(buffer, report.spans) and bool((buffer == index).all())
    assert ARENA_BYTES >= 64 << 20  # the module's own limit: few arenas for a real model


def test_huge_pages_are_advised_where_the_kernel_offers_them():
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("no transparent huge pages on this machine")
    report = gather_weights(_module())
    assert report is not None and report.advised
    start = report.spans[0][0]
    eligible = None
    for line in Path("/proc/self/smaps").read_text().splitlines():  # the arena's mapping: THPeligible 1
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            inside = low <= start < high
        elif inside and fields[0] == "THPeligible:":
            eligible = fields[1]
    assert eligible == "1"


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_model_generates_the_same_with_its_weights_gathered(tmp_path, monkeypatch, caplog, quantization):
    folder = make_tiny_model("llama", tmp_path / "llama")
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    prompt = list(range(5, 25))
    with caplog.at_level("INFO", logger="folio"):
        gathered = LLM(folder, num_kv_blocks=64, block_size=4, quantization=quantization)
    assert "weights gathered into 1 arena(s)" in caplog.text  # the loader gathers every CPU model
    expected = gathered.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    monkeypatch.setattr(model_loader, "gather_weights", lambda model: None)
    scattered = LLM(folder, num_kv_blocks=64, block_size=4, quantization=quantization)
    got = scattered.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in expected.logprobs]
