"""The apply agent's core: receive, apply, verify and activate versions; say so.

Each version arrives as chunks (any order, maybe twice) and a manifest. The first chunk (or the
manifest) of a new version opens a write transaction on the rollout store's inactive buffer:

    chunk/manifest of version v, no open job, v not seen before
      | a delta whose base is not the active version -> refused: needs_full, RefitFailed
      v
    APPLYING  begin_write; a delta whose target buffer does not hold its base gets there
      |       first (catch_up.py: kept current after each commit by default; else by the
      |       last delta again, or copy_from_active); each chunk is applied in place (the
      |       target, holding the base, is its own reference), the tensors before its
      |       first record hashed (written for good in an in-order send: VersionApply),
      |       then released; a chunk of a newer version abandons this one (failed)
      | manifest here and every chunk it lists applied
      v
    verify every tensor against the manifest (hashing only those not hashed as chunks
      | landed, or written since) -> commit (flip) -> VersionApplied
      | any FrameError / checksum mismatch -> abort (the active version stays) -> RefitFailed

Every change of that state is published as a ``ReceiverState`` (deltarl/refit/
receiver_state.py) at once, and the state again every ``heartbeat_s``: that is how the export
agent learns a version is active, or failed, or that this agent restarted (a new ``session``).
With relay targets (deltarl/refit/relay.py) every chunk and manifest is also relayed, as
received, to further apply agents, and the state published is the whole tree's.

No socket here: the process module (deltarl/daemons/apply.py) hands in the link's receiver,
the relay, and the event publisher (through the daemon context).

Nothing on the wire can take the agent down or change what it will accept later:

- a chunk is checked whole (its length, its checksum) before it may open a version, so a
  garbage chunk costs a hash, never a write transaction or a copy of the active buffer; it is
  counted (``refused_items``) and fails only the version open now, which it names (that
  version cannot complete without it);
- a manifest is checked field by field (versions in range, the version above its base)
  before it is used; a bad one is counted and changes nothing. With the cluster's data key,
  its seal (a MAC, deltarl/codecs/manifest_seal.py) is checked before anything else, and
  each chunk applied must match the BLAKE2b-256 the sealed manifest lists for it: a forger
  without the key can make a version fail (as a cut link can), never activate one;
- a failure is remembered with the attempt that failed (its base, and which send of the
  version: the chunk ids' ``send_slot``), and only that attempt's late chunks are ignored: a
  version failed by one bad attempt (or a forged one) is accepted when it is sent again;
- a version whose chunks stop coming (``stalled_job_s``) no longer holds off older versions,
  and is not remembered as failed: unproven chunks (a forger's, a dead sender's) cannot
  block the real versions for good;
- a delta on a base the agent does not hold is refused and reported, and neither remembered
  nor asking for a full version: the export agent sees from the receiver state that the
  bases differ, and the same delta is valid once the agent holds its base;
- a stale send, one the export agent gave up on that reaches the agent after newer ones
  (a manifest encoded before the newest version committed, of a lower version), is refused,
  never activated: the rollout does not go back to older weights (``_superseded``).

Invariant: at most one job (write transaction) is open, and it is touched only under
``_lock``, so a ``rollback`` never races a chunk being applied.

Drain: nothing new is opened; a version half received is finished (its remaining chunks still
arrive) or, when the drain runs out of time, aborted by ``close``; the active version stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.codecs.decoder import ChecksumMismatchError, VersionApply, check_frame, verify_tensors
from deltarl.codecs.frame import (
    KIND_FULL,
    NO_BASE,
    FrameError,
    FrameHeader,
    send_slot,
)
from deltarl.codecs.kernel_warmth import KernelWarmth
from deltarl.codecs.manifest import ManifestError, RefitManifest
from deltarl.codecs.manifest_seal import SealError, open_sealed
from deltarl.config.refit import ApplyConfig
from deltarl.engine.daemon import DaemonContext, DaemonCore
from deltarl.engine.weight_store import (
    LeaseTimeout,
    RollbackError,
    WeightStore,
    WriterBusy,
    WriteTxn,
)
from deltarl.ops import metrics
from deltarl.refit.catch_up import KeptDelta, Undo
from deltarl.refit.receiver_state import GetReceiverState, ReceiverState
from deltarl.refit.relay import Relay
from deltarl.transport.base import MAX_VERSION, ChunkReceiver, ReceivedChunk, ReceivedManifest
from deltarl.transport.control import Handler
from deltarl.transport.messages import (
    Command,
    Error,
    Ok,
    RefitFailed,
    Resync,
    Rollback,
    VersionApplied,
)

logger = logging.getLogger(__name__)

KEEP_FINISHED = 64  # versions remembered as done, so their late duplicates are ignored
KEEP_DIGESTS = 16  # applied versions whose model digest ``status`` reports
KEEP_UNSOUND = 8  # versions whose refused chunk ids are remembered


@dataclass
class _Job:
    version: int
    base: int | None
    slot: int  # which send of the version (frame.send_slot of its chunk ids)
    txn: WriteTxn
    apply: VersionApply
    started: float
    manifest: RefitManifest | None = None
    apply_s: float = 0.0
    """Seconds spent applying this version's chunks."""
    open_s: float = 0.0
    """Seconds spent opening the write (and copying the active buffer for a delta)."""
    heard_at: float = 0.0
    """Monotonic time the job last received a chunk or its manifest (stalled_job_s)."""
    kept: KeptDelta | None = None
    """A delta's chunks as applied, kept to bring the other buffer up to date next time."""
    opened_by: str = "none"
    """How the target came to hold the base: "settled" (kept current after the last commit),
    "catch_up" (the last delta again, now), "copy", or "none" (a full version)."""


class ApplyCore(DaemonCore):
    daemon: ClassVar[str] = "apply"

    def __init__(
        self,
        config: ApplyConfig,
        context: DaemonContext,
        store: WeightStore,
        receiver: ChunkReceiver,
        relay: Relay | None = None,
        mac_key: bytes | None = None,
    ) -> None:
        """``mac_key``: the cluster's data key (deltarl/transport/data_keys.py). With it, only
        manifests sealed under it are used, and every chunk must match the BLAKE2b-256 they
        list; without it, a sealed manifest is refused (this agent could not check it)."""
        self.config = config
        self.mac_key = mac_key
        self.context = context
        self.store = store
        self.receiver = receiver
        self.relay = relay or Relay(())
        self.session = secrets.token_hex(8)
        self.job: _Job | None = None
        # version -> ("applied", base, slot) or ("failed", base, slot) of the attempt that
        # failed: only that attempt's late chunks are ignored, never a re-send
        self.finished: dict[int, tuple[str, int | None, int]] = {}
        self.needs_full = store.active_version is None
        self.applied_state: dict[str, Any] = {}  # ReceiverState's applied_* figures
        self.failed_state: tuple[int, str] | None = None
        self.failures = 0
        self.applied = 0
        self.refused = 0
        self.revoked_leases = 0  # writes that revoked a lagging engine's lease (I4)
        # The warm-up of the codec kernels, started by the process (daemons/apply.py); None
        # where the core runs without one (in-process tests, benches).
        self.kernels: KernelWarmth | None = None
        # The last delta committed, to bring the other buffer up to date sparsely (catch_up.py);
        # how each delta's target got to its base: counts by "settled", "catch_up" and "copy".
        self.kept: KeptDelta | None = None
        self.opened_by = {"settled": 0, "catch_up": 0, "copy": 0}
        self._last_opened_by: str | None = None
        # The last two committed versions' manifests (an eager catch-up's undo is verified
        # against its base's), and the undo of the settled inactive buffer (catch_up.py).
        self.manifests: dict[int, RefitManifest] = {}
        # (version, time) of the most recently encoded manifest committed: what a stale send
        # is recognised by (``_superseded``).
        self.newest_sent: tuple[int, float] | None = None
        self.undo: Undo | None = None
        self.settle_failures = 0
        # The last settle: the version it brought the other buffer to, and its seconds.
        self.last_settle: dict[str, Any] | None = None
        self.refused_items = 0  # chunks and manifests refused before any use (counted, logged)
        self.seal_failures = 0  # of those, manifests whose seal did not hold (forged?)
        # version -> chunk id -> why it was refused: a version whose manifest lists one of
        # them fails at once, instead of waiting for a chunk that is not coming
        self.unsound: dict[int, dict[int, str]] = {}
        self.draining = False
        # version -> the manifest's whole-model digest, for the rollout daemon to check what its
        # engine loaded against what the trainer published (not just against this buffer).
        self.digests: dict[int, str] = {}
        # Read at scrape time: whatever moved it (an apply, a rollback), it is never stale.
        metrics.ACTIVE_VERSION.set_function(self._active_for_metrics)
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._job_done = asyncio.Event()
        self._job_done.set()
        self.relay.on_change = self._changed.set
        self._digest_active()

    def _digest_active(self) -> None:
        """The active version's digest after a restart (the one applied before is forgotten).

        Recomputed from the active buffer, which equals its manifest: it was verified against
        it before the flip, and only this agent writes the store, never the active buffer.
        Without it a rollout daemon restarted after this agent could not prove its engine
        until the trainer's next version, which may never come while no samples flow.
        """
        if self.store.active_version is None:
            return
        with self.store.lease() as snap:
            # Committed with the version since the digest lives in the segment; a segment of
            # an older deltarl has none, and the buffer is hashed instead.
            digest = snap.digest or model_digest(tensor_digests(self.store.layout, snap.buffer))
            self.digests[snap.version] = digest

    # -- the state it tells --------------------------------------------------------------

    def own_state(self) -> ReceiverState:
        failed = self.failed_state
        return ReceiverState(
            session=self.session,
            active_version=self.store.active_version,
            needs_full=self.needs_full,
            applying=None if self.job is None else self.job.version,
            failed_version=None if failed is None else failed[0],
            failed_reason="" if failed is None else failed[1],
            failures=self.failures,
            **self.applied_state,
        )

    def receiver_state(self) -> ReceiverState:
        """What the export agent is told: this agent's state, or its relay tree's."""
        own = self.own_state()
        return self.relay.tree(own) if self.relay.children else own

    async def _announce(self) -> None:
        """Publish the state on every change, and every ``heartbeat_s`` regardless."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.heartbeat_s):
                    await self._changed.wait()
            self._changed.clear()
            await self.context.publish(self.receiver_state())

    # -- receiving ------------------------------------------------------------------------

    async def run(self) -> None:
        self.relay.start()
        announcing = asyncio.create_task(self._announce(), name="apply:announce")
        try:
            async with self.receiver:
                async for item in self.receiver:
                    # Relay first: the children start on a chunk while this agent applies it.
                    self.relay.forward(item)
                    async with self._lock:
                        await self._on_item(item)
        finally:
            announcing.cancel()
            await asyncio.wait({announcing})

    async def _on_item(self, item: ReceivedChunk | ReceivedManifest) -> None:
        """One received item. Whatever it holds, the agent goes on serving: a decoder that
        gives up on it (``ValueError``, its ``FrameError``; ``MemoryError`` for a frame that
        claims more than can be held) fails the version open for it, if any, and nothing else."""
        try:
            if isinstance(item, ReceivedChunk):
                await self._on_chunk(item)
            else:
                await self._on_manifest(item)
        except (ValueError, MemoryError, OverflowError) as e:
            self.refused_items += 1
            logger.warning("version %d: refused %s: %s", item.version, type(item).__name__, e)
            if self.job is not None and self.job.version == item.version:
                await self._fail(item.version, f"{type(e).__name__}: {e}")

    async def _on_chunk(self, chunk: ReceivedChunk) -> None:
        try:
            # Whole, with a matching checksum, and the version it was delivered as?
            header, why = _sound_header(chunk)
            if header is None:
                # Unverified: it may not open a version or mark one failed. Only the version
                # open now, which cannot complete without this chunk, fails (a full one is
                # sent at once instead of waiting for the export agent's ack timeout).
                self.refused_items += 1
                metrics.CHECKSUM_FAILURES.inc()
                logger.warning("chunk %d of version %d %s", chunk.chunk_id, chunk.version, why)
                self.unsound.setdefault(chunk.version, {})[chunk.chunk_id] = why
                while len(self.unsound) > KEEP_UNSOUND:
                    del self.unsound[min(self.unsound)]
                if self.job is not None and self.job.version == chunk.version:
                    await self._fail(chunk.version, f"chunk {chunk.chunk_id} {why}")
                return
            base = None if header.kind == KIND_FULL else header.base
            job = await self._job_for(header.target, base, send_slot(header.chunk_id))
            if job is None:
                return
            t = job.heard_at = time.monotonic()
            try:
                await asyncio.to_thread(job.apply.apply, chunk.data)
            except (FrameError, ValueError) as e:
                await self._fail(job.version, f"chunk {header.chunk_id}: {e}")
                return
            job.apply_s += time.monotonic() - t
            metrics.REFIT_WIRE_BYTES.inc(len(chunk.data))
        finally:
            chunk.release()  # applied (or refused): the transport may free it now
        await self._maybe_finish()

    async def _on_manifest(self, item: ReceivedManifest) -> None:
        try:
            try:
                body = open_sealed(item.data, self.mac_key)
            except SealError:
                self.seal_failures += 1
                metrics.MAC_FAILURES.inc()
                raise
            manifest = RefitManifest.from_json(body)
            base = None if manifest.base_version == NO_BASE else manifest.base_version
            _check_versions(manifest.version, base, item.version)
        except (ManifestError, ValueError) as e:
            # Unverified and unusable: counted, and nothing changes (no version is failed).
            self.refused_items += 1
            logger.warning("dropping a malformed manifest for version %d: %s", item.version, e)
            return
        superseded = self._superseded(manifest)
        if superseded:
            # Not remembered and asking for nothing: the sender gave up on it long ago.
            await self._fail(manifest.version, superseded, needs_full=False, remember=False)
            return
        slot = send_slot(manifest.chunks[0].id) if manifest.chunks else 0
        job = await self._job_for(manifest.version, base, slot)
        if job is not None:
            job.manifest = manifest
            job.heard_at = time.monotonic()
            await self._maybe_finish()

    async def _job_for(self, version: int, base: int | None, slot: int) -> _Job | None:
        """The open job for ``version``, opened if it is new; None to ignore this item."""
        if self.kernels is not None:
            await self.kernels.wait()
        job = self.job
        if job is not None and job.version == version:
            if (job.base, job.slot) == (base, slot):
                return job
            # The same version sent again (another base, or another send of it): the export
            # agent re-sent it. The half-applied job is dropped; the new one starts afresh.
            logger.warning(
                "version %d re-sent (base %s, send %d; was base %s, send %d): starting over",
                version,
                base,
                slot,
                job.base,
                job.slot,
            )
            self._end_job(abort=True)
            job = None
        if self._ignored(version, base, slot):
            return None
        if job is not None:
            # Not remembered if it had stalled: its chunks were never proven (its manifest
            # had not come), and a real send of that version must still be accepted.
            stalled = time.monotonic() - job.heard_at >= self.config.stalled_job_s
            why = f"abandoned: version {version} started before it ended"
            if stalled:
                why += f" (it had received nothing for {self.config.stalled_job_s:g} s)"
            await self._fail(job.version, why, remember=not stalled)
        if self.draining:
            logger.info("version %d not started: draining", version)
            return None
        active = self.store.active_version
        if base is not None and base != active:
            # Contract 3: a delta applies only to its own base. Reported (the export agent
            # waiting for this version learns it at once), but it asks for nothing: the
            # receiver state already shows the export agent which base this agent holds.
            self.refused += 1
            reason = f"delta on {base} refused: the active version is {active}"
            await self._fail(version, reason, needs_full=False, remember=False)
            return None
        opened = time.monotonic()
        try:
            # An engine still loading from the buffer to be written gets lease_bound_s; past
            # it its lease is revoked (I4 in weight_store.py): it is told, discards that load
            # and loads the newest version, and this version is not lost waiting for it.
            txn = await asyncio.to_thread(
                self.store.begin_write, self.config.lease_bound_s, revoke=True
            )
        except LeaseTimeout as e:
            # Another writer kept the write lock (a rollback in flight): this version is
            # lost, the active one stays, and the export agent sends a full one.
            await self._fail(version, str(e), base=base, slot=slot)
            return None
        if txn.revoked:
            self.revoked_leases += 1
        # The other buffer is written from here on: what would undo its settled catch-up is
        # void (a rollback now has only the store's flip, to whatever that buffer holds).
        self.undo = None
        opened_by = "none"
        if base is not None and txn.base_version != base:
            # The target buffer holds an older version: bring it to the active one.
            opened_by = await self._bring_to_base(txn, base)
        elif base is not None:
            opened_by = "settled"
        if opened_by != "none":
            self.opened_by[opened_by] += 1
        # The reference is the target itself: once opened, a delta's target holds its base
        # bit for bit (settled, caught up or copied), and each chunk is applied once
        # (VersionApply, by chunk id, and no element by two chunks; a re-send of the version
        # is a new job on a reopened buffer), so every changed element is read just before
        # it is written. Reading the active buffer instead touched a second cache line per
        # change: the decode took twice as long on a 98M model at 1.5% changed (README). A
        # job given up leaves the target half written, which the store then marks EMPTY: the
        # next one copies (begin_write).
        reference = txn.buffer if base is not None else None
        catching = self.config.catch_up != "off"
        kept = None if base is None or not catching else KeptDelta(version, base)
        apply = VersionApply(
            txn.layout,
            txn.buffer,
            reference,
            base=base,
            version=version,
            hash_chunks=self.mac_key is not None,
            keep=None if kept is None else kept.chunks,
        )
        self.job = _Job(version, base, slot, txn, apply, time.monotonic())
        self.job.kept = kept
        self.job.opened_by = opened_by
        self.job.open_s = self.job.started - opened  # begin_write (+ copy_from_active)
        self.job.heard_at = self.job.started
        self._job_done.clear()
        self._changed.set()
        return self.job

    async def _bring_to_base(self, txn: WriteTxn, base: int) -> str:
        """Make the target hold ``base`` (the active version): by the kept delta when it
        bridges the target's version to it, else by copying the active buffer. (With
        ``catch_up = "off"`` nothing is ever kept: jobs keep no chunks.)"""
        kept = self.kept
        if kept is not None and kept.brings(txn.base_version, base):
            try:
                await asyncio.to_thread(kept.catch_up, txn.layout, txn.buffer)
            except Exception as e:  # noqa: BLE001 - whatever it was, the copy below repairs it
                # Applied once already, so this should not happen; the target may be half
                # written, and the copy overwrites every byte of it.
                logger.warning("catch-up by version %d failed (%r): copying", kept.version, e)
            else:
                txn.brought_to(base)
                return "catch_up"
        await asyncio.to_thread(txn.copy_from_active)
        return "copy"

    def _end_job(self, *, abort: bool) -> None:
        if self.job is not None and abort:
            # Its early hashes may still read the target (VersionApply's docstring): waited
            # for here, a run of tensors at most (a few ms), before the buffer is given up.
            self.job.apply.close()
            self.job.txn.abort()
        self.job = None
        self._job_done.set()

    def _superseded(self, manifest: RefitManifest) -> str | None:
        """Why ``manifest`` is a stale send, never to be activated; None if it is not.

        A send the export agent gave up on (no acknowledgement in time, a link error) may
        still reach this agent later: its notices or frames wait in the link while this
        agent is stalled (a long compile, a paused process), and several sender connections'
        queues are merged in no particular order. Applied then, it would take the rollout
        back to weights older than those active, with nothing to bring it forward again until
        the trainer's next version. A manifest encoded before the newest one committed, of
        a lower version, is such a send: the export agent encodes in order and never sends a
        version below one sent before, except a new run's versions (encoded later) and a
        version rolled back from (a higher one). Both conditions are needed: the time alone
        would refuse a new export agent whose clock stepped back, the version alone a new
        run's first versions."""
        newest = self.newest_sent
        if newest is None or manifest.version >= newest[0] or manifest.time >= newest[1]:
            return None
        return (
            f"superseded: a stale send, encoded {newest[1] - manifest.time:.3f} s before "
            f"version {newest[0]}, which was activated since"
        )

    def _ignored(self, version: int, base: int | None, slot: int) -> bool:
        """A late duplicate (of an applied version the store holds or has moved past, or of
        the attempt that failed), or a version older than the one open: nothing to do.

        A version applied and then rolled back from is above the active one: a re-send of it
        (``resync``) is accepted."""
        done = self.finished.get(version)
        active = self.store.active_version
        if done is not None and done[0] == "applied" and active is not None and version <= active:
            return True
        if done is not None and done[0] == "failed" and done[1:] == (base, slot):
            return True
        job = self.job
        if job is None or version >= job.version:
            return False
        # An older version waits for the open one only while that one is alive: a job that
        # has heard nothing for stalled_job_s (unproven chunks, a dead sender) gives way.
        return time.monotonic() - job.heard_at < self.config.stalled_job_s

    async def _maybe_finish(self) -> None:
        job = self.job
        if job is None or job.manifest is None:
            return
        missing = {c.id for c in job.manifest.chunks} - set(job.apply.applied)
        damaged = sorted(missing & set(self.unsound.get(job.version, {})))
        if damaged:
            # The manifest (which came with this version's sound chunks) lists a chunk that
            # arrived damaged: it is not coming again, so the version cannot complete.
            why = self.unsound[job.version][damaged[0]]
            await self._fail(job.version, f"chunk {damaged[0]} {why}")
            return
        if missing:
            return  # chunks still to come
        t_verify = time.monotonic()
        try:
            await asyncio.to_thread(job.apply.verify, job.manifest)
        except (FrameError, ChecksumMismatchError) as e:
            if isinstance(e, ChecksumMismatchError):
                metrics.CHECKSUM_FAILURES.inc()
            await self._fail(job.version, str(e))
            return
        t_commit = time.monotonic()
        # A full version is authoritative: it may replace a newer one (after a rollback).
        # With the manifest's model digest: the rollout daemon proves what its engine loaded
        # against it under its own lease; and its tensor digests, just verified against these
        # bytes, from which the rollout worker picks the layers that changed without hashing
        # the model (deltarl/rollout/worker_ext.py).
        try:
            job.txn.commit(
                job.version,
                allow_older=job.base is None,
                digest=job.manifest.model_xxh3_128,
                tensor_digests=job.manifest.tensor_digests,
            )
        except ValueError as e:  # checked on arrival; a commit must still never crash the agent
            await self._fail(job.version, f"cannot commit: {e}")
            return
        t_done = time.monotonic()
        self._end_job(abort=False)
        # The other buffer now holds what this one held before: this delta brings it here.
        kept = job.kept
        if kept is not None and kept.nbytes > self.config.catch_up_max_bytes:
            logger.info(
                "version %d: its delta (%d MB decoded) is over catch_up_max_bytes: not kept",
                job.version,
                kept.nbytes >> 20,
            )
            kept = None
        self.kept = kept
        self._last_opened_by = job.opened_by
        self.manifests[job.version] = job.manifest
        if self.newest_sent is None or job.manifest.time >= self.newest_sent[1]:
            self.newest_sent = (job.version, job.manifest.time)
        for old in [v for v in self.manifests if v < job.version - 1]:
            del self.manifests[old]
        self._finish(job.version, "applied", job.base, job.slot)
        if job.base is None:
            self.needs_full = False
        self.applied += 1
        self.applied_state = {
            "applied_version": job.version,
            "applied_base": job.base,
            "started_at": job.started,
            "committed_at": t_done,
            "open_s": job.open_s,
            "apply_s": job.apply_s,
            # Of apply_s: hashing tensors as later chunks landed, which verify_s then skips.
            "early_hash_s": job.apply.early_hash_s,
            # apply_s's parts: the worker thread's own time in its calls (wall and CPU: the
            # difference is time it was kept off its CPU), of which decoding and writing,
            # keeping the decoded delta; apply_s less apply_calls_s is waiting on the loop.
            "apply_calls_s": job.apply.calls_s,
            "apply_cpu_s": job.apply.cpu_s,
            "decode_s": job.apply.decode_s,
            "keep_s": job.apply.keep_s,
            "chunks": len(job.apply.applied),
            "verify_s": t_commit - t_verify,
            "commit_s": t_done - t_commit,
        }
        stages = metrics.REFIT_STAGE_SECONDS
        for stage in ("open", "apply", "verify", "commit"):
            stages.labels(stage).observe(self.applied_state[f"{stage}_s"])
        stages.labels("total").observe(t_done - job.started)
        metrics.REFIT_VERSIONS.labels("delta" if job.base is not None else "full").inc()
        self.digests[job.version] = job.manifest.model_xxh3_128
        while len(self.digests) > KEEP_DIGESTS:
            del self.digests[min(self.digests)]
        seconds = t_done - job.started
        logger.info(
            "version %d active (base %s, %.3f s)",
            job.version,
            job.base,
            seconds,
            extra={"version": job.version},
        )
        self._changed.set()
        await self.context.publish(VersionApplied(job.version, job.base, seconds))
        if self.config.catch_up == "eager":
            await self._settle_other()

    async def _settle_other(self) -> None:
        """Bring the inactive buffer (holding the previous version) to the active one with
        the delta just committed, and keep what undoes it (catch_up.py, ``eager``). Off the
        refit's path: the version is active and announced. Anything in the way (a reader
        still on the old buffer, a writer, no manifest to verify an undo against) leaves the
        buffer as it is; the next delta then copies."""
        kept = self.kept
        base_manifest = None if kept is None else self.manifests.get(kept.base)
        if kept is None or base_manifest is None or self.draining:
            return
        started = time.monotonic()
        try:
            txn = await asyncio.to_thread(self.store.begin_write, 0.0)
        except (LeaseTimeout, WriterBusy) as e:
            logger.debug("inactive buffer not settled: %s", e)
            return
        try:
            if not kept.brings(txn.base_version, self.store.active_version):
                txn.abort()
                return
            undo = await asyncio.to_thread(kept.catch_up_with_undo, txn.layout, txn.buffer)
            txn.settle(kept.version, digest=self.digests.get(kept.version))
            self.last_settle = {"version": kept.version, "seconds": time.monotonic() - started}
        except Exception as e:  # noqa: BLE001 - the buffer is marked EMPTY; the next copies
            txn.abort()
            self.settle_failures += 1
            logger.warning("settling version %d in the inactive buffer failed: %r", kept.version, e)
            return
        self.undo = Undo(kept.version, kept.base, undo, base_manifest)

    async def _fail(
        self,
        version: int,
        reason: str,
        *,
        base: int | None = None,
        slot: int = 0,
        needs_full: bool = True,
        remember: bool = True,
    ) -> None:
        """``version`` is not applied; the active version stays. Abort its job if open.

        ``base``: of the attempt that failed (the open job's, if there is one); with
        ``remember``, that attempt's late chunks are ignored (a re-send of the version on
        another base is not). A refused delta is not remembered: once the agent holds its
        base, the same delta is valid."""
        if self.job is not None and self.job.version == version:
            base, slot = self.job.base, self.job.slot
            if self.job.opened_by == "catch_up":
                # Whatever failed, the next attempt does not rest on the kept delta again.
                self.kept = None
            self._end_job(abort=True)
        if remember:
            self._finish(version, "failed", base, slot)
        self.needs_full = self.needs_full or needs_full
        self.failed_state = (version, reason)
        self.failures += 1
        metrics.REFIT_FAILED.inc()
        logger.warning("version %d not applied: %s", version, reason, extra={"version": version})
        self._changed.set()
        await self.context.publish(RefitFailed(version, reason))

    def _active_for_metrics(self) -> float:
        """The active version as the gauge reads it: -1 for none, NaN once the store is closed
        (a scrape between the core's close and the metrics server's)."""
        try:
            return _or_minus_one(self.store.active_version)
        except RuntimeError:
            return math.nan

    def _finish(self, version: int, how: str, base: int | None, slot: int) -> None:
        self.finished[version] = (how, base, slot)
        while len(self.finished) > KEEP_FINISHED:
            del self.finished[min(self.finished)]

    # -- the runtime's side ---------------------------------------------------------------

    async def drain(self) -> None:
        self.draining = True
        await self._job_done.wait()

    async def close(self) -> None:
        try:
            await self.relay.close()
        finally:
            self._end_job(abort=True)
            self.store.close()

    def state(self) -> str:
        return "applying" if self.job else "running"

    def status_fields(self) -> dict[str, Any]:
        failed = self.failed_state
        applied = self.applied_state
        fields: dict[str, Any] = {
            "session": self.session,
            "active_version": self.store.active_version,
            "needs_full": self.needs_full,
            "applying": None if self.job is None else self.job.version,
            "last_applied": None
            if not applied
            else {
                "version": applied["applied_version"],
                "base": applied["applied_base"],
                "seconds": applied["committed_at"] - applied["started_at"],
                **{k: v for k, v in applied.items() if not k.startswith("applied_")},
                "model_xxh3_128": self.digests.get(applied["applied_version"]),
            },
            "last_failed": None if failed is None else {"version": failed[0], "reason": failed[1]},
            "applied": self.applied,
            "refused": self.refused,
            "revoked_leases": self.revoked_leases,
            # How each delta's target buffer reached its base: the last delta again (sparse)
            # or a copy of the active buffer; and how the last one did.
            "opened_by": dict(self.opened_by),
            "last_opened_by": self._last_opened_by,
            "catch_up": self.config.catch_up,
            "settle_failures": self.settle_failures,
            # Off the refit's path, but a next version's chunks wait for it in the queue.
            "last_settle": self.last_settle,
            # A rollback from the active version writes this back (catch_up.py, ``eager``).
            "undo": None
            if self.undo is None
            else {"holds": self.undo.holds, "restores": self.undo.restores},
            "refused_items": self.refused_items,
            "seal_failures": self.seal_failures,
            "sealed": self.mac_key is not None,
            "store": self.config.rollout_store,
            "digests": {str(v): d for v, d in self.digests.items()},
            "kernels": None if self.kernels is None else self.kernels.fields(),
        }
        if self.relay.children:
            fields["tree"] = self.relay.status(self.receiver_state())
        return fields

    def handlers(self) -> Mapping[type[Command], Handler]:
        return {Resync: self.on_resync, Rollback: self.on_rollback}

    def concurrent_handlers(self) -> Mapping[type[Command], Handler]:
        # Never queued behind a rollback: the export agent asks it when events fall silent.
        return {GetReceiverState: self.on_get_state}

    async def on_get_state(self, _: GetReceiverState) -> ReceiverState:
        return self.receiver_state()

    async def on_resync(self, _: Resync) -> Ok:
        self.needs_full = True
        self._changed.set()
        return Ok("asked the export agent for a full version")

    async def on_rollback(self, command: Rollback) -> Ok | Error:
        async with self._lock:
            if self.job is not None:
                await self._fail(self.job.version, "interrupted by a rollback")
            undo = self.undo
            if undo is not None and undo.holds == self.store.active_version:
                return await self._roll_back_by_undo(undo, command.version)
            try:
                # A version other than the one kept is refused, nothing flipped: an operator
                # who asked for v must never be answered "ok" holding another.
                previous = await asyncio.to_thread(self.store.rollback, 5.0, command.version)
            except RollbackError as e:
                return Error("no_previous_version", str(e))
            self._changed.set()
            return Ok(f"rolled back to version {previous}")

    async def _roll_back_by_undo(self, undo: Undo, asked: int | None) -> Ok | Error:
        """The inactive buffer was settled at the active version: write the undo back into it,
        verify every tensor against the older version's manifest, and flip to it."""
        if asked is not None and asked != undo.restores:
            return Error(
                "no_previous_version",
                f"weight store {self.store.name!r}: version {asked} is not kept; the only "
                f"older version is {undo.restores} (active {undo.holds})",
            )
        try:
            txn = await asyncio.to_thread(self.store.begin_write, 5.0)
        except (LeaseTimeout, WriterBusy) as e:
            return Error("no_previous_version", f"cannot write the inactive buffer: {e}")
        self.undo = None
        if txn.base_version != undo.holds:  # cannot happen: every write voids the undo first
            txn.abort()
            return Error("no_previous_version", f"the inactive buffer no longer holds {undo.holds}")
        try:
            await asyncio.to_thread(undo.apply, txn.layout, txn.buffer)
            await asyncio.to_thread(verify_tensors, txn.layout, txn.buffer, undo.manifest)
        except (ChecksumMismatchError, ValueError) as e:
            txn.abort()
            metrics.CHECKSUM_FAILURES.inc()
            logger.warning("rollback to %d by undo refused: %s", undo.restores, e)
            return Error("no_previous_version", f"the undo of version {undo.holds} failed: {e}")
        txn.commit(
            undo.restores,
            allow_older=True,
            digest=undo.manifest.model_xxh3_128,
            tensor_digests=undo.manifest.tensor_digests,
        )
        self.kept = None  # the other buffer holds undo.holds: no delta bridges it to the active
        logger.warning(
            "weight store %s rolled back from version %d to %d (by undo)",
            self.store.name,
            undo.holds,
            undo.restores,
        )
        self._changed.set()
        return Ok(f"rolled back to version {undo.restores}")


def _check_versions(version: int, base: int | None, label: int) -> None:
    """ValueError unless a manifest's versions can be applied: in range, the version above its
    base, and the version the transport delivered it as."""
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version {version} is outside [0, 2**63)")
    if base is not None and not 0 <= base < version:
        raise ValueError(f"base {base} is not a version below {version}")
    if version != label:
        raise ValueError(f"delivered as version {label} but it says {version}")


def _sound_header(chunk: ReceivedChunk) -> tuple[FrameHeader | None, str]:
    """The chunk's header if its frame is whole, its checksum holds and it is of the version
    it was delivered as; else (None, why)."""
    try:
        header = check_frame(chunk.data)
    except FrameError as e:
        return None, f"refused: {e}"
    if header.target != chunk.version:
        return None, f"labelled version {chunk.version} but its frame says {header.target}"
    return header, ""


def _or_minus_one(version: int | None) -> float:
    """A version as a gauge's value: -1 for none (a gauge has no null)."""
    return -1.0 if version is None else float(version)
