"""Beam search through the whole engine against transformers' `generate(num_beams=...)` on a tiny
random-init model: the same hypotheses, in the same order, with the same scores."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from tests.tiny_models import VOCAB, make_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    llm = LLM(tiny_folder, num_kv_blocks=512, block_size=4, max_num_batched_tokens=1024)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    return llm, reference


def _prompt(seed: int, length: int = 10) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _likely_tokens(llm: LLM, prompt: list[int], steps: tuple[int, ...]) -> list[int]:
    """Tokens greedy decoding produces at `steps`: as EOS tokens, beams really do end early."""
    if not steps:
        return []
    out = llm.generate(prompt, SamplingParams(max_tokens=max(steps) + 1, temperature=0), use_tqdm=False)[0]
    return [out.outputs[0].token_ids[step] for step in steps]


def _reference(reference, prompt, width, n, max_tokens, eos, length_penalty, early_stopping):
    out = reference.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        num_beams=width,
        num_return_sequences=n,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    sequences = []
    for row in out.sequences[:, len(prompt) :].tolist():
        # Shorter hypotheses are padded after their EOS.
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        sequences.append(row[:end])
    return sequences, out.sequences_scores.tolist()


CASES = [
    # (prompt seed, beam width, n, max tokens, EOS tokens: those greedy decoding gives at these steps,
    #  length penalty, early stopping, some returned hypothesis ends in an EOS)
    (1, 2, 2, 12, (), 1.0, False, False),
    (2, 4, 4, 16, (3,), 1.0, False, False),
    (3, 3, 2, 16, (2,), 0.0, "never", True),
    (4, 4, 3, 14, (0,), 0.0, True, True),
    (5, 5, 1, 10, (1,), -1.0, False, True),
    (6, 3, 3, 20, (1,), 1.0, "never", False),
    (7, 2, 2, 20, (0,), 0.5, False, True),
    # Every beam's hypotheses end early, and the search stops when no live beam can beat them.
    (46, 2, 2, 16, (0, 1), 1.0, False, True),
    (41, 3, 3, 16, (0, 1), 0.0, False, True),
]


@pytest.mark.parametrize(
    ("seed", "width", "n", "max_tokens", "eos_steps", "length_penalty", "early_stopping", "expect_early_end"), CASES
)
def test_beam_search_equals_transformers(
    tiny, seed, width, n, max_tokens, eos_steps, length_penalty, early_stopping, expect_early_end
):
    llm, reference = tiny
    prompt = _prompt(seed)
    eos = _likely_tokens(llm, prompt, eos_steps)
    params = SamplingParams(
        n=n,
        max_tokens=max_tokens,
        use_beam_search=True,
        beam_width=width,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        stop_token_ids=eos,
    )
    [out] = llm.generate(prompt, params, use_tqdm=False)
    ref_sequences, ref_scores = _reference(reference, prompt, width, n, max_tokens, eos, length_penalty, early_stopping)
    assert [o.token_ids for o in out.outputs] == ref_sequences
    scores = [o.cumulative_logprob / len(o.token_ids) ** length_penalty for o in out.outputs]
    assert scores == pytest.approx(ref_scores, abs=1e-4)
    for o in out.outputs:
        assert o.finish_reason == ("stop" if o.token_ids[-1] in eos else "length")
    if expect_early_end:  # the case exists to cover hypotheses that end in an EOS
        assert any(o.finish_reason == "stop" for o in out.outputs)


def test_beam_searches_batched_with_other_requests(tiny):
    """Several searches and a sampled request in one batch give what each gives alone."""
    llm, _ = tiny
    prompts = [_prompt(10), _prompt(11, 23), _prompt(12, 5)]
    beam = SamplingParams(n=2, max_tokens=10, use_beam_search=True, beam_width=3)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=7)
    together = llm.generate(prompts, [beam, sampled, beam], use_tqdm=False)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, [beam, sampled, beam], strict=True)]
    for a, b in zip(together, alone, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_beams_share_the_prompt_blocks(tiny):
    """Mid-search, the live beams hold the prompt's full blocks by reference: the pool has them once."""
    llm, _ = tiny
    engine = llm.engine
    prompt = _prompt(20, 4 * 8 + 2)  # 8 full blocks of 4 and a partial one
    request = llm._make_request(prompt, SamplingParams(max_tokens=6, use_beam_search=True, beam_width=4))
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    beams = [r for r in engine.scheduler.running if r.request_id.startswith(request.request_id + "/")]
    assert len(beams) == 4
    tables = [engine.kv.block_table(b.request_id) for b in beams]
    prompt_blocks = tables[0][:8]
    assert all(t[:8] == prompt_blocks for t in tables)
    assert all(engine.kv.pool.ref_counts[b] == 4 for b in prompt_blocks)
    while engine.has_unfinished():
        engine.step()
    assert request.is_finished and len(request.output_token_ids) == 6
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_beam_search_under_a_tiny_pool(tiny, tiny_folder, prefix_caching):
    """With too few blocks and sequence slots for every beam at once, beams are preempted and parked
    beams give up their blocks, yet every search ends with what it gives with plenty of room."""
    roomy, _ = tiny
    cramped = LLM(tiny_folder, num_kv_blocks=14, block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                  enable_prefix_caching=prefix_caching)  # fmt: skip
    prompts = [_prompt(30 + i, 8 + 5 * i) for i in range(4)]
    params = [
        SamplingParams(n=2, max_tokens=12, use_beam_search=True, beam_width=3),
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(n=1, max_tokens=9, use_beam_search=True, beam_width=2),
        SamplingParams(n=2, max_tokens=12, use_beam_search=True, beam_width=2),
    ]
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = cramped.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, expected, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert cramped.engine.kv.pool.num_free_blocks == cramped.engine.kv.pool.num_blocks


def test_parked_beams_give_up_their_blocks(tiny, tiny_folder):
    """Without prefix caching, a preempted beam must recompute all its blocks; its sibling, parked
    while it waits, holds so many that it has to be preempted too, or the search would stall."""
    roomy, _ = tiny
    cramped = LLM(tiny_folder, num_kv_blocks=10, block_size=4, enable_prefix_caching=False)
    prompt = _prompt(5, 24)
    params = SamplingParams(n=2, max_tokens=12, use_beam_search=True, beam_width=2)
    [got] = cramped.generate(prompt, params, use_tqdm=False)
    [expected] = roomy.generate(prompt, params, use_tqdm=False)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in expected.outputs]
    assert got.metrics.num_preemptions > 0


def test_aborting_every_result_frees_every_beam(tiny):
    llm, _ = tiny
    engine = llm.engine
    params = SamplingParams(n=2, max_tokens=20, use_beam_search=True, beam_width=3)
    first, second = llm._make_samples(_prompt(21), params)
    engine.add_request(first, [second])
    for _ in range(4):
        engine.step()
    assert engine.abort_request(second.request_id) is second and second.finish_reason == "abort"
    assert engine.has_unfinished()  # the search goes on for the other result
    engine.abort_request(first.request_id)
    assert not engine.has_unfinished() and not engine.scheduler.requests
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
