"""The requests `folio bench serve` sends: folio's seeded datasets, turned into text for an HTTP server.

Random prompts are token ids decoded to text with the model's tokenizer; the server re-encodes that text,
which can shift the count by a few tokens, so throughput uses the server's own `usage.prompt_tokens`
whenever it reports them. Only the tokenizer is loaded (GGUF metadata or tokenizer.json), never weights.
`document`, `tenants`, `multi-turn` and `agent`, the workloads that share prefixes, live in prefix_workloads.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from folio.config import ModelConfig
from folio.loaders.catalog import ModelSourceError, resolve_model
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_model import gguf_model_config
from folio.loaders.hf_folder import read_hf_config
from folio.loaders.tokenizer import Tokenizer
from folio_tools.bench.harness.datasets import (
    LengthRange,
    chat_prompts,
    chat_requests,
    humaneval_path,
    humaneval_prompts,
    humaneval_requests,
    prompt_vocabulary,
    random_requests,
)
from folio_tools.bench.serve.client import ServeRequest
from folio_tools.bench.serve.prefix_workloads import (
    agent_requests,
    document_requests,
    multi_turn_requests,
    sharegpt_answers,
    sharegpt_dialogues,
    tenant_requests,
)
from folio_tools.eval.sharegpt import sharegpt_path

SERVE_DATASETS = ("random", "humaneval", "chat", "multi-turn", "agent", "document", "tenants")
CHAT_DATASETS = ("chat", "multi-turn", "agent")  # sent to /v1/chat/completions; the others to /v1/completions
# Drawn from a ShareGPT file (--dataset-path).
SHAREGPT_DATASETS = ("chat", "multi-turn", "agent", "document", "tenants")


@dataclass
class ServeWorkload:
    requests: list[ServeRequest]
    facts: dict[str, Any] = field(default_factory=dict)  # what the report says about it beyond the requests


@dataclass
class BenchTokenizer:
    name: str
    path: Path
    tokenizer: Tokenizer
    config: ModelConfig


def load_tokenizer(name: str, explicit: bool) -> BenchTokenizer:
    """The tokenizer (and vocabulary facts) of a catalog name, .gguf file or Hugging Face folder."""
    try:
        path = resolve_model(name)
    except ModelSourceError as exc:
        if explicit:
            raise ValueError(f"--tokenizer: {exc}") from None
        raise ValueError(
            f"--model {name!r} is not a folio model name or path, so the tokenizer is unknown; "
            "give --tokenizer (a catalog name, .gguf file or Hugging Face model folder)"
        ) from None
    if path.is_file():
        gguf = GGUFFile(path)
        config, tokenizer = gguf_model_config(gguf), Tokenizer.from_gguf(gguf)
    else:
        config = read_hf_config(path)
        tokenizer = Tokenizer.from_hf_folder(path, extra_eos=config.eos_token_ids)
    return BenchTokenizer(name, path, tokenizer, config)


def check_dataset(dataset: str, dataset_path: str | None) -> None:
    """Fail early, before any tokenizer is pulled, on a dataset that cannot be built."""
    if dataset not in SERVE_DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(SERVE_DATASETS)}")
    if dataset_path is not None:
        if dataset not in SHAREGPT_DATASETS:
            raise ValueError(
                "--dataset-path is for --dataset chat, multi-turn, agent, document or tenants (a ShareGPT-format JSON "
                "file)"
            )
        if not Path(dataset_path).is_file():
            raise ValueError(f"--dataset-path {dataset_path}: no such file")
    elif dataset in SHAREGPT_DATASETS:
        sharegpt_path(dataset)
    elif dataset == "humaneval":
        humaneval_path()


def build_serve_requests(
    dataset: str,
    bench_tokenizer: BenchTokenizer,
    num: int,
    input_range: LengthRange,
    output_range: LengthRange,
    seed: int,
    dataset_path: str | None = None,
    turns: int = 4,
    document_len: int = 2000,
    tenants: int = 4,
) -> ServeWorkload:
    tokenizer = bench_tokenizer.tokenizer
    path = Path(dataset_path) if dataset_path else None
    alone = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731 - a piece of text, no BOS
    if dataset == "document":
        requests, document_tokens = document_requests(
            sharegpt_answers(path), alone, tokenizer.decode, tokenizer.encode, num, document_len, output_range, seed
        )
        return ServeWorkload(requests, {"document_tokens": document_tokens})
    if dataset == "tenants":
        requests, tenant_tokens = tenant_requests(
            sharegpt_answers(path), alone, tokenizer.decode, tokenizer.encode, num, tenants, document_len,
            output_range, seed,
        )  # fmt: skip
        # Not "document_tokens": the report's table reads that as the one document's length.
        return ServeWorkload(requests, {"tenants": tenants, "tenant_document_tokens": tenant_tokens})
    if dataset == "multi-turn":
        dialogues = sharegpt_dialogues(path, turns)
        requests = multi_turn_requests(dialogues, alone, num, turns, input_range, output_range, seed)
        return ServeWorkload(requests, {"conversations": num, "turns": turns})
    if dataset == "agent":
        requests, system_tokens = agent_requests(
            sharegpt_answers(path), sharegpt_dialogues(path, turns), alone, tokenizer.decode, num, turns,
            document_len, input_range, output_range, seed,
        )  # fmt: skip
        return ServeWorkload(requests, {"conversations": num, "turns": turns, "system_prompt_tokens": system_tokens})
    return ServeWorkload(_single_requests(dataset, bench_tokenizer, num, input_range, output_range, seed, path))


def _single_requests(
    dataset: str,
    bench_tokenizer: BenchTokenizer,
    num: int,
    input_range: LengthRange,
    output_range: LengthRange,
    seed: int,
    path: Path | None,
) -> list[ServeRequest]:
    tokenizer, config = bench_tokenizer.tokenizer, bench_tokenizer.config
    if dataset == "random":
        special = set(config.eos_token_ids) | set(tokenizer.eos_token_ids)
        if config.bos_token_id is not None:
            special.add(config.bos_token_id)
        vocabulary = prompt_vocabulary(tokenizer.backend, config.vocab_size, special)
        return [
            ServeRequest(tokenizer.decode(r.prompt_token_ids), len(r.prompt_token_ids), r.output_len)
            for r in random_requests(vocabulary, num, input_range, output_range, seed)
        ]
    if dataset == "humaneval":
        texts = humaneval_prompts()
        used = min(num, len(texts))
        return [
            ServeRequest(texts[i % used], len(r.prompt_token_ids), r.output_len)
            for i, r in enumerate(humaneval_requests(tokenizer.encode, num, output_range, seed, prompts=texts))
        ]
    prompts = chat_prompts(path)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731 - the message alone
    return [
        ServeRequest(r.prompt, r.prompt_len, r.output_len)
        for r in chat_requests(encode, num, input_range, output_range, seed, prompts=prompts)
    ]
