"""The data plane's interface: a chunk sender, a chunk receiver, their configs, one factory.

The export agent sends each version as encoded chunks (``deltarl.codecs``) and a manifest;
the apply agent receives them. Which bytes travel how is a backend's business, one file per
backend, chosen by ``config.type``:

    "shm"     shm_link.py   same host: a file per chunk in shared memory, ZeroMQ notices
    "stream"  stream.py     across regions: parallel TCP connections, acks, resume
    "ucx"     ucx_link.py   inside a region: RDMA through UCX (the ``ucx`` extra)

What every backend promises (the receiver's side of contract 3, "replay-safe", in
docs/architecture.md):
- chunks and manifests arrive in any order, byte-exact; the receiver checks nothing about
  their content (the apply agent verifies each chunk's checksum and the manifest);
- a chunk or manifest received twice is delivered once (``DeliveredSet``);
- a peer that sends garbage loses its connection or its message, never the receiver.

A received chunk's ``data`` may be a zero-copy view of memory that the transport owns (a
mapped file for shm). It stays valid until ``release()``; release each chunk once it is
applied, so the transport can free its memory.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import xxhash

from deltarl.transport.link_config import LinkConfig

MAX_VERSION = (1 << 63) - 1  # versions are i64 in the chunk frame (codecs/frame.py)
MAX_CHUNK_ID = (1 << 32) - 1


class LinkError(ConnectionError):
    """The link cannot deliver: retries exhausted, no receiver in time, or it was closed."""


# -- what a receiver yields -------------------------------------------------------------------


@dataclass(eq=False)
class ReceivedChunk:
    """One chunk as it arrived. ``data`` is valid until ``release()`` (or the receiver's close)."""

    version: int
    chunk_id: int
    data: bytes | memoryview
    # Frees what the transport holds for this chunk (a mapping, a file); None: nothing to free.
    _free: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Tell the transport the chunk is consumed. Idempotent; ``data`` is invalid after."""
        free, self._free = self._free, None
        if free is not None:
            free()


@dataclass(frozen=True)
class ReceivedManifest:
    """One version's manifest, as ``RefitManifest.to_json()`` made it."""

    version: int
    data: bytes


Received = ReceivedChunk | ReceivedManifest


# -- the interface ----------------------------------------------------------------------------


class ChunkSender(abc.ABC):
    """Sends the chunks and the manifest of each version. ``async with`` starts and closes it;
    the first send starts it too."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Open what the link needs. Idempotent."""

    @abc.abstractmethod
    async def send_chunk(self, version: int, chunk_id: int, data: bytes | memoryview) -> None:
        """Hand one chunk to the link. It may return before the chunk arrives; ``data`` must
        not change until ``send_manifest`` of its version has returned."""

    @abc.abstractmethod
    async def send_manifest(self, version: int, manifest_json: bytes) -> None:
        """Send the version's manifest; return once the backend has delivered what it can
        promise for the version (each backend says what), or raise LinkError."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop; anything not yet delivered is dropped. Idempotent."""

    async def withdraw(self, version: int) -> int:
        """Take back what the link still holds of ``version`` that no receiver has taken: the
        sender gave up on the version (no acknowledgement in time, a link error) and will
        send a newer one, or this one again. Returns how many chunks were taken back (for
        the shm link, a chunk the receiver is reading may be among them: it reads on).

        Only a link that parks chunks for the receiver to collect holds any: the shm link's
        files (``ShmSender.withdraw``). A network link's chunks have left, or died with the
        sender that a link error spent (a stream sender's manifest returns only once every
        chunk is acknowledged): nothing to take back, 0. Works on a closed sender too."""
        del version
        return 0

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class ChunkReceiver(abc.ABC):
    """Yields ``ReceivedChunk`` and ``ReceivedManifest`` items until closed:

    async with make_receiver(config) as receiver:
        async for item in receiver:
            ...
    """

    @abc.abstractmethod
    async def start(self) -> None:
        """Listen. Idempotent; iterating starts it too."""

    @abc.abstractmethod
    async def __anext__(self) -> Received:
        """The next item; StopAsyncIteration once the receiver is closed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening, release every chunk still held, end the iteration. Idempotent."""

    def __aiter__(self) -> Self:
        return self

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class DeliveryQueue:
    """The bounded queue between a receiver's connection handlers and its consumer.

    Bounded, so a consumer that falls behind holds the senders back (their acks wait). ``end``
    drops what the consumer has not taken (it is closing the receiver) and leaves an end marker
    that every later ``next`` sees.
    """

    _END = object()

    def __init__(self, size: int, on_drop: Callable[[Received], None] | None = None) -> None:
        self._queue: asyncio.Queue[Received | object] = asyncio.Queue(size)
        self._on_drop = on_drop
        """Called with each item dropped untaken (the receiver frees what it holds for it)."""

    async def put(self, item: Received) -> None:
        await self._queue.put(item)

    def empty(self) -> bool:
        return self._queue.empty()

    async def next(self) -> Received:
        """The next item; StopAsyncIteration once ``end`` was called."""
        item = await self._queue.get()
        if item is self._END:
            self._queue.put_nowait(self._END)  # for any other iterator
            raise StopAsyncIteration
        if not isinstance(item, ReceivedChunk | ReceivedManifest):
            raise TypeError(f"unexpected queue item {item!r}")
        return item

    def drop_pending(self) -> None:
        """Drop every queued item (so a handler waiting to queue one can finish)."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if self._on_drop is not None and isinstance(item, ReceivedChunk | ReceivedManifest):
                self._on_drop(item)

    def end(self) -> None:
        self.drop_pending()
        self._queue.put_nowait(self._END)


def fingerprint(data: bytes | memoryview) -> bytes:
    """What tells two different chunks under one (version, chunk id) apart: their first 64
    bytes. A deltarl chunk frame's header holds its base, target, chunk id and xxh3-64
    checksum there, so a version re-sent in full after a half-delivered delta is new, while a
    true duplicate is not."""
    return bytes(memoryview(data)[:64])


def manifest_mark(data: bytes | memoryview) -> bytes:
    """What tells two manifests of one version apart: a hash of all of it. Their first bytes
    (version, base, kind) are the same for two sends of a version in full, which differ in
    their chunk ids, further in; a manifest is small, so hashing it whole costs nothing."""
    return xxhash.xxh3_128_digest(data)


class DeliveredSet:
    """Which chunks and manifests of recent versions a receiver has delivered.

    This is what makes receipt idempotent: ``add_*`` is True only the first time a payload
    (by ``fingerprint``) arrives under its (version, chunk id). It also answers the stream
    sender's resume question. Only the newest ``keep_versions`` versions are remembered, so
    memory stays bounded; a duplicate of an older version is delivered again, which the apply
    agent ignores (it refuses chunks of a version it is not applying).
    """

    def __init__(self, keep_versions: int) -> None:
        self._keep = keep_versions
        self._chunks: dict[int, set[tuple[int, bytes]]] = {}
        self._manifests: dict[int, set[bytes]] = {}

    def add_chunk(self, version: int, chunk_id: int, mark: bytes = b"") -> bool:
        """True the first time this payload (``mark``: its fingerprint) arrives."""
        held = self._version(version)
        if held is None:
            return True
        if (chunk_id, mark) in held:
            return False
        held.add((chunk_id, mark))
        return True

    def add_manifest(self, version: int, mark: bytes = b"") -> bool:
        if self._version(version) is None:
            return True
        if mark in self._manifests[version]:
            return False
        self._manifests[version].add(mark)
        return True

    def chunks(self, version: int) -> list[int]:
        """The chunk ids of ``version`` delivered so far, ascending."""
        return sorted({cid for cid, _ in self._chunks.get(version, ())})

    def _version(self, version: int) -> set[tuple[int, bytes]] | None:
        """The set for ``version``, made if needed; None for one too old to remember."""
        held = self._chunks.get(version)
        if held is not None:
            return held
        if len(self._chunks) >= self._keep:
            oldest = min(self._chunks)
            if version < oldest:
                return None
            del self._chunks[oldest], self._manifests[oldest]
        self._manifests[version] = set()
        return self._chunks.setdefault(version, set())


def check_ids(version: int, chunk_id: int = 0) -> None:
    """ValueError unless both fit the frame's fields (i64 version >= 0, u32 chunk id)."""
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version {version} is outside [0, 2**63)")
    if not 0 <= chunk_id <= MAX_CHUNK_ID:
        raise ValueError(f"chunk id {chunk_id} is outside [0, 2**32)")


# link type -> (module, sender class, receiver class). Imported when first used: each backend
# imports this module, and loads its own dependencies (ucxx only for "ucx").
_BACKENDS = {
    "shm": ("deltarl.transport.shm_link", "ShmSender", "ShmReceiver"),
    "stream": ("deltarl.transport.stream", "StreamSender", "StreamReceiver"),
    "ucx": ("deltarl.transport.ucx_link", "UcxSender", "UcxReceiver"),
}


def _backend(config: LinkConfig, role: int) -> Any:  # noqa: ANN401 - a class, by name
    entry = _BACKENDS.get(config.type)
    if entry is None:
        raise ValueError(f"unknown link type {config.type!r}; expected 'shm', 'stream' or 'ucx'")
    return getattr(importlib.import_module(entry[0]), entry[role])


def make_sender(config: LinkConfig) -> ChunkSender:
    """The sender of the backend ``config.type`` names."""
    sender: ChunkSender = _backend(config, 1)(config)
    return sender


def make_receiver(config: LinkConfig) -> ChunkReceiver:
    """The receiver of the backend ``config.type`` names."""
    receiver: ChunkReceiver = _backend(config, 2)(config)
    return receiver
