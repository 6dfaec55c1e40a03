"""Checksums: xxh3-64 over a chunk's wire bytes, xxh3-128 over each tensor after apply.

The whole-model checksum is the xxh3-128 of the concatenated per-tensor digests in layout
order: it changes if any tensor changes or if tensors are reordered, and it costs nothing
once the tensors are hashed.
"""

from __future__ import annotations

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
