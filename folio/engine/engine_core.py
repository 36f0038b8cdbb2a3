"""The engine loop: schedule -> run the model -> update requests. No tokenizer, no text."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from folio.config import (
    ACTIVATION_BITS_CHOICES,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_dtype,
)
from folio.distributed.pipeline_parallel import partition_layers
from folio.distributed.tensor_parallel import TensorParallel, head_shard
from folio.engine.kv_tiers import attach_disk_tier, attach_host_tier, fingerprint_settings, sync_tiers
from folio.engine.request import FinishReason, Request
from folio.engine.scheduler import Scheduler
from folio.engine.stats import SchedulerStats
from folio.engine_args import EngineArgs
from folio.kv_cache.groups import KVGroups, one_group, plan_kv_groups
from folio.kv_cache.manager import KVCacheManager
from folio.loaders.catalog import resolve_model
from folio.loaders.model_loader import LoadedModel, load_model, open_checkpoint
from folio.loaders.tokenizer import Tokenizer
from folio.lora.adapter import LoRARequest
from folio.lora.store import LoRAStore
from folio.memory import reuse_large_allocations
from folio.models.base import CausalLM
from folio.platform import configure_threads, default_device, default_kv_cache_memory, resolve_dtype
from folio.spec_decode.factory import make_proposer
from folio.step import ModelRunnerOutput, SchedulerOutput
from folio.structured.grammar import GrammarCompiler
from folio.weight_formats.activation_bits import set_activation_bits
from folio.worker.executor import SplitModelExecutor, WorkerDiedError, WorkerLaunch
from folio.worker.model_runner import ModelRunner, kv_bytes_per_token
from folio.worker.rank import WorkerSpec

logger = logging.getLogger("folio")


@dataclass
class StepStats:
    num_batched_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int


def _groups_note(groups: KVGroups) -> str:
    windows = [w for w in groups.windows if w is not None]
    if not windows:
        return ""
    behind = f"blocks behind the {windows[0]}-token window freed"
    if not groups.is_hybrid:
        return f"; {behind}"
    return (
        f"; {groups.num_groups} block tables of {groups.layers_per_block} layers, {len(windows)} of them "
        f"window layers' ({behind})"
    )


class EngineCore:
    def __init__(
        self,
        model: nn.Module | None,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        dtype: torch.dtype,
        device: torch.device,
        speculative_config: SpeculativeConfig | None = None,
        draft_model: CausalLM | None = None,
        workers: WorkerLaunch | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        """`model`: the model, in this process; or None with `workers`: its ranks, started here, load it.
        `cuda_graphs`: on a GPU, replay captured CUDA graphs for pure decode steps. Most callers want
        `from_engine_args`, which loads the model (and its tokenizer) first."""
        self.model_config, self.dtype, self.device = model_config, dtype, device
        # What from_engine_args loaded: the checkpoint (config, tokenizer, path, format, resident bytes),
        # and a draft model's.
        self.loaded: LoadedModel | None = None
        self.draft: LoadedModel | None = None
        parallel = workers.parallel if workers is not None else ParallelConfig()
        tp = parallel.tensor_parallel_size
        # Refuse a split the model cannot take before any rank starts.
        kv_heads = head_shard(model_config.num_heads, model_config.num_kv_heads, TensorParallel(0, tp)).num_kv_heads
        stages = partition_layers(model_config, parallel.pipeline_parallel_size, parallel.pipeline_layers)
        cp = parallel.context_parallel_size
        if cache_config.block_size % cp:
            raise ValueError(
                f"a context-parallel size of {cp} needs a block size that divides by it (each rank holds "
                f"block_size / {cp} tokens of every block); the block size is {cache_config.block_size}"
            )
        # Every layer's KV on one tensor-parallel rank; a pipeline stage holds its layers' share. The
        # pool's memory is shared by all ranks (KV heads replicated over ranks count twice). Context-
        # parallel ranks hold every token once between them: the pool's tokens need no factor.
        bytes_per_token = kv_bytes_per_token(model_config, dtype, cache_config.kv_cache_dtype, kv_heads)
        # A whole model in this process that mixes window and global layers gets a table per KV cache group;
        # a block then holds `layers_per_block` layers' K/V. Split models keep one table.
        kv_groups = one_group(model_config.num_layers, model_config.window_of_every_layer)
        if workers is None and cache_config.hybrid_kv_cache:
            kv_groups = plan_kv_groups(model_config.layer_windows)
        bytes_per_block_token = bytes_per_token * kv_groups.layers_per_block // model_config.num_layers
        if cache_config.num_blocks is not None:
            num_blocks = cache_config.num_blocks
        else:
            memory = cache_config.kv_cache_memory or default_kv_cache_memory(device)
            num_blocks = memory // (bytes_per_block_token * tp * cache_config.block_size)
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory of {memory} bytes holds no block of {cache_config.block_size} tokens "
                    f"({bytes_per_token} bytes per token)"
                )
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 kv_groups.windows)  # fmt: skip
        self.kv_groups = kv_groups
        # A request must always fit the pool alone, or preemption could never make room for it.
        max_len = min(scheduler_config.max_model_len, model_config.max_position_embeddings)
        if (fits := self.kv.longest_request_tokens(scheduler_config.max_num_batched_tokens)) is not None:
            max_len = min(max_len, fits)
        scheduler_config.max_model_len = max_len
        self.scheduler_config = scheduler_config
        self.scheduler = Scheduler(scheduler_config, self.kv, model_config.vocab_size)
        if draft_model is not None and draft_model.config.vocab_size != model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is not the target's "
                f"({model_config.vocab_size}): a draft must share the target's tokenizer"
            )
        self.runner: ModelRunner | SplitModelExecutor
        if workers is not None:
            spec = WorkerSpec(workers.model, dtype, workers.quantization, cache_config, num_blocks, speculative_config,
                              parallel)  # fmt: skip
            self.runner = SplitModelExecutor(spec, model_config, str(device))
        else:
            assert model is not None, "an engine without workers runs its model in process"
            self.runner = ModelRunner(model, model_config, cache_config, num_blocks, dtype, device, speculative_config,
                                      kv_groups=kv_groups, cuda_graphs=cuda_graphs)  # fmt: skip
        # After the runner: a draft of the same model reads its KV cache. Ranks build their own proposer.
        if speculative_config is not None and isinstance(self.runner, ModelRunner):
            shared = self.runner.kv_caches if draft_model is not None and draft_model.config == model_config else None
            # The draft's own pool holds as many tokens as the target's (every block kept).
            self.runner.proposer = make_proposer(speculative_config, draft_model, num_blocks // kv_groups.num_groups,
                                                 cache_config.block_size, dtype, device, shared,
                                                 kv_groups.layer_group)  # fmt: skip
        if cache_config.kv_offload_ram is not None:
            if not isinstance(self.runner, ModelRunner):
                raise ValueError("--kv-offload-ram needs a whole model in this process (not yet tensor, pipeline "
                                 "or context parallelism)")  # fmt: skip
            attach_host_tier(self.kv, self.runner, cache_config.kv_offload_ram)
        if len(stages) > 1:
            logger.info("pipeline stages hold layers %s", ", ".join(f"{r.start}-{r.stop - 1}" for r in stages))
        # A pipeline of P stages keeps up to P steps in flight (disjoint requests): stage 0 starts the
        # next step while the later stages finish this one. Steps leave in the order they entered.
        self.max_steps_in_flight = parallel.pipeline_parallel_size if workers is not None else 1
        if device.type == "cpu":  # the model and pool are loaded: from here a step's large tensors reuse the heap
            reuse_large_allocations()
        self.in_flight: deque[SchedulerOutput] = deque()
        self.kv_bytes_per_token = bytes_per_token
        self.kv_cache_bytes = num_blocks * cache_config.block_size * bytes_per_block_token * tp  # every rank's
        self.kv_cache_dtype = cache_config.kv_cache_dtype
        self.last_step: StepStats | None = None
        self.num_steps = 0  # steps that ran the model, for per-step figures
        self._disk_reads_ended = False  # in the last step
        self.grammars: GrammarCompiler | None = None  # set by from_engine_args, which has the tokenizer
        ranks = f" over {tp} tensor-parallel ranks" if tp > 1 else f", {cp} context-parallel ranks" if cp > 1 else ""
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/token%s, %s); context length %d; "
                    "prefix caching %s%s", num_blocks, cache_config.block_size, self.kv.capacity_tokens,
                    self.kv_cache_bytes / 2**20, bytes_per_token, ranks,
                    cache_config.kv_cache_dtype, max_len, "on" if cache_config.enable_prefix_caching else "off",
                    _groups_note(kv_groups))  # fmt: skip

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> EngineCore:
        """The one way folio builds an engine (LLM, folio serve, the engine process, Ray replicas): load
        the model in this process, or start the ranks that load it, then the KV cache and scheduler.
        A split model's ranks stop when the engine is collected, if `shutdown` did not stop them first."""
        parallel = args.parallel_config()
        if args.compile and parallel.is_parallel:
            raise ValueError("--compile compiles a whole model in this process: not with tensor, pipeline or "
                             "context parallelism")  # fmt: skip
        if args.activation_bits != 16 and parallel.is_parallel:
            raise ValueError("--activation-bits 8 applies to a model loaded in this process: not with tensor, "
                             "pipeline or context parallelism")  # fmt: skip
        if args.activation_bits not in ACTIVATION_BITS_CHOICES:
            raise ValueError(f"--activation-bits must be one of {ACTIVATION_BITS_CHOICES}, got {args.activation_bits}")
        configure_threads()
        device = torch.device(args.device) if args.device else default_device()
        dtype, dtype_reason = resolve_dtype(args.dtype, device)
        # quantization None: a GGUF file's 4-bit weights stay packed; "none": dequantize them all.
        path = resolve_model(args.model)
        logger.info("loading %s", path)
        if parallel.is_parallel:  # the ranks load the weights; this process reads config and tokenizer
            checkpoint = open_checkpoint(path, dtype, args.quantization)
            loaded = LoadedModel(None, checkpoint.config, checkpoint.tokenizer, path, checkpoint.label, 0.0)
        else:
            loaded = load_model(path, dtype, device, args.quantization)
            set_activation_bits(loaded.model, args.activation_bits)  # before the decode step copies it
            logger.info("weights: %.1f MiB resident (%s)", loaded.weight_bytes / 2**20, loaded.quantization)
        spec = args.speculative_config
        draft: LoadedModel | None = None
        if spec is not None and spec.draft_model is not None and not parallel.is_parallel:
            draft = load_model(resolve_model(spec.draft_model), dtype, device, spec.draft_quantization)
            set_activation_bits(draft.model, args.activation_bits)
            logger.info("draft model: %s, %.1f MiB resident (%s)", draft.path.name, draft.weight_bytes / 2**20,
                        draft.quantization)  # fmt: skip
        config = loaded.config
        engine = cls(loaded.model, config, args.cache_config(), args.scheduler_config(config.max_position_embeddings),
                     dtype, device, spec, draft.model if draft is not None else None,
                     WorkerLaunch(args.model, args.quantization, parallel) if parallel.is_parallel else None,
                     cuda_graphs=not args.enforce_eager)  # fmt: skip
        engine.loaded, engine.draft = loaded, draft
        if isinstance(engine.runner, SplitModelExecutor):
            weakref.finalize(engine, engine.runner.shutdown)  # the executor holds no reference to the engine
            ready = engine.runner.ready
            loaded.shard_bytes, loaded.load_seconds = ready.weight_bytes, ready.load_seconds
            logger.info("weights: %.1f MiB resident on rank 0 of %d (%s)", ready.weight_bytes / 2**20,
                        parallel.world_size, ready.quantization)  # fmt: skip
        whole = loaded.model
        if args.compile and whole is not None:
            whole.compile_layers()
        decode = "the C++ decode step" if whole is not None and whole.has_compiled_decode_step else "Python layers"
        if isinstance(engine.runner, ModelRunner) and engine.runner.graphs is not None:
            decode = "CUDA graphs of the layers (--enforce-eager: none)"
        logger.info("compute: %s activations (%s), %d threads, decodes through %s%s%s",
                    str(dtype).removeprefix("torch."), dtype_reason, torch.get_num_threads(), decode,
                    ", layers torch.compile'd" if args.compile else "",
                    ", 8-bit activations into the int8 dot products" if args.activation_bits == 8 else "")  # fmt: skip
        engine.grammars = GrammarCompiler(loaded.tokenizer, config.vocab_size)
        if args.kv_cache_dir is not None:
            engine._attach_disk_tier(args, dtype)
        if args.enable_lora:
            if whole is None or not isinstance(engine.runner, ModelRunner) or engine.runner.context is not None:
                raise ValueError("LoRA adapters are served by a whole model in this process: not with tensor, "
                                 "pipeline or context parallelism")  # fmt: skip
            if args.compile:
                raise ValueError("--enable-lora and --compile do not combine yet")
            lora_dtype = dtype if args.lora_dtype == "auto" else parse_dtype(args.lora_dtype)
            engine.runner.lora = LoRAStore(whole, args.max_loras, args.max_lora_rank, lora_dtype, device)
            logger.info("LoRA: up to %d adapters at once, rank up to %d, kept in %s", args.max_loras,
                        args.max_lora_rank, str(lora_dtype).removeprefix("torch."))  # fmt: skip
        return engine

    def _attach_disk_tier(self, args: EngineArgs, dtype: torch.dtype) -> None:
        runner, loaded = self.runner, self.loaded
        if not isinstance(runner, ModelRunner) or loaded is None:
            raise ValueError("--kv-cache-dir needs a whole model in this process (not yet tensor, pipeline or "
                             "context parallelism)")  # fmt: skip
        cache = args.cache_config()
        settings = fingerprint_settings(loaded.config, dtype, cache.kv_cache_dtype, loaded.quantization,
                                        args.activation_bits)  # fmt: skip
        attach_disk_tier(self.kv, runner, Path(cache.kv_cache_dir or "."), cache.kv_cache_disk, loaded.path,
                         settings, self.max_model_len)  # fmt: skip
        if runner.disk_tier is not None:  # its thread writes what is queued before the process ends
            weakref.finalize(self, runner.disk_tier.close)

    # -- LoRA adapters -------------------------------------------------------------------------------
    def add_lora(self, request: LoRARequest) -> None:
        """Register (or replace) an adapter that requests may then name; ValueError if it cannot serve this
        model (or the engine has no LoRA)."""
        self._lora_store().add(request)

    def remove_lora(self, name: str) -> bool:
        if any(r.lora_name == name for r in self.scheduler.running + self.scheduler.waiting):
            raise ValueError(f"the adapter {name!r} still has requests running; unload it once they are done")
        return self._lora_store().remove(name)

    def lora_names(self) -> list[str]:
        runner = self.runner
        store = runner.lora if isinstance(runner, ModelRunner) else None
        return sorted(store.adapters) if store is not None else []

    def _lora_store(self) -> LoRAStore:
        store = self.runner.lora if isinstance(self.runner, ModelRunner) else None
        if store is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
        return store

    @property
    def tokenizer(self) -> Tokenizer:
        if self.loaded is None:
            raise ValueError("this engine was built around a model, not loaded by from_engine_args: no tokenizer")
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def add_request(self, request: Request, forks: list[Request] | None = None) -> None:
        """Queue a request; `forks` (more samples of the same prompt) share its prompt's KV blocks."""
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request.lora_name is not None and request.lora_name not in self.lora_names():
            raise ValueError(f"no LoRA adapter named {request.lora_name!r} is loaded")
        pooling = request.sampling_params.pooling
        if pooling is not None:  # an embedding: prefill only, so the whole context may be prompt
            if request.num_prompt_tokens > self.max_model_len:
                raise ValueError(f"the input has {request.num_prompt_tokens} tokens but the context length is "
                                 f"{self.max_model_len}")  # fmt: skip
            if pooling.method is None:
                method = self.scheduler_config.pooling
                request.sampling_params = replace(request.sampling_params, pooling=replace(pooling, method=method))
        elif request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens but the context length is "
                f"{self.max_model_len}, leaving no room to generate"
            )
        vocab_size = self.runner.config.vocab_size
        for r in [request, *(forks or [])]:
            if any(t >= vocab_size for t in r.sampling_params.logit_bias):
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size})")
            structured = r.sampling_params.structured_output
            if structured is not None:
                if self.grammars is None:
                    raise ValueError("structured output needs the engine's tokenizer (EngineCore.grammars)")
                r.grammar = self.grammars.compile(structured)
        self.scheduler.add_request(request, forks)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        return self.scheduler.abort_request(request_id, reason)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.in_flight)

    @property
    def stalled(self) -> bool:
        """The last step scheduled nothing and no step is under way: requests wait for a batch to
        form (a caller may sleep until one does); with a step in flight, its result is coming."""
        idle = self.last_step is not None and self.last_step.num_batched_tokens == 0 and not self.in_flight
        # Not while reads from disk are under way (the next step waits for them) or just ended (their
        # request may go in now).
        return idle and not self.kv.tier_loads_pending and not self._disk_reads_ended

    def shutdown(self) -> None:
        """Stop the model's ranks, if it has any; let the disk KV tier finish its writes, if there is one."""
        if isinstance(self.runner, ModelRunner) and self.runner.disk_tier is not None:
            self.runner.disk_tier.close()
        if isinstance(self.runner, SplitModelExecutor):
            with contextlib.suppress(WorkerDiedError):
                while self.in_flight:  # the ranks finish what they were given before they stop
                    self._collect()
            self.runner.shutdown()

    def step(self) -> list[Request]:
        """Run one iteration; return requests that got a new token (including ones that finished).
        With steps in flight, an iteration starts a step and returns what the oldest one produced
        once as many steps as the pipeline holds are under way (or nothing new could start)."""
        out = self.scheduler.schedule()
        if self.max_steps_in_flight == 1:
            self._record(out)
            updated = self._apply(out, self.runner.execute(out))  # an empty step still tells the runner who ended
            if isinstance(self.runner, ModelRunner) and self.kv.tier is not None:
                self._disk_reads_ended = sync_tiers(self.kv, self.runner, out.is_empty)
            return updated
        started = not out.is_empty or bool(out.finished_request_ids)
        if started:
            assert isinstance(self.runner, SplitModelExecutor)
            self._record(out)
            self.runner.submit(out)
            self.in_flight.append(out)
        elif not self.in_flight:
            self._record(out)  # nothing runs and nothing could start: the scheduler is waiting
        if self.in_flight and (len(self.in_flight) >= self.max_steps_in_flight or not started):
            return self._collect()
        return []

    def _record(self, out: SchedulerOutput) -> None:
        self.last_step = StepStats(
            out.num_batched_tokens, len(self.scheduler.running), len(self.scheduler.waiting), len(out.preempted_ids)
        )

    def _collect(self) -> list[Request]:
        """The oldest step in flight: its result applied."""
        assert isinstance(self.runner, SplitModelExecutor)
        return self._apply(self.in_flight.popleft(), self.runner.collect())

    def _apply(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        if out.is_empty:
            return []
        self.num_steps += 1
        return self.scheduler.update_from_output(out, result)
