"""Checksums: xxh3-64 over a chunk's wire bytes, xxh3-128 over each tensor after apply;
BLAKE2b-256 over a chunk where the manifest is sealed (manifest_seal.py).

The whole-model checksum is the xxh3-128 of the concatenated per-tensor digests in layout
order: it changes if any tensor changes or if tensors are reordered, and it costs nothing
once the tensors are hashed.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import Self

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


PARALLEL_MIN_BYTES = 16 << 20
"""Below this many bytes the tensors are hashed on the calling thread: handing work to the
pool costs more than it saves."""
HASH_THREADS = max(1, min(len(os.sched_getaffinity(0)), 8))
"""xxh3 is memory-bound: a few threads fill the memory bus (two threads hashed two 200 MB
buffers in 13 ms against 23.5 ms on one, on a 2-core host); more only contend. Counted on the
CPUs this process may use (a daemon pinned to one, as ``bench refit`` pins each agent, hashes
on one thread), not the host's."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A forked child has none of the parent's threads: work handed to the inherited pool
    # would never run. The child makes its own on first use.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _hash_pool() -> ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 - one pool per process, made on first use
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="xxh3")
        return _pool


def _parts(sizes: Sequence[int], parts: int) -> list[range]:
    """Split indices ``0..len(sizes)`` into at most ``parts`` contiguous runs of about equal
    bytes (a run closes once it reaches its share of what is left)."""
    out: list[range] = []
    start, left = 0, sum(sizes)
    for k in range(parts, 0, -1):
        if start >= len(sizes):
            break
        share, end, got = left / k, start, 0
        while end < len(sizes) and (got < share or end == start):
            got += sizes[end]
            end += 1
        if k == 1:
            end = len(sizes)
        out.append(range(start, end))
        left -= got
        start = end
    return out


def tensor_digests(layout: Layout, buf: np.ndarray, ids: Iterable[int] | None = None) -> list[str]:
    """Digests of the given tensors (all by default) of a flat buffer laid out by ``layout``,
    in the order given. Large sets are hashed by ``HASH_THREADS`` threads (xxhash releases the
    GIL), each over a contiguous run of tensors of about equal bytes; the digests are the same
    whatever the split."""
    return PendingDigests(layout, buf, ids).result()


class PendingDigests:
    """``tensor_digests`` begun: a large set is hashed on the pool while the caller goes on
    (a small one, or any on a process with one hashing thread, is hashed here and now, where
    handing it over would only cost). Until ``result`` or ``wait`` returns, a hash may still
    read the buffer: the caller must not write these tensors before (a digest would be
    torn) nor let the buffer go away (``cancel`` first drops the runs not begun)."""

    def __init__(self, layout: Layout, buf: np.ndarray, ids: Iterable[int] | None = None) -> None:
        chosen = list(range(len(layout)) if ids is None else ids)
        views = [layout.view(buf, i) for i in chosen]
        sizes = [v.nbytes for v in views]
        self._parts: list[Future[list[str]] | list[str]]
        if HASH_THREADS == 1 or sum(sizes) < PARALLEL_MIN_BYTES:
            self._parts = [[tensor_digest(v) for v in views]]
            return
        pool = _hash_pool()
        self._parts = [
            pool.submit(lambda run: [tensor_digest(views[j]) for j in run], run)
            for run in _parts(sizes, HASH_THREADS)
        ]

    def result(self) -> list[str]:
        """The digests, in the order of the ids given (waits for those still being hashed)."""
        return [d for p in self._parts for d in (p if isinstance(p, list) else p.result())]

    def cancel(self) -> None:
        """Give the digests up: drop the runs not begun (``wait`` for those running)."""
        for p in self._parts:
            if isinstance(p, Future):
                p.cancel()

    def wait(self) -> None:
        """Return once no run reads the buffer (done, dropped or failed)."""
        wait([p for p in self._parts if isinstance(p, Future)])


POOLED_MIN_BYTES = 1 << 20
"""``DigestsAsWritten`` hashes a tensor this large on the pool; a smaller one on the calling
thread (handing it over costs about what hashing it does)."""


class DigestsAsWritten:
    """Each tensor's digest, taken as soon as the writer has written it, on the hash pool
    while the writer writes the next (xxhash and torch's copies release the GIL): a publish
    pays about the larger of its copies and its hashing over ``HASH_THREADS`` threads, not
    their sum (a 7B bf16 model is about 1.2 s of hashing on one thread). Use as a context
    manager: leaving it waits for every hash still running, so none outlives the buffer it
    reads."""

    def __init__(self) -> None:
        self._parts: list[Future[str] | str] = []

    def add(self, bits: np.ndarray) -> None:
        """Hash ``bits`` (one tensor, in layout order), which must not change afterwards."""
        if HASH_THREADS == 1 or bits.nbytes < POOLED_MIN_BYTES:
            self._parts.append(tensor_digest(bits))
        else:
            self._parts.append(_hash_pool().submit(tensor_digest, bits))

    def digests(self) -> list[str]:
        """The digests, in the order added (waits for those still being hashed)."""
        return [p if isinstance(p, str) else p.result() for p in self._parts]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        wait([p for p in self._parts if not isinstance(p, str)])


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
