"""The runner's half of the disk KV tier (the scheduler's half: kv_cache/disk_tier.py): the files, read
and written by one background I/O thread, in the order the operations came, so that a step never
waits for the disk.

A save takes the block's bytes at once (the pool may hand the block out next step) and writes them
under a temporary name, renamed into place when complete: a reader, in this server or another one on
the same directory, sees a whole file or none. A load reads the whole file, checks it (kv_files.py)
and fills the reserved RAM-tier slot; a file that fails the check is deleted. Either way the load is
reported back (`finished`). If a write fails (disk full, directory read-only or gone for good), the
tier turns itself off with one warning: requests go on with the RAM tier and the pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from pathlib import Path

import torch

from folio.kv_cache.disk_tier import file_name
from folio.kv_cache.tier_ops import DiskCounters, DiskLoad, DiskSave
from folio.worker.host_tier_store import HostTierStore
from folio.worker.kv_files import BadKVFile, decode, encode_header

logger = logging.getLogger("folio")

# Bytes of saves waiting for the thread at most; past them a save is dropped (its block is computed
# again if it is ever asked for from disk), so a slow disk never grows memory without bound.
MAX_PENDING_BYTES = 256 << 20


class DiskTierStore:
    def __init__(self, host: HostTierStore, directory: Path, fingerprint: bytes) -> None:
        self.host = host
        self.directory = directory
        self.fingerprint = fingerprint
        self.payload_bytes = host.slot_bytes
        self.counters = DiskCounters()
        self.disabled: str | None = None  # why the tier turned itself off
        self._jobs: queue.Queue[DiskSave | DiskLoad | bytes | None] = queue.Queue()  # bytes: a removal
        self._payloads: dict[int, torch.Tensor] = {}  # id(save) -> the bytes it writes
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._finished: list[tuple[int, bool]] = []
        self._reported = threading.Event()
        self._thread = threading.Thread(target=self._work, name="folio-kv-disk", daemon=True)
        self._thread.start()

    # -- the engine's side -------------------------------------------------------------------------
    def save(self, ops: tuple[DiskSave, ...]) -> None:
        """Take the blocks' bytes now (one copy for the batch), write their files in the background."""
        if self.disabled is not None or self._pending_bytes > MAX_PENDING_BYTES:
            self.counters.dropped_saves += len(ops)
            return
        if not ops:
            return
        payloads = self.host.block_payloads([op.block for op in ops])
        with self._lock:
            self._pending_bytes += payloads.numel()
            self._payloads.update((id(op), payload) for op, payload in zip(ops, payloads, strict=True))
        for op in ops:
            self._jobs.put(op)

    def load(self, op: DiskLoad) -> None:
        self._jobs.put(op)

    def remove(self, digest: bytes) -> None:
        self._jobs.put(digest)

    def finished(self) -> list[tuple[int, bool]]:
        """Loads that ended since the last call: (slot, whether it holds the block now)."""
        with self._lock:
            done, self._finished = self._finished, []
            self._reported.clear()
        return done

    def wait(self, timeout: float) -> None:
        """Until a load ends, or `timeout` seconds."""
        self._reported.wait(timeout)

    def drain(self) -> None:
        """Until the thread has done everything queued so far."""
        self._jobs.join()

    def close(self) -> None:
        """Finish the writes queued, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=30)

    # -- the I/O thread ----------------------------------------------------------------------------
    def _work(self) -> None:
        while (op := self._jobs.get()) is not None:
            try:
                self._do(op)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _do(self, op: DiskSave | DiskLoad | bytes) -> None:
        try:
            if isinstance(op, DiskSave):
                self._save(op)
            elif isinstance(op, DiskLoad):
                self._load(op)
            else:
                with contextlib.suppress(OSError):
                    (self.directory / file_name(op)).unlink(missing_ok=True)
        except Exception:  # a bug here must not leave a request waiting for its load forever
            logger.exception("the KV disk tier's I/O thread failed on %s", type(op).__name__)
            if isinstance(op, DiskLoad):
                self._report(op.slot, False)

    def _save(self, op: DiskSave) -> None:
        with self._lock:
            payload = self._payloads.pop(id(op))
            self._pending_bytes -= payload.numel()
        if self.disabled is not None:
            return
        start = time.perf_counter()
        data = memoryview(payload.numpy())
        name = file_name(op.key.digest)
        temporary = self.directory / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        header = encode_header(self.fingerprint, op.key, data)
        for attempt in range(2):
            try:
                write_file(temporary, self.directory / name, header, data)
                break
            except FileNotFoundError as error:  # the directory was removed: make it again, once
                if attempt == 1 or not self._remake_directory():
                    self._disable(error)
                    return
            except OSError as error:
                with contextlib.suppress(OSError):
                    temporary.unlink(missing_ok=True)
                self._disable(error)
                return
        self.counters.bytes_written += len(header) + data.nbytes
        self.counters.save_seconds += time.perf_counter() - start

    def _load(self, op: DiskLoad) -> None:
        start = time.perf_counter()
        path = self.directory / file_name(op.key.digest)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(data)
        except OSError:  # gone (another server's budget, or the directory): a miss
            self._report(op.slot, False)
            return
        try:
            payload = decode(memoryview(data)[:got], self.fingerprint, op.key, self.payload_bytes)
        except BadKVFile as why:
            logger.warning("KV disk tier: refused %s (%s); deleted it", path.name, why)
            self.counters.refused_files += 1
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            self._report(op.slot, False)
            return
        self.host.fill_slot(op.slot, torch.frombuffer(payload, dtype=torch.uint8))
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: a restart's index orders files by this
        self.counters.bytes_read += got
        self.counters.load_seconds += time.perf_counter() - start
        self._report(op.slot, True)

    def _report(self, slot: int, ok: bool) -> None:
        with self._lock:
            self._finished.append((slot, ok))
            self._reported.set()

    def _remake_directory(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        return True

    def _disable(self, error: OSError) -> None:
        self.disabled = f"{error.strerror or error} ({self.directory})"
        logger.warning("KV disk tier off: cannot write %s; prompts stay cached in the pool and the RAM tier",
                       self.disabled)  # fmt: skip


def write_file(temporary: Path, path: Path, header: bytes, payload: memoryview) -> None:
    """`path` appears whole or not at all: written under `temporary`, then renamed."""
    with open(temporary, "wb") as f:
        f.write(header)
        f.write(payload)
    os.replace(temporary, path)
