"""folio's embeddings (last-token and mean pooling of the final hidden states, L2-normalised) equal
transformers' on tiny random-init models: whole prompts and chunked ones, batched with generation
requests (whose tokens stay those of generating alone), under preemption, after prefix-cache hits, and
through `LLM.embed`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from folio import LLM
from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.kv_cache.groups import plan_kv_groups
from folio.loaders.model_loader import load_model
from folio.sampling_params import PoolingParams, SamplingParams
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS, VOCAB, make_tiny_model

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # unit vectors, fp32
MAX_LEN = 64
GENERATE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# (token budget per step, KV blocks of 4 tokens): whole prompts; 7-token chunks; a pool too small for
# every request at once, which preempts some and computes them again.
SCHEDULES = {"whole": (1024, 256), "chunked": (7, 256), "preempting": (8, 16)}
# Every layer of "mistral-window" sees 8 tokens: blocks behind that go back, so it preempts in a smaller pool.
WINDOWED_POOL = 7
# The tiny Gemma 3 has two block tables (window and global layers) of 2 layers each: a 64-token sequence
# holds 16 blocks in the global one and at most 5 in the window one, and the placeholder.
HYBRID_POOL = 22


def _prompts(*lengths: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    loaded = load_model(folder, torch.float32, torch.device("cpu"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, loaded, reference


@torch.no_grad()
def reference_embedding(reference, prompt: list[int], method: str, normalize: bool = True) -> torch.Tensor:
    hidden = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    vector = hidden[-1] if method == "last" else hidden.mean(dim=0)
    return F.normalize(vector, dim=0) if normalize else vector


def _engine(loaded, schedule: str, pooling: str) -> EngineCore:
    budget, num_blocks = SCHEDULES[schedule]
    if schedule == "preempting" and loaded.config.window_of_every_layer is not None:
        num_blocks = WINDOWED_POOL  # blocks behind the window go back: a smaller pool still preempts
    elif schedule == "preempting" and plan_kv_groups(loaded.config.layer_windows).is_hybrid:
        num_blocks = HYBRID_POOL
    return EngineCore(
        loaded.model, loaded.config, CacheConfig(block_size=4, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=MAX_LEN, pooling=pooling),
        torch.float32, torch.device("cpu"),
    )  # fmt: skip


def _run(engine: EngineCore, requests: list[Request]) -> None:
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert all(r.is_finished and r.error is None for r in requests)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # everything returned


def _embedding_requests(prompts: list[list[int]], prefix: str = "e") -> list[Request]:
    return [Request(f"{prefix}{i}", p, SamplingParams(pooling=PoolingParams())) for i, p in enumerate(prompts)]


@torch.no_grad()
def test_the_oracle_reads_the_hidden_state_after_the_final_norm(tiny):
    """transformers' last entry of `hidden_states` is what its LM head reads: after the final norm."""
    _, _, reference = tiny
    out = reference(torch.tensor([_prompts(9)[0]]), output_hidden_states=True)
    logits = reference.get_output_embeddings()(out.hidden_states[-1])
    if (cap := getattr(reference.config, "final_logit_softcapping", None)) is not None:
        logits = torch.tanh(logits / cap) * cap
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["last", "mean"])
@pytest.mark.parametrize("schedule", ["whole", "chunked"])
def test_embeddings_match(tiny, method, schedule):
    _, loaded, reference = tiny
    prompts = _prompts(40, 5, 23, 1, MAX_LEN)  # the last fills the whole context: an embedding needs no room
    requests = _embedding_requests(prompts)
    _run(_engine(loaded, schedule, method), requests)
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.sampling_params.pooling == PoolingParams(method)  # the engine's default was applied
        assert request.output_token_ids == []
        torch.testing.assert_close(request.embedding, reference_embedding(reference, prompt, method),
                                   atol=TOLERANCE, rtol=0)  # fmt: skip


@pytest.mark.parametrize("schedule", ["chunked", "preempting"])
def test_mixed_with_generation(tiny, schedule):
    """Embedding and generation requests share steps; the generations' tokens are those of generating
    alone, and the embeddings survive chunking and preemption."""
    _, loaded, reference = tiny
    gen_prompts, embed_prompts = _prompts(30, 6), _prompts(37, 3, 21)
    alone = [Request(f"g{i}", p, GENERATE) for i, p in enumerate(gen_prompts)]
    _run(_engine(loaded, "whole", "mean"), alone)
    generations = [Request(f"g{i}", p, GENERATE) for i, p in enumerate(gen_prompts)]
    last = [Request(f"l{i}", p, SamplingParams(pooling=PoolingParams("last"))) for i, p in enumerate(embed_prompts)]
    mean = _embedding_requests(embed_prompts, "m")
    engine = _engine(loaded, schedule, "mean")
    mixed = [generations[0], *last[:2], mean[0], generations[1], mean[1], last[2], mean[2]]
    _run(engine, mixed)
    assert [r.output_token_ids for r in generations] == [r.output_token_ids for r in alone]
    for prompt, by_last, by_mean in zip(embed_prompts, last, mean, strict=True):
        torch.testing.assert_close(by_last.embedding, reference_embedding(reference, prompt, "last"),
                                   atol=TOLERANCE, rtol=0)  # fmt: skip
        torch.testing.assert_close(by_mean.embedding, reference_embedding(reference, prompt, "mean"),
                                   atol=TOLERANCE, rtol=0)  # fmt: skip
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_mean_pooling_starts_again_after_a_preemption(tiny):
    """A generation decoding in a pool too small for both preempts the mean-pooling request that came
    after it, mid-prompt; the request pools its prompt again from the start (no partial sum counts twice)."""
    _, loaded, reference = tiny
    (gen_prompt, prompt) = _prompts(30, 37)
    alone = Request("g", gen_prompt, GENERATE)
    _run(_engine(loaded, "whole", "mean"), [alone])
    generation, mean = Request("g", gen_prompt, GENERATE), _embedding_requests([prompt])[0]
    _run(_engine(loaded, "preempting", "mean"), [generation, mean])
    assert mean.num_preemptions > 0 and generation.num_preemptions == 0
    assert generation.output_token_ids == alone.output_token_ids
    torch.testing.assert_close(mean.embedding, reference_embedding(reference, prompt, "mean"), atol=TOLERANCE, rtol=0)


def test_prefix_cache_policy(tiny):
    """A generation fills the prefix cache with the prompt's blocks; last-token pooling then reuses
    them (only the last token's state is read), mean pooling computes every token again."""
    _, loaded, reference = tiny
    prompt = _prompts(29)[0]
    engine = _engine(loaded, "whole", "last")
    _run(engine, [Request("g", prompt, GENERATE)])
    last = Request("last", prompt, SamplingParams(pooling=PoolingParams("last")))
    mean = Request("mean", prompt, SamplingParams(pooling=PoolingParams("mean")))
    _run(engine, [last])
    _run(engine, [mean])
    assert last.num_cached_tokens == 28 and mean.num_cached_tokens == 0
    for request, method in ((last, "last"), (mean, "mean")):
        torch.testing.assert_close(request.embedding, reference_embedding(reference, prompt, method),
                                   atol=TOLERANCE, rtol=0)  # fmt: skip


def test_an_input_longer_than_the_context_is_refused(tiny):
    _, loaded, _ = tiny
    engine = _engine(loaded, "whole", "last")
    with pytest.raises(ValueError, match=f"the input has {MAX_LEN + 1} tokens but the context length is {MAX_LEN}"):
        engine.add_request(_embedding_requests(_prompts(MAX_LEN + 1))[0])
    assert not engine.has_unfinished()


def test_llm_embed(tiny):
    folder, _, reference = tiny
    llm = LLM(folder, num_kv_blocks=64, block_size=4, max_num_batched_tokens=7, pooling="mean")
    ids = _prompts(26)[0]
    text = " ".join(f"t{t}" for t in ids[:11])  # the tiny tokenizer's words
    outputs = llm.embed([text, ids], use_tqdm=False)
    assert [o.prompt for o in outputs] == [text, None]
    assert [o.num_prompt_tokens for o in outputs] == [11, 26]
    for output, prompt in zip(outputs, [ids[:11], ids], strict=True):
        assert output.prompt_token_ids == prompt and isinstance(output.embedding, list)
        expected = reference_embedding(reference, prompt, "mean")
        torch.testing.assert_close(torch.tensor(output.embedding), expected, atol=TOLERANCE, rtol=0)
    (raw,) = llm.embed(ids, pooling="last", normalize=False, use_tqdm=False)
    expected = reference_embedding(reference, ids, "last", normalize=False)
    torch.testing.assert_close(torch.tensor(raw.embedding), expected, atol=1e-4, rtol=1e-5)
    # A one-token input alone is a step of decodes only (the C++ decode step, for the Llama family).
    (one,) = llm.embed([ids[:1]], use_tqdm=False)
    expected = reference_embedding(reference, ids[:1], "mean")
    torch.testing.assert_close(torch.tensor(one.embedding), expected, atol=TOLERANCE, rtol=0)
