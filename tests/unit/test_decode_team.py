"""The C++ decode step's team path (folio/csrc/decode_team_step.h) against the kernel-by-kernel path and the
Python layers: a step of at most four float32 tokens over tiled 4-, 5- and 8-bit weights runs in one
parallel region a layer, and must give the same tokens and logprobs, bit for bit; a larger batch, or
dense weights, keep the kernel-by-kernel path."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from tests.tiny_models import make_tiny_model
from tests.unit.test_decode_stack import _llm, _model

PROMPT_SETS = {"batch 1": [[5, 6, 7]], "batch 6": [list(range(5, 5 + n)) for n in (2, 3, 5, 8, 11, 20)]}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("prompts", PROMPT_SETS)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])  # q/k/v biases (qwen2), QK-norm
def test_team_steps_equal_the_python_layers(tmp_path, kind, prompts):
    folder = make_tiny_model(kind, tmp_path / kind)
    fast, slow = _llm(folder, "int8-groups"), _llm(folder, "int8-groups")
    _model(slow).decode_stack = None
    stack = _model(fast).decode_stack.stack
    assert _generate(fast, PROMPT_SETS[prompts]) == _generate(slow, PROMPT_SETS[prompts])
    if prompts == "batch 1":
        assert stack.team_steps >= 9 and stack.kernel_steps == 0
    else:  # six decodes every step (all stop at max_tokens together): kernel by kernel
        assert stack.kernel_steps >= 9 and stack.team_steps == 0


def test_the_gemma3_file_decodes_in_teams(gemma3_gguf):
    """Q5_0 q/k/gate/up, Q8_0 v (row blocks of two formats), Q6_K down, Q4_K o."""
    fast = LLM(gemma3_gguf, kv_cache_memory="32MiB")
    slow = LLM(gemma3_gguf, kv_cache_memory="32MiB")
    _model(slow).decode_stack = None
    assert _generate(fast, PROMPT_SETS["batch 1"]) == _generate(slow, PROMPT_SETS["batch 1"])
    assert _model(fast).decode_stack.stack.team_steps >= 9


def test_dense_weights_keep_the_kernel_by_kernel_path(tmp_path):
    llm = _llm(make_tiny_model("llama", tmp_path / "llama"), "fp32")
    _generate(llm, PROMPT_SETS["batch 1"])
    stack = _model(llm).decode_stack.stack
    assert stack.team_steps == 0 and stack.kernel_steps >= 9


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(tmp_path):
    model = _model(_llm(make_tiny_model("llama", tmp_path / "llama"), "int8-groups"))
    stack = model.decode_stack.stack
    attention = model.layers[0].self_attn
    caches = [t for layer in model.layers for t in (layer.self_attn.attn.cache.k, layer.self_attn.attn.cache.v)]
    before = [cache.clone() for cache in caches]
    hidden = torch.randn(1, model.layers[0].input_layernorm.weight.numel())
    original = hidden.clone()
    rope = [torch.ones(1, attention.head_dim), torch.zeros(1, attention.head_dim)]
    outside = torch.tensor([caches[0].shape[0]])  # one past the last slot
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        stack.forward(hidden, rope, [outside], [torch.zeros(1, 1, dtype=torch.int32)], torch.ones(1, dtype=torch.int32))
    assert stack.team_steps == 1 and stack.kernel_steps == 0  # the team path refused it
    assert torch.equal(hidden, original)  # the residual stream, written in place by a step, untouched
    assert all(torch.equal(cache, kept) for cache, kept in zip(caches, before, strict=True))
