"""Checksums: xxh3-64 over a chunk's wire bytes, xxh3-128 over each tensor after apply;
BLAKE2b-256 over a chunk where the manifest is sealed (manifest_seal.py).

The whole-model checksum is the xxh3-128 of the concatenated per-tensor digests in layout
order: it changes if any tensor changes or if tensors are reordered, and it costs nothing
once the tensors are hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import xxhash

from deltarl.engine.layout import Layout


def chunk_checksum(parts: Iterable[bytes | memoryview]) -> int:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def tensor_digest(bits: np.ndarray) -> str:
    """xxh3-128 of one tensor's bytes, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(bits)).cast("B"))


def tensor_digests(layout: Layout, buf: np.ndarray, ids: Iterable[int] | None = None) -> list[str]:
    """Digests of the given tensors (all by default) of a flat buffer laid out by ``layout``."""
    chosen = range(len(layout)) if ids is None else ids
    return [tensor_digest(layout.view(buf, i)) for i in chosen]


def model_digest(digests: Iterable[str]) -> str:
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


CHUNK_HASH_HEX = 64  # BLAKE2b-256, hex


def chunk_hash(data: bytes | bytearray | memoryview) -> str:
    """BLAKE2b-256 of a chunk's wire bytes, as hex: the cryptographic hash a sealed manifest
    lists per chunk (xxh3-64 catches corruption; it does not stop a forger making a collision).
    hashlib releases the GIL while it hashes, so encode and apply threads hash in parallel."""
    return hashlib.blake2b(data, digest_size=32, person=b"deltarl-chunk").hexdigest()
