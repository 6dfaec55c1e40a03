"""The export agent's core: diff the trainer's published weights, encode, send, record.

The export agent is the only reader of the trainer's published store. For each new version it
encodes the weights under a lease against its reference (a delta: read in place, and the
changed elements written into the reference as they are coded; a full version: copied out
first), sends each chunk as soon as the encoder yields it, then the manifest, and records the
version's life in the ManifestStore (pending -> uploaded -> verified -> active, or failed). No
socket here: the process module (deltarl/daemons/export.py) hands in the link's sender and a
``StateFeed`` that hears the receiver (deltarl/refit/receiver_state.py).

The reference and its acknowledgement (docs/architecture.md, "Why it pays: the reference"):

    the reference is what the receiver holds: (bytes, version, receiver session)
    1. the receiver's latest state: {session, active_version, needs_full, failed_version}
       none, or older than the feed's stale_s -> send nothing, wait (a restarting receiver
       must not get a delta)
    2. full version if: deltas turned off (``deltas off``) | no reference | session differs
       (receiver restarted) | its active version is not the reference version (rolled back,
       or lost a version) | needs_full (it refused a delta or failed one) | a ``resync``
       command | ``resync_period`` deltas in a row (``full_resync_every``, or fewer where
       deltas are nearly as large as a full version: ``full_resync_overhead``); otherwise a
       delta on the reference
    3. encode and send; the manifest last (stream: returns once everything is acked)
    4. wait for the states the receiver pushes: active_version == v (same session): verified
       + active, the reference becomes v | failed_version == v, the session changed, or
       ack_timeout_s passed: failed, the reference is dropped (step 2 sends a full one next),
       and what the link still holds of the version is withdrawn (the shm link's files)

Invariant: the reference advances only on an acknowledgement from the same receiver session,
so every delta is built on bytes the receiver was seen holding.

After a failure the newest published version is sent again (in full: the reference is gone),
after a back-off that doubles from ``RETRY_S`` to ``RETRY_MAX_S``, until one is acknowledged:
a trainer that publishes nothing newer (paused, finished, or waiting for samples that need
the new weights) must not leave the receivers one version behind for good.

Drain: no new version is taken; the one in flight is sent and its acknowledgement awaited.

Operator commands (besides ``resync``), through ``handlers()``:

- ``versions`` (``GetVersions``): the manifest store's rows, answered ``Versions``
  (``deltarl ctl export versions``).
- ``deltas`` (``SetDeltas``): the lever that turns deltas off, ``enabled=False``: every
  version sent afterwards is full (reason "deltas turned off by an operator", first of the
  rules of step 2), until ``enabled=True``. The reference is still kept meanwhile, so the
  first version after ``deltas on`` is a delta again. The switch is kept in a small file
  beside the manifest store's (``<manifest store>.deltas.json``, written atomically) and read
  at start, so it survives a restart; an unreadable file leaves deltas off (full versions are
  always correct) and logs why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import orjson

from deltarl.atomic_file import write_atomic
from deltarl.codecs.checksum import tensor_digests
from deltarl.codecs.encoder import Chunk, DeltaEncoder, delta_coding_options
from deltarl.codecs.frame import CHUNKS_PER_SEND, SEND_SLOTS
from deltarl.codecs.kernel_warmth import KernelWarmth
from deltarl.codecs.manifest import RefitManifest
from deltarl.codecs.manifest_seal import seal
from deltarl.config.refit import ExportConfig
from deltarl.engine.daemon import DaemonContext, DaemonCore, PauseGate
from deltarl.engine.leases import Snapshot
from deltarl.engine.weight_store import WeightStore
from deltarl.ops import metrics
from deltarl.refit.manifest_store import ManifestStore, ManifestStoreError, State, VersionRecord
from deltarl.refit.receiver_state import ReceiverState, RefitRecord, StateFeed
from deltarl.transport.base import ChunkSender, LinkError
from deltarl.transport.control import Handler
from deltarl.transport.messages import (
    MAX_MESSAGE_BYTES,
    Command,
    Error,
    ErrorCode,
    GetVersions,
    Ok,
    RefitFailed,
    Resync,
    SetDeltas,
    VersionPublished,
    Versions,
)

logger = logging.getLogger(__name__)

RECENT = 64
RETRY_S = 0.5  # the first back-off before a failed version is sent again
RETRY_MAX_S = 10.0
DELTAS_OFF = "deltas turned off by an operator"  # the full reason while the switch is off
ALL_VERSIONS = (1 << 63) - 1  # a ``history`` limit that takes every row (sqlite's largest)
VERSIONS_REPLY_BYTES = MAX_MESSAGE_BYTES - 4096  # rows of a Versions reply, at most


async def put_unless_done(
    queue: asyncio.Queue[Chunk | None], item: Chunk | None, consumer: asyncio.Task[None]
) -> bool:
    """Queue ``item``; False if the consumer ended first (a full queue would wait forever)."""
    put = asyncio.create_task(queue.put(item))
    await asyncio.wait({put, consumer}, return_when=asyncio.FIRST_COMPLETED)
    if put.done():
        return True
    put.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await put
    return False


def resync_period(
    ceiling: int, overhead: float, full_bytes: float | None, delta_bytes: float | None
) -> int:
    """How many deltas in a row before a periodic full version (seed 004: the period follows
    the measured change, instead of "full often, to be safe").

    A full version every N deltas costs full_bytes / N per version on top of the deltas; it
    is worth that when the cost is at most ``overhead`` of a delta's bytes, so N =
    ceil(full_bytes / (overhead x delta_bytes)), at most ``ceiling`` (the configured period
    still bounds every delta chain) and at least 1. Unmeasured, or ``overhead`` 0: the
    ceiling."""
    if overhead <= 0 or not full_bytes or not delta_bytes:
        return ceiling
    return max(1, min(ceiling, math.ceil(full_bytes / (overhead * delta_bytes))))


@dataclasses.dataclass
class Reference:
    """What the receiver was last seen holding: the bytes, their version, its session.

    Invariant: ``version`` (and ``session``) are set only while ``buffer`` holds exactly that
    version's bytes. The buffer is the export agent's only model-sized one: the version being
    sent is written into it (a full one copied in, a delta brought in by the encoder as it
    codes, sparsely), so ``take`` clears the label before the bytes change and ``adopt`` sets
    it once the receiver acknowledges. Whatever stops a send in between (a failure, a
    cancellation) leaves no label, so the next version goes in full.
    """

    buffer: np.ndarray | None = None
    version: int | None = None
    session: str | None = None
    deltas_in_a_row: int = 0

    def drop(self) -> None:
        """Forget what the receiver holds; the buffer stays, for its memory."""
        self.version = self.session = None

    def take(self, like: np.ndarray) -> np.ndarray:
        """The buffer (made like ``like`` the first time), unlabelled: it is about to
        change. Allocated once: a fresh array per version cost more in page faults than a
        copy of the model."""
        if self.buffer is None:
            self.buffer = np.empty_like(like)
        self.drop()
        return self.buffer

    def adopt(self, version: int, session: str, *, delta: bool) -> None:
        """The receiver acknowledged ``version``, whose bytes the buffer holds."""
        self.version, self.session = version, session
        self.deltas_in_a_row = self.deltas_in_a_row + 1 if delta else 0

    def full_reason(  # noqa: PLR0911
        self,
        receiver: ReceiverState,
        version: int,
        *,
        resync: bool,
        every: int,
        deltas: bool = True,
    ) -> str | None:
        """Why version ``version`` must go in full (None: a delta on the reference is safe).
        ``deltas=False``: an operator turned deltas off, every version is full."""
        if not deltas:
            return DELTAS_OFF
        if self.buffer is None or self.version is None:
            return "no reference"
        if receiver.session != self.session:
            return "the apply agent restarted"
        if receiver.active_version != self.version:
            return (
                f"the apply agent holds {receiver.active_version}, the reference is {self.version}"
            )
        if receiver.needs_full:
            return "the apply agent asked for one"
        if resync:
            return "resync command"
        if self.deltas_in_a_row >= every:
            return f"periodic, after {self.deltas_in_a_row} deltas"
        if self.version >= version:
            return f"version {version} is not newer than the reference {self.version}"
        return None


class ExportCore(DaemonCore):
    """Watches, encodes and sends; its command handlers only set flags the loop reads."""

    daemon: ClassVar[str] = "export"
    # Read from self.config where used (systemctl reload changes them live).
    reloadable: ClassVar[frozenset[str]] = frozenset(
        {
            "full_resync_every",
            "full_resync_overhead",
            "ack_timeout_s",
            "keep_versions",
            "delta_coding",
            "value_classes",
        }
    )

    def __init__(
        self,
        config: ExportConfig,
        context: DaemonContext,
        feed: StateFeed,
        senders: Callable[[], ChunkSender],
        manifests: ManifestStore,
        mac_key: bytes | None = None,
    ) -> None:
        """``mac_key``: the cluster's data key; with it every manifest is sealed (a MAC,
        deltarl/codecs/manifest_seal.py) and lists a BLAKE2b-256 hash per chunk."""
        self.config = config
        self.mac_key = mac_key
        self.context = context
        self.feed = feed
        self.senders = senders
        """Makes the link's sender: a fresh one after every link error (a stream sender that
        gave up stays failed), so a link that comes back carries the next send."""
        self.sender: ChunkSender | None = None
        self._spent = False
        self.manifests = manifests
        self.gate = PauseGate()
        self.store: WeightStore | None = None
        self.encoder: DeltaEncoder | None = None
        # The warm-up of the codec kernels, started by the process (daemons/export.py);
        # None where the core runs without one (in-process tests, benches).
        self.kernels: KernelWarmth | None = None
        self.ref = Reference()
        self.resync_pending = False
        self.deltas_path = deltas_switch_path(manifests.path)
        self.deltas_enabled = load_deltas_switch(self.deltas_path)
        if not self.deltas_enabled:
            logger.warning("deltas are off (%s): every version is sent in full", DELTAS_OFF)
        self.last_full_reason: str | None = None  # why the last version sent went in full
        self.draining = False
        self.shipping = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.detail = "starting"
        self.taken: int | None = None  # the last published version copied out
        self.sent = 0
        self.failed = 0
        self.republished = 0  # older versions published again, not sent (_republished)
        self.retries = 0  # versions sent again (after a failure, a resync, a restart)
        self.withdrawn = 0  # chunks of failed versions taken back from the link (_withdraw)
        # Failed versions whose published bytes no longer matched the trainer's digests
        # (_published_changed), and the newest of them: it is not sent again.
        self.published_mismatches = 0
        self.mismatched: tuple[int, int] | None = None  # (version, store generation)
        # version -> how often it was sent: a version sent again numbers its chunks from
        # elsewhere, or a link that delivered them before would drop them as duplicates
        self._sends: dict[int, int] = {}
        self.retry_at: float | None = None  # when the last failed version goes again
        self._backoff = RETRY_S
        # The last RECENT records: `deltarl up` reads every refit's figures from here even
        # when versions come faster than it polls.
        self.recent: deque[RefitRecord] = deque(maxlen=RECENT)
        # Read at scrape time from the trainer's store: never behind it.
        metrics.PUBLISHED_VERSION.set_function(self._published_version)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.config
        self.store = await self._open_published()
        self.encoder = DeltaEncoder(
            self.store.layout,
            chunk_bytes=cfg.chunk_bytes,
            hash_chunks=self.mac_key is not None,
            value_classes=cfg.value_classes,
        )
        while not self.draining:
            self._spent = False
            try:
                async with self.senders() as sender:
                    self.sender = sender
                    await self._serve()
            except LinkError as e:
                # The link could not start or close (no receiver in time, a spent stream):
                # tolerated, a fresh sender is made after a pause.
                logger.warning("export link: %s; trying a fresh sender", e)
                await asyncio.sleep(RETRY_S)

    async def _serve(self) -> None:
        """Send versions through ``self.sender`` until draining, or until a link error has
        spent it."""
        assert self.store is not None  # opened in run()
        cfg = self.config
        while not self.draining and not self._spent:
            # 1) a version to send (a new one, or the newest again)? 2) a receiver to send
            # it to? 3) ship it
            published = self.store.active_version
            receiver = self.feed.latest()
            again = None if published != self.taken else self._again(receiver)
            if self.gate.paused or published is None or (published == self.taken and not again):
                self.detail = "paused" if self.gate.paused else "idle"
                if self.retry_at is not None and not self.gate.paused:
                    self.detail = "waiting to send the newest version again"
                if self._mismatched(published):
                    self.detail = (
                        f"waiting for a version newer than {published}: its published bytes "
                        f"are not the ones the trainer committed"
                    )
                await asyncio.sleep(cfg.poll_s)
                continue
            if receiver is None:
                self.detail = "waiting for the apply agent"
                await self.feed.next(cfg.poll_s)
                continue
            if not again and self._republished(published, receiver):
                self.taken = published
                continue
            if again:
                self.retries += 1
                logger.info("version %d: sending it again (%s)", published, again)
            self.retry_at = None
            self.shipping = True
            self._idle.clear()
            try:
                await self._take_and_ship(receiver)
                await self._prune()  # before idle: a drain waits for it, then the store closes
            finally:
                self.shipping = False
                self._idle.set()

    async def _take_and_ship(self, receiver: ReceiverState) -> None:
        assert self.store is not None  # opened in run()
        if self.kernels is not None:  # before the lease: the trainer is not held meanwhile
            await self.kernels.wait()
        taken_at = time.monotonic()
        snap = self.store.lease()
        try:
            self.taken = snap.version
            await self._ship(snap, receiver, taken_at)
        finally:
            snap.release()  # idempotent: _ship releases it as soon as it can

    def _again(self, receiver: ReceiverState | None) -> str | None:
        """Why the version already taken must be sent again (None: it need not).

        Only to a receiver that does not hold it, and never before the back-off of the last
        failure has passed, so a version that keeps failing is not sent in a loop. A rollback
        on the apply agent alone is not a reason: that is an operator's choice, which the next
        new version (or ``resync``) ends.
        """
        if receiver is not None and self._older_than_held(self.taken, receiver):
            # Whatever the reason (a restart of either agent, a failure, resync), a version
            # older than the one the receiver holds is never sent: see ``_republished``.
            return None
        if self.retry_at is not None and time.monotonic() < self.retry_at:
            return None
        if self.taken is not None and self._mismatched(self.taken):
            return None  # its published bytes are not the trainer's: wait for its next
        if self.retry_at is not None:
            return "after its failure"
        if receiver is None or receiver.active_version == self.taken:
            return None  # it holds the newest version: nothing to send again
        reasons = {
            "the apply agent asked for a full version": receiver.needs_full,
            "resync command": self.resync_pending,
            "the apply agent restarted": self.ref.session not in (None, receiver.session),
        }
        return next((why for why, holds in reasons.items() if holds), None)

    def _republished(self, version: int, receiver: ReceiverState) -> bool:
        """Whether ``version`` is an older version published again, which is not sent.

        A trainer restarted from its checkpoint publishes the checkpoint's version again and
        replays the steps after it (bit-exactly: tests/trainer). The receiver keeps the newer
        version it holds; the trainer's next *newer* version goes as a delta against exactly
        what the receiver holds, so it arrives bit-exact whatever the replay produced. Sending
        the old version instead would roll every engine back for nothing. That holds after a
        restart of either agent too (a new receiver session, or no reference): a version
        older than the receiver's active one is not sent then either (``deltarl chaos`` found
        the engines rolled back when the apply agent restarted during a trainer's replay).
        """
        ref = self.ref
        same_receiver = (
            ref.version is not None
            and version <= ref.version
            and receiver.session == ref.session
            and receiver.active_version == ref.version
        )
        # Also when the reference says nothing (either agent restarted since): the receiver's
        # own state says what it holds, and an older version would roll it back just the same.
        if not same_receiver and not self._older_than_held(version, receiver):
            return False
        self.republished += 1
        detail = ""
        if version == ref.version and self.store is not None and ref.buffer is not None:
            with self.store.lease() as snap:
                same = snap.version == version and np.array_equal(snap.buffer, ref.buffer)
            if not same:
                # The replay diverged (another torch build or thread count?): the receiver's
                # version ``version`` is not the trainer's until the next version replaces it.
                logger.error(
                    "version %d republished with other bytes than the receiver holds; "
                    "the next version corrects it",
                    version,
                )
                detail = " (bytes differ!)"
        logger.info(
            "version %d published again (trainer restart?): the receiver keeps %d%s",
            version,
            receiver.active_version,
            detail,
        )
        return True

    @staticmethod
    def _older_than_held(version: int | None, receiver: ReceiverState) -> bool:
        """Whether ``version`` is older than the version the receiver holds active."""
        held = receiver.active_version
        return version is not None and held is not None and version < held

    async def _open_published(self) -> WeightStore:
        """The trainer's store, read-only, once it exists (the trainer may start after us)."""
        self.detail = "waiting for the published store"
        while True:
            try:
                return WeightStore.open(
                    self.config.published_store, root=self.config.store_root, readonly=True
                )
            except FileNotFoundError:
                await asyncio.sleep(self.config.poll_s)

    async def _ship(self, snap: Snapshot, receiver: ReceiverState, taken_at: float) -> None:
        """Encode ``snap`` against the reference, send it, release ``snap``, await the
        acknowledgement; the reference's buffer then holds ``snap``'s bytes and is adopted.

        For a delta the encoder reads the published buffer in place, under the lease, and
        writes each changed element into the reference as it codes it (``advance``): the
        next diff's reference without a copy of the model (a copy made after encoding cost
        the refit 20-50 ms of the memory bandwidth the receiver's apply shares, on a 98M
        model) and without a second model-sized buffer. The lease covers the encoding only,
        never a wait for the network (chunks queue for the link), so a slow link cannot keep
        the trainer from publishing.
        """
        assert self.encoder is not None  # set in run() before the loop
        version = snap.version
        reason = self.ref.full_reason(
            receiver,
            version,
            resync=self.resync_pending,
            every=self.resync_period(),
            deltas=self.deltas_enabled,
        )
        self.last_full_reason = reason
        base = None if reason else self.ref.version
        session = receiver.session
        kind = "delta" if base is not None else "full"
        self.detail = f"sending {version} ({'full: ' + reason if reason else f'delta on {base}'})"
        if reason:
            self.resync_pending = False
            logger.info("version %d: full (%s)", version, reason)
        t0 = time.monotonic()
        # The trainer's own digests of these bytes, committed with them (None from a trainer
        # that keeps none: the encoder hashes the model then); read under the lease.
        digests = snap.tensor_digests
        # Unlabelled from here: its bytes become this version's (Reference's invariant).
        current = self.ref.take(snap.buffer)
        if reason:
            # A full version is as large as the model and may cross a slow link: copy it out
            # first and let the lease go, so no network wait ever holds the trainer up.
            await asyncio.to_thread(np.copyto, current, snap.buffer)
            snap.release()
        source = current if reason else snap.buffer
        sends = self._sends.get(version, 0)
        self._sends[version] = sends + 1
        while len(self._sends) > RECENT:
            del self._sends[min(self._sends)]
        # read per version: delta_coding may change by reload (the receivers need nothing)
        coding = delta_coding_options(self.config.delta_coding)
        self.encoder.conditioned, self.encoder.conditioned_coder = coding
        self.encoder.value_classes = self.config.value_classes
        encoding = self.encoder.encode(
            source,
            None if reason else current,
            target_version=version,
            base_version=base,
            first_chunk_id=(sends % SEND_SLOTS) * CHUNKS_PER_SEND,
            advance=not reason,
            tensor_digests=digests,
        )
        chunks = iter(encoding)
        # Encoded chunks wait here for the link. For a delta the queue is unbounded, so the
        # encoder (which holds the lease) never waits for the network; a delta's chunks are at
        # most about a full version's wire size. A full version encodes from our own copy and
        # may wait: its queue is bounded.
        outbox: asyncio.Queue[Chunk | None] = asyncio.Queue(4 if reason else 0)
        sender = self.sender
        assert sender is not None  # set by run() around _serve()
        sent = {"bytes": 0, "seconds": 0.0}

        async def send_all() -> None:
            while (chunk := await outbox.get()) is not None:
                t = time.monotonic()
                await sender.send_chunk(version, chunk.chunk_id, chunk.data)
                sent["seconds"] += time.monotonic() - t
                sent["bytes"] += len(chunk.data)

        sending = asyncio.create_task(send_all(), name=f"export:send:{version}")
        recorded = False
        encoded_at = 0.0
        encode_s = time.monotonic() - t0  # time in the encoder (bench refit reads it)
        try:
            # Send while still encoding: each chunk leaves as soon as it exists.
            while not sending.done():  # done early: the link failed (raised below)
                t = time.monotonic()
                chunk = await asyncio.to_thread(next, chunks, None)
                encode_s += time.monotonic() - t
                if not await put_unless_done(outbox, chunk, sending) or chunk is None:
                    break
            snap.release()  # encoded: ``current`` holds its bytes now
            encoded_at = time.monotonic()
            await sending  # raises the link's error, if any
            manifest = encoding.manifest
            assert manifest is not None  # set once the chunks are exhausted
            recorded = self._record(manifest)
            t = time.monotonic()
            body = manifest.to_json()
            await sender.send_manifest(
                version, body if self.mac_key is None else seal(body, self.mac_key)
            )
            sent_at = time.monotonic()
            send_s = sent["seconds"] + sent_at - t
            nbytes = sent["bytes"]
        except LinkError as e:
            self._spent = True  # a fresh sender for the next send
            await self._failed(version, f"link: {e}", recorded=recorded)
            return
        finally:
            if not sending.done():
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, LinkError):
                    await sending
            snap.release()
        if recorded:
            self._mark(version, State.UPLOADED)
        self.sent += 1
        metrics.EXPORT_WIRE_BYTES.labels(kind).inc(nbytes)
        await self.context.publish(VersionPublished(version, base, nbytes))
        self.detail = f"waiting for the apply agent to activate {version}"
        outcome, acked_by = await self._await_ack(version, session, receiver.failures)
        acked_at = time.monotonic()
        if outcome is not None and digests is not None:
            outcome += await asyncio.to_thread(self._published_changed, version, digests)
        record = RefitRecord(
            version=version,
            base=base,
            kind=kind,
            wire_bytes=nbytes,
            outcome=outcome or "active",
            taken_at=taken_at,
            started_at=t0,
            sent_at=sent_at,
            acked_at=acked_at,
            copy_s=round(t0 - taken_at, 6),
            encode_s=round(encode_s, 6),
            send_s=round(send_s, 6),
            seconds=round(acked_at - t0, 4),
            receiver=acked_by,
            changed=manifest.changed,
            elements=self.encoder.layout.numel,
            encoded_at=encoded_at,
        )
        self.recent.append(record)
        if outcome is None:
            stages = metrics.EXPORT_STAGE_SECONDS
            for stage in ("copy", "encode", "send"):
                stages.labels(stage).observe(getattr(record, f"{stage}_s"))
            stages.labels("total").observe(record.seconds)
            metrics.EXPORT_VERSIONS.labels(kind).inc()
            metrics.ACKED_VERSION.set(version)
            if kind == "delta" and record.elements:
                metrics.CHANGED_RATIO.set(record.changed / record.elements)
                metrics.observe_groups(
                    (t.name, t.changed, math.prod(t.shape)) for t in manifest.tensors
                )
        if outcome is not None:
            await self._failed(version, outcome, recorded=recorded)
            return
        if recorded:
            self._mark(version, State.VERIFIED)
            self._mark(version, State.ACTIVE)
        self._backoff = RETRY_S
        self.ref.adopt(version, session, delta=base is not None)
        logger.info(
            "version %d active on the receiver (%d bytes, %.3f s)", version, nbytes, record.seconds
        )

    async def _await_ack(
        self, version: int, session: str, failures: int
    ) -> tuple[str | None, ReceiverState | None]:
        """(None, the acknowledging state) once the receiver reports ``version`` active,
        else (why it did not, the last state heard). Only a failure reported after the send
        began (``failures``: the receiver's count then) fails it."""
        deadline = time.monotonic() + self.config.ack_timeout_s
        state = self.feed.latest()
        while True:
            if state is not None:
                if state.session != session:
                    return "the apply agent restarted before acknowledging", state
                if state.active_version == version:
                    return None, state
                if state.failed(version, after=failures):
                    return f"the apply agent refused it: {state.failed_reason}", state
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no acknowledgement within {self.config.ack_timeout_s} s", state
            state = await self.feed.next(left)

    def _published_changed(self, version: int, digests: list[str]) -> str:
        """After ``version`` failed: whether the published bytes still match the tensor
        digests the trainer committed with them ("" if they do, or if the trainer has
        published since and the question is moot). Receivers check their bytes against those
        digests, so bytes changed after the trainer's commit (a stray writer, bad memory) fail
        on every receiver, in full as in a delta: such a version is named here, counted, and
        not sent again (``_again``); the trainer's next version is."""
        assert self.store is not None  # opened in run()
        with self.store.lease() as snap:
            if snap.version != version:
                return ""
            now = tensor_digests(self.store.layout, snap.buffer)
            generation = snap.generation
        names = [
            spec.name
            for spec, was, got in zip(self.store.layout.tensors, digests, now, strict=True)
            if was != got
        ]
        if not names:
            return ""
        self.published_mismatches += 1
        self.mismatched = (version, generation)
        metrics.EXPORT_PUBLISHED_MISMATCHES.inc()
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        why = (
            f"; the published bytes of {shown} no longer match the digests the trainer "
            f"committed with version {version}: they changed after its commit (a writer other "
            f"than the trainer, or bad memory), so they are not sent again as its weights; the "
            f"trainer's next version is"
        )
        logger.error("version %d%s", version, why)
        return why

    def _mismatched(self, version: int) -> bool:
        """Whether ``version``, as published now, is the one whose bytes were found changed
        (the trainer committing that version number again, after a restart, is a new one)."""
        assert self.store is not None  # opened in run()
        return self.mismatched == (version, self.store.generation)

    async def _failed(self, version: int, reason: str, *, recorded: bool) -> None:
        # Drop the reference: the receiver's state is unknown, so the next version is full;
        # and send the newest version again after a back-off, whether or not a newer comes.
        self.ref.drop()
        self.failed += 1
        metrics.EXPORT_FAILED.inc()
        self.retry_at = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, RETRY_MAX_S)
        logger.warning("version %d failed: %s", version, reason)
        if recorded:
            self._mark(version, State.FAILED, error=reason)
        await self._withdraw(version)
        await self.context.publish(RefitFailed(version, reason))

    async def _withdraw(self, version: int) -> None:
        """Take the failed version's chunks that the apply agent has not taken back from the
        link (the shm link's files; nothing on a network link): a stalled agent must not
        apply, once it reads again, a version given up on and sent again since."""
        if self.sender is None:
            return
        try:
            taken = await self.sender.withdraw(version)
        except OSError as e:  # tolerated: the receiver still refuses what it cannot complete
            logger.warning("version %d: its chunks could not be withdrawn: %s", version, e)
            return
        if taken:
            self.withdrawn += taken
            metrics.EXPORT_WITHDRAWN.inc(taken)
            logger.info(
                "version %d: withdrew %d chunks the apply agent had not taken", version, taken
            )

    def _record(self, manifest: RefitManifest) -> bool:
        try:
            # A version sent again after its failure replaces its failed record.
            self.manifests.record(manifest, again=True)
        except ManifestStoreError as e:
            # Tolerated: the record is for operators; a version the store already holds (a
            # restarted trainer reusing numbers) is still delivered, just not recorded twice.
            logger.warning("version %d not recorded: %s", manifest.version, e)
            return False
        return True

    async def _prune(self) -> None:
        """Retention of the manifest store (``keep_versions``), between two versions: one
        bounded batch and one bounded reclaim per version, in a thread, so it never delays a
        send by more than a batch and still outpaces the one row each version adds."""
        protect = () if self.ref.version is None else (self.ref.version,)
        try:
            await asyncio.to_thread(
                self.manifests.prune, self.config.keep_versions, protect=protect
            )
            await asyncio.to_thread(self.manifests.reclaim)
        except (ManifestStoreError, sqlite3.OperationalError) as e:
            # Tolerated like a record that fails: the store is for operators, the refit goes on.
            logger.warning("manifest store retention: %s", e)

    def _mark(self, version: int, state: State, *, error: str | None = None) -> None:
        try:
            self.manifests.mark(version, state, error=error)
        except ManifestStoreError as e:
            logger.warning("version %d: cannot mark %s: %s", version, state, e)

    # -- the runtime's side ---------------------------------------------------------------

    async def drain(self) -> None:
        self.draining = True
        await self._idle.wait()

    async def close(self) -> None:
        self.manifests.close()
        if self.store is not None:
            self.store.close()

    def resync_period(self) -> int:
        """Deltas in a row before a periodic full version, from this run's wire bytes
        (``resync_period``); the fixed ceiling until a full and a delta were measured."""
        sent = [r for r in self.recent if r.outcome == "active"]
        fulls = [r.wire_bytes for r in sent if r.kind == "full"]
        deltas = [r.wire_bytes for r in sent if r.kind == "delta"]
        return resync_period(
            self.config.full_resync_every,
            self.config.full_resync_overhead,
            fulls[-1] if fulls else None,
            sum(deltas) / len(deltas) if deltas else None,
        )

    def _published_version(self) -> float:
        """The trainer's newest version, as a gauge reads it (-1: none yet; NaN once the store
        is closed: a scrape between the core's close and the metrics server's)."""
        try:
            version = None if self.store is None else self.store.active_version
        except RuntimeError:
            return math.nan
        return -1.0 if version is None else float(version)

    def status_fields(self) -> dict[str, Any]:
        recent = [record_fields(r) for r in self.recent]
        return {
            "published_version": None if self.store is None else self.store.active_version,
            "taken_version": self.taken,
            "reference_version": self.ref.version,
            "receiver_session": self.ref.session,
            "deltas_in_a_row": self.ref.deltas_in_a_row,
            "full_resync_every": self.config.full_resync_every,
            "delta_coding": self.config.delta_coding,
            "full_resync_period": self.resync_period(),
            "resync_pending": self.resync_pending,
            "deltas_enabled": self.deltas_enabled,
            "last_full_reason": self.last_full_reason,
            "sent": self.sent,
            "failed": self.failed,
            "republished": self.republished,
            "retries": self.retries,
            "withdrawn": self.withdrawn,
            "published_mismatches": self.published_mismatches,
            "sealed": self.mac_key is not None,
            "receiver_age_s": round(min(self.feed.age_s, 1e9), 3),
            "last": recent[-1] if recent else None,
            "recent": recent,
            "detail": self.detail,
            "kernels": None if self.kernels is None else self.kernels.fields(),
        }

    def handlers(self) -> Mapping[type[Command], Handler]:
        return {Resync: self.on_resync, GetVersions: self.on_versions, SetDeltas: self.on_deltas}

    async def on_resync(self, _: Resync) -> Ok:
        # The next version is full; and a receiver that does not hold the newest version
        # (rolled back, restarted) gets it again now, in full, whether or not a newer comes.
        self.resync_pending = True
        return Ok("the next version is sent in full")

    async def on_versions(self, cmd: GetVersions) -> Versions | Error:
        """The manifest store's rows (the newest ``cmd.limit``, else all), newest last."""
        if cmd.limit is not None and cmd.limit < 1:
            return Error(
                ErrorCode.BAD_FIELDS, f"'versions': limit must be at least 1, got {cmd.limit}"
            )
        limit = ALL_VERSIONS if cmd.limit is None else cmd.limit
        # In a thread: history reads every row's manifest too (megabytes for a large model).
        records = await asyncio.to_thread(self.manifests.history, limit)
        return versions_reply(records)

    async def on_deltas(self, cmd: SetDeltas) -> Ok | Error:
        """Turn deltas off (every version goes in full) or on again; saved for restarts."""
        changed = cmd.enabled != self.deltas_enabled
        self.deltas_enabled = cmd.enabled  # now, even if it cannot be saved: the lever works
        if changed:
            logger.warning("deltas turned %s by an operator", "on" if cmd.enabled else "off")
        detail = (
            "deltas on: versions go as deltas again"
            if cmd.enabled
            else "deltas off: every version is sent in full until `deltas on`"
        )
        if self.deltas_path is not None:
            try:
                await asyncio.to_thread(save_deltas_switch, self.deltas_path, cmd.enabled)
            except OSError as e:
                return Error(
                    "not_saved",
                    f"{detail}, but not saved to {self.deltas_path} ({e}): "
                    "a restart of the export agent would forget it",
                )
        return Ok(detail if changed else f"{detail} (already)")


def deltas_switch_path(manifest_store: Path) -> Path | None:
    """Where the deltas switch is kept: beside the manifest store's file (None for an
    in-memory store: the switch then lasts as long as the process)."""
    if str(manifest_store) in ("", ":memory:"):
        return None
    return manifest_store.with_name(f"{manifest_store.name}.deltas.json")


def load_deltas_switch(path: Path | None) -> bool:
    """Whether deltas are on: yes without a file; an unreadable one turns them off."""
    if path is None:
        return True
    try:
        saved = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return True
    except (OSError, orjson.JSONDecodeError) as e:
        saved = e
    enabled = saved.get("deltas_enabled") if isinstance(saved, dict) else None
    if isinstance(enabled, bool):
        return enabled
    logger.error(
        "deltas switch %s is unreadable (%s): deltas stay off until `deltas on`",
        path,
        saved if isinstance(saved, Exception) else "no boolean 'deltas_enabled'",
    )
    return False


def save_deltas_switch(path: Path, enabled: bool) -> None:
    """Write the switch atomically: a crash leaves the old setting or the new one."""
    write_atomic(path, orjson.dumps({"deltas_enabled": enabled, "changed_at": time.time()}))


def version_row(record: VersionRecord) -> dict[str, Any]:
    """A manifest store row as ``Versions`` carries it: the record's fields but the manifest."""
    row = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    del row["manifest_json"]
    row["state"] = record.state.value
    return row


def versions_reply(records: list[VersionRecord]) -> Versions:
    """``records`` (newest first, as ``history`` returns them) as a reply, newest last; the
    oldest are left out (``omitted``) where all would not fit in one control message."""
    rows: list[dict[str, Any]] = []
    size = 0
    for record in records:
        row = version_row(record)
        size += len(orjson.dumps(row)) + 1
        if size > VERSIONS_REPLY_BYTES:
            break
        rows.append(row)
    rows.reverse()
    return Versions(rows, omitted=len(records) - len(rows))


def record_fields(record: RefitRecord) -> dict[str, Any]:
    """A record as status reports it: its fields, and ``total_s`` (None unless applied)."""
    return {**dataclasses.asdict(record), "total_s": record.total_s}
