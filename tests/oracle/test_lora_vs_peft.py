"""LoRA adapters against transformers + peft: on tiny random-init models of each architecture, with
random adapters on every linear projection (peft's "all-linear"), folio's logits equal the peft model's
within 1e-4 in fp32 and its greedy tokens are the same (decodes through the C++ decode step where the
model has one); rows of four adapters and the base model in one
batch get exactly what each gets alone."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, LoRARequest, SamplingParams
from folio.lora.adapter import read_adapter
from tests.engine_driver import run_greedy_capturing_logits
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS, VOCAB, make_lora_adapter, make_tiny_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOLERANCE = 1e-4  # fp32
DECODE_STEPS = 8
# GPT-2's Conv1D layers take PEFT's fan_in_fan_out adapters, which folio refuses (tested below).
KINDS = [kind for kind in TINY_KINDS + NEW_ARCHITECTURE_KINDS if kind != "gpt2"]


def reference_logits(base_folder, adapter: str | None, sequence: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(torch.tensor([sequence])).logits[0]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    folder = make_tiny_model(request.param, root / "base")
    adapters = [make_lora_adapter(folder, root / f"adapter{i}", seed=10 + i) for i in range(4)]
    llm = LLM(folder, enable_lora=True, max_loras=4, max_lora_rank=8, num_kv_blocks=256, block_size=4)
    for i, path in enumerate(adapters):
        llm.engine.add_lora(LoRARequest(f"a{i}", path))
    return request.param, folder, adapters, llm


def test_logits_and_greedy_tokens_match_peft(tiny):
    kind, folder, adapters, llm = tiny
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (11,), generator=generator).tolist()
    stack = getattr(llm.loaded.model.model, "decode_stack", None)  # the C++ decode step, where the model has one
    for name, adapter in (("a0", adapters[0]), (None, None)):
        steps_before = stack.stack.kernel_steps if stack is not None else 0
        [output], [logits] = run_greedy_capturing_logits(llm.engine, [prompt], DECODE_STEPS, [name])
        if stack is not None:  # its decodes, the adapter's rows included, took the C++ step
            assert stack.stack.kernel_steps - steps_before == DECODE_STEPS - 1
        expected = reference_logits(folder, adapter, prompt + output)[: len(prompt) + DECODE_STEPS - 1]
        assert logits.shape == expected.shape
        assert torch.allclose(logits, expected, atol=TOLERANCE, rtol=0), (kind, name, (logits - expected).abs().max())
        assert output == expected[len(prompt) - 1 :].argmax(-1).tolist()


def test_a_batch_of_four_adapters_and_the_base_gives_each_row_what_it_gets_alone(tiny):
    kind, _, _, llm = tiny
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (9, 14, 5, 17, 12)]
    names = ["a0", "a1", None, "a2", "a3"]
    together, together_logits = run_greedy_capturing_logits(llm.engine, prompts, DECODE_STEPS, names)
    for prompt, name, output, logits in zip(prompts, names, together, together_logits, strict=True):
        [alone], [alone_logits] = run_greedy_capturing_logits(llm.engine, [prompt], DECODE_STEPS, [name])
        assert output == alone, (kind, name)
        # Tokens exactly; logits to fp32's noise (a matmul over more rows may round differently).
        assert torch.allclose(logits, alone_logits, atol=TOLERANCE, rtol=0), (kind, name)
    assert len({tuple(o) for o in together[:2]}) == 2 or together[0] != together[2]  # adapters change answers


def test_adapters_folio_cannot_apply_are_refused_with_the_reason(tmp_path):
    folder = make_tiny_model("gpt2", tmp_path / "gpt2")
    adapter = make_lora_adapter(folder, tmp_path / "conv1d", seed=3)
    llm = LLM(folder, enable_lora=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="fan_in_fan_out"):
        llm.engine.add_lora(LoRARequest("conv", adapter))
    with pytest.raises(ValueError, match="max-lora-rank"):
        llama = make_tiny_model("llama", tmp_path / "llama")
        big = make_lora_adapter(llama, tmp_path / "rank32", seed=4, rank=32)
        LLM(llama, enable_lora=True, num_kv_blocks=64).engine.add_lora(LoRARequest("big", big))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter("none", tmp_path, llm.loaded.model)
    with pytest.raises(ValueError, match="no LoRA adapter named 'ghost'"):
        llm.generate([[1, 2, 3]], lora_request=None, use_tqdm=False)  # fine: the base model
        run_greedy_capturing_logits(llm.engine, [[1, 2, 3]], 2, ["ghost"])


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(tiny):
    """A prompt's KV under an adapter is not the base model's: a repeat hits only its own adapter's blocks,
    and every answer is what a cold run gives."""
    kind, folder, adapters, llm = tiny
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = [("a0", LoRARequest("a0", adapters[0])), ("base", None), ("a0", LoRARequest("a0", adapters[0])),
            ("a1", LoRARequest("a1", adapters[1]))]  # fmt: skip
    cached, texts = {}, {}
    for label, adapter in runs:
        [out] = llm.generate([prompt], greedy, use_tqdm=False, lora_request=adapter)
        cached.setdefault(label, []).append(out.metrics.num_cached_tokens)
        texts.setdefault(label, set()).add(tuple(out.outputs[0].token_ids))
    assert cached["base"] == [0] and cached["a1"] == [0]  # a0's blocks were not theirs
    assert cached["a0"][0] == 0 and cached["a0"][1] > 0  # its own repeat hits
    assert all(len(outputs) == 1 for outputs in texts.values())
    assert texts["a0"] != texts["base"], kind
