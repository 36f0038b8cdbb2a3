"""`folio bench stall`: does one hostile request freeze the server for everyone?

A quiet phase, then an attack phase of the same length. Through both, a probe asks GET /health every
PROBE_PERIOD_S and a client streams a long completion (restarted when it ends), so the run sees the two
things everyone else's traffic needs from the event loop: a quick answer, and a stream's next token. In the
attack phase a third client sends refused bodies of a few MiB back to back, in turn: a million
one-character prompts (/v1/completions), a million inputs (/api/embed), and messages by the hundred
thousand (/v1/chat/completions, /v1/messages). Reported per phase: /health latency and the gaps between a
stream's events (median, p99, max), and each attack's answers and how long each took to refuse.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from folio.engine_args import EngineArgs
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.folio_server import against_server
from folio_tools.bench.harness.plots import figure
from folio_tools.results import result_paths, write_json

PROBE_PERIOD_S = 0.02
ATTACK_INTERVAL_S = 0.25  # at most four hostile requests a second (--attack-interval)
BODY_BYTES = 4 * 2**20 - 4096  # just under folio's default --max-request-bytes: parsed, not refused for size


def _attack_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(name, path, body): each a few MiB of many small items."""

    def fill(prefix: str, item: str, suffix: str) -> bytes:
        count = (BODY_BYTES - len(prefix) - len(suffix)) // (len(item) + 1)
        return (prefix + ",".join([item] * count) + suffix).encode()

    message = '{"role":"user","content":"a"}'
    return [
        ("one-character prompts", "/v1/completions", fill(f'{{"model":"{model}","prompt":[', '"a"', "]}")),
        ("embedding inputs", "/api/embed", fill(f'{{"model":"{model}","input":[', '"a"', "]}")),
        ("chat messages", "/v1/chat/completions", fill(f'{{"model":"{model}","messages":[', message, "]}")),
        ("anthropic messages", "/v1/messages",
         fill(f'{{"model":"{model}","max_tokens":4,"messages":[', message, "]}")),
    ]  # fmt: skip


@dataclass
class StallReport:
    base_url: str
    phase_s: float
    # Seconds from one hostile request's start to the next's (0: back to back). The client runs on the
    # server's machine, so a flood of them would measure the client's own load as much as the server's.
    attack_interval_s: float = 0.0
    health: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # phase -> (t, latency ms)
    gaps: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # phase -> (t, gap between events ms)
    attacks: list[dict[str, Any]] = field(default_factory=list)  # name, status, seconds
    attack_window: tuple[float, float] = (0.0, 0.0)
    errors: list[str] = field(default_factory=list)  # a probe or the stream that failed, and why
    command: str = ""
    date_utc: str = ""
    server: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def stats(values: list[float]) -> dict[str, float | None]:
            ordered = sorted(values)
            if not ordered:
                return {"n": 0, "p50": None, "p99": None, "max": None}
            pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)  # noqa: E731
            return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": round(ordered[-1], 2)}

        by_name: dict[str, list[dict]] = {}
        for attack in self.attacks:
            by_name.setdefault(attack["name"], []).append(attack)
        return {
            "health_ms": {phase: stats([v for _, v in points]) for phase, points in self.health.items()},
            "stream_gap_ms": {phase: stats([v for _, v in points]) for phase, points in self.gaps.items()},
            "attacks": {
                name: {
                    "count": len(items),
                    "statuses": sorted({a["status"] for a in items}),
                    "refusal_s": stats([a["seconds"] for a in items]),
                }
                for name, items in by_name.items()
            },  # fmt: skip
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary()}


class _Phases:
    """Which phase a moment belongs to, as the run goes."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.name = "quiet"
        self.stop = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.start


def _probe(client: httpx.Client, phases: _Phases, report: StallReport) -> None:
    while not phases.stop.is_set():
        sent = time.monotonic()
        client.get("/health").raise_for_status()
        report.health.setdefault(phases.name, []).append(
            (round(phases.now(), 3), round((time.monotonic() - sent) * 1000, 3))
        )
        time.sleep(max(0.0, PROBE_PERIOD_S - (time.monotonic() - sent)))


def _stream(client: httpx.Client, model: str, phases: _Phases, report: StallReport) -> None:
    context = next(card["max_model_len"] for card in client.get("/v1/models").json()["data"] if card["id"] == model)
    body = {"model": model, "prompt": "Tell me a long story about the sea.", "max_tokens": max(16, context - 64),
            "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
    while not phases.stop.is_set():
        with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            last = None
            for line in response.iter_lines():
                if phases.stop.is_set():
                    return
                if not line.startswith("data: {"):
                    continue
                arrived = time.monotonic()
                if last is not None:
                    report.gaps.setdefault(phases.name, []).append(
                        (round(phases.now(), 3), round((arrived - last) * 1000, 3))
                    )
                last = arrived


def _attack(client: httpx.Client, bodies: list[tuple[str, str, bytes]], phases: _Phases, report: StallReport) -> None:
    index = 0
    while phases.name == "attack" and not phases.stop.is_set():
        name, path, body = bodies[index % len(bodies)]
        sent = time.monotonic()
        status = client.post(path, content=body, headers={"content-type": "application/json"}).status_code
        report.attacks.append({"name": name, "status": status, "seconds": round(time.monotonic() - sent, 4)})
        index += 1
        time.sleep(max(0.0, report.attack_interval_s - (time.monotonic() - sent)))


def _recording(work: Any, report: StallReport) -> Any:
    """`work`, with whatever ends it early kept in the report (a thread's exception is otherwise lost)."""

    def run(*args: Any) -> None:
        try:
            work(*args)
        except Exception as exc:  # noqa: BLE001 - reported with the results
            report.errors.append(f"{work.__name__.strip('_')}: {type(exc).__name__}: {exc}")

    return run


def run_stall(base_url: str, model: str, phase_s: float, attack_interval_s: float = ATTACK_INTERVAL_S) -> StallReport:
    report = StallReport(base_url=base_url, phase_s=phase_s, attack_interval_s=attack_interval_s)
    bodies = _attack_bodies(model)
    phases = _Phases()
    clients = [httpx.Client(base_url=base_url, timeout=120) for _ in range(3)]
    workers = [threading.Thread(target=_recording(_probe, report), args=(clients[0], phases, report), daemon=True),
               threading.Thread(target=_recording(_stream, report), args=(clients[1], model, phases, report),
                                daemon=True)]  # fmt: skip
    try:
        for worker in workers:
            worker.start()
        time.sleep(phase_s)
        phases.name = "attack"
        started = phases.now()
        attacker = threading.Thread(target=_recording(_attack, report), args=(clients[2], bodies, phases, report),
                                    daemon=True)  # fmt: skip
        attacker.start()
        time.sleep(phase_s)
        phases.name = "after"
        attacker.join()
        report.attack_window = (round(started, 3), round(phases.now(), 3))
    finally:
        phases.stop.set()
        for worker in workers:
            worker.join(timeout=30)
        for client in clients:
            client.close()
    return report


def format_stall(report: StallReport) -> str:
    summary = report.summary()
    pace = f"one every {report.attack_interval_s:g} s" if report.attack_interval_s else "back to back"
    lines = [f"{report.phase_s:.0f} s quiet, then {report.phase_s:.0f} s of refused multi-MiB bodies ({pace}), "
             f"against {report.base_url}"]  # fmt: skip
    for what, key in (("/health latency", "health_ms"), ("gaps between stream events", "stream_gap_ms")):
        for phase in ("quiet", "attack"):
            s = summary[key].get(phase, {})
            lines.append(f"  {what:<27} {phase:<6} n {s.get('n', 0):>5}  p50 {s.get('p50')} ms  p99 {s.get('p99')} "
                         f"ms  max {s.get('max')} ms")  # fmt: skip
    for name, attack in summary["attacks"].items():
        refusal = attack["refusal_s"]
        lines.append(f"  attack: {name:<22} {attack['count']} sent, statuses {attack['statuses']}, each refused in "
                     f"{refusal['p50']} s (max {refusal['max']})")  # fmt: skip
    lines += [f"  ERROR {error}" for error in report.errors]
    return "\n".join(lines)


def write_stall(report: StallReport, json_path: Path, png_path: Path) -> None:
    write_json(json_path, report.to_dict())
    with figure(png_path, figsize=(8, 4)) as (_, ax):
        for label, series in (("/health latency", report.health), ("gap between stream events", report.gaps)):
            points = sorted(p for phase_points in series.values() for p in phase_points)
            ax.plot([t for t, _ in points], [v for _, v in points], ".", markersize=2, label=label)
        ax.axvspan(*report.attack_window, color="red", alpha=0.1, label="refused multi-MiB bodies")
        ax.set_yscale("log")
        ax.set_xlabel("seconds")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.set_title("Does a hostile request stall everyone else?", fontsize=10)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    stall = benchmarks.add_parser(
        "stall", help="/health and a stream's pace while multi-MiB hostile bodies are refused",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )  # fmt: skip
    stall.add_argument("model", nargs="?", default="smollm2-135m")
    stall.add_argument("--phase-seconds", type=float, default=20.0, help="length of each phase (default 20)")
    stall.add_argument("--attack-interval", type=float, default=ATTACK_INTERVAL_S, help="seconds from one hostile "
                       f"request's start to the next's; 0: back to back (default {ATTACK_INTERVAL_S})")  # fmt: skip
    stall.add_argument("--base-url", default=None, help="measure this running server instead of starting one")
    stall.add_argument("--served-model", default=None, help="the model name the --base-url server serves")
    add_output_dir(stall)
    EngineArgs.add_cli_args(stall)
    stall.set_defaults(bench_run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.phase_seconds <= 0 or args.attack_interval < 0:
        raise ValueError("--phase-seconds must be positive and --attack-interval at least 0")
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    served = args.served_model or args.model if args.base_url is not None else args.model
    report, report.server = against_server(
        args.model, EngineArgs.from_cli_args(args).to_cli_flags(), args.base_url,
        lambda url: run_stall(url, served, args.phase_seconds, args.attack_interval),
    )  # fmt: skip
    report.command, report.date_utc = command_line(args), date
    print(format_stall(report))
    json_path, png_path = result_paths(Path(args.output_dir), "stall", args.model, date, f"{args.phase_seconds:g}s")
    write_stall(report, json_path, png_path)
    print(f"wrote {json_path}\nwrote {png_path}")
    return 0 if not report.errors and all(400 <= a["status"] < 500 for a in report.attacks) else 1
