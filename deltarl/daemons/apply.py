"""``deltarl apply --config FILE``: receive, apply, verify and activate versions.

Each version arrives as chunks (any order, maybe twice) and a manifest. The first chunk (or the
manifest) of a new version opens a write transaction on the rollout store's inactive buffer:

    chunk/manifest of version v, no open job, v not seen before
      | a delta whose base is not the active version -> refused: needs_full, RefitFailed
      v
    APPLYING  begin_write; a delta whose target buffer does not hold its base gets
      |       copy_from_active first; each chunk is applied (reference: the active buffer),
      |       then released; a chunk of a newer version abandons this one (failed)
      | manifest here and every chunk it lists applied
      v
    verify every tensor against the manifest -> commit (flip) -> VersionApplied
      | any FrameError / checksum mismatch -> abort (the active version stays) -> RefitFailed

With ``relay`` targets configured, every chunk and manifest is also relayed, as received, to
further apply agents (daemons/relay.py), and ``status`` adds the ``tree`` that the export agent
then reads instead of this agent's own fields.

The export agent learns the outcome from ``status`` (the acknowledgement channel; events are
notices only): ``session`` (new at every start), ``active_version``, ``last_failed`` and
``needs_full`` (set by a refusal or failure, cleared by an applied full version).

Invariant: at most one job (write transaction) is open, and it is touched only under
``_lock``, so a ``rollback`` never races a chunk being applied.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.codecs.decoder import ChecksumMismatchError, VersionApply
from deltarl.codecs.frame import KIND_FULL, NO_BASE, FrameError, FrameHeader
from deltarl.codecs.manifest import ManifestError, RefitManifest
from deltarl.daemons.config import ApplyConfig, ConfigError, DaemonShell, daemon_main
from deltarl.daemons.relay import Relay
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import LeaseTimeout, RollbackError, WeightStore, WriteTxn
from deltarl.transport.base import ReceivedChunk, ReceivedManifest, make_receiver
from deltarl.transport.messages import (
    Error,
    GetStatus,
    Ok,
    RefitFailed,
    Resync,
    Rollback,
    Shutdown,
    Status,
    VersionApplied,
)

logger = logging.getLogger(__name__)

KEEP_FINISHED = 64  # versions remembered as done, so their late duplicates are ignored
KEEP_DIGESTS = 16  # applied versions whose model digest ``status`` reports


@dataclass
class _Job:
    version: int
    base: int | None
    txn: WriteTxn
    apply: VersionApply
    started: float
    manifest: RefitManifest | None = None
    apply_s: float = 0.0
    """Seconds spent applying this version's chunks (bench refit reads it from status)."""
    open_s: float = 0.0
    """Seconds spent opening the write (and copying the active buffer for a delta)."""


class ApplyAgent:
    def __init__(self, config: ApplyConfig, shell: DaemonShell, store: WeightStore) -> None:
        self.config = config
        self.shell = shell
        self.store = store
        self.session = secrets.token_hex(8)
        self.job: _Job | None = None
        self.finished: dict[int, str] = {}  # version -> "applied" | "failed" | "refused"
        self.needs_full = store.active_version is None
        self.last_applied: dict[str, Any] | None = None
        self.last_failed: dict[str, Any] | None = None
        self.applied = 0
        self.refused = 0
        # version -> the manifest's whole-model digest, for the rollout daemon to check what its
        # engine loaded against what the trainer published (not just against this buffer).
        self.digests: dict[int, str] = {}
        self._lock = asyncio.Lock()
        self.relay = Relay(config.relay)
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
            digest = model_digest(tensor_digests(self.store.layout, snap.buffer))
            self.digests[snap.version] = digest

    async def run(self) -> None:
        self.relay.start()
        async with make_receiver(self.config.link) as receiver:
            async for item in receiver:
                # Relay first: the children start on a chunk while this agent applies it.
                self.relay.forward(item)
                async with self._lock:
                    if isinstance(item, ReceivedChunk):
                        await self._on_chunk(item)
                    elif isinstance(item, ReceivedManifest):
                        await self._on_manifest(item)

    # -- receiving ------------------------------------------------------------------------

    async def _on_chunk(self, chunk: ReceivedChunk) -> None:
        try:
            try:
                header = FrameHeader.parse(memoryview(chunk.data).cast("B"))
            except FrameError as e:
                # The transport's version label is all we have. Failing that version now
                # (rather than waiting for the export agent's ack timeout) gets a full one sent
                # at once; a version already done is left alone (a late, damaged duplicate).
                logger.warning("unreadable chunk of version %d: %s", chunk.version, e)
                if chunk.version not in self.finished:
                    await self._fail(chunk.version, f"chunk {chunk.chunk_id} unreadable: {e}")
                return
            base = None if header.kind == KIND_FULL else header.base
            job = await self._job_for(header.target, base)
            if job is None:
                return
            t = time.monotonic()
            try:
                await asyncio.to_thread(job.apply.apply, chunk.data)
            except (FrameError, ValueError) as e:
                await self._fail(job.version, f"chunk {header.chunk_id}: {e}")
                return
            job.apply_s += time.monotonic() - t
        finally:
            chunk.release()  # applied (or refused): the transport may free it now
        await self._maybe_finish()

    async def _on_manifest(self, item: ReceivedManifest) -> None:
        try:
            manifest = RefitManifest.from_json(item.data)
        except ManifestError as e:
            logger.warning("dropping a malformed manifest for version %d: %s", item.version, e)
            return
        base = None if manifest.base_version == NO_BASE else manifest.base_version
        job = await self._job_for(manifest.version, base)
        if job is not None:
            job.manifest = manifest
            await self._maybe_finish()

    async def _job_for(self, version: int, base: int | None) -> _Job | None:
        """The open job for ``version``, opened if it is new; None to ignore this item."""
        job = self.job
        if job is not None and job.version == version:
            if job.base == base:
                return job
            # The same version again on another base: a restarted export agent re-sent it
            # (in full). The half-applied job is dropped; the new one starts from scratch.
            logger.warning("version %d re-sent on base %s (was %s): starting over",
                           version, base, job.base)  # fmt: skip
            job.txn.abort()
            self.job = job = None
        if version in self.finished or (job is not None and version < job.version):
            return None  # a late duplicate, or a stale version: nothing to do
        if job is not None:
            await self._fail(job.version, f"abandoned: version {version} started before it ended")
        active = self.store.active_version
        if base is not None and base != active:
            # Contract 3: a delta applies only to its own base. Ask for a full version.
            self.refused += 1
            await self._fail(version, f"delta on {base} refused: the active version is {active}")
            return None
        opened = time.monotonic()
        try:
            txn = await asyncio.to_thread(self.store.begin_write, 10.0)
        except LeaseTimeout as e:
            # Tolerated: a reader kept the inactive buffer (or another writer the lock); this
            # version is lost, the active one stays, and the export agent sends a full one.
            await self._fail(version, str(e))
            return None
        if base is not None and txn.base_version != base:
            # The target buffer holds an older version: start it from the active one.
            await asyncio.to_thread(txn.copy_from_active)
        reference = txn.active if base is not None else None
        apply = VersionApply(txn.layout, txn.buffer, reference, base=base, version=version)
        self.job = _Job(version, base, txn, apply, time.monotonic())
        self.job.open_s = self.job.started - opened  # begin_write (+ copy_from_active)
        return self.job

    async def _maybe_finish(self) -> None:
        job = self.job
        if job is None or job.manifest is None:
            return
        if not {c.id for c in job.manifest.chunks} <= set(job.apply.applied):
            return  # chunks still to come
        t_verify = time.monotonic()
        try:
            await asyncio.to_thread(job.apply.verify, job.manifest)
        except (FrameError, ChecksumMismatchError) as e:
            await self._fail(job.version, str(e))
            return
        t_commit = time.monotonic()
        # A full version is authoritative: it may replace a newer one (after a rollback).
        job.txn.commit(job.version, allow_older=job.base is None)
        t_done = time.monotonic()
        self.job = None
        self._finish(job.version, "applied")
        if job.base is None:
            self.needs_full = False
        seconds = time.monotonic() - job.started
        self.applied += 1
        self.last_applied = {"version": job.version, "base": job.base, "seconds": seconds,
                             "started_at": job.started, "committed_at": t_done,
                             "apply_s": job.apply_s, "open_s": job.open_s,
                             "verify_s": t_commit - t_verify,
                             "commit_s": t_done - t_commit,
                             "model_xxh3_128": job.manifest.model_xxh3_128}  # fmt: skip
        self.digests[job.version] = job.manifest.model_xxh3_128
        while len(self.digests) > KEEP_DIGESTS:
            del self.digests[min(self.digests)]
        logger.info("version %d active (base %s, %.3f s)", job.version, job.base, seconds)
        await self.shell.publish(VersionApplied(job.version, job.base, seconds))

    async def _fail(self, version: int, reason: str) -> None:
        """``version`` is not applied; the active version stays. Abort its job if open."""
        if self.job is not None and self.job.version == version:
            self.job.txn.abort()
            self.job = None
        self._finish(version, "failed")
        self.needs_full = True
        self.last_failed = {"version": version, "reason": reason}
        logger.warning("version %d not applied: %s", version, reason)
        await self.shell.publish(RefitFailed(version, reason))

    def _finish(self, version: int, how: str) -> None:
        self.finished[version] = how
        while len(self.finished) > KEEP_FINISHED:
            del self.finished[min(self.finished)]

    # -- control handlers -----------------------------------------------------------------

    async def on_status(self, _: GetStatus) -> Status:
        fields = {
            "session": self.session,
            "active_version": self.store.active_version,
            "needs_full": self.needs_full,
            "applying": None if self.job is None else self.job.version,
            "last_applied": self.last_applied,
            "last_failed": self.last_failed,
            "applied": self.applied,
            "refused": self.refused,
            "store": self.config.rollout_store,
            "digests": {str(v): d for v, d in self.digests.items()},
        }
        if self.relay.children:
            fields["tree"] = await self.relay.tree(fields)
        return Status("apply", "applying" if self.job else "running", fields)

    async def on_resync(self, _: Resync) -> Ok:
        self.needs_full = True
        return Ok("asked the export agent for a full version")

    async def on_rollback(self, command: Rollback) -> Ok | Error:
        async with self._lock:
            if self.job is not None:
                await self._fail(self.job.version, "interrupted by a rollback")
            try:
                previous = await asyncio.to_thread(self.store.rollback, 5.0)
            except RollbackError as e:
                return Error("no_previous_version", str(e))
            if command.version is not None and command.version != previous:
                # Only one older version is kept; undo is one more flip, but say what happened.
                logger.warning("rollback to %d asked, %d was the one kept", command.version,
                               previous)  # fmt: skip
            return Ok(f"rolled back to version {previous}")

    async def on_shutdown(self, _: Shutdown) -> Ok:
        self.shell.stop.set()
        return Ok("stopping")

    def close(self) -> None:
        if self.job is not None:
            self.job.txn.abort()
        self.store.close()


async def _layout(cfg: ApplyConfig) -> Layout:
    if cfg.layout_file is not None:
        return Layout.from_json(cfg.layout_file.read_bytes())
    if cfg.layout_store is None:
        raise ConfigError(
            f"rollout store {cfg.rollout_store!r} does not exist and neither layout_file "
            f"nor layout_store says how to create it"
        )
    deadline = time.monotonic() + cfg.layout_wait_s
    while True:
        try:
            with WeightStore.open(cfg.layout_store, root=cfg.store_root, readonly=True) as src:
                return src.layout
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def open_rollout_store(cfg: ApplyConfig) -> WeightStore:
    """The rollout store: attach if it exists (it outlives a restart), else create it."""
    try:
        return WeightStore.open(cfg.rollout_store, root=cfg.store_root)
    except FileNotFoundError:
        pass
    layout = await _layout(cfg)
    try:
        return WeightStore.create(cfg.rollout_store, layout, root=cfg.store_root)
    except FileExistsError:
        return WeightStore.open(cfg.rollout_store, root=cfg.store_root, layout=layout)


async def _amain(cfg: ApplyConfig) -> None:
    store = await open_rollout_store(cfg)
    shell = DaemonShell("apply", cfg.control, {}, events=cfg.events)
    agent = ApplyAgent(cfg, shell, store)
    shell.handlers.update({
        GetStatus: agent.on_status,
        Resync: agent.on_resync,
        Rollback: agent.on_rollback,
        Shutdown: agent.on_shutdown,
    })  # fmt: skip
    try:
        await shell.run(agent.run())
    finally:
        await agent.relay.close()
        agent.close()


def main(argv: list[str]) -> int:
    return daemon_main("apply", ApplyConfig, argv, _amain, __doc__ or "")
