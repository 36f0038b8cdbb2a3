"""Identity of a full KV block for prefix caching: a hash chain over the tokens before it.

A block's KV depends on every token up to its end, so its key holds the parent block's digest, its
own token ids and extra keys (a tenant's `cache_salt`, only on the first block: the chain carries it
on). The cache map is keyed by the whole `BlockKey`, so a lookup compares token ids, not only a hash:
a hash collision can never hand one prompt another prompt's KV. Parents are named by a SHA-256
digest of their key.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

ROOT = b""


@dataclass(frozen=True)
class BlockKey:
    parent: bytes  # digest of the previous block's key; ROOT for the first block
    token_ids: tuple[int, ...]
    extra: str | None = None
    digest: bytes = field(default=b"", compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        h = hashlib.sha256(self.parent)
        h.update((self.extra or "").encode() + b"\0")
        h.update(array("q", self.token_ids).tobytes())
        object.__setattr__(self, "digest", h.digest())


def extend_block_keys(keys: list[BlockKey], token_ids: list[int], block_size: int, salt: str | None) -> None:
    """Append keys for every full block of `token_ids` that `keys` does not cover yet."""
    for index in range(len(keys), len(token_ids) // block_size):
        parent = keys[-1].digest if keys else ROOT
        block = tuple(token_ids[index * block_size : (index + 1) * block_size])
        keys.append(BlockKey(parent, block, salt if index == 0 else None))
