"""Typed configuration for the model, the KV cache and the scheduler, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

POSITION_EMBEDDINGS = ("rope", "learned", "alibi")
# How an embedding request pools its prompt's final hidden states into one vector (see SchedulerConfig.pooling).
POOLING_METHODS = ("last", "mean")
# The KV cache's formats (kv_cache/quant.py): the model's own dtype, or 8-bit K/V with per-token scales.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
ACTIVATION_BITS_CHOICES = (16, 8)  # 8: projections quantize their inputs per token (weight_formats/activation_bits.py)


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, filled from config.json or GGUF metadata."""

    architecture: str  # config.json's architecture name, e.g. "LlamaForCausalLM"; picks the model's module
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6  # the epsilon of every norm (RMSNorm, or LayerNorm where a model uses it)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    linear_bias: bool = False  # every projection and norm carries a bias (GPT-2, BLOOM)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma 3 specifics (ignored by other architectures).
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # "sliding_attention" | "full_attention" per layer
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # How a model knows positions: rotary ("rope"), a learned table added to the embeddings ("learned",
    # GPT-2) or linear biases on the attention scores ("alibi", BLOOM).
    position_embedding: str = "rope"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"model config: position_embedding must be one of {POSITION_EMBEDDINGS}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError("model config: layer_types must have one entry per layer")

    def is_sliding(self, layer_index: int) -> bool:
        return bool(self.layer_types and self.layer_types[layer_index] == "sliding_attention")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None where it attends over the whole context."""
        return tuple((self.sliding_window or None) if self.is_sliding(i) else None for i in range(self.num_layers))

    @property
    def window_of_every_layer(self) -> int | None:
        """The sliding window, when every layer attends through it (Mistral v0.1, Phi-3); else None."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: a share of available RAM
    num_blocks: int | None = None  # overrides kv_cache_memory (tests use tiny pools)
    enable_prefix_caching: bool = True  # reuse the KV of full blocks whose prefix was computed before
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "int8" or "fp8": 8-bit K/V with per-token scales
    # A model mixing sliding-window and global layers gets a block table per KV cache group
    # (kv_cache/groups.py), so its window layers free the blocks behind the window; False: one table.
    hybrid_kv_cache: bool = True
    kv_offload_ram: int | None = None  # bytes of host RAM for prefix-cache blocks the pool evicts; None: none
    kv_cache_dir: str | None = None  # a directory that keeps computed prefix-cache blocks as files; None: none
    kv_cache_disk: int | None = None  # bytes of files there at most; None: 20 GiB or half the free space

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_memory", "num_blocks", "kv_offload_ram", "kv_cache_disk"):
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 1024  # token budget of one engine step (prefill chunks + decodes)
    max_num_seqs: int = 128  # running requests at most
    max_model_len: int = 4096  # context length served (capped by the model's own)
    batching: str = "continuous"  # or "static" / "dynamic" (request-level, see folio/engine/batching.py)
    batch_size: int | None = None  # static/dynamic batch size; None: max_num_seqs
    batch_timeout: float = 0.05  # dynamic: seconds the oldest waiting request waits for a full batch
    # The pooling of embedding requests that name none. "last" by default: folio serves causal decoders,
    # where only the last token has attended to the whole input (vLLM's default for them, and how
    # decoder embedding models such as e5-mistral and Qwen3-Embedding pool); mean pooling suits
    # encoders trained for it. Last-token pooling also lets a request take prefix-cache hits.
    pooling: str = "last"
    max_loras: int | None = None  # with LoRA: adapters the running requests may use at once

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0 or self.max_model_len <= 0:
            raise ValueError("scheduler limits must be positive")
        if self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.pooling!r}")


CPU_COLLECTIVES = ("shm", "gloo")


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is split over processes: tensor-parallel ranks within each of the pipeline's
    stages, on one host or several (joined by torch.distributed's rendezvous at master_addr:master_port;
    see docs/parallelism.md). Global rank = stage * tensor_parallel_size + rank within the stage."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Ranks each sequence's tokens (and KV cache) are split over, every rank holding the whole model.
    context_parallel_size: int = 1
    nnodes: int = 1  # hosts taking part; this one starts ranks [node_rank * per_node, ...)
    node_rank: int = 0
    master_addr: str | None = None  # None: MASTER_ADDR from the environment, else loopback
    master_port: int | None = None  # None: MASTER_PORT from the environment, else a free port (one host)
    # Ranks all on one CPU host: "shm" exchanges through shared memory, "gloo" through loopback TCP.
    cpu_collectives: str = "shm"
    # Pieces a pipeline splits each step into, so that its stages overlap; None: two per stage.
    pipeline_micro_batches: int | None = None
    # Layers per stage; None: balanced by weight, the LM head counted (pipeline_parallel.py).
    pipeline_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        sizes = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "pipeline_micro_batches")
        for name in sizes:
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.context_parallel_size > 1 and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("context parallelism does not combine with tensor or pipeline parallelism yet")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}")
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise ValueError(
                f"cpu_collectives must be one of {', '.join(CPU_COLLECTIVES)}, got {self.cpu_collectives!r}"
            )
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks do not divide over {self.nnodes} hosts")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def micro_batches(self) -> int:
        return self.pipeline_micro_batches or 2 * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1


SPECULATIVE_METHODS = ("ngram", "suffix", "draft", "lookahead")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, the target model verifies them in one forward."""

    # ngram: prompt lookup, continue a match of the last tokens found earlier in the context;
    # suffix: SuffixDecoding, follow the likeliest continuation in suffix trees of the request and of past outputs
    # lookahead: Jacobi iteration on the verified drafts, and a pool of the n-grams its trajectory and the text hold
    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts per step, at most
    prompt_lookup_min: int = 1  # ngram: shortest suffix to match
    prompt_lookup_max: int = 4  # ngram: longest suffix to match (tried first)
    # Speculation costs more than it saves once the batch is compute bound: no drafts above this many
    # running requests (vLLM's speculative_disable_by_batch_size).
    disable_by_batch_size: int = 8
    suffix_max_tree_depth: int = 24  # suffix: longest string a tree holds (match plus draft)
    suffix_max_cached_requests: int = 10000  # suffix: finished requests' outputs in the global tree (0: none)
    suffix_max_spec_factor: float = 1.0  # suffix: a draft is at most this many times its match's length
    suffix_min_token_prob: float = 0.1  # suffix: stop drafting when the path's probability drops below this
    lookahead_ngram_size: int = 4  # lookahead: N, the pool's n-grams (a key token and N - 1 to follow it)
    lookahead_pool_size: int = 8  # lookahead: G, the continuations kept per key token (the most recent)
    # draft: the drafting model (a catalog name or a path) and how its weights are held (None: as its
    # file stores them, so a GGUF file stays 4-bit while the target may be served dense).
    draft_model: str | None = None
    draft_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative method 'draft' needs a draft model (--draft-model)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"a draft model is only used by speculative method 'draft', not {self.method!r}")
        # A suffix tree of depth 1 holds single tokens and continues none; a lookahead n-gram is a key token
        # and at least one to propose after it.
        least = {"num_speculative_tokens": 1, "disable_by_batch_size": 1, "suffix_max_tree_depth": 2,
                 "suffix_max_cached_requests": 0, "lookahead_ngram_size": 2, "lookahead_pool_size": 1}  # fmt: skip
        for name, low in least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not self.suffix_max_spec_factor > 0:
            raise ValueError(f"suffix_max_spec_factor must be positive, got {self.suffix_max_spec_factor}")
        if not 0 <= self.suffix_min_token_prob <= 1:
            raise ValueError(f"suffix_min_token_prob must be between 0 and 1, got {self.suffix_min_token_prob}")


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def parse_memory(value: str | int | None) -> int | None:
    """'4GiB', '512MB', '2G' or a byte count -> bytes."""
    if value is None or isinstance(value, int):
        return value
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(float(text))
    except ValueError:
        raise ValueError(f"cannot read memory size {value!r}; use e.g. 2GiB or 512MiB") from None
