"""The llama.cpp peer's pure logic (llama_cpp_build, llama_cpp_server and the llama_cpp_peer CLI): install
layout, version and commit resolution, command lines, and the health wait's error path. Nothing here builds
llama.cpp or touches the network."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from folio_tools.bench.peers import llama_cpp as peer
from folio_tools.bench.peers import llama_cpp_build as build
from folio_tools.bench.peers import llama_cpp_server as server
from folio_tools.bench.peers.llama_cpp_build import LlamaCppBinaries, LlamaCppBuildError


def _fake_install(home: Path, version: str, commit: str | None = "0c1e57098", executable: bool = True,
                  tools: tuple[str, ...] = build.TOOLS) -> Path:  # fmt: skip
    folder = home / "peers" / "llama.cpp" / version
    (folder / "bin").mkdir(parents=True)
    for name in tools:
        (folder / "bin" / name).write_text("#!/bin/sh\n")
        (folder / "bin" / name).chmod(0o755 if executable else 0o644)
    if commit is not None:
        (folder / "build.json").write_text(json.dumps({"version": version, "llama_cpp_commit": commit}))
    return folder


def test_install_dir_lives_under_folio_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert build.install_dir("0.3.36", tmp_path) == tmp_path / "peers" / "llama.cpp" / "0.3.36"
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))
    assert build.install_dir("0.3.36") == tmp_path / "home" / "peers" / "llama.cpp" / "0.3.36"
    for bad in ("../evil", "", ".build-x", "a/b"):
        with pytest.raises(ValueError):
            build.install_dir(bad, tmp_path)


def test_installed_needs_every_executable(tmp_path: Path) -> None:
    assert build.installed("0.3.36", tmp_path) is None
    folder = _fake_install(tmp_path, "0.3.36")
    bin_dir = folder / "bin"
    found = build.installed("0.3.36", tmp_path)
    assert found == LlamaCppBinaries(
        server=bin_dir / "llama-server", bench=bin_dir / "llama-bench", version="0.3.36", commit="0c1e57098"
    )
    assert found.batched_bench == bin_dir / "llama-batched-bench"
    _fake_install(tmp_path, "0.3.35", tools=("llama-server", "llama-bench"))  # an install from before batched-bench
    assert build.installed("0.3.35", tmp_path) is None
    _fake_install(tmp_path, "0.3.1", commit=None)
    assert build.installed("0.3.1", tmp_path).commit == "unknown"  # type: ignore[union-attr]
    _fake_install(tmp_path, "0.3.2", executable=False)
    assert build.installed("0.3.2", tmp_path) is None


def test_installed_versions_sort_numerically_and_skip_partial_builds(tmp_path: Path) -> None:
    for version in ("0.3.9", "0.3.10", "0.2.90"):
        _fake_install(tmp_path, version)
    (tmp_path / "peers" / "llama.cpp" / ".build-abc123" / "install" / "bin").mkdir(parents=True)
    (tmp_path / "peers" / "llama.cpp" / "0.4.0").mkdir()  # a folder without binaries is not an install
    assert build.installed_versions(tmp_path) == ["0.2.90", "0.3.9", "0.3.10"]
    assert build.installed_versions(tmp_path / "nowhere") == []


def test_build_reuses_an_install_without_cmake_or_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not build or download")

    monkeypatch.setattr(build, "find_cmake", no_build)
    monkeypatch.setattr(build, "_download_sdist", no_build)
    _fake_install(tmp_path, "0.3.9")
    _fake_install(tmp_path, "0.3.10")
    assert build.build_llama_cpp(tmp_path).version == "0.3.10"  # newest installed
    assert build.build_llama_cpp(tmp_path, "0.3.9").version == "0.3.9"


def test_missing_cmake_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(LlamaCppBuildError, match=r"apt-get install cmake.*pip install cmake"):
        build.build_llama_cpp(tmp_path, "0.3.36")


def test_sdist_version_and_changelog_commit() -> None:
    assert build.sdist_version("llama_cpp_python-0.3.36.tar.gz") == "0.3.36"
    assert build.sdist_version("llama-cpp-python-0.2.90.tar.gz") == "0.2.90"
    with pytest.raises(LlamaCppBuildError):
        build.sdist_version("llama_cpp_python-0.3.36-py3-none-any.whl")
    changelog = (
        "# Changelog\n\n## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n"
        "## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n- fix(example): something\n"
        "## [0.3.3]\n\n- fix: no llama.cpp update here\n"
    )
    assert build.changelog_commit(changelog, "0.3.36") == "0c1e57098"
    assert build.changelog_commit(changelog, "0.3.35") == "4df29be4f"
    assert build.changelog_commit(changelog, "0.3.3") == "unknown"  # must not borrow a neighbour's commit
    assert build.changelog_commit(changelog, "9.9.9") == "unknown"


def test_cmake_configure_args() -> None:
    args = build.cmake_configure_args(Path("/src"), Path("/build"), commit="0c1e57098")
    assert args[:2] == ["-S/src", "-B/build"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"):
        assert flag in args
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in args  # no network at build time
    assert "-DLLAMA_BUILD_COMMIT=0c1e57098" in args
    # Native, but without ggml's AMX kernels (SIGILL on AMX Xeons in VMs): their code needs __AMX_INT8__.
    assert "-DCMAKE_CXX_FLAGS=-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__" in args
    shared = build.cmake_configure_args(Path("/src"), Path("/build"), commit="unknown", shared=True)
    assert "-DBUILD_SHARED_LIBS=ON" in shared
    assert not any(a.startswith("-DLLAMA_BUILD_COMMIT") for a in shared)


def test_server_command() -> None:
    binaries = LlamaCppBinaries(server=Path("/p/bin/llama-server"), bench=Path("/p/bin/llama-bench"), version="0.3.36")
    cmd = server.server_command(binaries, Path("/m/model.gguf"), 8081, ctx_size=8192, parallel=4, extra_args=["--foo"])
    assert cmd[0] == "/p/bin/llama-server"
    options = dict(zip(cmd[1:-2:2], cmd[2:-2:2], strict=True))
    assert options == {
        "--model": "/m/model.gguf",
        "--host": "127.0.0.1",
        "--port": "8081",
        "--ctx-size": "8192",
        "--parallel": "4",
        "--threads": "2",
        "--threads-batch": "2",
    }
    assert cmd[-2:] == ["--cont-batching", "--foo"]
    old = server.server_command(binaries, Path("m.gguf"), 1, ctx_size=512, parallel=1, cont_batching_flag=False)
    assert "--cont-batching" not in old
    for parallel, ctx_size in ((0, 512), (4, 2)):
        with pytest.raises(ValueError):
            server.server_command(binaries, Path("m.gguf"), 1, ctx_size=ctx_size, parallel=parallel)


def test_health_wait_reports_an_early_exit_with_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(["sh", "-c", "echo 'error: failed to load model'; exit 3"], stdout=out)
    process.wait()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*failed to load model"):
        server.wait_for_health(f"http://127.0.0.1:{server.free_port()}", process, timeout=5, log_path=log)


def test_serve_cli_passes_flags_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    binaries = LlamaCppBinaries(server=Path("s"), bench=Path("b"), version="0.3.36")
    monkeypatch.setattr(peer, "build_llama_cpp", lambda version=None: binaries)
    seen: dict[str, object] = {}

    class Done:  # a llama-server that has already exited
        def wait(self) -> int:
            return 0

        def poll(self) -> int:
            return 0

    def fake_start(b: LlamaCppBinaries, model_path: Path, port: int, **kwargs: object) -> Done:
        seen.update(binaries=b, model=model_path, port=port, **kwargs)
        return Done()

    monkeypatch.setattr(peer, "start_llama_server", fake_start)
    argv = ["serve", str(model), "--port", "9001", "--parallel", "3", "--threads", "1", "--", "--kv-unified"]
    before = peer.signal.getsignal(peer.signal.SIGTERM)
    assert peer.main(argv) == 0
    assert seen["model"] == model and seen["port"] == 9001
    assert seen["parallel"] == 3 and seen["ctx_size"] == 3 * 2048 and seen["threads"] == 1
    assert seen["extra_args"] == ["--kv-unified"]
    assert peer.signal.getsignal(peer.signal.SIGTERM) == before  # main put back the handler it replaced


def test_batched_bench_rates_by_parallel_sequences(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """folio bench decode's peer: llama-batched-bench's JSONL lines, its S_TG keyed by parallel sequences."""
    from folio_tools.bench import decode

    folder = _fake_install(tmp_path, "0.3.36")
    script = folder / "bin" / "llama-batched-bench"
    lines = [{"pl": 1, "speed_tg": 130.5}, {"pl": 16, "speed_tg": 250.0}, {"pl": 64, "speed_tg": 170.25}]
    body = "".join(f"echo '{json.dumps(line)}'\n" for line in lines)
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "args"}\necho "| a markdown line |"\n{body}')
    monkeypatch.setattr(decode, "build_llama_cpp", lambda: build.installed("0.3.36", tmp_path))
    rates = decode._llama_batched_bench(tmp_path / "m.gguf", gen_tokens=32, batch=64, threads=2)
    assert rates == {"1": 130.5, "16": 250.0, "64": 170.25}
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-npl") + 1] == "1,2,4,8,16,32,64" and args[args.index("-c") + 1] == str(64 * (16 + 32))
