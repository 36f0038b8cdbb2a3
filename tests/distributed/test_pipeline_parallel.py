"""Pipeline parallelism, alone and with tensor parallelism, changes where the layers run, never the
result: every architecture split into 2 stages on loopback (and the attention variants into 2 stages
of 2 ranks each) gives the single process's greedy tokens and its logprobs within 1e-4 in float32,
under whole, chunked and preempting schedules, with steps cut into micro-batches that split prompts
between them."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from folio import LLM, SamplingParams
from tests.api.server_runner import running_server
from tests.parallel_compare import TINY_PROMPTS, run_both, sample_both, starting_no_rank, structured_with_speculation
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS

TOLERANCE = 1e-4
PP2 = {"pipeline_parallel_size": 2}
TP2_PP2 = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}


# Stages of two tensor-parallel ranks: four processes on this machine's two cores, so not every
# architecture (each is split by tensor parallelism alone in test_tensor_parallel.py, and into stages
# above): plain, one KV head replicated over the ranks, window and global layers, ALiBi.
TP2_PP2_KINDS = ["llama", "mqa", "gemma3", "bloom"]


@pytest.mark.parametrize(("kind", "split"), [(kind, PP2) for kind in TINY_KINDS + NEW_ARCHITECTURE_KINDS]
                         + [(kind, TP2_PP2) for kind in TP2_PP2_KINDS],
                         ids=lambda v: ("tp2xpp2" if "tensor_parallel_size" in v else "pp2") if isinstance(v, dict)
                         else v)  # fmt: skip
def test_two_stages_match_one_process(tiny_folders, kind, split):
    result = run_both(tiny_folders[kind], TINY_PROMPTS, split_kwargs=split, num_kv_blocks=64)
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


@pytest.mark.parametrize("split", [{**PP2, "pipeline_micro_batches": 3, "pipeline_layers": (1, 2)},
                                   {**TP2_PP2, "cpu_collectives": "gloo"}],
                         ids=["pp2-layers-1-2-3-micro-batches", "tp2xpp2-gloo"])  # fmt: skip
def test_chunked_prefill_and_preemption(tiny_folders, split):
    prompts = [[(7 * i + j) % 300 + 1 for j in range(40 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3, prompt_logprobs=2)
    # 8-token steps chunk every prompt; 20 blocks of 16 cannot hold six 70-token sequences at once.
    result = run_both(tiny_folders["llama"], prompts, params, split_kwargs=split, num_kv_blocks=20,
                      max_num_batched_tokens=8)  # fmt: skip
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_seeded_sampling_and_parallel_samples(tiny_folders):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.7, seed=5, n=2, logprobs=2)]  # fmt: skip
    reference, got = sample_both(tiny_folders["qwen2"], TINY_PROMPTS[:2], params, PP2, num_kv_blocks=64)
    assert got == reference


def test_more_stages_than_layers_is_refused_before_any_rank_starts(tiny_folders):
    with starting_no_rank(), pytest.raises(ValueError, match=r"pipeline-parallel size of 4 needs at least one "
                                                             r"layer per stage; this model has 3 layers"):  # fmt: skip
        LLM(tiny_folders["llama"], num_kv_blocks=64, pipeline_parallel_size=4)


def test_gemma3_270m_dense_matches(gemma3_gguf):
    # Its 262,144-row head outweighs most layers: the last stage holds it with one layer.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = run_both(gemma3_gguf, prompts, split_kwargs=PP2, kv_cache_memory="64MiB", quantization="none")
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_gemma3_270m_kept_formats_on_tp2_x_pp2(gemma3_gguf):
    # As with tensor parallelism alone (test_tensor_parallel.py): the 4-bit kernel's 8-bit activation
    # rounding can move by one step when a reduced sum differs in its last bit.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = run_both(gemma3_gguf, prompts, split_kwargs=TP2_PP2, kv_cache_memory="64MiB")
    assert result.same_tokens and result.max_logprob_diff < 2e-2, result


def test_smollm2_pipeline_with_structured_output_and_speculation(smollm2_gguf):
    # Kept Q4_1 weights, a tied embedding (the last stage holds its rows as the head), and the last
    # stage's first rank drafting by prompt lookup.
    reference, got, text = structured_with_speculation(smollm2_gguf, PP2)
    assert got == reference
    json.loads(text)


def test_steps_in_flight_and_a_stream_dropped_among_them(tiny_folders):
    # Two stages keep two steps in flight, over disjoint requests; a stream closed mid-run aborts its
    # request while its step may still be in the pipe. Outputs stay the single process's, no block leaks.
    prompts = [[(5 * i + j) % 300 + 1 for j in range(9 + i)] for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0)
    reference = LLM(tiny_folders["llama"], num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    split = LLM(tiny_folders["llama"], num_kv_blocks=64, max_num_batched_tokens=24, **PP2)
    engine = split.engine
    most = 0
    collect = engine.runner.collect

    def counted() -> object:
        nonlocal most
        most = max(most, engine.runner.pending)  # steps under way when the oldest one's result is read
        return collect()

    engine.runner.collect = counted
    step = engine.step
    stalled_in_flight = []

    def checked() -> list:
        updated = step()
        stalled_in_flight.append(engine.stalled and bool(engine.in_flight))  # a server would sleep on a result
        return updated

    engine.step = checked
    try:
        stream = split.stream([7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True, temperature=0))
        next(stream)
        next(stream)
        stream.close()  # aborted between steps, its last step perhaps still in flight
        got = split.generate(prompts, params, use_tqdm=False)
        pool = engine.kv.pool
        assert not engine.in_flight and pool.num_free_blocks == pool.num_blocks
    finally:
        split.close()
    assert most == 2 and not any(stalled_in_flight)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in reference]


def test_a_served_pipeline_answers_concurrent_clients(tiny_folders):
    # The server's engine thread drives the same steps in flight: concurrent completions, streamed and
    # not, get the single process's text; a client that leaves mid-stream frees its request.
    model = str(tiny_folders["llama"])
    prompts = [" ".join(f"t{(7 * i + j) % 300 + 1}" for j in range(6 + i)) for i in range(6)]
    reference = LLM(model, num_kv_blocks=64).generate(prompts, SamplingParams(max_tokens=10, temperature=0),
                                                      use_tqdm=False)  # fmt: skip
    llm = LLM(model, num_kv_blocks=64, max_num_batched_tokens=16, **PP2)
    with running_server(llm, "tiny") as (url, server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)  # a hang fails fast

        def complete(index: int) -> str:
            if index % 2:
                chunks = client.completions.create(model="tiny", prompt=prompts[index], max_tokens=10, temperature=0,
                                                   stream=True)  # fmt: skip
                return "".join(chunk.choices[0].text for chunk in chunks)
            answer = client.completions.create(model="tiny", prompt=prompts[index], max_tokens=10, temperature=0)
            return answer.choices[0].text

        left = client.completions.create(model="tiny", prompt="t5 t6", max_tokens=200, temperature=0, stream=True)
        next(iter(left))
        left.close()  # this client leaves mid-stream
        with ThreadPoolExecutor(max_workers=6) as pool:
            texts = list(pool.map(complete, range(len(prompts))))
        assert texts == [r.outputs[0].text for r in reference]
        deadline = time.monotonic() + 10
        engine = server.engine.engine
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
