"""`folio bench profile` on the CPU: the steps it measures are the batch's decode steps, and its tables
name the work those steps did."""

from __future__ import annotations

import json

import pytest

from folio.bench.step_profile import ProfileConfig, format_tables, run_profile, run_profile_command
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
