"""GPTQ and AWQ against round-to-nearest, and AWQ's folding leaving the float model unchanged."""

from __future__ import annotations

import pytest
import torch
from folio_tools.quantize.awq import output_error, search_scales
from folio_tools.quantize.calibration import InputStatistics
from folio_tools.quantize.gptq import gptq_quantize
from folio_tools.quantize.group_quantizer import group_params, rtn_int_groups
from folio_tools.quantize.quantize_model import fold_awq_scales

from folio import LLM
from folio.layers.linear import Linear
from tests.engine_driver import run_greedy_capturing_logits
from tests.tiny_models import make_tiny_model

GEN = torch.Generator().manual_seed(0)
ROWS, COLS = 128, 256
WEIGHT = torch.randn(ROWS, COLS, generator=GEN) * 0.05
# Correlated inputs with a few large channels, as real activations have.
INPUTS = torch.randn(2048, COLS, generator=GEN) @ (torch.eye(COLS) + 0.3 * torch.randn(COLS, COLS, generator=GEN))
INPUTS[:, 40:44] *= 25
HESSIAN = INPUTS.t() @ INPUTS


@pytest.mark.parametrize("group", [32, 128, -1])
def test_round_to_nearest_codes_are_within_half_a_step(group):
    groups = rtn_int_groups(WEIGHT, 4, group)
    error = (groups.dequantize() - WEIGHT).abs()
    step = groups.scales[:, groups.group_index]
    assert (error <= step / 2 + 1e-6).all()
    scale, zero = group_params(torch.tensor([[0.5, 1.0, 2.0]]), 4, symmetric=False)
    assert float(zero) == 0 and float(scale) == pytest.approx(2 / 15)  # the range always reaches 0


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    """With a diagonal Hessian no error can be compensated: GPTQ (in natural order) must reduce to RTN."""
    diagonal = torch.diag(torch.rand(COLS, generator=GEN) + 0.5)
    gptq = gptq_quantize(WEIGHT, diagonal, 4, 32, act_order=False)
    rtn = rtn_int_groups(WEIGHT, 4, 32)
    assert torch.equal(gptq.codes, rtn.codes) and torch.equal(gptq.zeros, rtn.zeros)


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reproduces_the_layer_output_better_than_round_to_nearest(group, act_order):
    rtn = output_error(WEIGHT, rtn_int_groups(WEIGHT, 4, group).dequantize(), HESSIAN)
    gptq = gptq_quantize(WEIGHT, HESSIAN, 4, group, act_order=act_order)
    assert torch.equal(gptq.group_index, torch.arange(COLS) // (COLS if group == -1 else group))
    assert gptq.codes.max() <= 15
    assert output_error(WEIGHT, gptq.dequantize(), HESSIAN) < 0.5 * rtn


def test_output_error_is_the_error_on_the_inputs():
    approx = rtn_int_groups(WEIGHT, 4, 32).dequantize()
    direct = float(((INPUTS.double() @ (approx - WEIGHT).double().t()) ** 2).sum())
    assert output_error(WEIGHT, approx, HESSIAN) == pytest.approx(direct, rel=1e-4)


def test_awq_scales_favour_the_large_channels_and_beat_round_to_nearest():
    mean_abs = INPUTS.abs().mean(dim=0)
    scales = search_scales(WEIGHT, HESSIAN, mean_abs, 4, 32)
    assert scales[40:44].min() > scales.median()
    awq = rtn_int_groups(WEIGHT * scales, 4, 32).dequantize() / scales
    rtn = rtn_int_groups(WEIGHT, 4, 32).dequantize()
    assert output_error(WEIGHT, awq, HESSIAN) < output_error(WEIGHT, rtn, HESSIAN)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mha"])
def test_folding_awq_scales_leaves_the_float_model_unchanged(tmp_path, kind):
    folder = make_tiny_model("llama" if kind == "mha" else kind, tmp_path / "model")
    if kind == "mha":  # every v row feeds one o column: o's scales fold into v too
        import json

        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
        _widen_kv(folder)
    prompts = [list(range(3, 30))]
    llm = LLM(folder, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    _, before = run_greedy_capturing_logits(llm.engine, prompts, 1)
    model = llm.loaded.model
    stats, generator = {}, torch.Generator().manual_seed(0)  # its own: the same inputs whatever ran before
    for name, layer in model.named_modules():
        if isinstance(layer, Linear):  # skewed channel magnitudes, so the scales are far from 1
            cols = layer.in_features
            x = torch.randn(512, cols, generator=generator) * torch.linspace(0.1, 10, cols)
            stats[name] = InputStatistics(x.t() @ x, x.abs().sum(0), 512)
    weights_before = {n: m.weight.data.clone() for n, m in model.named_modules() if isinstance(m, Linear)}
    fold_awq_scales(model, stats, 32, show_progress=False)
    changed = [
        n for n, m in model.named_modules() if isinstance(m, Linear) and not torch.equal(m.weight, weights_before[n])
    ]
    assert any("o_proj" in n for n in changed) == (kind == "mha")
    assert any("down_proj" in n for n in changed) and any("qkv_proj" in n for n in changed)
    _, after = run_greedy_capturing_logits(llm.engine, prompts, 1)
    torch.testing.assert_close(after[0], before[0], atol=1e-3, rtol=1e-3)


def _widen_kv(folder):
    """Give the tiny Llama four KV heads by repeating its two (so the checkpoint matches the config)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            heads = tensors[name].view(2, 16, -1)
            tensors[name] = heads.repeat_interleave(2, dim=0).reshape(64, -1).contiguous()
    save_file(tensors, str(path))
