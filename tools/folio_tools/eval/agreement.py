"""`folio eval agreement`: how often a model in some format picks the same greedy tokens as the same
model with every weight dequantized to float32 and a full-precision KV cache (the reference; or another
full-precision model, e.g. the one a quantized checkpoint was made from).

Prompts are the opening user turns of the held-out ShareGPT conversations (chat template applied,
or as plain text for a base model);
each is decoded greedily for `max_tokens` by both. Reported: the share of prompts whose whole
continuation is identical, and the mean share of each continuation that matches before the first
differing token.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from folio import LLM, SamplingParams
from folio_tools.eval.corpus import EVAL_CONVERSATIONS
from folio_tools.eval.perplexity import weight_format_label
from folio_tools.eval.sharegpt import ASSISTANT_ROLES, USER_ROLES, sharegpt_conversations
from folio_tools.results import machine_info

MAX_PROMPT_CHARS = 2000


@dataclass
class AgreementResult:
    model: str
    quantization: str
    dtype: str
    kv_cache_dtype: str
    num_prompts: int
    max_tokens: int
    identical: int  # prompts whose continuation equals the reference's
    mean_prefix_share: float  # mean over prompts of (tokens before the first difference) / max_tokens
    reference: str = ""  # the model agreed with (dequantized to float32)
    activation_bits: int = 16  # into the int8 dot products of kept-quantized weights
    date_utc: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    machine: dict[str, Any] = field(default_factory=machine_info)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def eval_prompts(num_prompts: int) -> list[list[dict[str, str]]]:
    chats = []
    for index, turns in enumerate(sharegpt_conversations()):
        if index >= EVAL_CONVERSATIONS or len(chats) >= num_prompts:
            break
        if len(turns) >= 2 and turns[0].get("from") in USER_ROLES and turns[1].get("from") in ASSISTANT_ROLES:
            text = str(turns[0].get("value", "")).strip()
            if text and len(text) <= MAX_PROMPT_CHARS:
                chats.append([{"role": "user", "content": text}])
    if len(chats) < num_prompts:
        raise ValueError(f"only {len(chats)} held-out prompts are available")
    return chats


def greedy_token_ids(llm: Any, chats: list[list[dict[str, str]]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if llm.tokenizer.chat_template:
        outputs = llm.chat(chats, params, use_tqdm=False)
    else:  # a base model: the user turn as a plain prompt
        outputs = llm.generate([chat[0]["content"] for chat in chats], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def prefix_share(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same / max(len(a), len(b), 1)


def run_agreement(
    model: str,
    quantization: str | None,
    kv_cache_dtype: str,
    num_prompts: int,
    max_tokens: int,
    reference_model: str | None = None,
    **engine: Any,
) -> AgreementResult:
    """`reference_model`: the full-precision model to agree with (default: `model` itself, dequantized
    to float32); e.g. the GGUF file a quantized checkpoint was made from."""
    chats = eval_prompts(num_prompts)
    reference_engine = {k: v for k, v in engine.items() if k not in ("dtype", "activation_bits")}
    reference = LLM(reference_model or model, quantization="none", dtype="float32", **reference_engine)
    expected = greedy_token_ids(reference, chats, max_tokens)
    del reference
    gc.collect()
    llm = LLM(model, quantization=quantization, kv_cache_dtype=kv_cache_dtype, **engine)
    got = greedy_token_ids(llm, chats, max_tokens)
    shares = [prefix_share(a, b) for a, b in zip(got, expected, strict=True)]
    label, dtype = weight_format_label(llm, quantization), str(llm.dtype).removeprefix("torch.")
    return AgreementResult(
        model,
        label,
        dtype,
        kv_cache_dtype,
        len(chats),
        max_tokens,
        sum(a == b for a, b in zip(got, expected, strict=True)),
        sum(shares) / len(shares),
        reference_model or model,
        engine.get("activation_bits", 16),
    )
