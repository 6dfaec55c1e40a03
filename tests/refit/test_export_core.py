"""The export agent's core in one process, against a real apply core over a real shm link.

The apply core's events reach the export core's ``StateFeed`` through a daemon context (what
the export agent's watch does across processes), so these tests run the reference and
acknowledgement rules end to end with no control socket: versions arrive bit-exact as deltas,
a receiver restart (a new session) gets a full version, a silent receiver gets nothing, a
refused version drops the reference, and a drain waits for the version in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import statistics
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from deltarl.codecs import encoder as encoder_module
from deltarl.codecs.checksum import tensor_digests
from deltarl.config.refit import ApplyConfig, ExportConfig
from deltarl.engine.daemon import DaemonContext
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore
from deltarl.ops import metrics
from deltarl.refit.apply import ApplyCore
from deltarl.refit.export import ExportCore, Reference, put_unless_done, resync_period
from deltarl.refit.manifest_store import ManifestStore, State
from deltarl.refit.receiver_state import ReceiverState, StateFeed
from deltarl.sim.realistic_deltas import RealisticDeltas
from deltarl.transport.base import ChunkSender, LinkError, make_receiver, make_sender
from deltarl.transport.link_config import ShmLinkConfig
from deltarl.transport.messages import Event, Ok, Resync, Rollback, VersionApplied

PARAMS = 200_000


class FeedContext(DaemonContext):
    def __init__(self, name: str, feed: StateFeed | None = None) -> None:
        super().__init__(name)
        self.feed = feed
        self.published: list[Event] = []

    async def publish(self, event: Event) -> None:
        self.published.append(event)
        if self.feed is not None and isinstance(event, ReceiverState):
            self.feed.update(event)


@dataclass
class Pair:
    trainer: RealisticDeltas
    published: WeightStore
    rollout: WeightStore
    export: ExportCore
    apply: ApplyCore
    feed: StateFeed
    manifests: Path
    digests: bool = True

    def publish(self) -> int:
        self.trainer.step()
        _commit(self.published, self.trainer, digests=self.digests)
        return self.trainer.version

    async def active(self, version: int, timeout_s: float = 30) -> None:
        async with asyncio.timeout(timeout_s):
            while not (  # noqa: ASYNC110 - the state is in two stores
                self.export.ref.version == version and self.rollout.active_version == version
            ):
                await asyncio.sleep(0.01)
        with self.published.lease() as pub, self.rollout.lease() as got:
            assert pub.version == got.version == version
            assert np.array_equal(pub.buffer, got.buffer)  # bit-exact


def _commit(store: WeightStore, trainer: RealisticDeltas, *, digests: bool) -> None:
    """The trainer's publish: with ``digests``, each tensor's committed with the version, as
    deltarl/trainer/publisher.py commits them; else none (the export agent hashes)."""
    with store.begin_write() as txn:
        hashes: list[str] | None = [] if digests else None
        trainer.publish(out=txn.buffer, digests=hashes)
        txn.commit(trainer.version, tensor_digests=hashes)


@contextlib.asynccontextmanager
async def pair(
    tmp: Path,
    *,
    full_resync_every: int = 50,
    full_resync_overhead: float = 0.05,
    link_root: Path | None = None,
    chunk_bytes: int = 16 << 20,
    sender: Callable[[ShmLinkConfig], ChunkSender] = make_sender,
    ack_timeout_s: float = 10,
    digests: bool = True,
) -> AsyncIterator[Pair]:
    trainer = RealisticDeltas(PARAMS, seed=5)
    published = WeightStore.create("pub", trainer.layout, root=tmp)
    _commit(published, trainer, digests=digests)
    rollout = WeightStore.create("roll", trainer.layout, root=tmp)
    link = ShmLinkConfig(name="t", root=link_root or tmp, connect_timeout_s=10)
    feed = StateFeed()
    acfg = ApplyConfig(control="ipc:///unused", rollout_store="roll", link=link, heartbeat_s=0.2)
    ecfg = ExportConfig(
        control="ipc:///unused",
        published_store="pub",
        manifest_store=tmp / "versions.sqlite",
        apply_control="ipc:///unused",
        link=link,
        store_root=tmp,
        full_resync_every=full_resync_every,
        full_resync_overhead=full_resync_overhead,
        ack_timeout_s=ack_timeout_s,
        poll_s=0.01,
        chunk_bytes=chunk_bytes,
    )
    apply = ApplyCore(acfg, FeedContext("apply", feed), rollout, make_receiver(link))
    export = ExportCore(
        ecfg,
        FeedContext("export"),
        feed,
        lambda: sender(link),
        ManifestStore(ecfg.manifest_store),
    )
    tasks = [asyncio.create_task(apply.run()), asyncio.create_task(export.run())]
    try:
        yield Pair(trainer, published, rollout, export, apply, feed, ecfg.manifest_store, digests)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        await export.close()
        await apply.close()
        published.close()


def test_versions_arrive_bit_exact_as_deltas_acknowledged_by_events(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            for _ in range(3):
                await p.active(p.publish())
            kinds = [r.kind for r in p.export.recent]
            assert kinds == ["full", "delta", "delta", "delta"]
            # One model-sized buffer, advanced sparsely by each delta's encoding: it holds
            # exactly the version acknowledged.
            assert p.export.ref.version == 3
            with p.published.lease() as pub:
                assert np.array_equal(p.export.ref.buffer, pub.buffer)
            last = p.export.recent[-1]
            assert last.outcome == "active"
            assert last.receiver is not None
            assert last.receiver.applied_version == 3
            assert last.total_s is not None
            assert 0 < last.total_s < 30
            assert p.export.status_fields()["last"]["total_s"] == last.total_s
            # the refit's moments in order: taken, encoding begun, last chunk encoded, the
            # manifest sent after every chunk, acknowledged (bench refit's diagnostics)
            assert last.taken_at <= last.started_at < last.encoded_at <= last.sent_at
            assert last.sent_at <= last.acked_at
            assert p.export.status_fields()["last"]["encoded_at"] == last.encoded_at
            with ManifestStore(p.manifests, readonly=True) as ms:
                record = ms.get(3)
                assert record is not None
                assert record.state is State.ACTIVE

    asyncio.run(scenario())


@pytest.mark.parametrize("digests", [True, False])
def test_the_manifest_carries_the_trainers_digests_and_the_export_agent_hashes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digests: bool
) -> None:
    """With the trainer's tensor digests committed beside its bytes, the export agent sends
    them and never hashes the model itself (its hash is made to fail here); without them (a
    trainer that keeps none, a segment of an older deltarl) it hashes, as before."""
    hashed: list[int] = []
    own = encoder_module.tensor_digests

    def counted(layout: Layout, buf: np.ndarray) -> list[str]:
        hashed.append(1)
        return own(layout, buf)

    monkeypatch.setattr(encoder_module, "tensor_digests", counted)

    async def scenario() -> None:
        async with pair(tmp_path, digests=digests) as p:
            await p.active(0)
            for _ in range(2):
                await p.active(p.publish())
            assert [r.kind for r in p.export.recent] == ["full", "delta", "delta"]
            with p.published.lease() as pub, ManifestStore(p.manifests, readonly=True) as ms:
                record = ms.get(2)
                assert record is not None
                listed = [t.xxh3_128 for t in record.manifest.tensors]
                assert listed == tensor_digests(p.published.layout, pub.buffer)
                assert pub.tensor_digests == (listed if digests else None)
            assert len(hashed) == (0 if digests else 3)

    asyncio.run(scenario())


def test_published_bytes_changed_after_the_trainers_commit_are_never_activated(
    tmp_path: Path,
) -> None:
    """The fault: after the trainer committed version 2 with its digests, a byte of the
    published buffer changes (a stray writer, bad memory). The export agent sends what it
    reads, with the trainer's digests: the apply agent's check refuses it, the rollout keeps
    version 1 (a version hashed by the export agent would have activated the changed
    bytes), and the trainer's next version arrives bit-exact."""

    async def scenario() -> None:
        async with pair(tmp_path, ack_timeout_s=5.0) as p:
            await p.active(0)
            await p.active(p.publish())
            p.export.gate.pause()  # the change lands before the export agent reads
            bad = p.publish()
            with p.published.lease() as snap:
                offset = p.published.header.buffer_offsets[snap.index]
            spec = p.published.layout.tensors[3]
            raw = np.memmap(p.published.path, np.uint8, "r+", offset + spec.offset, 2)
            raw[1] ^= 0x40  # an exponent bit of the tensor's first element
            raw.flush()
            del raw
            p.export.gate.resume()
            async with asyncio.timeout(30):
                while p.export.failed == 0:  # noqa: ASYNC110 - a core's state
                    await asyncio.sleep(0.01)
            failed = p.export.recent[-1]
            assert failed.version == bad
            assert f"differ after apply: {spec.name}" in failed.outcome
            # Named as what it is, and not sent again: every receiver would refuse it.
            assert f"the published bytes of {spec.name} no longer match" in failed.outcome
            assert p.export.published_mismatches == 1
            assert p.export.status_fields()["published_mismatches"] == 1
            await asyncio.sleep(1.5)  # past the first back-off (0.5 s) and the next
            assert p.export.retries == 0
            assert "waiting for a version newer than 2" in p.export.detail
            assert p.rollout.active_version == 1
            assert bad not in [
                e.version for e in p.apply.context.published if isinstance(e, VersionApplied)
            ]
            # The trainer commits that version again (a restart republishing it), sound this
            # time: a new commit, so it is sent (in full: the reference was dropped).
            with p.published.begin_write() as txn:
                hashes: list[str] = []
                p.trainer.publish(out=txn.buffer, digests=hashes)
                txn.commit(bad, allow_older=True, tensor_digests=hashes)
            await p.active(bad)
            assert p.export.recent[-1].kind == "full"
            await p.active(p.publish())  # and the next version, as a delta again
            assert p.export.recent[-1].kind == "delta"

    asyncio.run(scenario())


class FailsOnce(ChunkSender):
    """A real shm sender whose link breaks once, at the given chunk of the given version."""

    failed = 0

    def __init__(self, link: ShmLinkConfig, version: int, chunk: int) -> None:
        self.inner = make_sender(link)
        self.version, self.chunk = version, chunk
        self.seen = 0

    async def start(self) -> None:
        await self.inner.start()

    async def send_chunk(self, version: int, chunk_id: int, data: bytes | memoryview) -> None:
        if version == self.version and not FailsOnce.failed:
            self.seen += 1
            if self.seen == self.chunk:
                FailsOnce.failed += 1
                raise LinkError("injected: the link broke mid-version")
        await self.inner.send_chunk(version, chunk_id, data)

    async def send_manifest(self, version: int, manifest_json: bytes) -> None:
        await self.inner.send_manifest(version, manifest_json)

    async def close(self) -> None:
        await self.inner.close()


def test_a_delta_stopped_mid_encoding_leaves_no_reference(tmp_path: Path) -> None:
    """The fault: the link breaks at the second chunk of a delta, while the encoder has
    already written part of that version into the reference. The reference must not be
    used again (its bytes are part one version, part the other): the version goes again in
    full, and the deltas after it arrive bit-exact."""

    async def scenario() -> None:
        FailsOnce.failed = 0
        make = functools.partial(FailsOnce, version=2, chunk=2)
        async with pair(tmp_path, chunk_bytes=64 << 10, sender=make) as p:
            await p.active(0)
            await p.active(p.publish())
            version = p.publish()
            async with asyncio.timeout(30):
                while not FailsOnce.failed:  # noqa: ASYNC110 - a flag of the sender
                    await asyncio.sleep(0.001)
            await p.active(version)  # sent again, in full
            assert p.export.failed == 1
            again = p.export.recent[-1]
            assert (again.version, again.kind, again.outcome) == (version, "full", "active")
            await p.active(p.publish())  # and a delta on it, bit-exact
            assert p.export.recent[-1].kind == "delta"

    asyncio.run(scenario())


def test_a_version_given_up_on_is_withdrawn_not_applied_after_a_stall(tmp_path: Path) -> None:
    """The fault: the apply agent stalls (a compile, a paused process) with version 2 on the
    link, one chunk of it taken; the export agent hears no acknowledgement in time, gives
    version 2 up and sends the newest, 3, in full. Once the agent reads again it must not
    apply version 2 first (its engines reloading weights that are already stale): the
    export agent withdrew what the link still held of it, and only 3 is applied."""

    async def scenario() -> None:
        counted = metrics.catalogue().get_sample_value("deltarl_export_withdrawn_chunks_total")
        async with pair(tmp_path, chunk_bytes=64 << 10, ack_timeout_s=1.0) as p:
            await p.active(0)
            await p.active(p.publish())
            directory = p.apply.receiver.config.directory
            async with p.apply._lock:  # the stall: no item is handled while it is held
                stale = p.publish()
                async with asyncio.timeout(30):
                    while p.export.failed == 0:  # noqa: ASYNC110 - a core's state
                        await asyncio.sleep(0.001)
                    newest = p.publish()  # before the retry's back-off ends: it goes next
                    while p.export.taken != newest:  # noqa: ASYNC110 - a core's state
                        await asyncio.sleep(0.001)
                failed = p.export.recent[-1]
                assert (failed.version, failed.kind) == (stale, "delta")
                assert "no acknowledgement" in failed.outcome
                assert p.export.withdrawn > 1  # the chunk taken and at least one more
                served = metrics.catalogue().get_sample_value(
                    "deltarl_export_withdrawn_chunks_total"
                )
                assert served == (counted or 0) + p.export.withdrawn
                left = [f.name for f in directory.iterdir() if f.name.startswith(f"v{stale}-")]
                assert left == []
            await p.active(newest)
            assert (p.export.recent[-1].kind, p.export.recent[-1].outcome) == ("full", "active")
            applied = [
                e.version for e in p.apply.context.published if isinstance(e, VersionApplied)
            ]
            assert applied == [0, 1, newest]  # never the version given up on

    asyncio.run(scenario())


def test_the_reference_is_unlabelled_while_its_bytes_change() -> None:
    ref = Reference()
    like = np.zeros(64, np.uint8)
    buf = ref.take(like)
    assert ref.buffer is buf
    assert ref.version is None
    ref.adopt(3, "s", delta=False)
    assert (ref.version, ref.session, ref.deltas_in_a_row) == (3, "s", 0)
    ref.adopt(4, "s", delta=True)
    assert ref.deltas_in_a_row == 1
    assert ref.take(like) is buf  # allocated once, reused
    assert (ref.version, ref.session) == (None, None)
    ref.adopt(5, "s", delta=True)
    ref.drop()
    state = ReceiverState(session="s", active_version=5, needs_full=False)
    assert ref.buffer is buf
    assert ref.full_reason(state, 6, resync=False, every=9) == "no reference"


def test_resync_period_follows_the_measured_sizes() -> None:
    assert resync_period(50, 0.05, None, None) == 50  # nothing measured yet: the ceiling
    assert resync_period(50, 0.0, 1e9, 1e9) == 50  # turned off: the fixed period
    assert resync_period(50, 0.05, 200e6, 2e6) == 50  # 1% deltas: a full costs 2000 deltas
    assert resync_period(50, 0.05, 200e6, 100e6) == 40  # half-size deltas: every 40
    assert resync_period(50, 0.05, 200e6, 300e6) == 14  # deltas beyond a full version
    assert resync_period(50, 1e6, 200e6, 100e6) == 1  # never below one delta


def test_periodic_full_versions_come_sooner_when_deltas_are_large(tmp_path: Path) -> None:
    """An overhead that makes a full version worth 2-3 of this workload's deltas: periodic
    full versions come long before the ceiling, and no run of deltas outlasts the period in
    force when it was sent."""

    async def scenario() -> None:
        async with pair(tmp_path, full_resync_overhead=15.0) as p:
            await p.active(0)
            periods = []
            for _ in range(9):
                periods.append(p.export.resync_period())
                await p.active(p.publish())
            records = list(p.export.recent)
            full = records[0].wire_bytes
            delta = statistics.fmean(r.wire_bytes for r in records if r.kind == "delta")
            expected = resync_period(50, 15.0, full, delta)
            assert 1 < expected < 9, (full, delta)
            assert p.export.status_fields()["full_resync_period"] == expected
            kinds = [r.kind for r in records]
            assert kinds.count("full") >= 3, kinds  # the first, then periodic ones
            run = 0
            for kind, period in zip(kinds[1:], periods, strict=True):
                run = run + 1 if kind == "delta" else 0
                assert run <= period, (kinds, periods)

    asyncio.run(scenario())


def test_a_new_receiver_session_gets_a_full_version_and_resync_one_too(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            await p.active(p.publish())
            p.apply.session = "restarted"  # what a restart of the apply agent looks like,
            p.feed.update(p.apply.receiver_state())  # once it is heard
            await p.active(p.publish())
            assert p.export.recent[-1].kind == "full"
            await p.export.on_resync(Resync())
            await p.active(p.publish())
            assert p.export.recent[-1].kind == "full"
            await p.active(p.publish())
            assert p.export.recent[-1].kind == "delta"

    asyncio.run(scenario())


def test_a_silent_receiver_gets_nothing_until_it_is_heard(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            p.feed.stale_s = 0.3
            p.apply.config = ApplyConfig(  # silence: no heartbeat for a long while
                control="ipc:///unused",
                rollout_store="roll",
                link=p.apply.config.link,
                heartbeat_s=3600,
            )
            await asyncio.sleep(1.3)  # the heartbeat task sleeps out its old period first
            assert p.feed.latest() is None
            version = p.publish()
            await asyncio.sleep(0.5)
            assert p.export.taken == 0  # nothing taken while the receiver is silent
            assert p.export.status_fields()["detail"] == "waiting for the apply agent"
            p.feed.update(p.apply.receiver_state())  # heard again
            await p.active(version)

    asyncio.run(scenario())


def test_drain_waits_for_the_acknowledgement_of_the_version_in_flight(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            version = p.publish()
            # In flight: taken and being shipped. (``shipping`` alone also covers the retention
            # prune after the previous version's acknowledgement: a drain then has nothing
            # in flight to wait for, which is right, but not what this test is about.)
            async with asyncio.timeout(10):
                while not (p.export.shipping and p.export.taken == version):  # noqa: ASYNC110
                    await asyncio.sleep(0.001)
            await asyncio.wait_for(p.export.drain(), 30)
            assert p.export.ref.version == version  # acknowledged before the drain returned
            p.publish()
            await asyncio.sleep(0.3)
            assert p.export.taken == version  # draining: nothing new is taken

    asyncio.run(scenario())


def test_full_rule() -> None:
    ref = Reference(np.zeros(1), 5, "s")
    ok = ReceiverState(session="s", active_version=5, needs_full=False)

    def rule(state: ReceiverState, version: int, *, resync: bool = False) -> str | None:
        return ref.full_reason(state, version, resync=resync, every=3)

    assert rule(ok, 6) is None
    assert "restarted" in (rule(ReceiverState("t", 5, False), 6) or "")
    assert "holds 4" in (rule(ReceiverState("s", 4, False), 6) or "")
    assert "asked" in (rule(ReceiverState("s", 5, True), 6) or "")
    assert "not newer" in (rule(ok, 5) or "")
    ref.deltas_in_a_row = 3
    assert "periodic" in (rule(ok, 6) or "")
    ref.deltas_in_a_row = 0
    assert rule(ok, 6, resync=True) == "resync command"
    ref.drop()
    assert rule(ok, 6) == "no reference"


def test_put_returns_false_when_the_consumer_dies_on_a_full_queue() -> None:
    async def scenario() -> tuple[bool, bool]:
        queue: asyncio.Queue[object] = asyncio.Queue(1)
        queue.put_nowait(object())  # full

        async def consumer() -> None:
            await asyncio.sleep(0.05)
            raise ConnectionError("the link failed")

        task = asyncio.create_task(consumer())
        ok = await asyncio.wait_for(put_unless_done(queue, None, task), 5)  # type: ignore[arg-type]
        assert task.done()
        with_room = asyncio.Queue(1)  # type: ignore[var-annotated]
        live = asyncio.create_task(asyncio.sleep(10))
        ok2 = await put_unless_done(with_room, None, live)
        live.cancel()
        return ok, ok2

    ok, ok2 = asyncio.run(scenario())
    assert ok is False
    assert ok2 is True


def test_a_failed_version_is_sent_again_though_nothing_newer_is_published(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            await p.active(p.publish())
            version = p.publish()
            async with asyncio.timeout(10):
                while not p.export.shipping:  # noqa: ASYNC110 - a flag of the core
                    await asyncio.sleep(0.001)
            # The fault: the receiver restarts while the version is on its way (the state
            # heard next has another session), so this version fails; the trainer then
            # publishes nothing newer.
            p.apply.session = "restarted"
            await p.active(version)  # sent again, in full, and acknowledged
            failed, again = list(p.export.recent)[-2:]
            assert failed.version == again.version == version
            assert "restarted" in failed.outcome
            assert (again.kind, again.outcome) == ("full", "active")
            assert p.export.retries == 1

    asyncio.run(scenario())


def test_resync_and_a_restarted_receiver_get_the_newest_version_again(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            await p.active(p.publish())
            version = p.publish()
            await p.active(version)
            # a rollback on the receiver is left alone (an operator's choice) ...
            assert await p.apply.on_rollback(Rollback()) == Ok(
                f"rolled back to version {version - 1}"
            )
            p.feed.update(p.apply.receiver_state())
            await asyncio.sleep(0.3)
            assert p.rollout.active_version == version - 1
            # ... until `resync`: the newest version goes again, in full, though nothing newer
            # is published
            sent = len(p.export.recent)
            await p.export.on_resync(Resync())
            await p.active(version)
            async with asyncio.timeout(30):  # the flip comes before the export agent's record
                while len(p.export.recent) == sent:  # noqa: ASYNC110 - a core's state
                    await asyncio.sleep(0.01)
            assert (p.export.recent[-1].version, p.export.recent[-1].kind) == (version, "full"), [
                (r.version, r.base, r.kind, r.outcome) for r in p.export.recent
            ]
            # a receiver that restarted holding an older version is brought up to date too
            await p.apply.on_rollback(Rollback())
            p.apply.session = "restarted"
            p.feed.update(p.apply.receiver_state())
            async with asyncio.timeout(30):
                while p.export.ref.session != "restarted":  # noqa: ASYNC110 - a core's state
                    await asyncio.sleep(0.01)
            await p.active(version)

    asyncio.run(scenario())


def test_an_older_version_is_not_sent_to_a_restarted_receiver_holding_a_newer_one(
    tmp_path: Path,
) -> None:
    # Found by `deltarl chaos`: a trainer restarted from its checkpoint publishes an older
    # version again; the apply agent (or the export agent) restarted meanwhile. The older
    # version must not be sent in full "because the receiver restarted" (or "no reference"):
    # that rolled every engine back to it, until the replay caught up.
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            old = p.publish()
            await p.active(old)
            with p.published.lease() as snap:
                old_bytes = np.array(snap.buffer)
            held = p.publish()
            await p.active(held)
            with p.published.begin_write() as txn:  # the restarted trainer's checkpoint
                txn.buffer[:] = old_bytes
                txn.commit(old, allow_older=True)
            async with asyncio.timeout(30):
                while p.export.republished == 0:  # noqa: ASYNC110 - a core's state
                    await asyncio.sleep(0.01)
            sent = len(p.export.recent)
            # the apply agent restarted, holding ``held`` and remembering nothing else
            p.apply.session = "restarted"
            p.apply.finished.clear()
            retries = p.export.retries
            p.feed.update(p.apply.receiver_state())
            await asyncio.sleep(1.0)
            assert p.rollout.active_version == held
            assert p.export.retries == retries  # nothing sent again
            p.export.ref.drop()  # what a restarted export agent holds: no reference
            p.export.taken = None
            await asyncio.sleep(1.0)
            assert p.rollout.active_version == held
            assert len(p.export.recent) == sent, [(r.version, r.kind) for r in p.export.recent]
            # the trainer's next newer version goes, in full (the reference is gone)
            await p.active(p.publish())
            assert (p.export.recent[-1].kind, p.export.recent[-1].outcome) == ("full", "active")

    asyncio.run(scenario())


def test_the_version_gauges_read_nan_once_the_stores_are_closed(tmp_path: Path) -> None:
    """A scrape between a core's close and the metrics server's must still be served."""

    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            served = metrics.catalogue()
            assert served.get_sample_value("deltarl_active_version") == 0
            assert served.get_sample_value("deltarl_published_version") == 0
        served = metrics.catalogue()  # the cores are closed now
        assert math.isnan(served.get_sample_value("deltarl_active_version") or 0.0)
        assert math.isnan(served.get_sample_value("deltarl_published_version") or 0.0)

    asyncio.run(scenario())
