// The dashboard: polls /metrics once a second, keeps the last 5½ minutes of scrapes, and turns them into
// the figures a Prometheus + Grafana setup would show (rates, windowed ratios, histogram quantiles).
// Rates and quantiles are computed per model and then summed or merged, as sum(rate(...)) would be, so
// "All models" is not thrown off by one model's counters appearing or resetting.

import "./style.css";
import "./dashboard.css";
import "uplot/dist/uPlot.min.css";
import uPlot from "uplot";
import { getText } from "./api";
import { logOutButton, withLogin } from "./login";
import { Bucket, histogramQuantile, parsePrometheus } from "./prometheus";

const POLL_MS = 1000;
const RATE_S = 5; // throughput is averaged over this many seconds to smooth out step-sized bursts
const WINDOW_S = 30; // quantiles and ratios: enough requests to mean something, recent enough to react
const CHART_S = 300;
const KEEP_S = CHART_S + WINDOW_S + 5; // the oldest charted point still needs a full window behind it

interface Reading {
  values: Map<string, number>; // counters and gauges by sample name (+ "|reason" for request_success)
  buckets: Map<string, Bucket[]>; // histogram family -> its cumulative buckets
}
interface Snapshot {
  t: number; // seconds since the epoch, as uPlot's time axis wants
  models: Map<string, Reading>;
}
type Figure = "outTps" | "promptTps" | "running" | "waiting" | "kv" | "ttft50" | "ttft95" | "itl50" | "itl95"
  | "preemptions" | "prefixHit" | "specAccept" | "aborts" | "requests";
type Point = { t: number } & Record<Figure, number | null>;

const SUCCESS = "folio:request_success_total";

function snapshot(text: string, t: number): Snapshot {
  const models = new Map<string, Reading>();
  for (const { name, labels, value } of parsePrometheus(text)) {
    const model = labels.model_name;
    if (!name.startsWith("folio:") || model === undefined) continue;
    let reading = models.get(model);
    if (!reading) models.set(model, (reading = { values: new Map(), buckets: new Map() }));
    if (name.endsWith("_bucket") && labels.le !== undefined) {
      const family = name.slice(0, -"_bucket".length);
      const buckets = reading.buckets.get(family) ?? [];
      buckets.push({ le: labels.le === "+Inf" ? Infinity : Number(labels.le), count: value });
      reading.buckets.set(family, buckets);
      continue;
    }
    // Summed over any other labels (finished_reason, draft position): the family's total.
    reading.values.set(name, (reading.values.get(name) ?? 0) + value);
    if (labels.finished_reason !== undefined) reading.values.set(`${name}|${labels.finished_reason}`, value);
  }
  return { t, models };
}

const select = document.getElementById("dash-model") as HTMLSelectElement;
let snapshots: Snapshot[] = [];
let points: Point[] = [];

function chosen(s: Snapshot): string[] {
  return select.value === "" ? [...s.models.keys()] : [select.value];
}

function sum(parts: (number | undefined)[]): number | null {
  const present = parts.filter((part): part is number => part !== undefined);
  return present.length ? present.reduce((a, b) => a + b, 0) : null;
}

/** A gauge's (or a counter's running total) current value over the chosen models. */
function current(s: Snapshot, key: string): number | null {
  return sum(chosen(s).map((model) => s.models.get(model)?.values.get(key)));
}

/** A ratio gauge over the chosen models: their sum would not be a ratio, so the mean of their caches. */
function mean(s: Snapshot, key: string): number | null {
  const parts = chosen(s).map((model) => s.models.get(model)?.values.get(key)).filter((v) => v !== undefined);
  return parts.length ? parts.reduce((a, b) => a + b, 0) / parts.length : null;
}

/** A counter's increase from `a` to `b`; a fall means the counter restarted, so count from zero. */
function increase(a: Snapshot, b: Snapshot, key: string): number | null {
  return sum(
    chosen(b).map((model) => {
      const before = a.models.get(model)?.values.get(key);
      const after = b.models.get(model)?.values.get(key);
      if (before === undefined || after === undefined) return undefined;
      return after >= before ? after - before : after;
    }),
  );
}

function total(buckets: Bucket[]): number {
  return buckets.find((bucket) => bucket.le === Infinity)?.count ?? 0;
}

/** Each bucket's increase from `a` to `b`, merged over the chosen models (they share bucket bounds). */
function bucketIncrease(a: Snapshot, b: Snapshot, family: string): Bucket[] {
  const merged = new Map<number, number>();
  for (const model of chosen(b)) {
    const before = a.models.get(model)?.buckets.get(family);
    const after = b.models.get(model)?.buckets.get(family);
    if (!before || !after) continue;
    const restarted = total(after) < total(before);
    const old = new Map(before.map((bucket) => [bucket.le, bucket.count]));
    for (const { le, count } of after) {
      const delta = restarted ? count : count - (old.get(le) ?? 0);
      merged.set(le, (merged.get(le) ?? 0) + delta);
    }
  }
  return [...merged].map(([le, count]) => ({ le, count }));
}

/** The latest snapshot at least `seconds` before snapshot `i`, else the oldest there is (a shorter
 * window beats none while the page has just opened); null for the very first one. */
function behind(i: number, seconds: number): Snapshot | null {
  if (i === 0) return null;
  const cutoff = snapshots[i].t - seconds;
  for (let j = i - 1; j >= 0; j--) if (snapshots[j].t <= cutoff) return snapshots[j];
  return snapshots[0];
}

function ratio(numerator: number | null, denominator: number | null): number | null {
  return numerator !== null && denominator ? numerator / denominator : null;
}

function pointAt(i: number): Point {
  const b = snapshots[i];
  const r = behind(i, RATE_S);
  const w = behind(i, WINDOW_S);
  const rate = (key: string) => (r ? ratio(increase(r, b, key), b.t - r.t) : null);
  const inWindow = (key: string) => (w ? increase(w, b, key) : null);
  const quantile = (family: string, q: number) => (w ? histogramQuantile(q, bucketIncrease(w, b, family)) : null);
  // A model with no request finished yet has no request_success sample at all: that is zero, not unknown.
  const finished = (key: string) => current(b, key) ?? (chosen(b).some((m) => b.models.has(m)) ? 0 : null);
  return {
    t: b.t,
    outTps: rate("folio:generation_tokens_total"),
    promptTps: rate("folio:prompt_tokens_total"),
    running: current(b, "folio:num_requests_running"),
    waiting: current(b, "folio:num_requests_waiting"),
    kv: mean(b, "folio:kv_cache_usage_ratio"),
    ttft50: quantile("folio:time_to_first_token_seconds", 0.5),
    ttft95: quantile("folio:time_to_first_token_seconds", 0.95),
    itl50: quantile("folio:inter_token_latency_seconds", 0.5),
    itl95: quantile("folio:inter_token_latency_seconds", 0.95),
    preemptions: inWindow("folio:num_preemptions_total"),
    prefixHit: ratio(inWindow("folio:prefix_cache_hits_total"), inWindow("folio:prefix_cache_queries_total")),
    specAccept: ratio(
      inWindow("folio:spec_decode_num_accepted_tokens_total"),
      inWindow("folio:spec_decode_num_draft_tokens_total"),
    ),
    aborts: finished(`${SUCCESS}|abort`),
    requests: finished(SUCCESS),
  };
}

// ---- tiles

const count = (v: number) => Math.round(v).toLocaleString();
const perSecond = (v: number) => (v < 100 ? v.toFixed(1) : Math.round(v).toLocaleString());
const percent = (v: number) => `${(v * 100).toFixed(1)} %`;
const ms = (v: number) => (v < 0.01 ? `${(v * 1000).toFixed(2)} ms` : v < 1 ? `${(v * 1000).toFixed(1)} ms` : `${v.toFixed(2)} s`);

// data-value holds the figure in the metric's own unit: tokens/s, requests, a 0-1 ratio, seconds.
const TILES: [string, (p: Point) => number | null, (v: number) => string][] = [
  ["stat-output-tps", (p) => p.outTps, perSecond],
  ["stat-prompt-tps", (p) => p.promptTps, perSecond],
  ["stat-running", (p) => p.running, count],
  ["stat-waiting", (p) => p.waiting, count],
  ["stat-kv-usage", (p) => p.kv, percent],
  ["stat-ttft-p50", (p) => p.ttft50, ms],
  ["stat-ttft-p95", (p) => p.ttft95, ms],
  ["stat-itl-p50", (p) => p.itl50, ms],
  ["stat-itl-p95", (p) => p.itl95, ms],
  ["stat-preemptions", (p) => p.preemptions, count],
  ["stat-prefix-hit-rate", (p) => p.prefixHit, percent],
  ["stat-spec-acceptance", (p) => p.specAccept, percent],
  ["stat-aborts", (p) => p.aborts, count],
  ["stat-requests", (p) => p.requests, count],
];

function showTiles(point: Point | undefined): void {
  for (const [id, pick, format] of TILES) {
    const tile = document.getElementById(id)!;
    const value = point ? pick(point) : null;
    const known = value !== null && Number.isFinite(value);
    tile.dataset.value = known ? String(value) : "";
    tile.querySelector(".value")!.textContent = known ? format(value) : "—";
  }
}

// ---- charts

const toMs = (v: number | null) => (v === null ? null : v * 1000);
const toPct = (v: number | null) => (v === null ? null : v * 100);
type Line = [label: string, pick: (p: Point) => number | null, color: string];
type Scale = "percent" | "count" | "amount";
const CHARTS: [id: string, lines: Line[], scale: Scale][] = [
  ["chart-throughput", [["Output", (p) => p.outTps, "#2f6fdf"], ["Prompt", (p) => p.promptTps, "#16a34a"]], "amount"],
  ["chart-latency", [
    ["TTFT p50", (p) => toMs(p.ttft50), "#2f6fdf"], ["TTFT p95", (p) => toMs(p.ttft95), "#93b4f0"],
    ["ITL p50", (p) => toMs(p.itl50), "#c2410c"], ["ITL p95", (p) => toMs(p.itl95), "#f0a37a"],
  ], "amount"],
  ["chart-requests", [["Running", (p) => p.running, "#2f6fdf"], ["Waiting", (p) => p.waiting, "#c2410c"]], "count"],
  ["chart-cache", [
    ["KV usage", (p) => toPct(p.kv), "#2f6fdf"], ["Prefix hits", (p) => toPct(p.prefixHit), "#16a34a"],
    ["Spec acceptance", (p) => toPct(p.specAccept), "#a855f7"],
  ], "percent"],
];
const HEIGHT = 200;
const opened = Date.now() / 1000;
let now = Date.now() / 1000;

// One row of x labels ("1:54", ":30"): uPlot's default adds a date row that crowds a phone screen.
const pad = (n: number) => String(n).padStart(2, "0");
function timeLabels(_u: uPlot, splits: number[]): string[] {
  return splits.map((t) => {
    const d = new Date(t * 1000);
    return d.getSeconds() ? `:${pad(d.getSeconds())}` : `${d.getHours()}:${pad(d.getMinutes())}`;
  });
}

function makeChart(id: string, lines: Line[], scale: Scale): uPlot {
  const container = document.getElementById(id)!;
  const style = getComputedStyle(document.documentElement);
  const muted = style.getPropertyValue("--muted").trim() || "#6b7280";
  const grid = style.getPropertyValue("--line").trim() || "#e3e5e8";
  const axis = { stroke: muted, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
  const chart = new uPlot(
    {
      width: Math.max(200, container.clientWidth),
      height: HEIGHT,
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      scales: {
        // Slides even when a scrape fails; a page opened a moment ago shows its first minute, not a sliver.
        x: { time: true, range: () => [Math.max(now - CHART_S, Math.min(opened, now - 60)), now] },
        y: { range: (_u, _min, max) => [0, scale === "percent" ? 100 : max > 0 ? max * 1.1 : 1] },
      },
      axes: [
        { ...axis, values: timeLabels },
        // Requests come whole: no 0.25 ticks.
        { ...axis, size: 50, ...(scale === "count" ? { incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] } : {}) },
      ],
      series: [{}, ...lines.map(([label, , stroke]) => ({ label, stroke, width: 2, points: { show: false } }))],
    },
    [[], ...lines.map(() => [])],
    container,
  );
  let width = container.clientWidth;
  new ResizeObserver(() => {
    // Only the width follows the container; the height is fixed, so this cannot feed back on itself.
    if (container.clientWidth !== width && container.clientWidth > 0) {
      width = container.clientWidth;
      chart.setSize({ width, height: HEIGHT });
    }
  }).observe(container);
  return chart;
}

const charts = CHARTS.map(([id, lines, scale]) => ({ id, lines, chart: makeChart(id, lines, scale) }));

function drawCharts(): void {
  const shown = points.filter((p) => p.t >= now - CHART_S);
  for (const { id, lines, chart } of charts) {
    const ys = lines.map(([, pick]) => shown.map(pick));
    chart.setData([shown.map((p) => p.t), ...ys] as uPlot.AlignedData);
    const first = ys[0].filter((v): v is number => v !== null && Number.isFinite(v));
    const container = document.getElementById(id)!;
    container.dataset.points = String(shown.length);
    container.dataset.max = first.length ? String(Math.max(...first)) : "";
  }
}

// ---- polling

const status = document.getElementById("dash-status")!;
const clock = (t: number) => new Date(t * 1000).toLocaleTimeString();

function addModels(s: Snapshot): void {
  const known = new Set([...select.options].map((option) => option.value));
  for (const model of [...s.models.keys()].sort()) {
    if (!known.has(model)) select.add(new Option(model, model));
  }
}

function redraw(): void {
  showTiles(points[points.length - 1]);
  drawCharts();
}

select.onchange = () => {
  points = snapshots.map((_, i) => pointAt(i));
  redraw();
};

async function poll(): Promise<void> {
  now = Date.now() / 1000;
  try {
    // withLogin on every poll: a server restarted with another key brings the login form back.
    const text = await withLogin(() => getText("/metrics", AbortSignal.timeout(5 * POLL_MS)));
    now = Date.now() / 1000;
    const s = snapshot(text, now);
    snapshots.push(s);
    points.push(pointAt(snapshots.length - 1));
    const drop = snapshots.findIndex((old) => old.t >= now - KEEP_S);
    if (drop > 0) {
      snapshots = snapshots.slice(drop);
      points = points.slice(drop);
    }
    addModels(s);
    logOutButton(document.getElementById("logout") as HTMLButtonElement);
    const models = s.models.size;
    status.dataset.state = "ok";
    status.textContent = `Updated ${clock(now)}` + (models ? "" : " · no model is loaded yet");
    document.body.classList.remove("stale");
    redraw();
  } catch (error) {
    // Server gone, timed out, or not Prometheus: say so, keep the last figures (marked stale).
    status.dataset.state = "error";
    const message = error instanceof Error ? error.message : String(error);
    const last = snapshots.length ? `; last update ${clock(snapshots[snapshots.length - 1].t)}` : "";
    status.textContent = `Could not read /metrics at ${clock(now)}: ${message}${last}`;
    document.body.classList.add("stale");
    drawCharts();
  }
  setTimeout(poll, POLL_MS);
}

void poll();
