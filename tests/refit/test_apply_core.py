"""The apply agent's core in one process: what it applies, refuses, says, and how it drains.

Chunks are handed to the core as a transport would hand them (``ReceivedChunk`` with a release
callback); its events go to a ``StateFeed`` through the daemon context, as the export agent's
watch would hear them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import orjson

from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import CHUNKS_PER_SEND, HEADER_SIZE
from deltarl.config.refit import ApplyConfig
from deltarl.engine.daemon import DaemonContext
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore
from deltarl.refit.apply import ApplyCore
from deltarl.refit.receiver_state import GetReceiverState, ReceiverState, StateFeed
from deltarl.sim.realistic_deltas import RealisticDeltas
from deltarl.transport.base import ReceivedChunk, ReceivedManifest, make_receiver
from deltarl.transport.link_config import ShmLinkConfig
from deltarl.transport.messages import Error, Event, Ok, RefitFailed, Rollback, VersionApplied
from tests.codecs.forge import reseal

PARAMS = 200_000


class FeedContext(DaemonContext):
    """A daemon context whose events land in a list and, for receiver states, in a feed."""

    def __init__(self) -> None:
        super().__init__("apply")
        self.feed = StateFeed()
        self.events: list[Event] = []  # type: ignore[assignment]

    async def publish(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, ReceiverState):
            self.feed.update(event)


def _versions(n: int) -> tuple[Layout, list[np.ndarray]]:
    gen = RealisticDeltas(PARAMS, seed=3)
    out = [gen.publish()]
    for _ in range(n - 1):
        gen.step()
        out.append(gen.publish())
    return gen.layout, out


class Sender:
    def __init__(self, layout: Layout, versions: list[np.ndarray]) -> None:
        self.enc = DeltaEncoder(layout, chunk_bytes=64 << 10)
        self.versions = versions
        self.released = 0

    def encoded(self, v: int, base: int | None) -> tuple[list[bytes], bytes]:
        ref = None if base is None else self.versions[base]
        e = self.enc.encode(self.versions[v], ref, target_version=v, base_version=base)
        chunks = [c.data for c in e]
        assert e.manifest is not None
        return chunks, e.manifest.to_json()

    async def send(self, core: ApplyCore, v: int, chunks: list[bytes], manifest: bytes) -> None:
        before = self.released
        for i, data in enumerate(chunks + chunks[:1]):  # one chunk twice: harmless
            await core._on_chunk(ReceivedChunk(v, i % len(chunks), data, self._release))
        await core._on_manifest(ReceivedManifest(v, manifest))
        assert self.released - before == len(chunks) + 1  # every chunk was released

    def _release(self) -> None:
        self.released += 1


def _core(tmp: Path, layout: Layout) -> tuple[ApplyCore, FeedContext, WeightStore]:
    store = WeightStore.create("r", layout, root=tmp)
    link = ShmLinkConfig(name="t", root=tmp)
    cfg = ApplyConfig(control="ipc:///unused", rollout_store="r", link=link)
    context = FeedContext()
    return ApplyCore(cfg, context, store, make_receiver(link)), context, store


def test_apply_core_refuses_what_it_cannot_apply_and_says_so(tmp_path: Path) -> None:
    layout, vs = _versions(5)
    tx = Sender(layout, vs)

    async def scenario() -> None:
        core, context, store = _core(tmp_path, layout)
        assert core.needs_full  # an empty store needs a full version
        await tx.send(core, 0, *tx.encoded(0, None))
        await tx.send(core, 1, *tx.encoded(1, 0))
        st = await core.on_get_state(GetReceiverState())
        assert (st.active_version, st.needs_full, st.applied_version, st.applied_base) == (
            1,
            False,
            1,
            0,
        )
        assert st.committed_at >= st.started_at > 0
        assert [e.version for e in context.events if isinstance(e, VersionApplied)] == [0, 1]
        # a delta on a version the store does not hold is refused and reported; it asks for
        # nothing more (the receiver state shows the export agent which base is held)
        await tx.send(core, 3, *tx.encoded(3, 2))
        st = core.receiver_state()
        assert (st.active_version, st.needs_full, st.failed_version) == (1, False, 3)
        assert "refused" in st.failed_reason
        assert any(isinstance(e, RefitFailed) and e.version == 3 for e in context.events)
        # chunks that disagree with their manifest never become active
        chunks, _ = tx.encoded(2, 1)
        _, wrong = tx.encoded(2, 0)
        await tx.send(core, 2, chunks, wrong)
        assert (core.receiver_state().active_version, core.receiver_state().failed_version) == (
            1,
            2,
        )
        # a full version clears needs_full (version 3 failed as a delta on 2: re-sent in full,
        # it is accepted); rollback flips back to the version kept
        await tx.send(core, 3, *tx.encoded(3, None))
        st = core.receiver_state()
        assert (st.active_version, st.needs_full) == (3, False)
        with store.lease() as snap:
            assert np.array_equal(snap.buffer, vs[3])
        # --to a version that is not the one kept: refused, nothing flipped
        refused = await core.on_rollback(Rollback(version=2))
        assert isinstance(refused, Error)
        assert refused.code == "no_previous_version"
        assert "the only older version is 1" in refused.message
        assert core.receiver_state().active_version == 3
        assert await core.on_rollback(Rollback(version=1)) == Ok("rolled back to version 1")
        with store.lease() as snap:
            assert snap.version == 1
            assert np.array_equal(snap.buffer, vs[1])
        # a version half-received as a delta, then re-sent in full (the export agent restarted)
        delta_chunks, _ = tx.encoded(4, 1)
        await core._on_chunk(ReceivedChunk(4, 0, delta_chunks[0]))
        assert core.receiver_state().applying == 4
        assert core.status_fields()["applying"] == 4
        await tx.send(core, 4, *tx.encoded(4, None))
        with store.lease() as snap:
            assert snap.version == 4
            assert np.array_equal(snap.buffer, vs[4])
        await core.close()

    asyncio.run(scenario())


def test_state_is_pushed_on_change_and_as_a_heartbeat(tmp_path: Path) -> None:
    layout, vs = _versions(2)
    tx = Sender(layout, vs)

    async def scenario() -> None:
        core, context, _ = _core(tmp_path, layout)
        announcing = asyncio.create_task(core._announce())
        try:
            first = await context.feed.next(5)  # the heartbeat (nothing changed yet)
            assert first is not None
            assert (first.session, first.active_version, first.needs_full) == (
                core.session,
                None,
                True,
            )
            await tx.send(core, 0, *tx.encoded(0, None))
            # the change is pushed at once, well before the next heartbeat (1 s)
            heard = context.feed.updates
            state = await asyncio.wait_for(_until(context.feed, 0), 0.5)
            assert context.feed.updates > heard
            assert state.applied_version == 0
        finally:
            announcing.cancel()
            await core.close()

    asyncio.run(scenario())


async def _until(feed: StateFeed, version: int) -> ReceiverState:
    state = feed.latest()
    while state is None or state.active_version != version:
        state = await feed.next(1.0)
    return state


def test_drain_finishes_the_version_in_flight_and_opens_no_other(tmp_path: Path) -> None:
    layout, vs = _versions(3)
    tx = Sender(layout, vs)

    async def scenario() -> None:
        core, _, store = _core(tmp_path, layout)
        await tx.send(core, 0, *tx.encoded(0, None))
        chunks, manifest = tx.encoded(1, 0)
        await core._on_chunk(ReceivedChunk(1, 0, chunks[0]))
        draining = asyncio.create_task(core.drain())
        await asyncio.sleep(0.05)
        assert not draining.done()  # version 1 is half applied: the drain waits for it
        for i, data in enumerate(chunks[1:], start=1):
            await core._on_chunk(ReceivedChunk(1, i, data))
        await core._on_manifest(ReceivedManifest(1, manifest))
        await asyncio.wait_for(draining, 5)
        assert store.active_version == 1
        # draining: a new version is not started, the active one stays
        await core._on_chunk(ReceivedChunk(2, 0, tx.encoded(2, 1)[0][0]))
        assert core.job is None
        assert store.active_version == 1
        await core.close()

    asyncio.run(scenario())


def _manifest_with(manifest: bytes, **fields: object) -> bytes:
    obj = orjson.loads(manifest)
    obj.update(fields)
    return orjson.dumps(obj)


def test_nothing_on_the_wire_takes_the_agent_down_or_blocks_a_later_version(
    tmp_path: Path,
) -> None:
    layout, vs = _versions(4)
    tx = Sender(layout, vs)

    async def scenario() -> None:
        core, context, store = _core(tmp_path, layout)
        await tx.send(core, 0, *tx.encoded(0, None))
        chunks, manifest = tx.encoded(1, 0)
        # Manifests that would crash a commit or lie about their versions: refused, counted,
        # and nothing changes (no version is failed, no job opened).
        for bad in (
            _manifest_with(manifest, version=2**63),
            _manifest_with(manifest, base_version=1),  # not below its version
            _manifest_with(manifest, version=5),  # not the version it was delivered as
        ):
            await core._on_item(ReceivedManifest(1, bad))
        # Garbage chunks for versions not sent yet, and a chunk whose checksum does not hold:
        # no job is opened (no write transaction, no copy of the active buffer), none of
        # those versions is marked failed.
        await core._on_item(ReceivedChunk(2, 0, b"\x00not a frame" * 10))
        await core._on_item(ReceivedChunk(3, 0, b"DRLD" + b"\xff" * 200))
        broken = bytearray(chunks[0])
        broken[-1] ^= 1
        await core._on_item(ReceivedChunk(1, 0, bytes(broken)))
        assert core.job is None
        assert core.finished == {0: ("applied", None, 0)}
        assert core.refused_items == 6
        assert core.receiver_state().failed_version is None
        # A well-formed delta for version 2 on a base the agent does not hold: refused once.
        wrong_chunks, _ = tx.encoded(2, 1)
        await core._on_item(ReceivedChunk(2, 0, wrong_chunks[0]))
        assert core.receiver_state().failed_version == 2
        # The real versions still go through, each on the version the agent holds.
        await tx.send(core, 1, chunks, manifest)
        await tx.send(core, 2, *tx.encoded(2, 1))
        await tx.send(core, 3, *tx.encoded(3, 2))
        assert store.active_version == 3
        with store.lease() as snap:
            assert np.array_equal(snap.buffer, vs[3])
        assert not any(isinstance(e, RefitFailed) and e.version in (1, 3) for e in context.events)
        await core.close()

    asyncio.run(scenario())


def test_a_failed_full_version_is_accepted_on_its_next_send_not_its_late_chunks(
    tmp_path: Path,
) -> None:
    # Found by looking past defect 6: failures were remembered by base only, so a full
    # version that failed was never accepted in full again (a full re-send has the same
    # "base"). Now an attempt is its base and its send slot (the chunk ids' range).
    layout, vs = _versions(1)

    async def scenario() -> None:
        core, _, store = _core(tmp_path, layout)
        enc = DeltaEncoder(layout, chunk_bytes=64 << 10)

        def send_of(n: int) -> tuple[list[tuple[int, bytes]], bytes]:
            e = enc.encode(vs[0], None, target_version=0, first_chunk_id=n * CHUNKS_PER_SEND)
            chunks = [(c.chunk_id, c.data) for c in e]
            assert e.manifest is not None
            return chunks, e.manifest.to_json()

        first, manifest = send_of(0)
        assert len(first) > 1
        # the first send fails: its second chunk is damaged after its checksum (the decoder
        # refuses it), so version 0 fails with that attempt remembered
        cid, data = first[1]
        damaged = bytearray(data)
        damaged[HEADER_SIZE + 8] ^= 0xFF
        await core._on_item(ReceivedChunk(0, first[0][0], first[0][1]))
        await core._on_item(ReceivedChunk(0, cid, reseal(damaged)))
        assert store.active_version is None
        assert core.receiver_state().failed_version == 0
        # its late chunks are ignored: no job opens for them
        await core._on_item(ReceivedChunk(0, first[0][0], first[0][1]))
        assert core.job is None
        # the next send of the same full version is accepted
        second, manifest = send_of(1)
        for chunk_id, data in second:
            await core._on_item(ReceivedChunk(0, chunk_id, data))
        await core._on_item(ReceivedManifest(0, manifest))
        assert store.active_version == 0
        await core.close()

    asyncio.run(scenario())


def test_a_stale_send_never_takes_the_rollout_back(tmp_path: Path) -> None:
    """Sends the export agent gave up on can reach the agent after newer ones (they waited
    in the link while the agent stalled, and several sender connections' queues merge in
    no particular order). One encoded before the newest version committed, of a lower
    version, is refused; a new run's lower versions (encoded later), a higher version
    encoded earlier (a clock stepped back) and a re-send after a rollback are not."""
    layout, vs = _versions(6)
    tx = Sender(layout, vs)

    async def scenario() -> None:
        core, context, store = _core(tmp_path, layout)
        stale_1 = tx.encoded(1, None)  # given up on by the sender, still in the link
        stale_2 = tx.encoded(2, None)
        await tx.send(core, 3, *tx.encoded(3, None))
        for v, (chunks, manifest) in ((2, stale_2), (1, stale_1)):
            await tx.send(core, v, chunks, manifest)
            st = core.receiver_state()
            assert (st.active_version, st.needs_full, st.failed_version) == (3, False, v)
            assert st.failed_reason.startswith("superseded: a stale send"), st.failed_reason
        with store.lease() as snap:
            assert (snap.version, np.array_equal(snap.buffer, vs[3])) == (3, True)
        # a delta on the active version goes on as before
        await tx.send(core, 4, *tx.encoded(4, 3))
        assert core.receiver_state().active_version == 4
        # a rollback, then the version rolled back from sent again: accepted
        assert await core.on_rollback(Rollback()) == Ok("rolled back to version 3")
        await tx.send(core, 4, *tx.encoded(4, None))
        assert core.receiver_state().active_version == 4
        # a higher version encoded "earlier" (the export host's clock stepped back)
        chunks, manifest = tx.encoded(5, 4)
        body = orjson.loads(manifest)
        body["time"] -= 3600
        await tx.send(core, 5, chunks, orjson.dumps(body))
        assert core.receiver_state().active_version == 5
        # a new run: its trainer numbers from 0 again, encoded after everything before
        await tx.send(core, 0, *tx.encoded(0, None))
        assert core.receiver_state().active_version == 0
        with store.lease() as snap:
            assert np.array_equal(snap.buffer, vs[0])
        refused = [e.version for e in context.events if isinstance(e, RefitFailed)]
        assert refused == [2, 1], context.events

    asyncio.run(scenario())
