"""`--dtype auto` takes bfloat16 where the hardware multiplies it natively and float32 elsewhere; float32
stays the default; start-up says what was picked and why."""

from __future__ import annotations

import logging

import pytest
import torch

from folio import LLM, SamplingParams
from folio import platform as folio_platform
from folio.engine_args import EngineArgs
from folio.platform import cpu_flags, resolve_dtype
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")


def _flags(monkeypatch, flags: set[str]) -> None:
    monkeypatch.setattr(folio_platform, "cpu_flags", lambda: frozenset(flags))


def test_explicit_dtypes_are_taken_as_given(monkeypatch):
    _flags(monkeypatch, {"avx2"})
    assert resolve_dtype("float32", CPU) == (torch.float32, "as asked")
    assert resolve_dtype(torch.bfloat16, CPU) == (torch.bfloat16, "as asked")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", CPU)


def test_float32_names_the_faster_choice_where_there_is_one(monkeypatch):
    _flags(monkeypatch, {"avx512f", "avx512_bf16"})
    dtype, why = resolve_dtype("float32", CPU)
    assert dtype == torch.float32 and "--dtype auto takes bfloat16, native here (avx512_bf16)" in why


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"avx512f", "avx512_bf16"}, torch.bfloat16), ({"avx2", "amx_bf16"}, torch.bfloat16),
     ({"fp", "asimd", "bf16"}, torch.bfloat16), ({"avx2", "avx512f", "avx512_vnni"}, torch.float32),
     (set(), torch.float32)],
)  # fmt: skip
def test_auto_follows_native_bfloat16(monkeypatch, flags, expected):
    _flags(monkeypatch, flags)
    dtype, why = resolve_dtype("AUTO", CPU)
    assert dtype == expected and why.startswith("auto: ")
    assert ("multiplies bfloat16 natively" in why) == (expected == torch.bfloat16)


def test_this_machines_flags_are_read():
    flags = cpu_flags()
    assert flags == frozenset() or len(flags) > 5  # Linux lists dozens; elsewhere none are read


def test_float32_is_the_default_and_start_up_names_what_auto_picked(tmp_path, caplog):
    assert EngineArgs("m").dtype == "float32"
    with caplog.at_level(logging.INFO, logger="folio"):
        llm = LLM(make_tiny_model("llama", tmp_path / "llama"), dtype="auto", num_kv_blocks=8, block_size=4)
    expected, why = resolve_dtype("auto", CPU)
    assert llm.dtype == expected
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compute: ")]
    assert line.startswith(f"compute: {str(expected).removeprefix('torch.')} activations ({why}), ")
    assert f"{torch.get_num_threads()} threads" in line and "decodes through the C++ decode step" in line
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
