"""`EngineArgs`: every engine option once. It adds its flags to a command's parser, is read back from the
parsed flags, builds the engine's configs, and renders itself as `folio serve` flags again (benchmarks
that start a server pass their engine options on that way)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

import torch

from folio.config import (
    ACTIVATION_BITS_CHOICES,
    CPU_COLLECTIVES,
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
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8")
SWITCHES_OFF_BY_DEFAULT = ("compile", "enforce_eager")  # store_true flags: --compile, --enforce-eager


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL  # catalog name, .gguf file or Hugging Face folder (a positional argument)
    dtype: str | torch.dtype = "float32"  # a name on the command line; LLM(...) also takes a torch.dtype
    device: str | None = None  # None: the platform's default
    kv_cache_memory: str | int | None = None  # "2GiB" or bytes; None: a share of available RAM
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True  # a table per KV cache group where window and global layers mix (Gemma 3)
    batching: str = "continuous"
    batch_size: int | None = None  # None: max_num_seqs
    batch_timeout_ms: float = 50.0
    # None: a checkpoint's own formats stay as they are; "none": dequantize every weight to dtype
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    tensor_parallel_size: int = 1  # ranks each layer is split over (processes started by the engine)
    pipeline_parallel_size: int = 1  # stages the layers are split into, each of tensor_parallel_size ranks
    context_parallel_size: int = 1  # ranks each sequence's tokens and KV cache are split over (whole model each)
    pipeline_micro_batches: int | None = None  # pieces of each step a pipeline overlaps (None: 2 per stage)
    pipeline_layers: str | None = None  # layers per stage, "9,9"; None: balanced by weight
    nnodes: int = 1  # hosts those ranks run on; the others start theirs with `folio worker`
    master_addr: str | None = None  # the rendezvous (default MASTER_ADDR, else loopback)
    master_port: int | None = None  # default MASTER_PORT, else a free port (one host only)
    cpu_collectives: str = "shm"  # ranks on one CPU host: shared memory, or gloo over loopback
    pooling: str = "last"  # embeddings: "last" token or "mean" over the prompt (why last: SchedulerConfig.pooling)
    compile: bool = False  # torch.compile each decoder layer (the Python path; whole in-process models)
    activation_bits: int = 16  # into the int8 dot products: 16 (8 + 8, the default) or 8 (llama.cpp's Q8)
    enforce_eager: bool = False  # on a GPU, no CUDA graphs for decode steps

    # -- command line ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The engine flags (the command adds its own MODEL positional, which `from_cli_args` reads)."""
        engine = parser.add_argument_group("engine")
        engine.add_argument(
            "--dtype", default="float32",
            help="activations: float32 (kept quantized weights give outputs independent of the batch), bfloat16, "
            "or auto (bfloat16 where the hardware multiplies it natively: faster, same perplexity, other greedy "
            "tokens; else float32)",
        )  # fmt: skip
        engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present, else cpu)")
        engine.add_argument(
            "--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB (default: 1/4 of free RAM, max 4GiB)"
        )
        engine.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool in blocks (overrides memory)")
        engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
        engine.add_argument("--max-num-seqs", type=int, default=128, help="requests running at once")
        engine.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget of one step")
        engine.add_argument("--max-model-len", type=int, default=None, help="context length served")
        engine.add_argument(
            "--batching", default="continuous", choices=BATCHING_CHOICES,
            help="continuous (default; requests join at any step), static (wait for a full batch, run it to the "
            "end) or dynamic (a full batch or --batch-timeout-ms, whichever first)",
        )  # fmt: skip
        engine.add_argument("--batch-size", type=int, default=None, help="static/dynamic batch size (--max-num-seqs)")
        engine.add_argument("--batch-timeout-ms", type=float, default=50.0, help="dynamic: longest wait (default 50)")
        engine.add_argument(
            "--quantization", default=None, choices=QUANTIZATION_CHOICES,
            help="none: dequantize every quantized weight to --dtype at load; int8 / int4 / nf4: quantize every "
            "projection at load (per-channel int8; 4-bit round-to-nearest in groups of 32; NormalFloat-4 in blocks "
            "of 64) (default: the checkpoint's own formats - GGUF 4-bit and Q8_0, GPTQ, AWQ, NF4 - stay as they are)",
        )  # fmt: skip
        engine.add_argument(
            "--activation-bits", type=int, default=16, choices=ACTIVATION_BITS_CHOICES,
            help="bits of each activation that kept-quantized weights' int8 dot products multiply: 16 (an 8-bit "
            "code and its rounding error; the default) or 8 (the code alone, as llama.cpp's Q8 activations: "
            "faster batches and prefill, outputs further from float32's)",
        )  # fmt: skip
        engine.add_argument(
            "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
            help="auto (the model's dtype), or 8-bit K/V with a float16 scale per token and head: about twice "
            "the tokens in the same memory",
        )  # fmt: skip
        engine.add_argument(
            "--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
            help="recompute every prompt instead of reusing the KV of prefixes seen before",
        )  # fmt: skip
        engine.add_argument(
            "--no-hybrid-kv-cache", dest="hybrid_kv_cache", action="store_false",
            help="one block table for every layer of a model that mixes sliding-window and global layers "
            "(Gemma 3), instead of a table per group that frees the blocks behind the window",
        )  # fmt: skip
        engine.add_argument(
            "--pooling", default="last", choices=POOLING_METHODS,
            help="how /v1/embeddings and LLM.embed pool the final hidden states: the last token (default; a causal "
            "model's only token that saw the whole input) or the mean over every input token",
        )  # fmt: skip
        engine.add_argument(
            "--compile", action="store_true",
            help="torch.compile each decoder layer: the Python path that prefills and runs the steps the C++ "
            "decode step does not take (whole models in this process; on CPU it is slower, docs/benchmarks.md)",
        )  # fmt: skip
        engine.add_argument(
            "--enforce-eager", action="store_true",
            help="on a GPU, run every step eagerly instead of replaying captured CUDA graphs for decode steps",
        )  # fmt: skip
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
        spec.add_argument("--num-speculative-tokens", type=int, default=defaults.num_speculative_tokens,
                          help="drafts per step, at most")  # fmt: skip
        spec.add_argument("--prompt-lookup-min", type=int, default=defaults.prompt_lookup_min,
                          help="ngram: shortest suffix matched")  # fmt: skip
        spec.add_argument("--prompt-lookup-max", type=int, default=defaults.prompt_lookup_max,
                          help="ngram: longest suffix matched (tried first)")  # fmt: skip
        spec.add_argument("--speculative-disable-by-batch-size", type=int, default=defaults.disable_by_batch_size,
                          help="no drafts while more requests than this run (speculation stops paying)")  # fmt: skip
        spec.add_argument("--suffix-max-tree-depth", type=int, default=defaults.suffix_max_tree_depth,
                          help="suffix: longest string a suffix tree holds, match and draft together")  # fmt: skip
        spec.add_argument("--suffix-max-cached-requests", type=int, default=defaults.suffix_max_cached_requests,
                          help="suffix: finished requests whose outputs the global tree keeps (0: none)")  # fmt: skip
        spec.add_argument("--suffix-max-spec-factor", type=float, default=defaults.suffix_max_spec_factor,
                          help="suffix: a draft is at most this many times as long as its match")  # fmt: skip
        spec.add_argument("--suffix-min-token-prob", type=float, default=defaults.suffix_min_token_prob,
                          help="suffix: stop a draft where its estimated probability falls below this")  # fmt: skip
        spec.add_argument("--lookahead-ngram-size", type=int, default=defaults.lookahead_ngram_size,
                          help="lookahead: N, the pool's n-gram length (a key token, N - 1 after it)")  # fmt: skip
        spec.add_argument("--lookahead-pool-size", type=int, default=defaults.lookahead_pool_size,
                          help="lookahead: G, the n-grams kept per key token (the most recent)")  # fmt: skip
        spec.add_argument("--draft-model", default=None,
                          help="draft: the drafting model (a catalog name or a path; the same GGUF file as a "
                          "target served with --quantization none drafts at its 4-bit speed)")  # fmt: skip
        spec.add_argument("--draft-quantization", default=None,
                          help="draft: how the draft's weights are held (default: as stored in its file)")  # fmt: skip

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != "speculative_config"}
        speculative = None
        if args.speculative_method is not None:
            options = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in _SPECULATIVE_FLAGS.items()}
            speculative = SpeculativeConfig(method=args.speculative_method, **options)
        return cls(**values, speculative_config=speculative)

    def to_cli_flags(self) -> list[str]:
        """The flags that `add_cli_args` reads back into these arguments (the model not included): every
        option spelled out, defaults too, so a recorded command line says exactly what ran."""
        words: list[str] = []
        for key, value in self.llm_kwargs().items():
            if key == "enable_prefix_caching":
                words += [] if value else ["--no-prefix-caching"]
            elif key == "hybrid_kv_cache":
                words += [] if value else ["--no-hybrid-kv-cache"]
            elif key in SWITCHES_OFF_BY_DEFAULT:
                words += [f"--{key.replace('_', '-')}"] if value else []
            elif key == "speculative_config":
                words += [] if value is None else _speculative_flags(value)
            elif value is not None:
                text = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)
                words += [f"--{key.replace('_', '-')}", text]
        return words

    # -- the engine --------------------------------------------------------------------------------
    def llm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `LLM(model, ...)`."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        return kwargs

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
            nnodes=self.nnodes,
            master_addr=self.master_addr,
            master_port=self.master_port,
            cpu_collectives=self.cpu_collectives,
            pipeline_micro_batches=self.pipeline_micro_batches,
            pipeline_layers=parse_layer_counts(self.pipeline_layers),
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=parse_memory(self.kv_cache_memory),
            num_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
            hybrid_kv_cache=self.hybrid_kv_cache,
        )

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        """`model_max_len`: the model's own context length, served when `max_model_len` is not given."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len or model_max_len,
            batching=self.batching,
            batch_size=self.batch_size,
            batch_timeout=self.batch_timeout_ms / 1000,
            pooling=self.pooling,
        )


def parse_layer_counts(text: str | None) -> tuple[int, ...] | None:
    """ "9,9" -> (9, 9)."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pipeline-layers must be comma-separated layer counts such as 9,9, got {text!r}") from None


def add_parallel_args(group: argparse._ArgumentGroup, engine: bool = True) -> None:
    """The flags `folio serve|run|bench` and `folio worker` share (a worker also names its host's rank)."""
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split each layer over this many processes (heads and MLP columns per rank)")  # fmt: skip
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="split the layers into this many stages of --tensor-parallel-size processes")  # fmt: skip
    group.add_argument("--context-parallel-size", "-cp", type=int, default=1,
                       help="split each sequence's tokens and KV cache over this many processes, each holding the "
                       "whole model (long prompts: C times the context, prefill divided C ways)")  # fmt: skip
    group.add_argument("--nnodes", type=int, default=1, help="hosts the ranks run on (default 1)")
    if not engine:
        group.add_argument("--node-rank", type=int, required=True, help="this host's index among --nnodes (1, 2, ...)")
    group.add_argument("--master-addr", default=None, help="the head host's address (default: $MASTER_ADDR)")
    group.add_argument("--master-port", type=int, default=None, help="its rendezvous port (default: $MASTER_PORT)")
    if engine:
        group.add_argument("--cpu-collectives", default="shm", choices=CPU_COLLECTIVES,
                           help="ranks all on one CPU host reduce through shared memory (shm, default) or gloo "
                           "over loopback TCP")  # fmt: skip
        group.add_argument("--pipeline-layers", default=None,
                           help="layers per pipeline stage, e.g. 9,9 (default: balanced by weight, the LM head "
                           "counted)")  # fmt: skip
        group.add_argument("--pipeline-micro-batches", type=int, default=None,
                           help="pieces a pipeline splits each step into so that its stages overlap (default: 2 "
                           "per stage)")  # fmt: skip


# Every SpeculativeConfig option but the method (--speculative-method) and the flag that sets it; the
# flags themselves, with their help, are declared once in add_cli_args.
_SPECULATIVE_FLAGS = {
    name: "--speculative-disable-by-batch-size" if name == "disable_by_batch_size" else f"--{name.replace('_', '-')}"
    for name in (f.name for f in fields(SpeculativeConfig))
    if name != "method"
}


def _speculative_flags(config: SpeculativeConfig) -> list[str]:
    words = ["--speculative-method", config.method]
    for name, flag in _SPECULATIVE_FLAGS.items():
        if (value := getattr(config, name)) is not None:
            words += [flag, str(value)]
    return words
