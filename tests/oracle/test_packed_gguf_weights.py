"""GGUF weights kept quantized (4- and 5-bit formats in the int4 kernel; Q6_K and Q8_0 as int8 groups in
the C++ kernel) against the same weights dequantized to fp32, on both real
models, teacher-forced: every position of the dequantized model's greedy continuation is scored by
both, so one early disagreement cannot hide the rest."""

from __future__ import annotations

import pytest
import torch

from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.loaders.model_loader import load_model
from tests.engine_driver import run_greedy_capturing_logits
from tests.oracle.test_real_models_vs_transformers import NEW_TOKENS, PROMPTS


def _engine(loaded) -> EngineCore:
    return EngineCore(loaded.model, loaded.config, CacheConfig(num_blocks=256),
                      SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=2048),
                      torch.float32, torch.device("cpu"))  # fmt: skip


@pytest.fixture(scope="module", params=["smollm2_gguf", "gemma3_gguf"])
def both(request):
    path = request.getfixturevalue(request.param)
    cpu = torch.device("cpu")
    return load_model(path, torch.float32, cpu), load_model(path, torch.float32, cpu, quantization="none")


def test_packed_weights_are_smaller_and_score_like_the_dequantized_ones(both):
    packed, dense = both
    assert packed.weight_bytes < dense.weight_bytes
    num_packed = sum(getattr(m, "packed", None) is not None for m in packed.model.modules())
    assert num_packed > 0
    prompts = [packed.tokenizer.encode(p) for p in PROMPTS]
    outputs, dense_logits = run_greedy_capturing_logits(_engine(dense), prompts, NEW_TOKENS)
    sequences = [p + o[:-1] for p, o in zip(prompts, outputs, strict=True)]
    _, packed_logits = run_greedy_capturing_logits(_engine(packed), sequences, 1)
    agree = total = 0
    worst = 0.0
    for a, b in zip(packed_logits, dense_logits, strict=True):
        a = a[: len(b)]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(b)
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    print(f"{num_packed} packed layers; top-1 agreement {agree}/{total}; worst relative logit gap {worst:.4f}")
    assert agree / total >= 0.97
    assert worst < 0.05


def test_gemma3_keeps_its_5_6_and_8_bit_projections_packed(gemma3_gguf):
    """gemma3-270m's file holds Q5_0 q/k/gate/up (and v in half the layers), Q8_0 v, Q6_K or Q4_K down and
    Q4_K o: none is widened. The 5-bit ones are 4-bit tiles with a fifth bit plane, the 8-bit ones 8-bit
    tiles, and a q/k/v whose v is Q8_0 keeps both side by side."""
    from folio.layers.linear import Linear
    from folio.layers.weight_storage import ConcatRows
    from folio.loaders.gguf_file import GGUFFile
    from folio.weight_formats.gguf_dequant import dequantize_tensor, unpack
    from folio.weight_formats.int4 import PackedInt4
    from folio.weight_formats.int8 import PackedInt8, int8_groups

    loaded = load_model(gemma3_gguf, torch.bfloat16, torch.device("cpu"))
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    kinds = {type(m.packed) for m in linears}
    assert kinds == {PackedInt8, PackedInt4, ConcatRows}
    assert all(m.weight.numel() == 0 for m in linears)
    joined = [m.packed for m in linears if isinstance(m.packed, ConcatRows)]
    blocks = [[(type(p), getattr(p, "bits", 8)) for p in packed.parts] for packed in joined]
    assert blocks and all(b == [(PackedInt4, 5), (PackedInt8, 8)] for b in blocks)
    assert {m.packed.bits for m in linears if isinstance(m.packed, PackedInt4)} == {4, 5}
    gguf = GGUFFile(gemma3_gguf)
    [name] = [n for n, t in gguf.tensors.items() if t.ggml_type.name == "Q6_K"][:1]
    tensor = gguf.tensors[name]
    groups = int8_groups(unpack(tensor.data, tensor.ggml_type, tensor.shape), tensor.shape)
    assert groups.group_size == 16 and torch.equal(groups.dequantize(), dequantize_tensor(tensor))
