"""The disk KV tier's two halves together: the scheduler's index (kv_cache/disk_tier.py) decides, the
runner's store (worker/disk_tier_store.py) writes and reads real files, over a real layer cache.

A Hypothesis property moves blocks pool -> RAM tier -> disk -> RAM tier -> pool at random and checks
every block that comes back is bit for bit what was computed under its key, that no slot leaks, and
that the budgets hold (in the index and in the directory). Fault tests: a truncated file, a flipped
byte, another block's file under the name, another fingerprint's file, a directory removed while in
use, a disk that is full."""

from __future__ import annotations

import errno
import logging
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kv_cache.disk_tier import DiskTier, file_name
from folio.kv_cache.hashing import BlockKey
from folio.kv_cache.host_tier import HostTier
from folio.kv_cache.tier_ops import TierOps
from folio.worker import disk_tier_store
from folio.worker.disk_tier_store import DiskTierStore
from folio.worker.host_tier_store import HostTierStore
from tests.unit.test_host_tier import BLOCK, BLOCKS, _block, _layers, _scribble

FINGERPRINT = bytes(range(32))


class Tiers:
    """Both tiers with both halves, run as the engine runs them."""

    def __init__(self, directory: Path, fmt: str | None = "int8", num_slots: int = 4, capacity: int = 3,
                 fingerprint: bytes = FINGERPRINT) -> None:  # fmt: skip
        self.layers = _layers(fmt)
        self.host = HostTier(num_slots)
        self.host_store = HostTierStore(self.layers, num_slots, BLOCK)
        self.disk = DiskTier(self.host, directory, capacity)
        self.store = DiskTierStore(self.host_store, directory, fingerprint)

    def flush(self) -> None:
        saves, loads, removes = self.disk.take_ops()
        ops = TierOps(saves, self.host.take_ops(), loads, removes)
        self.store.save(ops.disk_saves)
        self.host_store.run(ops.copies)
        for load in ops.disk_loads:
            self.store.load(load)
        for digest in ops.disk_removes:
            self.store.remove(digest)
        self.store.drain()
        self.disk.finish(self.store.finished())

    def close(self) -> None:
        self.store.close()


def _key(n: int) -> BlockKey:
    return BlockKey(b"", (n, n + 1))


def _bring_back(tiers: Tiers, n: int) -> bool:
    """Key n from disk into the RAM tier; whether it came."""
    started = tiers.disk.prefetch([_key(n)])
    tiers.flush()
    return bool(started) and (0, _key(n)) in tiers.host


@pytest.fixture
def tiers(tmp_path):
    made = Tiers(tmp_path)
    yield made
    made.close()


def _computed(tiers: Tiers, n: int, block: int = 0) -> list[torch.Tensor]:
    _scribble(tiers.layers, block, torch.Generator().manual_seed(n))
    tiers.disk.save(block, (0, _key(n)))
    tiers.flush()
    return _block(tiers.layers, block)


def test_a_block_comes_back_from_disk_bit_for_bit(tiers, tmp_path):
    expected = _computed(tiers, 7)
    assert (tmp_path / file_name(_key(7).digest)).is_file()
    assert _bring_back(tiers, 7)
    tiers.host.load((0, _key(7)), 3)
    tiers.flush()
    assert all(torch.equal(a, b) for a, b in zip(_block(tiers.layers, 3), expected, strict=True))
    assert (tiers.disk.num_stored, tiers.disk.num_loaded, tiers.disk.num_failed) == (1, 1, 0)
    assert tiers.store.counters.bytes_read == tiers.store.counters.bytes_written > 0


def test_a_restart_finds_the_files_and_an_unknown_key_is_a_miss(tiers, tmp_path):
    expected = _computed(tiers, 1)
    again = Tiers(tmp_path)
    try:
        assert again.disk.num_files == 1 and not _bring_back(again, 2)
        assert _bring_back(again, 1)
        again.host.load((0, _key(1)), 5)
        again.flush()
        assert all(torch.equal(a, b) for a, b in zip(_block(again.layers, 5), expected, strict=True))
    finally:
        again.close()


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[len(data) // 2 :]
    elif how == "payload byte flipped":
        data[-1] ^= 0x40
    elif how == "token flipped":
        data[8 + 32 + 8 + 4 + 4 + 32] ^= 1  # the first token id, after the fixed header fields
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "payload byte flipped", "token flipped", "empty"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tiers, tmp_path, how, caplog):
    _computed(tiers, 1)
    path = tmp_path / file_name(_key(1).digest)
    if how == "empty":
        path.write_bytes(b"")
    else:
        _damage(path, how)
    with caplog.at_level(logging.WARNING, logger="folio"):
        assert not _bring_back(tiers, 1)
    assert not path.exists() and tiers.disk.num_failed == 1 and tiers.store.counters.refused_files == 1
    assert "refused" in caplog.text
    assert tiers.host.num_used == 0 and sorted(tiers.host._free) == list(range(tiers.host.num_slots))  # slot back


def test_another_fingerprints_file_is_never_loaded(tmp_path):
    other = Tiers(tmp_path, fingerprint=bytes(32))
    _computed(other, 1)  # the same key, written by another model (or KV format)
    other.close()
    ours = Tiers(tmp_path)
    try:
        assert ours.disk.num_files == 1 and not _bring_back(ours, 1)
        assert ours.store.counters.refused_files == 1 and not any(tmp_path.iterdir())
    finally:
        ours.close()


def test_a_removed_directory_is_made_again_and_its_lost_files_are_misses(tiers, tmp_path):
    _computed(tiers, 1)
    for path in tmp_path.iterdir():
        path.unlink()
    tmp_path.rmdir()
    assert not _bring_back(tiers, 1)
    _computed(tiers, 2)
    assert tiers.store.disabled is None and (tmp_path / file_name(_key(2).digest)).is_file()
    assert _bring_back(tiers, 2)


def test_a_full_disk_turns_the_tier_off_with_one_warning(tiers, monkeypatch, caplog):
    def full(*_args) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier_store, "write_file", full)
    with caplog.at_level(logging.WARNING, logger="folio"):
        _computed(tiers, 1)
        _computed(tiers, 2)
    assert tiers.store.disabled is not None and "No space left" in tiers.store.disabled
    assert caplog.text.count("KV disk tier off") == 1
    tiers.disk.disable()  # what the engine does when it sees it (kv_tiers.sync_tiers)
    _computed(tiers, 3)
    assert tiers.disk.num_files == 0 and not tiers.disk.prefetch([_key(3)])
    assert not list(tiers.store.directory.glob(".*.tmp"))


def test_the_budget_removes_the_least_recently_used_files(tiers, tmp_path):
    for n in range(5):
        _computed(tiers, n)
    assert tiers.disk.num_files == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(file_name(_key(n).digest) for n in (2, 3, 4))


def test_files_another_server_wrote_are_found_and_count_against_the_budget(tmp_path):
    first, second = Tiers(tmp_path, capacity=4), Tiers(tmp_path, capacity=4)
    try:
        expected = _computed(first, 1)
        assert _bring_back(second, 1)  # not in its index: looked for on disk
        second.host.load((0, _key(1)), 2)
        second.flush()
        assert all(torch.equal(a, b) for a, b in zip(_block(second.layers, 2), expected, strict=True))
        for n in range(2, 6):
            _computed(first, n)
        second.disk.rescan()
        assert second.disk.num_files <= 4
    finally:
        first.close()
        second.close()


ACTIONS = st.lists(st.tuples(st.sampled_from(["compute", "load"]), st.integers(0, 9), st.integers(0, BLOCKS - 1)),
                   min_size=1, max_size=30)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([None, "int8", "fp8"]), st.integers(1, 4), st.integers(1, 5), ACTIONS)
def test_blocks_moving_through_every_tier_come_back_intact(fmt, num_slots, capacity, actions):
    with tempfile.TemporaryDirectory() as folder:
        tiers = Tiers(Path(folder), fmt, num_slots, capacity)
        try:
            _check_random_moves(tiers, actions)
        finally:
            tiers.close()


def _check_random_moves(tiers: Tiers, actions: list[tuple[str, int, int]]) -> None:
    expected: dict[int, list[torch.Tensor]] = {}  # key -> its computed bytes (a key's KV never changes)
    holds: dict[int, int] = {}  # pool block -> the key it holds
    generator = torch.Generator().manual_seed(3)
    for action, n, block in actions:
        if block in holds:  # the pool hands the block out: its key goes to the RAM tier first
            tiers.host.store(block, (0, _key(holds.pop(block))))
            tiers.flush()
        if action == "compute" or n not in expected:
            if n in expected:  # computed again: the same KV
                _write(tiers, block, expected[n])
            else:
                _scribble(tiers.layers, block, generator)
                expected[n] = _block(tiers.layers, block)
            tiers.disk.save(block, (0, _key(n)))
            tiers.flush()
        else:
            if (0, _key(n)) not in tiers.host and not _bring_back(tiers, n):
                continue  # pushed out of both tiers: a miss
            tiers.host.load((0, _key(n)), block)
            tiers.flush()
            assert all(torch.equal(a, b) for a, b in zip(_block(tiers.layers, block), expected[n], strict=True))
        holds[block] = n
        assert tiers.host.num_used + len(tiers.host._free) == tiers.host.num_slots  # no slot leaks
        assert tiers.disk.num_files <= tiers.disk.capacity
        assert len(list(tiers.store.directory.glob("*.kv"))) <= tiers.disk.capacity
        assert not tiers.disk.loading
    assert tiers.store.counters.refused_files == 0


def _write(tiers: Tiers, block: int, parts: list[torch.Tensor]) -> None:
    """Pool block `block` of every layer from `_block`'s list."""
    rest = list(parts)
    for layer in tiers.layers:
        count = len(layer.tensors())
        layer.write_blocks(torch.tensor([block]), BLOCK, rest[:count])
        rest = rest[count:]
