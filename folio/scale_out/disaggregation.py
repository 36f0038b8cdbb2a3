"""Prefill/decode disaggregation on Ray Serve: decode replicas pull a prompt's KV from prefill replicas.

The ingress sends every job to a decode replica, as without disaggregation. Before adding the request,
the decode replica asks its own prefix cache how many of the prompt's full blocks it holds; if some are
missing, it sends the job to the prefill deployment (routed by prefix and load like any job), whose
replica computes the prompt (one greedy token, discarded: only the KV matters) and returns copies of the
missing blocks in its cache's own format through Ray's object store. The decode replica writes them into
its prefix cache (engine/kv_transfer.py) and adds the request, which hits them. If the prefill replica
fails or dies mid-transfer, the decode replica computes the prompt itself: slower, never wrong, and
nothing is left allocated on either side (the prefill request ended or died with its replica; the
decode side allocates only once the blocks have arrived).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from ray.serve.handle import DeploymentHandle

from folio.engine.kv_transfer import KVBlocks, export_prefix, held_prefix, import_prefix, prompt_keys
from folio.sampling_params import SamplingParams
from folio.scale_out.jobs import EngineJob
from folio.server.engine_client.thread import AsyncEngine

logger = logging.getLogger("folio")

PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # the prompt's KV is the product


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Counter("folio:kv_transfer_blocks", "KV blocks received from prefill replicas.",
                              registry=registry)  # fmt: skip
        self.bytes = Counter("folio:kv_transfer_bytes", "Bytes of KV received from prefill replicas.",
                             registry=registry)  # fmt: skip
        self.seconds = Histogram("folio:kv_transfer_seconds", "Handing a prompt's blocks over: from asking a prefill "
                                 "replica to the blocks being in this cache, less the prefill's own compute.",
                                 registry=registry, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                 0.5, 1, 2.5))  # fmt: skip
        self.prefill_seconds = Histogram("folio:kv_prefill_seconds", "Computing a prompt on a prefill replica, as "
                                         "it reported.", registry=registry,
                                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))  # fmt: skip
        self.local = Counter("folio:kv_transfer_fallbacks", "Prompts a decode replica computed itself because "
                             "the prefill replica failed.", registry=registry)  # fmt: skip


async def prefill_and_export(engine: AsyncEngine, job: EngineJob, skip: int) -> KVBlocks:
    """On a prefill replica: compute the job's prompt, then copy its cached full blocks after the first
    `skip` (which the asking decode replica holds already)."""
    started = time.monotonic()
    generation = engine.generation()
    try:
        generation.add(job.prompt_token_ids, [PREFILL_PARAMS], job.cache_salt, job.priority)
        async for _ in generation:
            pass
    finally:
        generation.close()
    computed = time.monotonic() - started
    keys = prompt_keys(engine.engine, job.prompt_token_ids, job.cache_salt)
    blocks = await engine.call(lambda core: export_prefix(core, keys, skip))
    blocks.compute_seconds = computed
    return blocks


async def pull_prefix(engine: AsyncEngine, prefill: DeploymentHandle, job: EngineJob, metrics: TransferMetrics) -> None:
    """On a decode replica: get the prompt's missing full blocks from a prefill replica into this cache."""
    keys = prompt_keys(engine.engine, job.prompt_token_ids, job.cache_salt)
    held = await engine.call(lambda core: held_prefix(core, keys))
    if held == len(keys):
        return
    started = time.monotonic()
    try:
        blocks: KVBlocks = await prefill.prefill.remote(job, held)
        imported = await engine.call(lambda core: import_prefix(core, blocks))
    except Exception:  # the prefill replica died or failed: compute the prompt here
        logger.warning("prefill for a %d-token prompt failed; computing it on this replica",
                       len(job.prompt_token_ids), exc_info=True)  # fmt: skip
        metrics.local.inc()
        return
    metrics.blocks.inc(imported)
    metrics.bytes.inc(blocks.nbytes)
    metrics.seconds.observe(max(0.0, time.monotonic() - started - blocks.compute_seconds))
    metrics.prefill_seconds.observe(blocks.compute_seconds)
