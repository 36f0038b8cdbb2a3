"""Build llama.cpp's `llama-server`, `llama-bench` and `llama-batched-bench` from source, once, for the
llama.cpp benchmark peer.

The llama-cpp-python sdist on PyPI vendors llama.cpp under vendor/llama.cpp, so a package registry is
all the build needs. We compile only those tools, statically linked and tuned for this CPU
(GGML_NATIVE), into `folio_home()/peers/llama.cpp/<version>/bin`; the folder appears in one rename once
the build is complete, so its existence means the binaries are usable (ggml's AMX kernels are left out:
they fault on the AMX Xeons of our VMs). Because of GGML_NATIVE the cache
belongs to this machine: do not copy it to another CPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from folio.loaders.catalog import folio_home

PACKAGE = "llama-cpp-python"
SERVER, BENCH, BATCHED_BENCH = "llama-server", "llama-bench", "llama-batched-bench"
TOOLS = (SERVER, BENCH, BATCHED_BENCH)
BUILD_INFO = "build.json"
NO_AMX = "-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
_VERSION_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+!_-]*$")  # a PEP 440 version; also safe as a folder name


@dataclass(frozen=True)
class LlamaCppBinaries:
    server: Path
    bench: Path
    version: str  # of llama-cpp-python, whose sdist pins the llama.cpp commit
    commit: str = "unknown"  # llama.cpp commit, from the sdist's changelog

    @property
    def batched_bench(self) -> Path:
        return self.bench.parent / BATCHED_BENCH


class LlamaCppBuildError(RuntimeError):
    pass


def peers_root(home: Path | None = None) -> Path:
    return (home or folio_home()) / "peers" / "llama.cpp"


def install_dir(version: str, home: Path | None = None) -> Path:
    if not _VERSION_RE.match(version):
        raise ValueError(f"not a version: {version!r}")
    return peers_root(home) / version


def installed(version: str, home: Path | None = None) -> LlamaCppBinaries | None:
    """The binaries of `version` if a complete build of it is installed, else None."""
    folder = install_dir(version, home)
    if not all(os.access(folder / "bin" / tool, os.X_OK) for tool in TOOLS):
        return None
    server, bench = folder / "bin" / SERVER, folder / "bin" / BENCH
    try:
        commit = str(json.loads((folder / BUILD_INFO).read_text(encoding="utf-8")).get("llama_cpp_commit", "unknown"))
    except (OSError, ValueError):
        commit = "unknown"
    return LlamaCppBinaries(server=server, bench=bench, version=version, commit=commit)


def _version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    # Numeric parts compare as numbers (0.3.10 > 0.3.9); text parts sort below any number.
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in re.split(r"[.+!_-]", version))


def installed_versions(home: Path | None = None) -> list[str]:
    """Complete installs, oldest first (build folders start with '.', so they never count)."""
    root = peers_root(home)
    names = [p.name for p in root.iterdir() if _VERSION_RE.match(p.name)] if root.is_dir() else []
    return sorted((v for v in names if installed(v, home)), key=_version_key)


def sdist_version(filename: str) -> str:
    """'llama_cpp_python-0.3.36.tar.gz' -> '0.3.36'."""
    match = re.fullmatch(r"llama[_.-]cpp[_.-]python-(.+)\.tar\.gz", filename, flags=re.IGNORECASE)
    if not match:
        raise LlamaCppBuildError(f"unexpected sdist name {filename!r}")
    return match.group(1)


def changelog_commit(changelog: str, version: str) -> str:
    """The llama.cpp commit a llama-cpp-python release vendors, as its CHANGELOG states it. The sdist has
    no .git, so llama.cpp's own build info would otherwise say 'unknown'."""
    section = re.search(rf"^## \[{re.escape(version)}\]\s*$(.*?)(?=^## \[|\Z)", changelog, flags=re.M | re.S)
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return found.group(1) if found else "unknown"


def cmake_configure_args(source: Path, build: Path, *, commit: str, shared: bool = False) -> list[str]:
    args = [
        f"-S{source}",
        f"-B{build}",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",  # ignored by recent llama.cpp; older ones default it ON and then need libcurl-dev
        "-DLLAMA_OPENSSL=OFF",  # the server only listens on plain HTTP here
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # otherwise the build downloads the web UI from Hugging Face
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DCMAKE_BUILD_RPATH=$ORIGIN",  # a shared build finds its .so files next to the binaries once moved
        # ggml's AMX kernels (compiled where -march=native has AMX) fault with SIGILL on the AMX Xeons this runs
        # on in VMs; their code is behind these macros, so the rest stays native.
        f"-DCMAKE_C_FLAGS={NO_AMX}",
        f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    ]
    if commit != "unknown":
        args.append(f"-DLLAMA_BUILD_COMMIT={commit}")  # shows up in --version and the server's log
    return args


def find_cmake() -> str:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise LlamaCppBuildError(
            "building llama.cpp needs cmake (and a C++ compiler): `apt-get install cmake` or `pip install cmake`"
        )
    return cmake


def _say(message: str) -> None:
    print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


def _run(cmd: Sequence[str], log: Path, *, progress: bool = False) -> None:
    """Run `cmd` with its output going to `log`; on failure raise with the log's tail. With `progress`,
    echo make's percentage every 10 points so a long build visibly moves."""
    shown = -10
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            match = re.match(r"\[\s*(\d+)%\]", line)
            if progress and match and int(match.group(1)) >= shown + 10:
                shown = int(match.group(1))
                _say(f"  {shown:3d}%  {line[match.end() :].strip()[:100]}")
        if proc.wait() != 0:
            out.flush()
            tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-30:])
            raise LlamaCppBuildError(f"`{' '.join(cmd[:3])} ...` failed (exit {proc.returncode}); log {log}:\n{tail}")


def _download_sdist(version: str | None, dest: Path, log: Path) -> Path:
    spec = PACKAGE if version is None else f"{PACKAGE}=={version}"
    _say(f"downloading the {spec} source distribution from PyPI")
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--dest", str(dest), spec]
    _run(cmd, log)
    sdists = sorted(dest.glob("*.tar.gz"))
    if len(sdists) != 1:
        raise LlamaCppBuildError(f"expected one sdist in {dest}, found {[p.name for p in sdists]}")
    return sdists[0]


def build_llama_cpp(home: Path | None = None, version: str | None = None) -> LlamaCppBinaries:
    """`llama-server`, `llama-bench` and `llama-batched-bench` of llama-cpp-python `version`, built on first
    use (again where an install of it lacks one of them).

    With no version, an installed build (the newest) is reused, else PyPI's latest release is built.
    """
    if version is None and (versions := installed_versions(home)):
        version = versions[-1]
    if version is not None and (found := installed(version, home)):
        return found
    cmake = find_cmake()
    root = peers_root(home)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # Everything happens inside one folder next to the install so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=".build-", dir=root) as tmp:
        work = Path(tmp)
        log = work / "build.log"
        sdist = _download_sdist(version, work / "sdist", log)
        version = sdist_version(sdist.name)
        if found := installed(version, home):  # "latest" turned out to be installed already
            return found
        _say(f"extracting {sdist.name}")
        with tarfile.open(sdist) as archive:
            archive.extractall(work / "src", filter="data")
        (package,) = (work / "src").iterdir()
        source = package / "vendor" / "llama.cpp"
        if not (source / "CMakeLists.txt").is_file():
            raise LlamaCppBuildError(f"{sdist.name} has no vendor/llama.cpp/CMakeLists.txt")
        changelog = package / "CHANGELOG.md"
        commit = changelog_commit(changelog.read_text(encoding="utf-8"), version) if changelog.is_file() else "unknown"
        _say(f"building llama.cpp {commit} (llama-cpp-python {version}); log: {log}")

        shared = False
        build = work / "build"
        try:
            _say("configuring (static)")
            _run([cmake, *cmake_configure_args(source, build, commit=commit, shared=False)], log)
        except LlamaCppBuildError:
            _say("static configure failed, retrying with shared libraries")
            shared = True
            shutil.rmtree(build, ignore_errors=True)
            _run([cmake, *cmake_configure_args(source, build, commit=commit, shared=True)], log)
        jobs = str(os.cpu_count() or 2)
        _say(f"compiling {', '.join(TOOLS)} with {jobs} jobs (several minutes)")
        _run([cmake, "--build", str(build), "--config", "Release", "--target", *TOOLS, "-j", jobs], log, progress=True)

        stage = work / "install"
        (stage / "bin").mkdir(parents=True)
        built = build / "bin"
        for name in TOOLS:
            shutil.copy2(built / name, stage / "bin" / name)
        for lib in built.glob("*.so*") if shared else ():
            shutil.copy2(lib, stage / "bin" / lib.name, follow_symlinks=False)
        seconds = time.perf_counter() - start
        info = {"version": version, "llama_cpp_commit": commit, "shared_libs": shared, "build_seconds": round(seconds)}
        (stage / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        shutil.copy2(log, stage / "build.log")
        target = install_dir(version, home)
        if target.exists() and not installed(version, home):  # an earlier install lacking a tool
            target.rename(work / "incomplete")
        try:
            stage.rename(target)
        except OSError:
            if not installed(version, home):  # not a concurrent build that finished first
                raise
    _say(f"done in {seconds / 60:.1f} min: {target / 'bin'}")
    found = installed(version, home)
    assert found is not None
    return found
