"""Fan-out: an apply agent relays every chunk and manifest it receives to further apply agents.

Across regions, one apply agent per region receives each chunk once over the slow link and
relays it inside the region (DESIGN.md, "Scaling out"); the agents it feeds may relay again,
so the agents form a tree rooted at the export agent's receiver. Chunks are relayed as they
arrived (the frame bytes are not decoded or re-encoded), so every agent verifies the same
checksums the export agent wrote: verification is end to end, not hop by hop.

    receive (root) --copy--> Downstream queue --sender--> child apply agent (maybe a relay)
         \\--> apply locally (the same bytes)

The export agent sees the whole tree as one receiver. The root's ``status`` carries a
``tree`` object made from its own state and its children's ``tree`` (or plain) status:

    session         own session + each child's tree session, in order; a child that does
                    not answer shows as "name:?". Any restart (or loss, or return) anywhere
                    changes it, and a changed session makes the export agent send a full
                    version to everyone: a returning member never gets a delta on a base it
                    may not hold.
    active_version  own active version if every answering child's tree holds the same, else
                    None (some member has not activated it yet)
    needs_full      own, or any child's
    last_failed     the newest failure of self, a child's tree, or of relaying to a child

A child that does not answer is left out of ``active_version`` (its session shows "?"), so a
dead host slows the rest of the tree by one full version, not forever.

Invariant: the relay never holds more than ``max_queued_bytes`` per child. A child that falls
that far behind loses the version (counted as ``dropped_versions`` and reported as a failure
of that version, so the export agent sends a full one next) instead of stalling its siblings
and the relay's own apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from deltarl.transport.base import (
    LinkConfig,
    LinkError,
    ReceivedChunk,
    ReceivedManifest,
    make_sender,
)
from deltarl.transport.control import ControlClient, ControlProtocolError, ControlTimeoutError
from deltarl.transport.messages import GetStatus, Status

logger = logging.getLogger(__name__)

CHILD_STATUS_TIMEOUT_S = 1.0
RETRY_S = 0.5  # after a link failure, before a fresh sender is made


@dataclass(frozen=True)
class RelayTarget:
    """One apply agent this one relays to (``[[daemons.apply.relay]]`` in the config)."""

    control: str
    """The child's control endpoint: its ``status`` is part of this agent's tree status."""
    link: LinkConfig
    """How the chunks reach it (its receiver's link config)."""
    name: str = ""
    """For status and logs; default: the control endpoint."""
    max_queued_bytes: int = 256 << 20
    """Relayed bytes waiting for this child at most (see the module's invariant)."""

    def __post_init__(self) -> None:
        if self.max_queued_bytes <= 0:
            raise ValueError(f"max_queued_bytes must be positive, got {self.max_queued_bytes}")

    @property
    def label(self) -> str:
        return self.name or self.control


@dataclass(frozen=True)
class _Item:
    version: int
    chunk_id: int | None  # None: the manifest
    data: bytes


class Downstream:
    """One child: a byte-bounded queue and a task that sends it through a fresh sender after
    every link failure."""

    def __init__(self, target: RelayTarget) -> None:
        self.target = target
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.queued_bytes = 0
        self.dropped: dict[int, str] = {}  # version -> why it was not relayed (recent ones)
        self.last_failed: dict[str, Any] | None = None
        self.relayed_chunks = 0
        self.relayed_bytes = 0
        self.dropped_versions = 0
        self.status_client = ControlClient(target.control)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"relay:{self.target.label}")

    def offer(self, item: _Item) -> None:
        """Queue ``item`` unless its version is already lost for this child, or the queue is
        full (then the version is lost: see the module's invariant)."""
        if item.version in self.dropped:
            return
        if self.queued_bytes + len(item.data) > self.target.max_queued_bytes:
            self._drop(item.version, f"more than {self.target.max_queued_bytes} bytes queued")
            return
        self.queued_bytes += len(item.data)
        self.queue.put_nowait(item)

    def _drop(self, version: int, reason: str) -> None:
        if version in self.dropped:
            return
        self.dropped[version] = reason
        while len(self.dropped) > 64:
            del self.dropped[min(self.dropped)]
        self.dropped_versions += 1
        why = f"not relayed to {self.target.label}: {reason}"
        self.last_failed = {"version": version, "reason": why}
        logger.warning("version %d %s", version, why)

    async def _run(self) -> None:
        while True:
            sender = make_sender(self.target.link)
            item: _Item | None = None
            try:
                async with sender:
                    while True:
                        item = await self.queue.get()
                        self.queued_bytes -= len(item.data)
                        if item.version in self.dropped:
                            continue
                        if item.chunk_id is None:
                            # Stream: returns once the child acknowledged the whole version.
                            await sender.send_manifest(item.version, item.data)
                        else:
                            await sender.send_chunk(item.version, item.chunk_id, item.data)
                            self.relayed_chunks += 1
                            self.relayed_bytes += len(item.data)
            except LinkError as e:
                # The sender is spent (a stream sender fails for good); what it held for the
                # current version is lost, so the version is. A fresh sender serves the next.
                if item is not None:
                    self._drop(item.version, f"link: {e}")
                logger.warning("relay link to %s failed: %s", self.target.label, e)
                await asyncio.sleep(RETRY_S)

    async def status(self) -> dict[str, Any] | None:
        """The child's status fields (its tree when it relays too), or None if it is silent."""
        try:
            reply = await self.status_client.request(GetStatus(), CHILD_STATUS_TIMEOUT_S)
        except (ControlTimeoutError, ControlProtocolError):
            return None
        if not isinstance(reply, Status):
            return None
        fields = reply.fields
        tree = fields.get("tree")
        return tree if isinstance(tree, dict) else fields

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.status_client.close()


class Relay:
    """All children of one apply agent."""

    def __init__(self, targets: tuple[RelayTarget, ...]) -> None:
        self.children = [Downstream(t) for t in targets]

    def start(self) -> None:
        for child in self.children:
            child.start()

    def forward(self, item: ReceivedChunk | ReceivedManifest) -> None:
        """Queue a copy of ``item`` for every child. A copy, because a received chunk's bytes
        belong to the transport and are released once applied here."""
        if not self.children:
            return
        chunk_id = item.chunk_id if isinstance(item, ReceivedChunk) else None
        relayed = _Item(item.version, chunk_id, bytes(item.data))
        for child in self.children:
            child.offer(relayed)

    async def tree(self, own: dict[str, Any]) -> dict[str, Any]:
        """The tree status (see the module docstring) from this agent's own fields."""
        t0 = time.monotonic()
        answers = await asyncio.gather(*(c.status() for c in self.children))
        sessions = [str(own.get("session"))]
        active = own.get("active_version")
        needs_full = bool(own.get("needs_full"))
        failures = [own.get("last_failed")]
        members: dict[str, Any] = {}
        for child, st in zip(self.children, answers, strict=True):
            failures.append(child.last_failed)
            label = child.target.label
            if st is None:
                sessions.append(f"{label}:?")
                members[label] = {"reachable": False}
                continue
            sessions.append(f"{label}:{st.get('session')}")
            if st.get("active_version") != own.get("active_version"):
                active = None
            needs_full = needs_full or bool(st.get("needs_full"))
            failures.append(st.get("last_failed"))
            members[label] = {
                "reachable": True,
                "active_version": st.get("active_version"),
                "needs_full": st.get("needs_full"),
                "relayed_chunks": child.relayed_chunks,
                "relayed_bytes": child.relayed_bytes,
                "dropped_versions": child.dropped_versions,
                "queued_bytes": child.queued_bytes,
            }
        known = [f for f in failures if isinstance(f, dict) and f.get("version") is not None]
        return {
            "session": "/".join(sessions),
            "active_version": active,
            "needs_full": needs_full,
            "last_failed": max(known, key=lambda f: f["version"]) if known else None,
            "members": members,
            "status_s": round(time.monotonic() - t0, 6),
        }

    async def close(self) -> None:
        for child in self.children:
            await child.close()
