"""Quantizing dense weights at load (`quantization="int8"|"int4"|"nf4"`): round-to-nearest stays within half a
step, and both kernels' paths equal dequantize-then-matmul of the quantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from folio import LLM, SamplingParams
from folio.layers.linear import Linear
from folio.weight_formats import int8
from folio.weight_formats.int4 import PackedInt4, rtn_groups
from folio.weight_formats.int8 import ChannelInt8
from tests.tiny_models import make_tiny_model

WEIGHT = torch.randn(192, 256, generator=torch.Generator().manual_seed(0)) * 0.05


def test_int4_round_to_nearest_is_within_half_a_step():
    groups = rtn_groups(WEIGHT)
    assert groups.codes.max() <= 15
    error = (groups.dequantize() - WEIGHT).abs().view(192, 8, 32)
    assert (error <= groups.scales.unsqueeze(-1) / 2 + 1e-6).all()


def test_int8_per_channel_is_within_half_a_step():
    quantized = ChannelInt8.quantize(WEIGHT)
    error = (quantized.dequantize() - WEIGHT).abs()
    steps = quantized.scales.float().unsqueeze(1)  # the bf16-rounded scale is the step actually used
    assert (error <= steps / 2 + steps * 2**-7 * 127).all()


@pytest.mark.parametrize("rows", [1, 7, int8.CHANNEL_KERNEL_MAX_ROWS, int8.CHANNEL_KERNEL_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_paths_equal_dequantize_then_matmul(rows, dtype):
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for packed in (ChannelInt8.quantize(WEIGHT), PackedInt4(rtn_groups(WEIGHT))):
        expected = F.linear(x.double(), packed.dequantize(torch.float64))
        got = packed.linear(x).double()
        assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()  # bf16 activations (int8 kernel)


def test_a_loaded_linear_quantizes_and_drops_its_dense_weight():
    layer = Linear(256, 192)
    layer.weight.data.copy_(WEIGHT)
    assert layer.quantize("int8") and layer.weight.numel() == 0
    assert layer.weight_nbytes == 192 * 256 + 192 * 2
    assert not layer.quantize("int4")  # already quantized
    assert Linear(256, 100).quantize("int4")  # any number of rows
    odd = Linear(100, 64)  # 100 inputs: not whole groups of 32
    assert not odd.quantize("int4") and odd.packed is None


@pytest.mark.parametrize("method", ["int8", "int4", "nf4"])
def test_models_quantized_on_the_fly_generate_close_to_dense(tmp_path, method):
    folder = make_tiny_model("llama", tmp_path / "llama")
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    dense = LLM(folder, num_kv_blocks=64, block_size=4).generate(prompt, params, use_tqdm=False)[0]
    llm = LLM(folder, num_kv_blocks=64, block_size=4, quantization=method)
    assert "on the fly" in llm.loaded.quantization
    assert any(getattr(m, "packed", None) is not None for m in llm.loaded.model.modules())
    got = llm.generate(prompt, params, use_tqdm=False)[0]
    top_dense = {t for t, _ in dense.outputs[0].logprobs[0].top}
    assert got.outputs[0].token_ids[0] in top_dense  # the quantized model's pick is among the dense top 5
