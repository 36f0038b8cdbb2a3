"""The web pages ship as built files (folio/server/ui/static) so that installing folio needs no Node; their
source and lockfile live in web/. build.json, written by the build, holds the SHA-256 of every source file
and output: the committed build must match the source it claims, and rebuilding from the lockfile must
give the same bytes (where npm is on PATH: it fetches the locked packages from the npm registry)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WEB = REPO / "web"
STATIC = REPO / "folio" / "server" / "ui" / "static"
BUILD = json.loads((STATIC / "build.json").read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sources() -> dict[str, str]:
    files = [p for p in WEB.rglob("*") if p.is_file() and "node_modules" not in p.relative_to(WEB).parts]
    return {p.relative_to(WEB).as_posix(): _sha256(p) for p in files if not p.name.startswith(".")}


def test_the_committed_build_is_the_build_of_the_committed_source():
    stale = sorted(name for name in _sources().keys() | BUILD["sources"].keys()
                   if _sources().get(name) != BUILD["sources"].get(name))  # fmt: skip
    assert not stale, f"web/ changed since the pages were built: run `npm ci && npm run build` in web/ ({stale})"
    built = {p.name: _sha256(p) for p in STATIC.iterdir() if p.name != "build.json"}
    assert built == BUILD["outputs"]
    assert {"index.html", "dashboard.html", "playground.js", "dashboard.js"} <= built.keys()


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed: the rebuild needs Node")
def test_building_from_the_lockfile_gives_the_same_bytes(tmp_path):
    source = tmp_path / "web"
    shutil.copytree(WEB, source, ignore=shutil.ignore_patterns("node_modules"))
    for command in (["npm", "ci", "--no-audit", "--no-fund"], ["npm", "run", "build", "--", str(tmp_path / "out")]):
        done = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr  # the type check (tsc) runs in `build`
    rebuilt = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert rebuilt == {p.name: p.read_bytes() for p in STATIC.iterdir()}
