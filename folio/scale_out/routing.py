"""Which replica gets a prompt: the one that holds its prefix, unless that one is too busy.

Each replica's prefix cache is keyed by the hash chain of a prompt's full blocks (kv_cache/hashing.py),
so the router hashes a prompt's leading blocks the same way and remembers which replica it sent each
block digest to (`PrefixAffinity`, an LRU table: SGLang's router keeps an approximate tree the same
way, without asking the replicas). A prompt goes to the replica holding its longest recorded prefix
when that replica's load is within `imbalance_bound` requests of the least-loaded replica; otherwise,
or with no prefix recorded, to the least-loaded replica (ties: the one holding the fewest blocks, so
new tenants spread out). Round-robin is kept for comparison.

Pure Python over replica names and load counts, so it is tested without Ray.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from folio.kv_cache.hashing import BlockKey, extend_block_keys

POLICIES = ("cache_aware", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "cache_aware"
    imbalance_bound: int = 4  # extra requests the prefix's owner may have over the least-loaded replica
    max_prefix_blocks: int = 128  # leading blocks hashed per prompt (2,048 tokens at 16 per block)
    max_recorded_blocks: int = 200_000  # LRU bound on the affinity table

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"the routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.imbalance_bound < 0:
            raise ValueError(f"the imbalance bound must be >= 0 requests, got {self.imbalance_bound}")
        if self.max_prefix_blocks < 1 or self.max_recorded_blocks < 1:
            raise ValueError("max_prefix_blocks and max_recorded_blocks must be >= 1")


def prefix_digests(token_ids: list[int], block_size: int, cache_salt: str | None, max_blocks: int) -> list[bytes]:
    """The digests a replica's prefix cache would give the prompt's leading full blocks."""
    keys: list[BlockKey] = []
    extend_block_keys(keys, token_ids[: max_blocks * block_size], block_size, cache_salt)
    return [key.digest for key in keys]


class PrefixAffinity:
    """Block digest -> the replica last sent a prompt holding that block, least recently used first out."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._held: dict[str, int] = {}  # replica -> blocks recorded for it

    def blocks_held(self, replica: str) -> int:
        return self._held.get(replica, 0)

    def match(self, digests: list[bytes], candidates: set[str]) -> tuple[str | None, int]:
        """The candidate holding the longest run of `digests` from the first, and that run's length.
        A chain's blocks are recorded together, so walking down the chain while the owner stays the same
        finds the deepest block a single replica holds."""
        best, depth = None, 0
        for index, digest in enumerate(digests):
            owner = self._owner.get(digest)
            if owner is None or owner not in candidates or (best is not None and owner != best):
                break
            best, depth = owner, index + 1
        return best, depth

    def record(self, digests: list[bytes], replica: str) -> None:
        for digest in digests:
            previous = self._owner.pop(digest, None)
            if previous is not None:
                self._held[previous] -= 1
            self._owner[digest] = replica
            self._held[replica] = self._held.get(replica, 0) + 1
        while len(self._owner) > self.max_blocks:
            _, evicted = self._owner.popitem(last=False)
            self._held[evicted] -= 1

    def forget(self, replica: str) -> None:
        """A replica that died or was removed holds nothing any more."""
        for digest in [d for d, owner in self._owner.items() if owner == replica]:
            del self._owner[digest]
        self._held.pop(replica, None)


@dataclass(frozen=True)
class RoutingDecision:
    replica: str
    reason: str  # "prefix" (its owner), "least_loaded" or "round_robin"
    matched_blocks: int = 0


class RoutingPolicy:
    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self.affinity = PrefixAffinity(self.config.max_recorded_blocks)
        self._turn = itertools.count()

    def choose(self, digests: list[bytes], loads: dict[str, int]) -> RoutingDecision:
        """Pick one of `loads`' replicas (name -> requests in flight) for a prompt with these digests."""
        if not loads:
            raise ValueError("no replica to route to")
        names = sorted(loads)
        if self.config.policy == "round_robin":
            return RoutingDecision(names[next(self._turn) % len(names)], "round_robin")
        least = min(loads.values())
        owner, depth = self.affinity.match(digests, set(names))
        if owner is not None and loads[owner] - least <= self.config.imbalance_bound:
            return RoutingDecision(owner, "prefix", depth)
        idle = [name for name in names if loads[name] == least]
        fewest = min(self.affinity.blocks_held(name) for name in idle)
        emptiest = [name for name in idle if self.affinity.blocks_held(name) == fewest]
        return RoutingDecision(emptiest[next(self._turn) % len(emptiest)], "least_loaded")

    def routed(self, digests: list[bytes], replica: str) -> None:
        """Record where a prompt went (the framework may have sent it elsewhere than chosen)."""
        if self.config.policy == "cache_aware":
            self.affinity.record(digests, replica)

    def forget(self, replica: str) -> None:
        self.affinity.forget(replica)
