"""`folio bench profile` on the CPU: the steps it measures are the batch's decode steps, and its tables
name the work those steps did."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from folio_tools.bench.profile import ProfileConfig, _op_table, format_tables, run_profile, run_profile_command
from torch.autograd import DeviceType

from folio.cli import build_parser
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_the_report_times_each_decode_step_and_names_where_it_went(tiny):
    config = ProfileConfig(str(tiny), batch=3, prompt_tokens=9, steps=4,
                           engine_args={"num_kv_blocks": 64, "block_size": 4})  # fmt: skip
    report = run_profile(config, "folio bench profile")
    assert len(report.step_ms) == 4 and all(ms > 0 for ms in report.step_ms)
    assert report.device == "cpu" and report.device_busy_ms_per_step is None
    assert report.ops and all(op.device_us_per_step == 0 for op in report.ops)
    assert sum(op.host_us_per_step for op in report.ops) > 0
    step = next(
        f for f in report.functions if f.function.startswith("engine/engine_core.py") and "(step)" in f.function
    )
    assert step.calls_per_step == 1  # one engine step per step measured: the driver's own frames are left out
    assert report.functions[0] is step  # everything else runs inside it
    assert not any("step_profile" in f.function for f in report.functions)
    assert "median step" in format_tables(report)


def test_prefill_mode_times_passes_of_fresh_prompts(tiny):
    """--prefill: each step is a pass prefilling the batch's prompts to their first token. Fresh prompts
    each pass: a repeated one would come from the prefix cache (an error, not a profile). The pool holds
    one pass's prompts (2 x 2 blocks of 4 slots): each pass's blocks come back for the next."""
    config = ProfileConfig(str(tiny), batch=2, prompt_tokens=7, steps=3, prefill=True,
                           engine_args={"num_kv_blocks": 5, "block_size": 4})  # fmt: skip
    report = run_profile(config, "folio bench profile --prefill")
    assert len(report.step_ms) == 3 and all(ms > 0 for ms in report.step_ms)
    step = next(
        f for f in report.functions if f.function.startswith("engine/engine_core.py") and "(step)" in f.function
    )
    assert step.calls_per_step >= 1  # a pass takes the engine steps its prompts need
    forward = [f for f in report.functions if "(forward)" in f.function]
    assert forward and all(f.inclusive_us_per_step > 0 for f in forward)
    tables = format_tables(report)
    assert "prefill of 2 x 7-token prompts" in tables and "prompt tok/s" in tables


def test_the_device_busy_time_counts_each_kernel_once():
    """On a GPU an eager op's device time is its kernels', listed again as rows of their own."""

    def event(key, device_us, device_type):
        return SimpleNamespace(key=key, count=2, self_cpu_time_total=10.0, self_device_time_total=device_us,
                               device_type=device_type)  # fmt: skip

    events = [event("aten::mm", 300.0, DeviceType.CPU), event("gemm_kernel", 300.0, DeviceType.CUDA),
              event("aten::add", 100.0, DeviceType.CPU), event("add_kernel", 100.0, DeviceType.CUDA)]  # fmt: skip
    ops, busy = _op_table(SimpleNamespace(key_averages=lambda: events), steps=2)
    assert busy == pytest.approx(0.2)  # (300 + 100) us over 2 steps, in ms
    assert [op.name for op in ops][:2] == ["aten::mm", "gemm_kernel"]


def test_a_pool_too_small_for_the_batch_is_an_error_not_a_profile(tiny):
    # 6 blocks of 4 slots: two requests' prompts fit, the third waits, so the steps are not a batch of 3
    config = ProfileConfig(str(tiny), batch=3, prompt_tokens=9, steps=2,
                           engine_args={"num_kv_blocks": 8, "block_size": 4})  # fmt: skip
    with pytest.raises(RuntimeError, match="too small for this batch"):
        run_profile(config, "folio bench profile")


def test_the_command_writes_its_json_and_plot(tiny, tmp_path, capsys):
    words = ["bench", "profile", str(tiny), "--steps", "2", "--prompt-tokens", "5", "--num-kv-blocks", "32",
             "--block-size", "4", "--output-dir", str(tmp_path)]  # fmt: skip
    args = build_parser().parse_args(words)
    assert run_profile_command(args) == 0
    [json_path] = tmp_path.glob("profile_*.json")
    assert json.loads(json_path.read_text())["config"]["steps"] == 2
    assert list(tmp_path.glob("profile_*.png"))
    assert "wrote" in capsys.readouterr().out
    assert run_profile_command(build_parser().parse_args([*words, "--prefill"])) == 0
    [prefill_json] = tmp_path.glob("profile_*prefill5x1*.json")
    assert json.loads(prefill_json.read_text())["config"]["prefill"] is True
