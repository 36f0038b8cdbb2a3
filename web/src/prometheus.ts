// Reading Prometheus's text exposition format (what /metrics serves) and the one piece of PromQL the
// dashboard needs, histogram_quantile, so the page can chart the server without a Prometheus of its own.

export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

/** One bucket of a cumulative histogram: how many observations were <= `le`. */
export interface Bucket {
  le: number;
  count: number;
}

function parseValue(text: string): number {
  // Go's and Python's spellings of the special values both appear in the wild.
  switch (text) {
    case "+Inf":
    case "Inf":
    case "+inf":
    case "inf":
      return Infinity;
    case "-Inf":
    case "-inf":
      return -Infinity;
    case "NaN":
    case "nan":
      return NaN;
    default:
      return Number(text);
  }
}

/** Parses `{a="x",b="y\"z"}` starting at `start` (the `{`); returns the labels and the index after `}`. */
function parseLabels(line: string, start: number): [Record<string, string>, number] {
  const labels: Record<string, string> = {};
  let i = start + 1;
  for (;;) {
    while (line[i] === " " || line[i] === ",") i++;
    if (i >= line.length) throw new Error("unterminated label set");
    if (line[i] === "}") return [labels, i + 1];
    const eq = line.indexOf("=", i);
    if (eq < 0 || line[eq + 1] !== '"') throw new Error("malformed label");
    const key = line.slice(i, eq).trim();
    let value = "";
    i = eq + 2;
    // Label values escape only backslash, double quote and newline.
    while (i < line.length && line[i] !== '"') {
      if (line[i] === "\\" && i + 1 < line.length) {
        const next = line[i + 1];
        value += next === "n" ? "\n" : next;
        i += 2;
      } else {
        value += line[i++];
      }
    }
    if (i >= line.length) throw new Error("unterminated label value");
    labels[key] = value;
    i++;
  }
}

/** Every sample of a text-format scrape. Comments (# HELP, # TYPE) are skipped, and so is any line that
 * does not parse, so one odd line cannot blank the whole dashboard. */
export function parsePrometheus(text: string): Sample[] {
  const samples: Sample[] = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (line === "" || line.startsWith("#")) continue;
    try {
      const brace = line.indexOf("{");
      const space = line.search(/\s/);
      let name: string;
      let labels: Record<string, string> = {};
      let rest: string;
      if (brace >= 0 && (space < 0 || brace < space)) {
        name = line.slice(0, brace);
        let end: number;
        [labels, end] = parseLabels(line, brace);
        rest = line.slice(end);
      } else {
        if (space < 0) continue;
        name = line.slice(0, space);
        rest = line.slice(space);
      }
      const [value] = rest.trim().split(/\s+/); // a trailing timestamp, if any, is not needed
      if (value === undefined || value === "") continue;
      samples.push({ name, labels, value: parseValue(value) });
    } catch {
      continue;
    }
  }
  return samples;
}

/** The q-quantile (0..1) of the observations counted by cumulative `buckets` (typically the increase
 * of each bucket over a window), as PromQL's histogram_quantile computes it: find the bucket holding the
 * rank q*total and interpolate linearly inside it, the first bucket starting at 0. A rank in the +Inf
 * bucket gives the largest finite bound. Null when there were no observations or no +Inf bucket. */
export function histogramQuantile(q: number, buckets: Bucket[]): number | null {
  if (!(q >= 0 && q <= 1)) return null;
  const sorted = [...buckets].sort((a, b) => a.le - b.le);
  if (sorted.length < 2 || sorted[sorted.length - 1].le !== Infinity) return null;
  // Counts must not fall as `le` rises; deltas across a counter reset can break that, so flatten it
  // as Prometheus does rather than interpolate backwards.
  let floor = 0;
  const counts = sorted.map((bucket) => (floor = Math.max(floor, bucket.count)));
  const total = counts[counts.length - 1];
  if (!(total > 0)) return null;
  const rank = q * total;
  let index = counts.findIndex((count) => count >= rank);
  if (index < 0) index = counts.length - 1;
  if (index === sorted.length - 1) return sorted[sorted.length - 2].le;
  const upper = sorted[index].le;
  if (index === 0 && upper <= 0) return upper;
  const lower = index === 0 ? 0 : sorted[index - 1].le;
  const below = index === 0 ? 0 : counts[index - 1];
  const inBucket = counts[index] - below;
  if (inBucket <= 0) return upper;
  return lower + (upper - lower) * ((rank - below) / inBucket);
}
