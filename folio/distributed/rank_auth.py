"""Ranks prove to each other that they hold the model's rank secret before anything else crosses.

Whoever reaches a rendezvous port can join it as a rank (torch.distributed authenticates nothing), so a
rank meets the others through the store first and runs a challenge on it: every rank writes a fresh
random nonce, then an HMAC-SHA256 under the shared secret of its own rank number and every rank's nonce;
each rank checks every other rank's proof. A peer without the secret cannot make a proof, and one
recorded from an earlier meeting does not hold this meeting's nonces. Only then does a rank join the
process group, and even then what it receives is read as typed values (wire.py), never unpickled.

The secret comes from FOLIO_RANK_SECRET. On one host the engine draws one for its own ranks; a head host
of several (`--nnodes`) without one draws one and logs it, for `folio worker` on the other hosts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Any

SECRET_ENV = "FOLIO_RANK_SECRET"
_PREFIX = "folio/rank-auth"
_NONCE_BYTES = 32


class RankAuthError(RuntimeError):
    """A rank at the rendezvous did not prove it holds the rank secret."""


def new_secret() -> str:
    return secrets.token_hex(32)


def secret_from_environment() -> str | None:
    return os.environ.get(SECRET_ENV) or None


def _proof(secret: str, rank: int, nonces: list[bytes]) -> bytes:
    transcript = b"".join(len(n).to_bytes(4, "big") + n for n in nonces)  # length-prefixed: one reading only
    return hmac.new(secret.encode(), b"folio-rank-v1:%d:" % rank + transcript, hashlib.sha256).digest()


def authenticate(store: Any, rank: int, world_size: int, secret: str) -> None:
    """Run the challenge on `store` (a torch.distributed Store every rank reaches); raises RankAuthError
    naming a rank whose proof is wrong. Waits for every rank, up to the store's timeout."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    store.set(f"{_PREFIX}/nonce/{rank}", nonce)
    nonces = [store.get(f"{_PREFIX}/nonce/{r}") for r in range(world_size)]
    if nonces[rank] != nonce:  # someone else wrote this rank's key: the meeting is not ours alone
        raise RankAuthError(f"rank {rank}'s challenge was overwritten at the rendezvous: another party is there")
    store.set(f"{_PREFIX}/proof/{rank}", _proof(secret, rank, nonces))
    for other in range(world_size):
        if other != rank and not hmac.compare_digest(store.get(f"{_PREFIX}/proof/{other}"),
                                                     _proof(secret, other, nonces)):  # fmt: skip
            raise RankAuthError(
                f"rank {other} at the rendezvous does not hold this model's rank secret: every host must run with "
                f"the same {SECRET_ENV}; nothing was exchanged with it"
            )
