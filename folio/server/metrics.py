"""Prometheus metrics for `/metrics`, fed from the engine thread (prometheus_client is thread-safe).

Names follow vLLM's with a `folio:` prefix, so existing Grafana dashboards need only a rename.
Latencies use the engine's monotonic timestamps on each Request: queue time ends when a request is
first scheduled, TTFT at its first sampled token, ITL between consecutive tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.engine.stats import SchedulerStats
from folio.server.admission import Admission
from folio.spec_decode.scheduling import SpecDecodeStats

disable_created_metrics()  # `*_created` timestamps only clutter the scrape

_FAST = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_SLOW = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


def track_admission(registry: CollectorRegistry, model_name: str, admission: Admission) -> None:
    """The API server's admission count, read at each scrape. It lives where admission does: beside the
    routes, which may be another process than the engine's."""
    doc = ("Engine requests holding admission slots (running, queued, or being set up); new requests get 429 "
           "when this reaches --max-num-seqs + --max-queue.")  # fmt: skip
    gauge = Gauge("folio:num_requests_admitted", doc, ["model_name"], registry=registry).labels(model_name)
    gauge.set_function(lambda: admission.in_flight)


class MergedEngineMetrics:
    """Several engines' metrics in one registry (a server of several models): each family once, with every
    engine's samples (they carry a model_name label), and each model's admission count. `texts` asks the
    engines now (scrapes run off the event loop)."""

    def __init__(self, texts: Callable[[], list[str]], admissions: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._texts, self._admissions = texts, admissions

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for text in self._texts():
            for family in text_string_to_metric_families(text):
                known = families.setdefault(family.name, family)
                if known is not family:
                    known.samples.extend(family.samples)
        admitted = Metric("folio:num_requests_admitted", "Engine requests holding admission slots (running, "
                          "queued, or being set up), per model.", "gauge")  # fmt: skip
        for name, count in self._admissions():
            admitted.add_sample("folio:num_requests_admitted", {"model_name": name}, count)
        families[admitted.name] = admitted
        yield from families.values()


class ServerMetrics:
    def __init__(self, engine: EngineCore, model_name: str) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"folio:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"folio:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"folio:{name}", doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", _FAST)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Per request: (last token - first token) / (tokens - 1).", _PER_TOKEN
        )
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens of a request.", _PER_TOKEN)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to finish.", _SLOW)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduled.", _SLOW)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted once per request).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache at admission (a preempted request "
            "coming back looks up its generated tokens too)."
        )  # fmt: skip
        self.prefix_hits = counter("prefix_cache_hits", "Of those, tokens whose KV came from the prefix cache.")
        self._prefix_seen = (0, 0)
        # Speculative decoding, with vLLM's names (folio: for vllm:); zero without a speculative engine.
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications: a request checking its drafts in a step.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_per_position = Counter(
            "folio:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            ["model_name", "position"], registry=self.registry,
        )  # fmt: skip
        self._spec_seen = SpecDecodeStats()
        # The KV tiers under the pool (--kv-offload-ram, --kv-cache-dir): zero without them.
        self._tier_counters = {
            "ram_stored": counter("kv_offload_ram_stored_blocks", "Prefix-cache blocks the pool evicted into the "
                                  "host-RAM tier."),
            "ram_loaded": counter("kv_offload_ram_loaded_blocks", "Blocks loaded back from the host-RAM tier for a "
                                  "prompt's prefix."),
            "disk_stored": counter("kv_cache_disk_stored_blocks", "Computed prefix-cache blocks written to the disk "
                                   "tier."),
            "disk_loaded": counter("kv_cache_disk_loaded_blocks", "Blocks read back from the disk tier for a prompt's "
                                   "prefix."),
            "disk_failed": counter("kv_cache_disk_failed_loads", "Reads from the disk tier that found no usable file "
                                   "(removed, torn, corrupted or another model's): computed instead."),
            "disk_written": counter("kv_cache_disk_written_bytes", "Bytes written to the disk tier."),
            "disk_read": counter("kv_cache_disk_read_bytes", "Bytes read from the disk tier."),
            "disk_save_seconds": counter("kv_cache_disk_save_seconds", "Seconds the disk tier's I/O thread spent "
                                         "writing blocks (over stored blocks: the store latency)."),
            "disk_load_seconds": counter("kv_cache_disk_load_seconds", "Seconds the disk tier's I/O thread spent "
                                         "reading and checking blocks (over loaded blocks: the load latency)."),
        }  # fmt: skip
        self._tier_seen: dict[str, float] = dict.fromkeys(self._tier_counters, 0)
        self.tier_usage = gauge("kv_offload_ram_usage_ratio", "Fraction of the host-RAM tier's blocks in use (0-1).")
        self.disk_usage = gauge("kv_cache_disk_usage_ratio", "Fraction of the disk tier's budget its files hold (0-1).")
        self.disk_enabled = gauge("kv_cache_disk_enabled", "1 while the disk tier writes; 0 once a write failed (disk "
                                  "full, read-only) or without one.")  # fmt: skip
        self.success = Counter(
            "folio:request_success", "Requests finished, by reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )  # fmt: skip
        self._model_name = model_name
        self._progress: dict[str, tuple[float, int]] = {}  # request id -> (last update, tokens seen)

    def _count_tiers(self, reading: SchedulerStats) -> None:
        totals: dict[str, float] = {}
        if (tier := reading.tier) is not None:
            totals.update(ram_stored=tier.stored_blocks, ram_loaded=tier.loaded_blocks)
            self.tier_usage.set(tier.used_blocks / tier.capacity_blocks)
        if (disk := reading.disk) is not None:
            io = disk.io
            totals.update(disk_stored=disk.stored_blocks, disk_loaded=disk.loaded_blocks, disk_failed=disk.failed_loads,
                          disk_written=io.bytes_written, disk_read=io.bytes_read, disk_save_seconds=io.save_seconds,
                          disk_load_seconds=io.load_seconds)  # fmt: skip
            self.disk_usage.set(disk.files / disk.capacity_blocks)
            self.disk_enabled.set(float(disk.enabled))
        for name, total in totals.items():
            self._tier_counters[name].inc(max(total - self._tier_seen[name], 0))
            self._tier_seen[name] = total

    def on_step(self, updated: list[Request], now: float) -> None:
        stats = self.engine.last_step
        if stats is not None and stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        reading = self.engine.make_stats()  # one reading for every figure of this step
        queries, hits = reading.prefix_cache_queries, reading.prefix_cache_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        self._count_speculation(reading.spec_decoding)
        self._count_tiers(reading)
        generated = 0
        for request in updated:
            # Usually one new token; a beam search's results arrive once, with all of theirs.
            num_tokens = len(request.output_token_ids)
            previous = self._progress.pop(request.request_id, None)
            if previous is None:
                self.prompt_tokens.inc(request.num_prompt_tokens)
                if request.first_token_time is not None:
                    self.ttft.observe(request.first_token_time - request.arrival_time)
                generated += num_tokens
            else:
                self.itl.observe(now - previous[0])
                generated += num_tokens - previous[1]
            if not request.is_finished:
                self._progress[request.request_id] = (now, num_tokens)
        self.generation_tokens.inc(generated)
        self._refresh_gauges(reading)

    def on_finished(self, request: Request, now: float) -> None:
        self._progress.pop(request.request_id, None)
        reason = request.finish_reason.value if request.finish_reason else "abort"
        self.success.labels(self._model_name, reason).inc()
        finish = request.finish_time or now
        self.e2e.observe(finish - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - request.arrival_time)
        num_tokens = len(request.output_token_ids)
        if request.first_token_time is not None and num_tokens > 1:
            self.tpot.observe((finish - request.first_token_time) / (num_tokens - 1))
        self._refresh_gauges(self.engine.make_stats())

    def _count_speculation(self, now: SpecDecodeStats) -> None:
        seen = self._spec_seen
        if now.num_drafts == seen.num_drafts:
            return
        self.spec_drafts.inc(now.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(now.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted.inc(now.num_accepted_tokens - seen.num_accepted_tokens)
        for position, count in enumerate(now.accepted_per_position):
            before = seen.accepted_per_position[position] if position < len(seen.accepted_per_position) else 0
            if count > before:
                self.spec_per_position.labels(self._model_name, str(position)).inc(count - before)
        self._spec_seen = now

    def _refresh_gauges(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage_ratio)
