"""What the link tests share: a bounded runner and real encoded versions to carry."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import numpy as np

from deltarl.codecs.encoder import DeltaEncoder
from deltarl.engine.layout import Layout

Version = tuple[list[bytes], bytes]  # chunks, manifest json


def run(coro: Awaitable[Any], limit: float = 20.0) -> Any:
    """Run a test coroutine with a hard limit, so a protocol bug fails instead of hanging."""

    async def bounded() -> Any:
        async with asyncio.timeout(limit):
            return await coro

    return asyncio.run(bounded())


def encoded_versions(seed: int) -> tuple[Version, Version]:
    """A full version 1 and a delta 1 -> 2 of a small random layout, in 4 KiB chunks."""
    layout = Layout.pack([("a", "bfloat16", (20000,)), ("b", "float32", (3000,))])
    rng = np.random.default_rng(seed)
    v1 = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    v2 = v1.copy()
    v2[rng.choice(v2.size, 2000, replace=False)] ^= 1
    enc = DeltaEncoder(layout, chunk_bytes=4096)
    out = []
    for cur, ref, version in ((v1, None, 1), (v2, v1, 2)):
        e = enc.encode(cur, ref, target_version=version, base_version=None if ref is None else 1)
        chunks = [c.data for c in e]
        assert e.manifest is not None
        out.append((chunks, e.manifest.to_json()))
    assert len(out[0][0]) > 4
    assert len(out[1][0]) > 1
    return out[0], out[1]
