"""What a receiver (an apply agent, or a relay tree) tells the export agent, typed.

The export agent builds every delta on what the receiver holds, so it must know, per receiver
session, the active version, whether a full version is needed, and each version's outcome.
The apply agent *pushes* that state as a ``ReceiverState`` event on its event socket whenever
it changes (a chunk opened a version, a version was applied or refused) and at least every
``heartbeat_s``; the same message answers ``GetReceiverState`` on its control socket, which
the export agent asks when it starts and when the events fall silent (a PUB/SUB subscriber
misses what was published before it connected).

    session         new at every start of the apply agent (for a tree: every member's,
                    joined; see deltarl/refit/relay.py), so a restart anywhere is seen
    active_version  what the rollout store serves (for a tree: only if every member does)
    needs_full      the next version must be full (a refusal or failure asked for it)
    failed_*        the newest version that was not applied, and why
    applied_*       the figures of the newest version applied (``deltarl up``, ``bench refit``)

``RefitRecord`` is the export agent's account of one version, end to end: taken out of the
trainer's store, encoded, sent, and acknowledged with the receiver's own figures, so one
record holds the whole refit (every ``*_at`` is CLOCK_MONOTONIC, comparable on one host).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from deltarl.transport.messages import Command, Event, Reply, decode_table


@dataclass(frozen=True)
class GetReceiverState(Command):
    """Ask an apply agent for its ``ReceiverState`` (a relay root: its tree's)."""

    TAG: ClassVar[str] = "refit.get_receiver"


@dataclass(frozen=True)
class ReceiverState(Event, Reply):
    """A receiver's state: pushed as an event, and the reply to ``GetReceiverState``."""

    TAG: ClassVar[str] = "refit.receiver"
    session: str
    active_version: int | None
    needs_full: bool
    applying: int | None = None
    failed_version: int | None = None
    failed_reason: str = ""
    failures: int = 0
    """Failures reported since the session began: a failure of a version counts for a send
    only if it came after the send began (a version sent again must not be failed by the
    report of its earlier attempt)."""
    applied_version: int | None = None
    applied_base: int | None = None
    started_at: float = 0.0
    """When the applied version's first chunk (or manifest) arrived."""
    committed_at: float = 0.0
    """When it became active (the flip)."""
    open_s: float = 0.0
    apply_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    early_hash_s: float = 0.0
    """Of ``apply_s``: tensors hashed as later chunks landed, which the verify skipped."""
    apply_calls_s: float = 0.0
    """Of ``apply_s``: the worker thread's own time applying (the rest waited for the
    agent's event loop)."""
    apply_cpu_s: float = 0.0
    """The worker thread's CPU time in those calls (less than ``apply_calls_s``: it was
    kept off its CPU)."""
    decode_s: float = 0.0
    """Of ``apply_calls_s``: decoding the chunks and writing the changes."""
    keep_s: float = 0.0
    """Of ``apply_calls_s``: copying the decoded delta to keep (catch-up)."""
    chunks: int = 0
    """Chunks the applied version came in."""
    members: dict[str, Any] = field(default_factory=dict)
    """A relay root's children, by label: reachable, active_version, relay counters."""

    def failed(self, version: int, after: int = -1) -> bool:
        """Whether ``version`` is reported failed, by a failure newer than ``after``."""
        return self.failed_version == version and self.failures > after


RECEIVER_STATE = decode_table(ReceiverState)
"""The decode table of the state: as an event (``EventSubscriber(events=...)``) and as a
reply (``ControlClient(replies={**REPLIES, **RECEIVER_STATE})``)."""


class StateFeed:
    """The newest ``ReceiverState`` heard, and when; ``next`` waits for the one after.

    Whatever hears the receiver (events, a control reply, a test) calls ``update``; the
    export agent reads ``latest`` (None once the state is older than ``stale_s``: a receiver
    that went silent is treated as unreachable, and nothing is sent to it).
    """

    def __init__(self, stale_s: float = 3.0) -> None:
        self.stale_s = stale_s
        self.state: ReceiverState | None = None
        self.heard_at = -math.inf
        self.updates = 0
        self._next = asyncio.Event()

    def update(self, state: ReceiverState) -> None:
        self.state, self.heard_at = state, time.monotonic()
        self.updates += 1
        woken, self._next = self._next, asyncio.Event()
        woken.set()

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.heard_at

    def latest(self) -> ReceiverState | None:
        return self.state if self.age_s <= self.stale_s else None

    async def next(self, timeout_s: float) -> ReceiverState | None:
        """The state after the next update, or ``latest`` after ``timeout_s`` without one."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._next.wait()
        return self.latest()


@dataclass(frozen=True)
class RefitRecord:
    """One version, from the trainer's store to the receiver's flip (or its failure)."""

    version: int
    base: int | None
    kind: Literal["delta", "full"]
    wire_bytes: int
    outcome: str
    """"active", or why it failed."""
    taken_at: float
    """The export agent took the version out of the trainer's store."""
    started_at: float
    """It started encoding."""
    sent_at: float
    """The manifest was handed to the link (everything else was sent before it)."""
    acked_at: float
    """The acknowledgement (or the failure) arrived."""
    copy_s: float
    encode_s: float
    send_s: float
    seconds: float
    """From ``started_at`` to ``acked_at``."""
    receiver: ReceiverState | None = None
    """The state that acknowledged it: the receiver's own figures (``committed_at``...)."""
    changed: int = 0
    """Elements whose bits differ from the base (every element for a full version)."""
    elements: int = 0
    """Elements in the model: ``changed / elements`` is the version's changed ratio."""
    encoded_at: float = 0.0
    """The encoder handed over the last chunk (0.0 where the encoding failed first): from
    here to ``sent_at`` the sender drained the last chunks and sent the manifest."""

    @property
    def total_s(self) -> float | None:
        """From the trainer's store to the receiver's flip; None if it was not applied."""
        r = self.receiver
        if self.outcome != "active" or r is None or r.applied_version != self.version:
            return None
        return r.committed_at - self.taken_at
