// Builds the pages into folio/server/ui/static (or the folder given as the first argument): one
// minified script and stylesheet per page plus its HTML, and build.json, the SHA-256 of every source
// file and of every output, which the test suite checks so the committed build cannot drift from its
// source. Run with `npm ci && npm run build`.

import { createHash } from "node:crypto";
import { copyFileSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import * as esbuild from "esbuild";

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2] ?? join(here, "..", "folio", "server", "ui", "static");
const PAGES = ["playground", "dashboard"];
const HTML = ["index.html", "dashboard.html"];

function sha256(path) {
  return createHash("sha256").update(readFileSync(path)).digest("hex");
}

function sourceFiles(folder) {
  return readdirSync(folder)
    .filter((name) => name !== "node_modules" && !name.startsWith("."))
    .flatMap((name) => {
      const path = join(folder, name);
      return statSync(path).isDirectory() ? sourceFiles(path) : [path];
    });
}

rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await esbuild.build({
  entryPoints: Object.fromEntries(PAGES.map((page) => [page, join(here, "src", `${page}.ts`)])),
  bundle: true,
  minify: true,
  format: "iife",
  target: "es2022",
  legalComments: "eof",
  outdir: out,
  logLevel: "warning",
});
for (const page of HTML) copyFileSync(join(here, page), join(out, page));

const sources = Object.fromEntries(
  sourceFiles(here)
    .map((path) => relative(here, path).split("\\").join("/"))
    .sort()
    .map((name) => [name, sha256(join(here, name))]),
);
const outputs = Object.fromEntries(
  readdirSync(out)
    .sort()
    .map((name) => [name, sha256(join(out, name))]),
);
writeFileSync(join(out, "build.json"), JSON.stringify({ sources, outputs }, null, 1) + "\n");
