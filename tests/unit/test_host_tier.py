"""The host-RAM KV tier's two halves together: the scheduler's index (kv_cache/host_tier.py) decides,
the runner's store (worker/host_tier_store.py) copies, over a real layer cache of random bytes.

A Hypothesis property drives random evictions and loads through both, with the pool's blocks written
over between steps, and checks every loaded block is bit for bit what was stored under its key, that
the tier never holds more than its slots, and that a pinned key is never pushed out."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kv_cache.hashing import BlockKey
from folio.kv_cache.host_tier import HostTier
from folio.kv_cache.quant import kv_format
from folio.layers.attention.kv_tensors import LayerKV, scale_zeros
from folio.worker.host_tier_store import HostTierStore, block_bytes

BLOCK, HEADS, DIM, BLOCKS = 4, 2, 8, 6


def _layers(fmt_name: str | None) -> list[LayerKV]:
    fmt = kv_format(fmt_name) if fmt_name else None
    slots = BLOCKS * BLOCK
    layers = []
    for _ in range(2):
        dtype = torch.float32 if fmt is None else fmt.dtype
        k, v = (torch.zeros(slots, HEADS, DIM, dtype=dtype) for _ in range(2))
        scales = (scale_zeros(slots, HEADS, torch.device("cpu")), scale_zeros(slots, HEADS, torch.device("cpu")))
        layers.append(LayerKV(k, v, fmt, *(scales if fmt else (None, None))))
    return layers


def _scribble(layers: list[LayerKV], block: int, generator: torch.Generator) -> None:
    for layer in layers:
        for tensor in layer.tensors():
            raw = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
            view = raw.view(BLOCKS, BLOCK, *raw.shape[1:])
            if raw.dtype.is_floating_point:
                view[block] = torch.randn(view[block].shape, generator=generator).to(raw.dtype)
            else:
                view[block] = torch.randint(0, 255, view[block].shape, generator=generator, dtype=torch.uint8)


def _block(layers: list[LayerKV], block: int) -> list[torch.Tensor]:
    return [t.clone() for layer in layers for t in layer.read_blocks(torch.tensor([block]), BLOCK)]


def _key(n: int) -> tuple[int, BlockKey]:
    return (0, BlockKey(b"", (n,)))


def test_a_block_comes_back_bit_for_bit_and_the_least_recently_used_goes_first():
    layers = _layers("int8")
    tier, store = HostTier(2), HostTierStore(layers, 2, BLOCK)
    generator = torch.Generator().manual_seed(0)
    saved = {}
    for n in range(3):  # three keys through a two-slot tier: key 0 is pushed out by key 2
        _scribble(layers, n, generator)
        saved[n] = _block(layers, n)
        tier.store(n, _key(n))
    store.run(tier.take_ops())
    assert _key(0) not in tier and _key(1) in tier and _key(2) in tier and tier.num_used == 2
    _scribble(layers, 5, generator)
    tier.load(_key(1), 5)
    store.run(tier.take_ops())
    assert all(torch.equal(a, b) for a, b in zip(_block(layers, 5), saved[1], strict=True))
    assert block_bytes(layers, BLOCK) == 2 * 2 * (BLOCK * HEADS * DIM + BLOCK * HEADS * 2)  # int8 codes, fp16 scales


def test_pinned_keys_stay_and_a_full_pinned_tier_keeps_nothing_new():
    tier = HostTier(1)
    tier.store(0, _key(0))
    tier.pin([_key(0)])
    tier.store(1, _key(1))
    assert _key(0) in tier and _key(1) not in tier and tier.num_stored == 1
    tier.unpin([_key(0)])
    tier.store(1, _key(1))
    assert _key(1) in tier and _key(0) not in tier
    ops = tier.take_ops()
    assert [(op.load, op.slots) for op in ops] == [(False, (0,)), (False, (0,))]  # one slot reused: two batches


ACTIONS = st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, BLOCKS - 1)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([None, "int8", "fp8"]), st.integers(1, 4), ACTIONS)
def test_random_evictions_and_loads_keep_every_block_intact(fmt, num_slots, actions):
    layers = _layers(fmt)
    tier, store = HostTier(num_slots), HostTierStore(layers, num_slots, BLOCK)
    generator = torch.Generator().manual_seed(1)
    expected: dict[int, list[torch.Tensor]] = {}  # key -> the bytes stored under it (a key's KV never changes)
    loaded: list[tuple[int, int]] = []  # (key, block) loaded in this step
    touched: set[int] = set()  # blocks saved or loaded in this step: the pool hands a block out once a step
    for step_ends, key, block in actions:
        if block not in touched and _key(key) in tier:
            tier.load(_key(key), block)
            loaded.append((key, block))
            touched.add(block)
        elif block not in touched and key not in expected:
            _scribble(layers, block, generator)  # a computed block, evicted before the step writes it over
            expected[key] = _block(layers, block)
            tier.store(block, _key(key))
            touched.add(block)
        assert tier.num_used <= num_slots
        if step_ends:
            store.run(tier.take_ops())
            for k, b in loaded:
                assert all(torch.equal(x, y) for x, y in zip(_block(layers, b), expected[k], strict=True))
            for b in touched:
                _scribble(layers, b, generator)  # the step computes on
            loaded, touched = [], set()
