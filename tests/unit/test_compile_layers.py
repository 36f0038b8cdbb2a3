"""`--compile`: each decoder layer torch.compile'd, the outputs those of the eager layers."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.engine_args import EngineArgs
from tests.tiny_models import make_tiny_model


def test_compiled_layers_give_the_eager_tokens_and_logprobs(tmp_path):
    folder = make_tiny_model("gemma3", tmp_path / "gemma3")
    prompts = [[5, 17, 42, 9, 3, 77, 21], [8, 8, 2]]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    eager, compiled = (LLM(folder, num_kv_blocks=32, block_size=4, compile=flag) for flag in (False, True))
    # Prompts go through the compiled layers, decodes through the C++ step; without it, both compiled.
    for decode_stack in (True, False):
        if not decode_stack:
            eager.loaded.model.model.decode_stack = compiled.loaded.model.model.decode_stack = None
        want, got = (llm.generate(prompts, params, use_tqdm=False) for llm in (eager, compiled))
        for a, b in zip(want, got, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)
    layer = next(compiled.loaded.model.model.held_layers())
    assert layer._compiled_call_impl is not None  # nn.Module.compile's in-place wrapper


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_mixed_steps_stay_within_the_compilers_recompile_limit(tmp_path, kind):
    """Batches of 1 to 9 rows, prompts chunked beside decodes, on the Python layers: every step's shapes
    and metadata differ, and past 8 recompiles of a frame dynamo would run it eager from then on."""
    torch._dynamo.reset()  # a process serves one model: forget the frames other tests compiled
    llm = LLM(make_tiny_model(kind, tmp_path / kind), num_kv_blocks=96, block_size=4, max_num_batched_tokens=16,
              compile=True)  # fmt: skip
    llm.loaded.model.model.decode_stack = None
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for count in (1, 2, 5, 9):
            prompts = [[3 + i] * (2 + 5 * i) for i in range(count)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [len(out.outputs[0].token_ids) for out in outputs] == [5] * count


def test_compile_is_a_flag_that_round_trips_and_refuses_split_models(tmp_path):
    assert "--compile" in EngineArgs("m", compile=True).to_cli_flags()
    assert "--compile" not in EngineArgs("m").to_cli_flags()
    with pytest.raises(ValueError, match="--compile compiles a whole model"):
        LLM(tmp_path, compile=True, tensor_parallel_size=2)
