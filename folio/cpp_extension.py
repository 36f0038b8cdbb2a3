"""Builds folio's C++ CPU kernels on first use, once per machine, and shares each build between every
checkout and install of the same code.

A build is keyed by what decides its binary: the source and the headers beside it, the flags, torch's
version, the Python ABI and the CPU (kernels are compiled with -march=native, so one must never run on
another CPU). The source's path is not in the key. Under $FOLIO_HOME/kernels/v2:

    <name>-<key16>/        a finished build: the .so and the sources it came from
    <name>-<key16>.lock    flock'ed by the one process building it; the OS releases it if that process dies
    <name>-<key16>.tmp-*   a build in progress, renamed onto the finished name once whole

so a finished folder always holds a whole .so, and a killed build leaves only a temp folder that the
next build removes. Each import of a build touches its folder; when a kernel is built anew, its other
builds that no process has imported for UNUSED_BUILD_SECONDS (older sources, torch or Python versions)
are removed, so the cache does not grow with every change. Folders of the previous layout
(kernels/<name>-<key16>/ with torch's build.ninja) sit outside v2 and are left to the older versions
that use them.

A finished build is imported directly, without torch's build machinery. A kernel that cannot be built
is None, reported once per process with the slower path its caller takes instead.

Importing a build runs its code, so only this user's files are trusted: kernels/, kernels/v2/, the build
folder and its .so must belong to this user and be writable by no one else (folio makes them so whatever
the umask). A build that fails this is not imported but built anew in its place; a cache folder that fails
it holds nothing that can be trusted, not even a new build, so the kernel is not used at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import itertools
import logging
import os
import platform
import re
import shutil
import stat
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from tqdm import tqdm

from folio.paths import folio_home

logger = logging.getLogger("folio")

# Tuples, passed to torch as copies: its loader appends to the lists it is given (-lc10, ...), which
# would change every later key in the process.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
LDFLAGS = ("-fopenmp",)
LAYOUT = "v2"
# A temp folder of another build of the same kernel (other sources) is left alone while it may still
# be in progress; a real build takes under a minute.
STALE_BUILD_SECONDS = 3600
UNUSED_BUILD_SECONDS = 30 * 24 * 3600
# /proc/cpuinfo fields that decide what -march=native emits (x86: model name, flags; ARM: the rest).
_CPU_FIELDS = {"model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part"}

# A compiler's or a shell's message, not ninja's echo of a command (whose paths may hold any word).
_CAUSE = re.compile(r"\berror: |: not found$|: no such file or directory$|: permission denied$", re.IGNORECASE)
_failed: set[str] = set()  # kernels already reported as unavailable in this process
_refused: set[Path] = set()  # builds already reported as not safe to import in this process
FOLDER_MODE = 0o755  # the umask can only take bits away: never writable by group or others


class UntrustedCache(Exception):
    """A kernel cache folder that someone else could write to: no build in it may be imported."""


def cpu_features() -> str:
    """The CPU's model and feature flags (on Linux its first processor's /proc/cpuinfo fields)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            first = list(itertools.takewhile(str.strip, cpuinfo))  # up to the first blank line
    except OSError:  # not Linux
        return platform.processor()
    fields = (line.partition(":") for line in first)
    wanted = [f"{key.strip()}: {value.strip()}" for key, _, value in fields if key.strip() in _CPU_FIELDS]
    return "\n".join(wanted) or platform.processor()


def compiler() -> str | None:
    """The C++ compiler torch's loader would run ($CXX, else c++), or None if there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _inputs(source: Path) -> list[Path]:
    """The source and every header beside it (what it may include)."""
    return [source, *sorted(source.parent.glob("*.h"))]


def kernel_key(module_name: str, source: Path) -> str:
    """sha256 of everything that decides the binary, and nothing else (not the source's path)."""
    digest = hashlib.sha256()
    for file in _inputs(source):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    python_abi = (sys.implementation.cache_tag or "", sysconfig.get_config_var("EXT_SUFFIX") or "")
    machine = (platform.machine(), cpu_features())
    for part in (module_name, *CFLAGS, "|", *LDFLAGS, torch.__version__, *python_abi, *machine):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def kernel_directory(name: str, module_name: str, source: Path) -> Path:
    """Where the finished build of `source` lives (it may not exist yet)."""
    return folio_home() / "kernels" / LAYOUT / f"{name}-{kernel_key(module_name, source)[:16]}"


def load_extension(name: str, module_name: str, source: Path, what: str, fallback: str) -> ModuleType | None:
    """The compiled module of `source` (built if needed), or None if it cannot be built: logged once,
    naming `what` (the kernel, for people) and `fallback` (the slower path the caller takes instead)."""
    if name in _failed:
        return None
    try:
        directory = kernel_directory(name, module_name, source)
        return _import_built(directory) or _build_once(directory, name, module_name, source, what)
    except UntrustedCache as exc:
        _failed.add(name)
        logger.warning("not using the compiled %s: %s; %s", what, exc, fallback)
        return None
    except Exception as exc:  # no compiler, no ninja, a missing source or a build error
        _failed.add(name)
        logger.warning("could not build the %s (%s); %s", what, _reason(exc), fallback)
        return None


def untrusted_reason(st: os.stat_result, uid: int) -> str | None:
    """Why a file or folder with this stat is not safe to load code from for user `uid`, or None."""
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not to this user (uid {uid})"
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("anyone", stat.S_IWOTH)) if st.st_mode & bit]
    if writers:
        return f"{' and '.join(writers)} can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _check_cache_folders(cache: Path) -> None:
    """Raises UntrustedCache unless kernels/ and kernels/v2/ (`cache`), where they exist, are this user's alone."""
    for folder in (cache.parent, cache):
        try:
            reason = untrusted_reason(folder.stat(), os.getuid())
        except FileNotFoundError:
            continue  # made by _make_cache_folders, and checked again after
        if reason is not None:
            raise UntrustedCache(f"the kernel cache folder {folder} is not safe to load code from: {reason} "
                                 f"(chmod go-w it, or remove it)")  # fmt: skip


def _make_cache_folders(cache: Path) -> None:
    cache.parent.parent.mkdir(parents=True, exist_ok=True)  # FOLIO_HOME: models live there too
    for folder in (cache.parent, cache):
        folder.mkdir(mode=FOLDER_MODE, exist_ok=True)
    _check_cache_folders(cache)  # they may have been there already, made by someone else


def _import_built(directory: Path) -> ModuleType | None:
    """The finished build in `directory`, or None if there is none or it is not safe to import."""
    library = next(directory.glob("*.so"), None)
    if library is None:
        return None
    _check_cache_folders(directory.parent)
    for path in (directory, library):
        reason = untrusted_reason(path.stat(), os.getuid())
        if reason is not None:
            if library not in _refused:
                _refused.add(library)
                logger.warning("not importing %s, building it anew: %s is not safe to load code from: %s",
                               library, path, reason)  # fmt: skip
            return None
    # Named by its file: torch names a second build of one name in a process <name>_v1.
    spec = importlib.util.spec_from_file_location(library.stem, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.suppress(OSError):  # a read-only cache is still used, only never pruned
        os.utime(directory)  # its last use, for _prune_unused
    return module


def _build_once(directory: Path, name: str, module_name: str, source: Path, what: str) -> ModuleType:
    _make_cache_folders(directory.parent)
    with _exclusive(directory.with_name(directory.name + ".lock"), what):
        module = _import_built(directory)  # another process may have built it while this one waited
        if module is not None:
            return module
        if compiler() is None:
            raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'c++')} not found")
        why = _why(directory, name)
        _clear_leftovers(directory, name)  # with a build refused as unsafe
        _prune_unused(directory, name)
        logger.warning("compiling the %s (%s; about 30 s, once) in %s", what, why, directory.parent)
        started = time.monotonic()
        with _ticking(f"compiling the {what}"):
            module = _compile(directory, module_name, source)
        logger.info("compiled the %s in %.0f s", what, time.monotonic() - started)
        return module


@contextlib.contextmanager
def _ticking(doing: str) -> Iterator[None]:
    """On a terminal, a line that counts the seconds while the block runs (a compile prints nothing else)."""
    with tqdm(desc=doing, bar_format="{desc}: {elapsed}", disable=None, leave=False) as line:
        done = threading.Event()

        def tick() -> None:
            while not done.wait(1.0):
                line.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()


@contextlib.contextmanager
def _exclusive(path: Path, what: str) -> Iterator[None]:
    import fcntl  # POSIX only: elsewhere the build fails and is reported like any other

    with open(path, "a") as lock:  # never removed: another process may be waiting on this very file
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another folio process to finish compiling the %s", what)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, as the OS does when a process dies holding it


def _clear_leftovers(directory: Path, name: str) -> None:
    """What killed or failed builds left; called holding the lock."""
    shutil.rmtree(directory, ignore_errors=True)  # no .so in it (checked under the lock): not a build
    cutoff = time.time() - STALE_BUILD_SECONDS
    for staging in directory.parent.glob(f"{name}-*.tmp-*"):
        # This key's builder would hold the lock this process holds, so its temp folders are dead;
        # another key's (other sources) may still be building unless old.
        with contextlib.suppress(OSError):
            if staging.name.startswith(directory.name + ".") or staging.stat().st_mtime < cutoff:
                shutil.rmtree(staging, ignore_errors=True)


def _prune_unused(directory: Path, name: str) -> None:
    """This kernel's other finished builds that no process imported for UNUSED_BUILD_SECONDS, removed with
    their locks where no builder holds them; called holding this build's lock."""
    import fcntl  # POSIX only, as in _exclusive (which has run by now)

    build_name = re.compile(re.escape(name) + r"-[0-9a-f]{16}")
    cutoff = time.time() - UNUSED_BUILD_SECONDS
    for build in directory.parent.glob(f"{name}-*"):
        if build == directory or not build_name.fullmatch(build.name):
            continue
        with contextlib.suppress(OSError):
            if build.stat().st_mtime >= cutoff:
                continue
            shutil.rmtree(build)
            lock_path = build.with_name(build.name + ".lock")
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises (and keeps it) if a builder waits
                lock_path.unlink()


def _why(directory: Path, name: str) -> str:
    if any(directory.glob("*.so")):
        return "its build was not safe to import"
    if any(directory.parent.glob(f"{name}-*/*.so")):
        return "its source, the CPU, Python or torch changed since it was last built"
    return "first use on this machine"


def _compile(directory: Path, module_name: str, source: Path) -> ModuleType:
    """Builds in a fresh temp folder (torch writes the sources' absolute paths into its build.ninja, so
    a folder shared with another checkout would rebuild each time), then renames it into place."""
    from torch.utils.cpp_extension import load

    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=directory.name + ".tmp-"))
    try:
        for file in _inputs(source):
            shutil.copyfile(file, staging / file.name)
        with _ninja_on_path():
            module = load(
                name=module_name,
                sources=[str(staging / source.name)],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(staging),
                verbose=False,
            )
        library = Path(module.__file__)
        library.chmod(stat.S_IMODE(library.stat().st_mode) & ~0o022)  # the linker's mode follows the umask
        for file in staging.iterdir():  # objects, ninja's files, torch's lock: only the library is used
            if file.suffix not in (".so", ".cpp", ".h"):
                file.unlink()
        with open(library, "rb") as f:
            os.fsync(f.fileno())  # whole on disk before it is published
        os.rename(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    module.__file__ = str(directory / library.name)  # where it now lives
    if module.__spec__ is not None:
        module.__spec__.origin = module.__file__
    return module


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH, and a virtual environment that is not activated (pipx, or
    .venv/bin/folio) has the ninja dependency only in its own bin folder."""
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        os.environ["PATH"] = sysconfig.get_path("scripts") + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _reason(exc: Exception) -> str:
    """One line of a build failure: past torch's first line (ninja's command), the first that names a cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    causes = [line for line in lines[1:] if _CAUSE.search(line)]
    return (causes or lines or [type(exc).__name__])[0]
