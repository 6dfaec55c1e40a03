"""Fan-out: an apply agent relays every chunk and manifest it receives to further apply agents.

Across regions, one apply agent per region receives each chunk once over the slow link and
relays it inside the region (docs/architecture.md, "Scaling out"); the agents it feeds may
relay again, so the agents form a tree rooted at the export agent's receiver. Chunks are
relayed as they arrived (the frame bytes are not decoded or re-encoded), so every agent
verifies the same checksums the export agent wrote: verification is end to end, not hop by
hop.

    receive (root) --copy--> Downstream queue --sender--> child apply agent (maybe a relay)
         \\--> apply locally (the same bytes)

The export agent sees the whole tree as one receiver. The root publishes one
``ReceiverState`` made from its own and its children's (each child publishes its own, or its
subtree's, and the root hears it through a ``StateFeed``, so a change anywhere in the tree
reaches the export agent as an event, not a poll):

    session         own session + each child's tree session, in order; a child not heard
                    from within its feed's stale_s shows as "name:?". Any restart (or
                    loss, or return) anywhere changes it, and a changed session makes the
                    export agent send a full version to everyone: a returning member never
                    gets a delta on a base it may not hold.
    active_version  own active version if every child heard from holds the same, else
                    None (some member has not activated it yet)
    needs_full      own, or any child's
    last_failed     the newest failure of self, a child's tree, or of relaying to a child

A child not heard from is left out of ``active_version`` (its session shows "?"), so a
dead host slows the rest of the tree by one full version, not forever.

Invariant: the relay never holds more than ``max_queued_bytes`` per child. A child that falls
that far behind loses the version (counted as ``dropped_versions`` and reported as a failure
of that version, so the export agent sends a full one next) instead of stalling its siblings
and the relay's own apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltarl.config.refit import RelayTarget
from deltarl.refit.receiver_state import ReceiverState, StateFeed
from deltarl.transport.base import ChunkSender, LinkError, ReceivedChunk, ReceivedManifest
from deltarl.transport.link_config import LinkConfig

logger = logging.getLogger(__name__)

RETRY_S = 0.5  # after a link failure, before a fresh sender is made
KEEP_DROPPED = 64  # versions remembered as lost per child


@dataclass(frozen=True)
class _Item:
    version: int
    chunk_id: int | None  # None: the manifest
    data: bytes


class Downstream:
    """One child: a byte-bounded queue, a task that sends it through a fresh sender after
    every link failure, and the feed of the child's state."""

    def __init__(
        self, target: RelayTarget, feed: StateFeed, senders: Callable[[LinkConfig], ChunkSender]
    ) -> None:
        self.target = target
        self.feed = feed
        self.senders = senders
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.queued_bytes = 0
        self.dropped: dict[int, str] = {}  # version -> why it was not relayed (recent ones)
        self.last_failed: tuple[int, str] | None = None
        self.relayed_chunks = 0
        self.relayed_bytes = 0
        self.dropped_versions = 0
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
        while len(self.dropped) > KEEP_DROPPED:
            del self.dropped[min(self.dropped)]
        self.dropped_versions += 1
        why = f"not relayed to {self.target.label}: {reason}"
        self.last_failed = (version, why)
        logger.warning("version %d %s", version, why)

    async def _run(self) -> None:
        while True:
            item: _Item | None = None
            try:
                async with self.senders(self.target.link) as sender:
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

    def member(self, state: ReceiverState | None) -> dict[str, Any]:
        if state is None:
            return {"reachable": False, "dropped_versions": self.dropped_versions}
        return {
            "reachable": True,
            "active_version": state.active_version,
            "needs_full": state.needs_full,
            "relayed_chunks": self.relayed_chunks,
            "relayed_bytes": self.relayed_bytes,
            "dropped_versions": self.dropped_versions,
            "queued_bytes": self.queued_bytes,
        }

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Relay:
    """All children of one apply agent (none: relaying is off)."""

    def __init__(
        self,
        children: tuple[tuple[RelayTarget, StateFeed], ...],
        senders: Callable[[LinkConfig], ChunkSender] | None = None,
    ) -> None:
        if children and senders is None:
            raise ValueError("a relay with children needs a sender factory")
        self.children = [Downstream(t, f, senders) for t, f in children]  # type: ignore[arg-type]
        self.on_change: Callable[[], None] = lambda: None
        """Called when a child's state changes: the root publishes its tree's state again."""

    def start(self) -> None:
        for child in self.children:
            child.start()

    def heard(self) -> None:
        """A child's state arrived (the process module's watcher calls it)."""
        self.on_change()

    def forward(self, item: ReceivedChunk | ReceivedManifest) -> None:
        """Queue a copy of ``item`` for every child. A copy, because a received chunk's bytes
        belong to the transport and are released once applied here."""
        if not self.children:
            return
        chunk_id = item.chunk_id if isinstance(item, ReceivedChunk) else None
        relayed = _Item(item.version, chunk_id, bytes(item.data))
        for child in self.children:
            child.offer(relayed)

    def tree(self, own: ReceiverState) -> ReceiverState:
        """The tree's state (see the module docstring) from this agent's own."""
        sessions = [own.session]
        active = own.active_version
        needs_full = own.needs_full
        failures: list[tuple[int | None, str]] = [(own.failed_version, own.failed_reason)]
        members: dict[str, Any] = {}
        count = own.failures
        for child in self.children:
            count += child.dropped_versions
            label = child.target.label
            if child.last_failed is not None:
                failures.append(child.last_failed)
            st = child.feed.latest()
            members[label] = child.member(st)
            if st is None:
                sessions.append(f"{label}:?")
                continue
            sessions.append(f"{label}:{st.session}")
            count += st.failures
            if st.active_version != own.active_version:
                active = None
            needs_full = needs_full or st.needs_full
            if st.failed_version is not None:
                failures.append((st.failed_version, st.failed_reason))
        known = [f for f in failures if f[0] is not None]
        newest = max(known, key=lambda f: f[0]) if known else (None, "")
        return dataclasses.replace(
            own,
            session="/".join(sessions),
            active_version=active,
            needs_full=needs_full,
            failed_version=newest[0],
            failed_reason=newest[1],
            failures=count,
            members=members,
        )

    def status(self, tree: ReceiverState) -> dict[str, Any]:
        """The tree as the root's ``status`` shows it."""
        failed = tree.failed_version
        return {
            "session": tree.session,
            "active_version": tree.active_version,
            "needs_full": tree.needs_full,
            "last_failed": None
            if failed is None
            else {"version": failed, "reason": tree.failed_reason},
            "members": tree.members,
        }

    async def close(self) -> None:
        for child in self.children:
            await child.close()
