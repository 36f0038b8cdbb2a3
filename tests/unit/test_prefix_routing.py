"""The replicas' routing policy (folio/scale_out/routing.py), without Ray."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kv_cache.hashing import BlockKey, extend_block_keys
from folio.scale_out.routing import PrefixAffinity, RoutingConfig, RoutingPolicy, prefix_digests

BLOCK = 4


def digests(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return prefix_digests(tokens, BLOCK, salt, max_blocks=64)


def test_digests_are_the_prefix_caches_own_keys():
    tokens = list(range(19))
    keys: list[BlockKey] = []
    extend_block_keys(keys, tokens, BLOCK, "tenant")
    assert digests(tokens, "tenant") == [key.digest for key in keys]
    assert len(digests(tokens)) == 4  # full blocks only
    assert digests(tokens, "a") != digests(tokens, "b")  # a salt isolates tenants, as in the cache
    assert len(prefix_digests(tokens, BLOCK, None, max_blocks=2)) == 2


def test_shared_prefix_follows_its_replica_and_new_tenants_spread():
    policy = RoutingPolicy()
    idle = {"a": 0, "b": 0}
    system_a, system_b = list(range(100, 132)), list(range(200, 232))
    first = policy.choose(digests(system_a + [1, 2]), idle)
    assert first.reason == "least_loaded"
    policy.routed(digests(system_a + [1, 2]), first.replica)
    again = policy.choose(digests(system_a + [7, 8, 9, 10, 11]), idle)
    assert (again.replica, again.reason, again.matched_blocks) == (first.replica, "prefix", 8)
    other = policy.choose(digests(system_b), idle)  # a new tenant: the replica holding fewer blocks
    assert other.reason == "least_loaded" and other.replica != first.replica


def test_a_busy_owner_loses_its_prefix_beyond_the_bound():
    policy = RoutingPolicy(RoutingConfig(imbalance_bound=2))
    prompt = digests(list(range(64)))
    policy.routed(prompt, "a")
    assert policy.choose(prompt, {"a": 2, "b": 0}).replica == "a"  # within the bound
    spilled = policy.choose(prompt, {"a": 3, "b": 0})
    assert (spilled.replica, spilled.reason) == ("b", "least_loaded")


def test_round_robin_ignores_prefixes():
    policy = RoutingPolicy(RoutingConfig(policy="round_robin"))
    prompt = digests(list(range(64)))
    picks = []
    for _ in range(6):
        decision = policy.choose(prompt, {"a": 0, "b": 5, "c": 0})
        policy.routed(prompt, decision.replica)
        picks.append(decision.replica)
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_a_forgotten_replica_holds_nothing():
    policy = RoutingPolicy()
    prompt = digests(list(range(64)))
    policy.routed(prompt, "a")
    policy.forget("a")
    assert policy.affinity.blocks_held("a") == 0
    assert policy.choose(prompt, {"a": 0, "b": 0}).reason == "least_loaded"
    assert policy.affinity.match(prompt, {"b"}) == (None, 0)


def test_only_live_candidates_match():
    policy = RoutingPolicy()
    prompt = digests(list(range(64)))
    policy.routed(prompt, "gone")
    decision = policy.choose(prompt, {"a": 0})
    assert (decision.replica, decision.reason) == ("a", "least_loaded")


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="imbalance"):
        RoutingConfig(imbalance_bound=-1)
    with pytest.raises(ValueError, match="no replica"):
        RoutingPolicy().choose([], {})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 3), min_size=0, max_size=24)),
        max_size=40,
    ),
    st.integers(1, 20),
)
def test_affinity_table_stays_bounded_and_counts_balance(routed, bound):
    """However prompts are recorded, the table holds at most its bound, each digest has one owner,
    and the per-replica counts equal what the table holds."""
    affinity = PrefixAffinity(bound)
    for replica, tokens in routed:
        affinity.record(digests(tokens), replica)
    owners = affinity._owner
    assert len(owners) <= bound
    for replica in "abc":
        assert affinity.blocks_held(replica) == sum(1 for owner in owners.values() if owner == replica)
