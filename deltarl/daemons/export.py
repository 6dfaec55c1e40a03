"""``deltarl export --config FILE``: diff the trainer's published weights, encode, send, record.

The export agent is the only reader of the trainer's published store. For each new version it
copies the weights out under a lease, encodes them against its reference, sends each chunk as
soon as the encoder yields it, then the manifest, and records the version's life in the
ManifestStore (pending -> uploaded -> verified -> active, or failed).

The reference and its acknowledgement (DESIGN.md, "The reference for the diff"):

    the reference is what the apply agent holds: (bytes, version, receiver session)
    1. ask the apply agent's ``status``: {session, active_version, needs_full, last_failed}
       unreachable -> send nothing, ask again (a restarting receiver must not get a delta)
    2. full version if: no reference | session differs (receiver restarted) | its active
       version is not the reference version (rolled back, or lost a version) | needs_full
       (it refused a delta or failed one) | a ``resync`` command | full_resync_every deltas
       in a row; otherwise a delta on the reference
    3. encode and send; the manifest last (stream: returns once everything is acked)
    4. poll ``status`` until active_version == v (same session): verified + active, the
       reference becomes v | last_failed names v, the session changed, or ack_timeout_s
       passed: failed, the reference is dropped (so step 2 sends a full version next)

Invariant: the reference advances only on an acknowledgement from the same receiver session,
so every delta is built on bytes the receiver was seen holding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import numpy as np

from deltarl.codecs.encoder import Chunk, DeltaEncoder
from deltarl.daemons.config import DaemonShell, ExportConfig, daemon_main
from deltarl.engine.leases import Snapshot
from deltarl.engine.weight_store import WeightStore
from deltarl.refit.manifest_store import ManifestStore, ManifestStoreError, State
from deltarl.transport.base import ChunkSender, LinkError, make_sender
from deltarl.transport.control import ControlClient, ControlProtocolError, ControlTimeoutError
from deltarl.transport.messages import (
    GetStatus,
    Ok,
    Pause,
    RefitFailed,
    Resume,
    Resync,
    Shutdown,
    Status,
    VersionPublished,
)

logger = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 2.0
RECENT = 64


async def _put_unless_done(
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


class ExportAgent:
    """Watches, encodes and sends; its control handlers only set flags the loop reads."""

    def __init__(self, config: ExportConfig, shell: DaemonShell) -> None:
        self.config = config
        self.shell = shell
        self.manifests = ManifestStore(config.manifest_store)
        self.acks = ControlClient(config.apply_control)
        self.store: WeightStore | None = None
        self.encoder: DeltaEncoder | None = None
        # The reference: what the receiver was last seen holding (see the module docstring).
        self.ref: np.ndarray | None = None
        self._spare: np.ndarray | None = None  # receives the next version (_copy_out)
        self.ref_version: int | None = None
        self.ref_session: str | None = None
        self.deltas_in_a_row = 0
        self.resync_pending = False
        self.paused = False
        self.state = "starting"
        self.taken: int | None = None  # the last published version copied out
        self.sent = 0
        self.failed = 0
        self.republished = 0  # older versions published again, not sent (_republished)
        self.last: dict[str, Any] | None = None
        # The last RECENT ``last`` records: `deltarl up` reads every refit's figures from here
        # even when versions come faster than it polls.
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.taken_at = 0.0

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.config
        self.store = await self._open_published()
        self.encoder = DeltaEncoder(self.store.layout, chunk_bytes=cfg.chunk_bytes)
        async with make_sender(cfg.link) as sender:
            while True:
                # 1) a new published version? 2) a receiver to send it to? 3) ship it
                published = self.store.active_version
                if self.paused or published is None or published == self.taken:
                    self.state = "paused" if self.paused else "idle"
                    await asyncio.sleep(cfg.poll_s)
                    continue
                receiver = await self._receiver_status()
                if receiver is None:
                    self.state = "waiting for the apply agent"
                    await asyncio.sleep(cfg.poll_s)
                    continue
                if self._republished(published, receiver):
                    self.taken = published
                    continue
                self.taken_at = time.monotonic()  # bench refit and deltarl up read it
                snap = self.store.lease()
                try:
                    version, current = snap.version, self._take_spare(snap.buffer)
                    self.taken = version
                    await self._ship(sender, snap, current, receiver)
                finally:
                    snap.release()  # idempotent: _ship releases it as soon as it can
                if self.ref is not current:
                    self._spare = current  # not adopted as the reference: reuse its memory

    def _republished(self, version: int, receiver: dict[str, Any]) -> bool:
        """Whether ``version`` is an older version published again, which is not sent.

        A trainer restarted from its checkpoint publishes the checkpoint's version again and
        replays the steps after it (bit-exactly: tests/trainer). The receiver keeps the newer
        version it holds; the trainer's next *newer* version goes as a delta against exactly
        what the receiver holds, so it arrives bit-exact whatever the replay produced. Sending
        the old version instead would roll every engine back for nothing.
        """
        if (
            self.ref_version is None
            or version > self.ref_version
            or receiver.get("session") != self.ref_session
            or receiver.get("active_version") != self.ref_version
        ):
            return False
        self.republished += 1
        detail = ""
        if version == self.ref_version and self.store is not None and self.ref is not None:
            with self.store.lease() as snap:
                same = snap.version == version and np.array_equal(snap.buffer, self.ref)
            if not same:
                # The replay diverged (another torch build or thread count?): the receiver's
                # version ``version`` is not the trainer's until the next version replaces it.
                logger.error("version %d republished with other bytes than the receiver holds; "
                             "the next version corrects it", version)  # fmt: skip
                detail = " (bytes differ!)"
        logger.info("version %d published again (trainer restart?): the receiver keeps %d%s",
                    version, self.ref_version, detail)  # fmt: skip
        return True

    def _take_spare(self, published: np.ndarray) -> np.ndarray:
        """The buffer that receives a copy of the published bytes (allocated once, reused).

        A fresh array per version cost more in page faults than the copy itself. Two buffers
        suffice: the reference, and the spare that receives the next version.
        """
        buf = self._spare if self._spare is not None else np.empty_like(published)
        self._spare = None
        return buf

    async def _open_published(self) -> WeightStore:
        """The trainer's store, read-only, once it exists (the trainer may start after us)."""
        self.state = "waiting for the published store"
        while True:
            try:
                return WeightStore.open(
                    self.config.published_store, root=self.config.store_root, readonly=True
                )
            except FileNotFoundError:
                await asyncio.sleep(self.config.poll_s)

    async def _receiver_status(self) -> dict[str, Any] | None:
        """The apply agent's status fields, or None if it does not answer now."""
        try:
            reply = await self.acks.request(GetStatus(), STATUS_TIMEOUT_S)
        except (ControlTimeoutError, ControlProtocolError) as e:
            # Tolerated: the apply agent restarts under systemd; we wait for it.
            logger.info("apply agent at %s not answering: %s", self.config.apply_control, e)
            return None
        if not isinstance(reply, Status):
            logger.warning("apply agent answered status with %r", reply)
            return None
        # A relaying apply agent speaks for its whole tree (daemons/relay.py): every member
        # must hold the reference, and a version is acknowledged once all of them hold it.
        tree = reply.fields.get("tree")
        return tree if isinstance(tree, dict) else reply.fields

    def _full_reason(self, receiver: dict[str, Any], version: int) -> str | None:  # noqa: PLR0911
        """Why the next version must be full (None: a delta on the reference is safe)."""
        if self.ref is None or self.ref_version is None:
            return "no reference"
        if receiver.get("session") != self.ref_session:
            return "the apply agent restarted"
        if receiver.get("active_version") != self.ref_version:
            return (
                f"the apply agent holds {receiver.get('active_version')}, "
                f"the reference is {self.ref_version}"
            )
        if receiver.get("needs_full"):
            return "the apply agent asked for one"
        if self.resync_pending:
            return "resync command"
        if self.deltas_in_a_row >= self.config.full_resync_every:
            return f"periodic, after {self.deltas_in_a_row} deltas"
        if self.ref_version >= version:
            return f"version {version} is not newer than the reference {self.ref_version}"
        return None

    async def _ship(
        self, sender: ChunkSender, snap: Snapshot, current: np.ndarray, receiver: dict[str, Any]
    ) -> None:
        """Encode ``snap`` against the reference, send it, copy it into ``current`` (which
        becomes the reference once acknowledged), release ``snap``, await the acknowledgement.

        For a delta the encoder reads the published buffer in place, under the lease, and the
        copy that the next diff needs is made once the encoder is done, while the last chunks
        travel and the receiver applies them: before encoding it delayed every refit by a
        full memory copy. The lease covers the encoding and that copy only, never a wait for
        the network (chunks queue for the link), so a slow link cannot keep the trainer from
        publishing.
        """
        assert self.encoder is not None  # set in run() before the loop
        version = snap.version
        reason = self._full_reason(receiver, version)
        base = None if reason else self.ref_version
        session = receiver.get("session")
        self.state = f"sending {version} ({'full: ' + reason if reason else f'delta on {base}'})"
        if reason:
            self.resync_pending = False
            logger.info("version %d: full (%s)", version, reason)
        t0 = time.monotonic()
        if reason:
            # A full version is as large as the model and may cross a slow link: copy it out
            # first and let the lease go, so no network wait ever holds the trainer up.
            await asyncio.to_thread(np.copyto, current, snap.buffer)
            snap.release()
        source = current if reason else snap.buffer
        encoding = self.encoder.encode(
            source, None if reason else self.ref, target_version=version, base_version=base
        )
        chunks = iter(encoding)
        # Encoded chunks wait here for the link. For a delta the queue is unbounded, so the
        # encoder (which holds the lease) never waits for the network; a delta's chunks are at
        # most about a full version's wire size. A full version encodes from our own copy and
        # may wait: its queue is bounded.
        outbox: asyncio.Queue[Chunk | None] = asyncio.Queue(4 if reason else 0)
        sent = {"bytes": 0, "seconds": 0.0}

        async def send_all() -> None:
            while (chunk := await outbox.get()) is not None:
                t = time.monotonic()
                await sender.send_chunk(version, chunk.chunk_id, chunk.data)
                sent["seconds"] += time.monotonic() - t
                sent["bytes"] += len(chunk.data)

        sending = asyncio.create_task(send_all(), name=f"export:send:{version}")
        recorded = False
        encode_s = time.monotonic() - t0  # time in the encoder (bench refit reads it)
        try:
            # Send while still encoding: each chunk leaves as soon as it exists.
            while not sending.done():  # done early: the link failed (raised below)
                t = time.monotonic()
                chunk = await asyncio.to_thread(next, chunks, None)
                encode_s += time.monotonic() - t
                if not await _put_unless_done(outbox, chunk, sending) or chunk is None:
                    break
            if not reason:
                # The next diff needs these bytes after the lease is gone: copy them now,
                # while the last chunks travel and the receiver applies them.
                await asyncio.to_thread(np.copyto, current, snap.buffer)
                snap.release()
            await sending  # raises the link's error, if any
            manifest = encoding.manifest
            assert manifest is not None  # set once the chunks are exhausted
            recorded = self._record(manifest)
            t = time.monotonic()
            await sender.send_manifest(version, manifest.to_json())
            sent_at = time.monotonic()
            send_s = sent["seconds"] + sent_at - t
            nbytes = sent["bytes"]
        except LinkError as e:
            self._failed(version, f"link: {e}", recorded=recorded)
            await self.shell.publish(RefitFailed(version, f"link: {e}"))
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
        await self.shell.publish(VersionPublished(version, base, nbytes))
        self.state = f"waiting for the apply agent to activate {version}"
        outcome = await self._await_ack(version, session)
        seconds = time.monotonic() - t0
        self.last = {"version": version, "base": base, "kind": "delta" if base is not None
                     else "full", "wire_bytes": nbytes, "seconds": round(seconds, 4),
                     "outcome": outcome or "active", "taken_at": self.taken_at, "started_at": t0,
                     "copy_s": round(t0 - self.taken_at, 6), "sent_at": sent_at,
                     "encode_s": round(encode_s, 6), "send_s": round(send_s, 6)}  # fmt: skip
        self.recent.append(self.last)
        if outcome is None:
            if recorded:
                self._mark(version, State.VERIFIED)
                self._mark(version, State.ACTIVE)
            old, self.ref = self.ref, current
            self.ref_version, self.ref_session = version, session
            if old is not None:
                self._spare = old  # the previous reference receives the next version
            self.deltas_in_a_row = 0 if base is None else self.deltas_in_a_row + 1
            logger.info("version %d active on the receiver (%d bytes, %.3f s)",
                        version, nbytes, seconds)  # fmt: skip
        else:
            self._failed(version, outcome, recorded=recorded)
            await self.shell.publish(RefitFailed(version, outcome))

    async def _await_ack(self, version: int, session: Any) -> str | None:  # noqa: ANN401
        """None once the receiver reports ``version`` active, else why it did not."""
        deadline = time.monotonic() + self.config.ack_timeout_s
        while time.monotonic() < deadline:
            st = await self._receiver_status()
            if st is not None:
                if st.get("session") != session:
                    return "the apply agent restarted before acknowledging"
                if st.get("active_version") == version:
                    return None
                failed = st.get("last_failed") or {}
                if failed.get("version") == version:
                    return f"the apply agent refused it: {failed.get('reason')}"
            await asyncio.sleep(self.config.poll_s)
        return f"no acknowledgement within {self.config.ack_timeout_s} s"

    def _failed(self, version: int, reason: str, *, recorded: bool) -> None:
        # Drop the reference: the receiver's state is unknown, so the next version is full.
        self.ref = self.ref_version = self.ref_session = None
        self.failed += 1
        logger.warning("version %d failed: %s", version, reason)
        if recorded:
            self._mark(version, State.FAILED, error=reason)

    def _record(self, manifest: Any) -> bool:  # noqa: ANN401 - a RefitManifest
        try:
            self.manifests.record(manifest)
        except ManifestStoreError as e:
            # Tolerated: the record is for operators; a version the store already holds (a
            # restarted trainer reusing numbers) is still delivered, just not recorded twice.
            logger.warning("version %d not recorded: %s", manifest.version, e)
            return False
        return True

    def _mark(self, version: int, state: State, *, error: str | None = None) -> None:
        try:
            self.manifests.mark(version, state, error=error)
        except ManifestStoreError as e:
            logger.warning("version %d: cannot mark %s: %s", version, state, e)

    def close(self) -> None:
        self.manifests.close()
        if self.store is not None:
            self.store.close()

    # -- control handlers -----------------------------------------------------------------

    async def on_status(self, _: GetStatus) -> Status:
        fields = {
            "published_version": None if self.store is None else self.store.active_version,
            "taken_version": self.taken,
            "reference_version": self.ref_version,
            "receiver_session": self.ref_session,
            "deltas_in_a_row": self.deltas_in_a_row,
            "full_resync_every": self.config.full_resync_every,
            "resync_pending": self.resync_pending,
            "sent": self.sent,
            "failed": self.failed,
            "republished": self.republished,
            "last": self.last,
            "recent": list(self.recent),
            "detail": self.state,
        }
        return Status("export", "paused" if self.paused else "running", fields)

    async def on_pause(self, _: Pause) -> Ok:
        was, self.paused = self.paused, True
        return Ok("already paused" if was else "paused")

    async def on_resume(self, _: Resume) -> Ok:
        was, self.paused = self.paused, False
        return Ok("resumed" if was else "was not paused")

    async def on_resync(self, _: Resync) -> Ok:
        self.resync_pending = True
        return Ok("the next version is sent in full")

    async def on_shutdown(self, _: Shutdown) -> Ok:
        self.shell.stop.set()
        return Ok("stopping")


async def _amain(cfg: ExportConfig) -> None:
    shell = DaemonShell("export", cfg.control, {}, events=cfg.events)
    agent = ExportAgent(cfg, shell)
    shell.handlers.update({
        GetStatus: agent.on_status,
        Pause: agent.on_pause,
        Resume: agent.on_resume,
        Resync: agent.on_resync,
        Shutdown: agent.on_shutdown,
    })  # fmt: skip
    try:
        await shell.run(agent.run())
    finally:
        await agent.acks.close()
        agent.close()


def main(argv: list[str]) -> int:
    return daemon_main("export", ExportConfig, argv, _amain, __doc__ or "")
