"""Kernel builds (folio/cpp_extension.py, which folio/ops.py calls): built once per content key, shared
between checkouts, safe against concurrent and killed builds, and a failure reported once.

The build machinery is exercised with a tiny extension (Python.h only, about a second to compile)
instead of a real torch kernel (about 30 s). Builds go to a FOLIO_HOME under tmp_path; a slow compile
is a g++ wrapper (CXX, which torch's loader honours) that sleeps before each compile step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from folio import LLM, cpp_extension, ops
from folio.cpp_extension import kernel_directory, load_extension
from tests.tiny_models import make_tiny_model

TINY = """\
#include <Python.h>

#define FOLIO_CONCAT_(a, b) a##b
#define FOLIO_CONCAT(a, b) FOLIO_CONCAT_(a, b)

static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef definition = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
// torch's loader passes -DTORCH_EXTENSION_NAME=<module name> and imports PyInit_<module name>.
PyMODINIT_FUNC FOLIO_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&definition); }
"""
SLOW_GXX = """\
#!/bin/sh
case " $* " in *" -c "*) sleep "$FOLIO_TEST_COMPILE_SLEEP";; esac
exec g++ "$@"
"""
# One start of folio in a fresh process with no logging set up: warnings reach stderr through logging's
# last-resort handler, as they do for a program using folio's Python API.
LOAD = """\
import sys, time
from pathlib import Path
from folio.cpp_extension import load_extension
start = time.perf_counter()
module = load_extension(sys.argv[1], sys.argv[2], Path(sys.argv[3]), "test kernel", "the test's slow path")
elapsed = time.perf_counter() - start
machinery = "torch.utils.cpp_extension" in sys.modules, "torch._dynamo" in sys.modules
print(module.answer() if module else None, *machinery, elapsed)
"""
COMPILING = "compiling the test kernel"
FALLBACK = "the test's slow path"


def _compiles(lines: str) -> int:
    """Compile announcements among log lines (another process's wait names the kernel too)."""
    return sum(line.startswith(COMPILING) for line in lines.splitlines())


def _source(folder: Path, text: str = TINY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "tiny.cpp"
    source.write_text(text)
    return source


def _env(home: Path, compile_sleep: float | None = None) -> dict[str, str]:
    env = {**os.environ, "FOLIO_HOME": str(home)}
    if compile_sleep is not None:
        wrapper = home / "slow-g++"  # torch accepts a compiler whose path names g++
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        wrapper.write_text(SLOW_GXX)
        wrapper.chmod(0o755)
        env |= {"CXX": str(wrapper), "FOLIO_TEST_COMPILE_SLEEP": str(compile_sleep)}
    return env


def _start(name: str, source: Path, env: dict[str, str], **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-c", LOAD, name, f"folio_{name}", str(source)]
    return subprocess.Popen(command, env=env, text=True, **kwargs)


def _kill_session(session: int) -> None:
    """SIGKILL every process of a session (ninja starts each compile in a process group of its own)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            if int(fields[3]) == session:
                os.kill(int(stat.parent.name), signal.SIGKILL)


def _kernels(home: Path) -> Path:
    return home / "kernels" / cpp_extension.LAYOUT


def test_two_processes_building_at_once_both_get_the_kernel_compiled_once(tmp_path):
    home, source = tmp_path / "home", _source(tmp_path / "src")
    env = _env(home, compile_sleep=3)  # both reach the lock while the first compiles
    processes = [_start("tiny_race", source, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=180) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], results
    assert [out.split()[0] for out, _ in results] == ["42", "42"]
    assert sum(_compiles(err) for _, err in results) == 1, results
    built = sorted(p.name for p in _kernels(home).iterdir())
    assert len([b for b in built if b.startswith("tiny_race-") and b.endswith(".lock")]) == 1
    assert not [b for b in built if ".tmp-" in b]  # the one build was renamed into place


def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next_start(tmp_path, monkeypatch):
    home, source = tmp_path / "home", _source(tmp_path / "src")
    kernels = _kernels(home)
    monkeypatch.setenv("FOLIO_HOME", str(home))
    killed = _start("tiny_killed", source, _env(home, compile_sleep=120), start_new_session=True,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(kernels.glob("tiny_killed-*.tmp-*/build.ninja")):  # torch has taken its own lock
        assert killed.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    time.sleep(0.5)  # ninja is running the (sleeping) compiler
    killed.kill()  # folio dies holding the lock, with torch's own lock taken in the temp folder
    killed.wait()
    _kill_session(killed.pid)  # and its ninja and compiler, so none finishes the build behind the test's back
    left = list(kernels.glob("tiny_killed-*.tmp-*"))
    assert len(left) == 1 and (left[0] / "lock").exists()  # torch's lock, which used to block every start

    nxt = _start("tiny_killed", source, _env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = nxt.communicate(timeout=120)  # a start that waited on the dead build would time out here
    assert nxt.returncode == 0 and out.split()[0] == "42", (out, err)
    assert _compiles(err) == 1
    assert not list(kernels.glob("*.tmp-*"))  # the dead build's folder was cleared
    directory = kernel_directory("tiny_killed", "folio_tiny_killed", source)
    assert [p.name for p in directory.glob("*.so")] == ["folio_tiny_killed.so"]


def test_two_checkouts_share_one_build(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("FOLIO_HOME", str(home))
    first, second = _source(tmp_path / "checkout-a" / "csrc"), _source(tmp_path / "checkout-b" / "csrc")
    module = load_extension("tiny_shared", "folio_tiny_shared", first, "test kernel", FALLBACK)
    assert module is not None and module.answer() == 42
    directory = Path(module.__file__).parent
    # the same folder from the other path, and after a build (torch appends to the flag lists it is given)
    assert kernel_directory("tiny_shared", "folio_tiny_shared", second) == directory
    before = sorted(_kernels(home).iterdir())

    other = _start("tiny_shared", second, _env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = other.communicate(timeout=120)
    answer, build_machinery, compiler, _ = out.split()
    assert answer == "42" and _compiles(err) == 0, (out, err)
    assert build_machinery == "False"  # imported as is: no torch loader, no ninja
    assert compiler == "False"  # nor torch.compile's (~2 s of every start), which only --compile needs
    assert sorted(_kernels(home).iterdir()) == before


def test_a_new_build_removes_the_kernels_builds_unused_for_a_month(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("FOLIO_HOME", str(home))
    kernels, month = _kernels(home), cpp_extension.UNUSED_BUILD_SECONDS

    def build(text: str) -> Path:
        """In this process (each build is its own .so, imported under its own path): a process per build
        cost ~4 s of start each."""
        source = _source(tmp_path / f"src-{len(text)}", text)
        module = load_extension("tiny_prune", "folio_tiny_prune", source, "test kernel", FALLBACK)
        assert module is not None and module.answer() == 42
        return kernel_directory("tiny_prune", "folio_tiny_prune", source)

    old, recent = build(TINY), build(TINY + "// recent\n")
    another = kernels / "tiny_prune_other-0123456789abcdef"  # another kernel's build, as old
    another.mkdir()
    long_ago = time.time() - month - 3600
    for folder in (old, another):
        os.utime(folder, (long_ago, long_ago))
    os.utime(recent, (time.time() - month + 3600,) * 2)
    new = build(TINY + "// new\n")
    assert new.is_dir() and recent.is_dir() and another.is_dir()
    assert not old.exists() and not old.with_name(old.name + ".lock").exists()

    os.utime(recent, (long_ago, long_ago))
    build(TINY + "// recent\n")  # imported, not built: that use counts
    assert recent.stat().st_mtime > time.time() - 60
    build(TINY + "// newer\n")
    assert recent.is_dir()


def test_the_key_follows_the_cpu_and_the_headers_not_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))
    source = _source(tmp_path / "src")
    directory = kernel_directory("tiny", "folio_tiny", source)
    assert directory.parent == _kernels(tmp_path / "home")
    assert cpp_extension.cpu_features() and cpp_extension.cpu_features() == cpp_extension.cpu_features()

    moved = _source(tmp_path / "elsewhere")
    assert kernel_directory("tiny", "folio_tiny", moved) == directory
    with monkeypatch.context() as patch:
        patch.setattr(cpp_extension, "cpu_features", lambda: "model name: another CPU\nflags: sse2")
        on_other_cpu = kernel_directory("tiny", "folio_tiny", source)
    assert on_other_cpu != directory and on_other_cpu.parent == directory.parent
    (source.parent / "tiny.h").write_text("#define TINY 1\n")  # a header it may include
    assert kernel_directory("tiny", "folio_tiny", source) not in (directory, on_other_cpu)


@pytest.mark.parametrize("broken", ["compile error", "missing source"])
def test_a_kernel_that_cannot_be_built_is_none_and_reported_once(tmp_path, monkeypatch, caplog, broken):
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cpp_extension, "_failed", set())
    if broken == "compile error":
        source = _source(tmp_path / "src", TINY.replace("return PyLong_FromLong(42);", "return undeclared_name;"))
    else:
        source = tmp_path / "src" / "absent.cpp"
    with caplog.at_level(logging.WARNING, logger="folio"):
        first = load_extension("tiny_broken", "folio_tiny_broken", source, "test kernel", FALLBACK)
        second = load_extension("tiny_broken", "folio_tiny_broken", source, "test kernel", FALLBACK)
    assert first is None and second is None
    reports = [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]
    assert len(reports) == 1, caplog.text
    assert reports[0].startswith("could not build the test kernel")
    if broken == "compile error":
        assert "undeclared_name" in reports[0]  # the compiler's own error line
        assert _compiles("\n".join(r.getMessage() for r in caplog.records)) == 1  # the second did not retry
        left = [p.name for p in _kernels(tmp_path / "home").iterdir()]
        assert len(left) == 1 and left[0].endswith(".lock")  # no build folder, finished or temporary


def test_without_a_compiler_built_kernels_load_and_others_name_the_missing_compiler(tmp_path, monkeypatch, caplog):
    home, built = tmp_path / "home", _source(tmp_path / "built")
    monkeypatch.setenv("FOLIO_HOME", str(home))
    monkeypatch.setattr(cpp_extension, "_failed", set())
    assert ops.compiler_available()  # a C++ compiler is part of the project's setup
    assert load_extension("tiny_built", "folio_tiny_built", built, "test kernel", FALLBACK) is not None

    absent = str(tmp_path / "no-such-c++")
    monkeypatch.setenv("CXX", absent)
    assert not ops.compiler_available()
    process = _start("tiny_built", built, _env(home) | {"CXX": absent}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and out.split()[0] == "42", (out, err)  # built: imported, nothing compiled
    unbuilt = _source(tmp_path / "unbuilt", TINY.replace("42", "43"))
    caplog.clear()  # the first build's announcement
    with caplog.at_level(logging.WARNING, logger="folio"):
        assert load_extension("tiny_unbuilt", "folio_tiny_unbuilt", unbuilt, "test kernel", FALLBACK) is None
    reports = [r.getMessage() for r in caplog.records]
    assert reports == [f"could not build the test kernel (no C++ compiler: {absent} not found); {FALLBACK}"]


def test_every_real_kernel_builds_into_the_content_keyed_layout():
    loaders = list(ops.KERNELS)
    sources = list(Path(cpp_extension.__file__).parent.rglob("csrc/*.cpp"))
    assert len(loaders) == len(sources), "a new kernel source: add its loader here"
    modules = {name: ops.load(name) for name in loaders}
    assert None not in modules.values(), modules  # a C++ compiler is part of the project's setup
    for module in modules.values():  # (a loader may have run first under another test's FOLIO_HOME)
        assert Path(module.__file__).parts[-4:-2] == ("kernels", cpp_extension.LAYOUT), module.__file__


def test_a_model_loads_the_kernels_of_its_weights_when_it_starts(tmp_path, monkeypatch):
    """Built (or reported) at start-up, not at the first request that multiplies by them."""
    calls: list[int] = []
    real = ops.load

    def counting_load(name: ops.KernelName):
        if name == "nf4_linear":
            calls.append(1)
        return real(name)

    monkeypatch.setattr(ops, "load", counting_load)
    LLM(make_tiny_model("llama", tmp_path / "llama"), quantization="nf4", kv_cache_memory="8MiB")
    assert calls  # before any generation


def _run(name: str, source: Path, home: Path) -> tuple[str, str]:
    process = _start(name, source, _env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, (out, err)
    return out.split()[0], err


def test_a_build_others_could_write_is_never_imported(tmp_path, monkeypatch):
    home, source = tmp_path / "home", _source(tmp_path / "src")
    monkeypatch.setenv("FOLIO_HOME", str(home))
    assert _run("tiny_trust", source, home)[0] == "42"
    directory = kernel_directory("tiny_trust", "folio_tiny_trust", source)
    library = directory / "folio_tiny_trust.so"

    library.chmod(0o775)  # writable by the group (anyone in it could have put code there): built anew
    answer, err = _run("tiny_trust", source, home)
    assert answer == "42" and _compiles(err) == 1, err
    assert str(library) in err and "write" in err
    assert library.stat().st_mode & 0o022 == 0

    cache = directory.parent
    cache.chmod(0o777)  # the cache folder itself: nothing in it can be trusted, not even a new build
    answer, err = _run("tiny_trust", source, home)
    assert answer == "None" and FALLBACK in err and str(cache) in err and _compiles(err) == 0, err
    cache.chmod(0o755)  # the same build, now only this user's: imported as it is, not built again
    answer, err = _run("tiny_trust", source, home)
    assert answer == "42" and _compiles(err) == 0, err


def test_new_kernel_folders_and_builds_are_writable_only_by_their_user(tmp_path, monkeypatch):
    home, source = tmp_path / "home", _source(tmp_path / "src")
    monkeypatch.setenv("FOLIO_HOME", str(home))
    process = _start("tiny_umask", source, _env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     preexec_fn=lambda: os.umask(0o002))  # fmt: skip
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and out.split()[0] == "42", (out, err)
    directory = kernel_directory("tiny_umask", "folio_tiny_umask", source)
    for path in (home / "kernels", directory.parent, directory, directory / "folio_tiny_umask.so"):
        assert path.stat().st_mode & 0o022 == 0, (path, oct(path.stat().st_mode))
        assert path.stat().st_uid == os.getuid()


def test_only_this_users_unshared_files_are_trusted(tmp_path, monkeypatch):
    uid = os.getuid()

    def fake(mode: int, owner: int) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, owner, 0, 0, 0, 0, 0))

    assert cpp_extension.untrusted_reason(fake(0o100755, uid), uid) is None
    assert cpp_extension.untrusted_reason(fake(0o40700, uid), uid) is None
    assert "uid 4242" in cpp_extension.untrusted_reason(fake(0o100755, 4242), uid)
    assert "group" in cpp_extension.untrusted_reason(fake(0o40775, uid), uid)
    assert "anyone" in cpp_extension.untrusted_reason(fake(0o100757, uid), uid)
    if uid != 0:
        return  # only root can give a file to another user
    home, source = tmp_path / "home", _source(tmp_path / "src")
    monkeypatch.setenv("FOLIO_HOME", str(home))
    assert _run("tiny_owner", source, home)[0] == "42"
    library = next(kernel_directory("tiny_owner", "folio_tiny_owner", source).glob("*.so"))
    os.chown(library, 4242, -1)  # another user's file, though no one else can write it
    answer, err = _run("tiny_owner", source, home)
    assert answer == "42" and _compiles(err) == 1 and "uid 4242" in err, err
    assert library.stat().st_uid == uid
