"""`EngineArgs`: every engine option once. Each field carries its flag's help, so the flags that `add_cli_args`
adds to a command's parser take their names and defaults from the fields; it is read back from the parsed
flags, builds the engine's configs, and renders itself as `folio serve` flags again (benchmarks that start a
server pass their engine options on that way)."""

from __future__ import annotations

import argparse
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar

import torch

from folio.config import (
    ACTIVATION_BITS_CHOICES,
    CPU_COLLECTIVES,
    KV_CACHE_DTYPES,
    POOLING_METHODS,
    SPECULATIVE_METHODS,
    CacheConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory,
)

DEFAULT_MODEL = "smollm2-135m"
BATCHING_CHOICES = ("continuous", "static", "dynamic")
QUANTIZATION_CHOICES = ("none", "int8", "int4", "nf4")
Config = TypeVar("Config")


def _flag(default: Any, help: str, **argparse_keywords: Any) -> Any:
    """A field that is a flag too: its help and any other `add_argument` keywords but its name and default."""
    return field(default=default, metadata={"help": help, **argparse_keywords})


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL  # catalog name, .gguf file or Hugging Face folder (a positional argument)
    # A name on the command line; LLM(...) also takes a torch.dtype.
    dtype: str | torch.dtype = _flag(
        "float32", "activations: float32 (kept quantized weights give outputs independent of the batch), bfloat16, "
        "or auto (bfloat16 where the hardware multiplies it natively: faster, same perplexity, other greedy "
        "tokens; else float32)",
    )  # fmt: skip
    device: str | None = _flag(None, "cpu or cuda (default: cuda when present, else cpu)")
    kv_cache_memory: str | int | None = _flag(None, "KV pool size, e.g. 2GiB (default: 1/4 of free RAM, max 4GiB)")
    num_kv_blocks: int | None = _flag(None, "KV pool in blocks (overrides memory)", type=int)
    kv_offload_ram: str | int | None = _flag(None, "host RAM that keeps the prefix-cache blocks the KV pool evicts, "
                                             "e.g. 4GiB; a later prompt with that prefix loads them back instead "
                                             "of recomputing them (default: none)")  # fmt: skip
    kv_cache_dir: str | None = _flag(None, "a directory where every computed prefix-cache block is also kept as a "
                                     "file, read back after memory pressure or a restart (default: none)")  # fmt: skip
    kv_cache_disk: str | int | None = _flag(None, "size of --kv-cache-dir's files at most, e.g. 20GiB (default: "
                                            "20GiB or half the free space)")  # fmt: skip
    block_size: int = _flag(16, "tokens per KV block (default 16)")
    max_num_seqs: int = _flag(128, "requests running at once")
    max_num_batched_tokens: int = _flag(1024, "token budget of one step")
    max_model_len: int | None = _flag(None, "context length served", type=int)
    enable_prefix_caching: bool = _flag(True, "recompute every prompt instead of reusing the KV of prefixes seen "
                                        "before")  # fmt: skip
    hybrid_kv_cache: bool = _flag(
        True, "one block table for every layer of a model that mixes sliding-window and global layers (Gemma 3), "
        "instead of a table per group that frees the blocks behind the window",
    )  # fmt: skip
    batching: str = _flag(
        "continuous", "continuous (default; requests join at any step), static (wait for a full batch, run it to "
        "the end) or dynamic (a full batch or --batch-timeout-ms, whichever first)", choices=BATCHING_CHOICES,
    )  # fmt: skip
    batch_size: int | None = _flag(None, "static/dynamic batch size (--max-num-seqs)", type=int)
    batch_timeout_ms: float = _flag(50.0, "dynamic: longest wait (default 50)")
    quantization: str | None = _flag(
        None, "none: dequantize every quantized weight to --dtype at load; int8 / int4 / nf4: quantize every "
        "projection at load (per-channel int8; 4-bit round-to-nearest in groups of 32; NormalFloat-4 in blocks "
        "of 64) (default: the checkpoint's own formats - GGUF 4-bit and Q8_0, GPTQ, AWQ, NF4 - stay as they are)",
        choices=QUANTIZATION_CHOICES,
    )  # fmt: skip
    kv_cache_dtype: str = _flag(
        "auto", "auto (the model's dtype), or 8-bit K/V with a float16 scale per token and head: about twice the "
        "tokens in the same memory", choices=KV_CACHE_DTYPES,
    )  # fmt: skip
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding (flags: SPECULATIVE_HELP)
    tensor_parallel_size: int = _flag(1, "split each layer over this many processes (heads and MLP columns per rank)",
                                      alias="-tp")  # fmt: skip
    pipeline_parallel_size: int = _flag(1, "split the layers into this many stages of --tensor-parallel-size "
                                        "processes", alias="-pp")  # fmt: skip
    context_parallel_size: int = _flag(
        1, "split each sequence's tokens and KV cache over this many processes, each holding the whole model "
        "(long prompts: C times the context, prefill divided C ways)", alias="-cp",
    )  # fmt: skip
    pipeline_micro_batches: int | None = _flag(None, "pieces a pipeline splits each step into so that its stages "
                                               "overlap (default: 2 per stage)", type=int)  # fmt: skip
    pipeline_layers: str | None = _flag(None, "layers per pipeline stage, e.g. 9,9 (default: balanced by weight, "
                                        "the LM head counted)")  # fmt: skip
    nnodes: int = _flag(1, "hosts the ranks run on (default 1)")  # the others start theirs with `folio worker`
    master_addr: str | None = _flag(None, "the head host's address (default: $MASTER_ADDR)")  # else loopback
    # A free port (one host only) when neither given nor in $MASTER_PORT.
    master_port: int | None = _flag(None, "its rendezvous port (default: $MASTER_PORT)", type=int)
    cpu_collectives: str = _flag(
        "shm", "ranks all on one CPU host reduce through shared memory (shm, default) or gloo over loopback TCP",
        choices=CPU_COLLECTIVES,
    )  # fmt: skip
    pooling: str = _flag(
        "last", "how /v1/embeddings and LLM.embed pool the final hidden states: the last token (default; a causal "
        "model's only token that saw the whole input) or the mean over every input token", choices=POOLING_METHODS,
    )  # fmt: skip
    compile: bool = _flag(
        False, "torch.compile each decoder layer: the Python path that prefills and runs the steps the C++ decode "
        "step does not take (whole models in this process; on CPU it is slower, docs/benchmarks.md)",
    )  # fmt: skip
    activation_bits: int = _flag(
        16, "bits of each activation that kept-quantized weights' int8 dot products multiply: 16 (an 8-bit code "
        "and its rounding error; the default) or 8 (the code alone, as llama.cpp's Q8 activations: faster batches "
        "and prefill, outputs further from float32's)", choices=ACTIVATION_BITS_CHOICES,
    )  # fmt: skip
    enforce_eager: bool = _flag(False, "on a GPU, run every step eagerly instead of replaying captured CUDA graphs "
                                "for decode steps")  # fmt: skip
    enable_lora: bool = _flag(False, "serve LoRA adapters (PEFT format) beside the base model, rows of different "
                              "adapters in one batch (whole models in this process)")  # fmt: skip
    max_loras: int = _flag(4, "LoRA: adapters the running requests may use at once (default 4)")
    max_lora_rank: int = _flag(16, "LoRA: the largest adapter rank served (default 16)")
    lora_dtype: str = _flag("auto", "LoRA: the dtype adapters are kept in: auto (the activations'), float32 or "
                            "bfloat16 (half the bytes a step reads for its adapters)",
                            choices=("auto", "float32", "bfloat16"))  # fmt: skip

    # -- command line ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The engine flags (the command adds its own MODEL positional, which `from_cli_args` reads)."""
        engine = parser.add_argument_group("engine")
        for name in _ENGINE_FLAGS:
            _add_flag(engine, _FIELDS[name])
        add_parallel_args(parser.add_argument_group("parallelism (see docs/parallelism.md)"))
        spec, defaults = parser.add_argument_group("speculative decoding"), SpeculativeConfig()
        spec.add_argument(
            "--speculative-method", default=None, choices=SPECULATIVE_METHODS,
            help="draft tokens and verify them in one forward; outputs stay exactly the model's (ngram: prompt "
            "lookup, continuing a match of the last tokens found earlier in the context; suffix: SuffixDecoding, "
            "the likeliest continuation in suffix trees of the request and of earlier requests' outputs; draft: a "
            "cheaper model with the same vocabulary, --draft-model; lookahead: Jacobi iteration on the verified "
            "drafts, with a pool of the n-grams its trajectory, the prompt and the output hold)",
        )  # fmt: skip
        for name, help in SPECULATIVE_HELP.items():
            default = getattr(defaults, name)
            spec.add_argument(_speculative_flag(name), type=None if default is None else type(default),
                              default=default, help=help)  # fmt: skip

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != "speculative_config"}
        speculative = None
        if args.speculative_method is not None:
            options = {name: getattr(args, _speculative_flag(name)[2:].replace("-", "_")) for name in SPECULATIVE_HELP}
            speculative = SpeculativeConfig(method=args.speculative_method, **options)
        return cls(**values, speculative_config=speculative)

    def to_cli_flags(self) -> list[str]:
        """The flags that `add_cli_args` reads back into these arguments (the model not included): every
        option spelled out, defaults too, so a recorded command line says exactly what ran."""
        words: list[str] = []
        for option in fields(self)[1:]:  # after the model
            value = getattr(self, option.name)
            if option.name == "speculative_config":
                words += [] if value is None else _speculative_flags(value)
            elif isinstance(option.default, bool):  # a switch, written only when it switches
                words += [_flag_name(option)] if value != option.default else []
            elif value is not None:
                text = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)
                words += [_flag_name(option), text]
        return words

    # -- the engine --------------------------------------------------------------------------------
    def llm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `LLM(model, ...)`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}

    def _config(self, kind: type[Config], **given: Any) -> Config:
        """A `kind` config from the options named as its fields, and `given`."""
        same = {f.name: getattr(self, f.name) for f in fields(kind) if f.name in _FIELDS}  # type: ignore[arg-type]
        return kind(**{**same, **given})

    def parallel_config(self) -> ParallelConfig:
        return self._config(ParallelConfig, pipeline_layers=parse_layer_counts(self.pipeline_layers))

    def cache_config(self) -> CacheConfig:
        return self._config(CacheConfig, kv_cache_memory=parse_memory(self.kv_cache_memory),
                            num_blocks=self.num_kv_blocks,
                            kv_offload_ram=parse_memory(self.kv_offload_ram),
                            kv_cache_disk=parse_memory(self.kv_cache_disk))  # fmt: skip

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        """`model_max_len`: the model's own context length, served when `max_model_len` is not given."""
        return self._config(SchedulerConfig, max_model_len=self.max_model_len or model_max_len,
                            batch_timeout=self.batch_timeout_ms / 1000,
                            max_loras=self.max_loras if self.enable_lora else None)  # fmt: skip


_FIELDS: dict[str, Field] = {f.name: f for f in fields(EngineArgs)}
# Each group's flags, in the order `--help` lists them.
_ENGINE_FLAGS = ("dtype", "device", "kv_cache_memory", "num_kv_blocks", "kv_offload_ram", "kv_cache_dir",
                 "kv_cache_disk", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "batching", "batch_size", "batch_timeout_ms",
                 "quantization", "activation_bits", "kv_cache_dtype", "enable_prefix_caching", "hybrid_kv_cache",
                 "pooling", "compile", "enforce_eager", "enable_lora", "max_loras", "max_lora_rank",
                 "lora_dtype")  # fmt: skip
_PARALLEL_FLAGS = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "nnodes", "master_addr",
                   "master_port", "cpu_collectives", "pipeline_layers", "pipeline_micro_batches")  # fmt: skip
SWITCHES_OFF_BY_DEFAULT = tuple(f.name for f in _FIELDS.values() if f.default is False)  # --compile, --enforce-eager


def _flag_name(option: Field) -> str:
    """`--block-size`; a switch that is on by default is a `--no-...` one: `--no-prefix-caching`."""
    if option.default is True:
        return f"--no-{option.name.removeprefix('enable_').replace('_', '-')}"
    return f"--{option.name.replace('_', '-')}"


def _add_flag(group: argparse._ActionsContainer, option: Field) -> None:
    keywords = dict(option.metadata)
    names = [_flag_name(option), *([keywords.pop("alias")] if "alias" in keywords else [])]
    if isinstance(option.default, bool):
        keywords["action"] = "store_false" if option.default else "store_true"
    else:
        keywords["default"] = option.default
        if type(option.default) in (int, float):
            keywords.setdefault("type", type(option.default))
    group.add_argument(*names, dest=option.name, **keywords)


def add_parallel_args(group: argparse._ActionsContainer, engine: bool = True) -> None:
    """The flags `folio serve|run|bench` and `folio worker` share: a worker also names its host's rank, and
    leaves what only the head host's engine reads to it."""
    for name in _PARALLEL_FLAGS if engine else _PARALLEL_FLAGS[:6]:
        _add_flag(group, _FIELDS[name])
        if name == "nnodes" and not engine:
            group.add_argument(
                "--node-rank", type=int, required=True, help="this host's index among --nnodes (1, 2, ...)"
            )


def parse_layer_counts(text: str | None) -> tuple[int, ...] | None:
    """ "9,9" -> (9, 9)."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pipeline-layers must be comma-separated layer counts such as 9,9, got {text!r}") from None


# Every SpeculativeConfig option but the method (--speculative-method), with its flag's help.
SPECULATIVE_HELP = {
    "num_speculative_tokens": "drafts per step, at most",
    "prompt_lookup_min": "ngram: shortest suffix matched",
    "prompt_lookup_max": "ngram: longest suffix matched (tried first)",
    "disable_by_batch_size": "no drafts while more requests than this run (speculation stops paying)",
    "suffix_max_tree_depth": "suffix: longest string a suffix tree holds, match and draft together",
    "suffix_max_cached_requests": "suffix: finished requests whose outputs the global tree keeps (0: none)",
    "suffix_max_spec_factor": "suffix: a draft is at most this many times as long as its match",
    "suffix_min_token_prob": "suffix: stop a draft where its estimated probability falls below this",
    "lookahead_ngram_size": "lookahead: N, the pool's n-gram length (a key token, N - 1 after it)",
    "lookahead_pool_size": "lookahead: G, the n-grams kept per key token (the most recent)",
    "draft_model": "draft: the drafting model (a catalog name or a path; the same GGUF file as a target served "
    "with --quantization none drafts at its 4-bit speed)",
    "draft_quantization": "draft: how the draft's weights are held (default: as stored in its file)",
}


def _speculative_flag(name: str) -> str:
    return "--speculative-disable-by-batch-size" if name == "disable_by_batch_size" else f"--{name.replace('_', '-')}"


def _speculative_flags(config: SpeculativeConfig) -> list[str]:
    words = ["--speculative-method", config.method]
    for name in SPECULATIVE_HELP:
        if (value := getattr(config, name)) is not None:
            words += [_speculative_flag(name), str(value)]
    return words
