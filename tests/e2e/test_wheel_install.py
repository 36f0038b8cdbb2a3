"""A wheel built from the repository, installed (not editable) into a fresh virtual environment, carries
every kernel source and the built web pages, and runs the compiled fast paths.

The fresh environment sees the project environment's packages through a .pth line (a plain path,
so the editable install's own .pth there is not processed), and pip installs only the wheel into it.
It shares this session's FOLIO_HOME, so it finds the kernels already built by content and compiles
nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from folio import __version__
from folio.loaders.catalog import folio_home

REPO = Path(__file__).resolve().parents[2]
# Loads every kernel and says which folio it is; run by the checkout, then by the installed wheel.
CHECK = """\
import sys
from pathlib import Path

import folio
from folio import ops

loaders = list(ops.KERNELS)
sources = list(Path(folio.__file__).parent.rglob("csrc/*.cpp"))
assert len(loaders) == len(sources), f"{len(sources)} kernel sources: add the new one's loader to this list"
missing = [name for name in loaders if ops.load(name) is None]
assert not missing, f"kernels on the slow path: {missing}"
print(Path(folio.__file__).resolve())
"""


def _run(command: list[str | Path], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["FOLIO_HOME"] = str(folio_home())
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _kernel_files(names: list[str]) -> set[str]:
    return {name for name in names if name.endswith((".cpp", ".h"))}


def test_the_wheel_carries_every_kernel_and_installs_with_the_fast_paths(tmp_path):
    # The kernels built (once) by the checkout, so the installed copy must find them by content.
    _run([sys.executable, "-c", CHECK], cwd=tmp_path)

    # Build from a copy, so setuptools' build/ and egg-info never land in the checkout.
    source = tmp_path / "source"
    shutil.copytree(REPO / "folio", source / "folio", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", source, "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist"], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("folio-*.whl")
    expected = _kernel_files([p.relative_to(REPO).as_posix() for p in (REPO / "folio").rglob("*")])
    assert len(expected) >= 7  # six kernels and int8_dot's header
    names = zipfile.ZipFile(wheel).namelist()
    assert _kernel_files(names) == expected
    assert not [name for name in names if name.startswith(("folio_tools", "folio/bench"))]  # the runtime alone
    pages = {p.relative_to(REPO).as_posix() for p in (REPO / "folio" / "server" / "ui" / "static").iterdir()}
    assert {"folio/server/ui/static/index.html", "folio/server/ui/static/playground.js"} <= pages
    assert {name for name in names if name.startswith("folio/server/ui/static/")} == pages  # the built web pages

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path).stdout.strip())
    (site / "project_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], tmp_path)

    installed = _run([python, "-c", CHECK], cwd=tmp_path)
    assert Path(installed.stdout.strip()).is_relative_to(site)  # the wheel's copy, not the checkout
    assert "compiling" not in installed.stderr  # the same sources: the checkout's builds are shared
    version = _run([venv / "bin" / "folio", "--version"], cwd=tmp_path)
    assert version.stdout.strip() == f"folio {__version__}"
    # The tools are not in this environment (the project's editable folio_tools is not importable from
    # it): their commands say how to get them, in one line.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    bench = subprocess.run([venv / "bin" / "folio", "bench", "decode", "m"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bench.returncode == 1 and bench.stderr.count("\n") == 1, bench.stderr
    assert "one of folio's tools" in bench.stderr and "pip install -e ./tools" in bench.stderr
