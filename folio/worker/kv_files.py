"""The disk tier's file format: one block of every layer's KV per file, with what proves it is the
block asked for.

A file is a header, then the block's bytes in the cache's own format (the RAM tier's slot layout):

    magic "FOLIOKV1" | fingerprint (32) | payload bytes (u64) | tokens (u32) | salt bytes (u32)
    | parent digest (32; zeros for a first block) | token ids (i64 each) | salt (utf-8)
    | SHA-256 of all before it and of the payload (32) | payload

The fingerprint (`kv_fingerprint`) names everything besides the tokens that decides what the KV holds:
the model's files, dtypes, KV format, block size, layout. A file is used only if its fingerprint and
its whole key (parent digest, token ids, salt) are the ones asked for, and its checksum holds; a torn,
flipped or foreign file is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from folio.kv_cache.hashing import BlockKey

MAGIC = b"FOLIOKV1"
_FIXED = struct.Struct("<8s32sQII32s")  # magic, fingerprint, payload bytes, tokens, salt bytes, parent
_CHECKSUM_BYTES = 32


class BadKVFile(ValueError):
    """A file that must not be loaded: why, in words."""


def _key_fields(key: BlockKey) -> tuple[bytes, bytes]:
    salt = (key.extra or "").encode()
    return struct.pack(f"<{len(key.token_ids)}q", *key.token_ids), salt


def encode_header(fingerprint: bytes, key: BlockKey, payload: memoryview) -> bytes:
    tokens, salt = _key_fields(key)
    head = _FIXED.pack(MAGIC, fingerprint, payload.nbytes, len(key.token_ids), len(salt), key.parent) + tokens + salt
    checksum = hashlib.sha256(head)
    checksum.update(payload)
    return head + checksum.digest()


def decode(data: memoryview, fingerprint: bytes, key: BlockKey, payload_bytes: int) -> memoryview:
    """The payload of a file read whole, if it holds `key`'s block under `fingerprint`; else BadKVFile."""
    if data.nbytes < _FIXED.size:
        raise BadKVFile("shorter than a header")
    magic, their_fingerprint, size, num_tokens, salt_len, parent = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise BadKVFile("not a folio KV file")
    if their_fingerprint != fingerprint:
        raise BadKVFile("written for another model or KV format")
    tokens, salt = _key_fields(key)
    head_len = _FIXED.size + len(tokens) + len(salt)
    if (
        size != payload_bytes
        or num_tokens != len(key.token_ids)
        or salt_len != len(salt)
        or data.nbytes != head_len + _CHECKSUM_BYTES + size
    ):
        raise BadKVFile("truncated or of another layout")
    if parent != key.parent.ljust(32, b"\0") or data[_FIXED.size : head_len] != tokens + salt:
        raise BadKVFile("holds another block's key")
    payload = data[head_len + _CHECKSUM_BYTES :]
    checksum = hashlib.sha256(data[:head_len])
    checksum.update(payload)
    if checksum.digest() != data[head_len : head_len + _CHECKSUM_BYTES]:
        raise BadKVFile("checksum mismatch")
    return payload


def kv_fingerprint(model_digest: str, settings: dict[str, object]) -> bytes:
    """What the KV of given tokens depends on besides them: the model's files and the engine's settings."""
    text = json.dumps({"format": MAGIC.decode(), "model": model_digest, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def model_digest(path: Path, memo: Path | None = None) -> str:
    """SHA-256 over a model's files (a GGUF file, or every file of a folder), remembered in `memo` by
    path, size and modification time so a restart does not read gigabytes again."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    known: dict[str, dict[str, object]] = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
    entry = known.get(str(path.resolve()))
    if entry is not None and entry.get("stamp") == stamp:
        return str(entry["digest"])
    digest = hashlib.sha256()
    for file, (_, size, _) in zip(files, stamp, strict=True):
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    result = digest.hexdigest()
    if memo is not None:
        known[str(path.resolve())] = {"stamp": stamp, "digest": result}
        temporary = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
        try:
            temporary.write_text(json.dumps(known))
            os.replace(temporary, memo)
        except OSError:  # a read-only directory: hash again next time
            temporary.unlink(missing_ok=True)
    return result
