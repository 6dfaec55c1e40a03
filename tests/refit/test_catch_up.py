"""The apply agent keeps the inactive buffer current with the last delta (deltarl/refit/
catch_up.py) instead of copying the whole model: eagerly after each commit (the default, with
an undo for the rollback) or when the next delta opens; it falls back to the copy when the
chain is broken, and never activates a byte that no verify passed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from deltarl.codecs.decoder import decode_chunk, owned
from deltarl.config.refit import ApplyConfig
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore
from deltarl.refit.apply import ApplyCore
from deltarl.refit.catch_up import KeptDelta, Undo
from deltarl.transport.base import make_receiver
from deltarl.transport.link_config import ShmLinkConfig
from deltarl.transport.messages import Error, Ok, Rollback, VersionApplied
from tests.refit.test_apply_core import FeedContext, Sender, _versions


def _core(
    tmp: Path, layout: Layout, catch_up: str = "on_open"
) -> tuple[ApplyCore, FeedContext, WeightStore]:
    store = WeightStore.create("r", layout, root=tmp)
    link = ShmLinkConfig(name="t", root=tmp)
    cfg = ApplyConfig(
        control="ipc:///unused",
        rollout_store="r",
        link=link,
        catch_up=catch_up,  # type: ignore[arg-type]
    )
    context = FeedContext()
    return ApplyCore(cfg, context, store, make_receiver(link)), context, store


def assert_active(store: WeightStore, vs: list[np.ndarray], version: int) -> None:
    """The store's active version is ``version``, bit for bit."""
    with store.lease() as snap:
        assert snap.version == version
        assert np.array_equal(snap.buffer, vs[version])


def _buffers(store: WeightStore) -> list[tuple[str, int | None, bool]]:
    return [(b["state"], b["version"], b["active"]) for b in store.status()["buffers"]]


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_a_chain_of_deltas_catches_up_after_the_first_copy(tmp_path: Path) -> None:
    """``on_open``. Full 0, then deltas 1..5: delta 1 finds the other buffer empty (copy);
    from delta 2 on, the other buffer holds the version before the active one, and the last
    delta bridges it. Each version is bit-exact, and after each commit the other buffer still
    holds the version before (the rollback target)."""
    layout, vs = _versions(6)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, context, store = _core(tmp_path, layout)
        await tx.send(core, 0, *tx.encoded(0, None))
        for v in range(1, 6):
            await tx.send(core, v, *tx.encoded(v, v - 1))
            with store.lease() as snap:
                assert snap.version == v
                assert np.array_equal(snap.buffer, vs[v])
        status = core.status_fields()
        assert status["opened_by"] == {"settled": 0, "copy": 1, "catch_up": 4}
        assert status["last_opened_by"] == "catch_up"
        assert [e.version for e in context.events if isinstance(e, VersionApplied)] == list(
            range(6)
        )
        assert await core.on_rollback(Rollback(version=4)) == Ok("rolled back to version 4")
        with store.lease() as snap:
            assert np.array_equal(snap.buffer, vs[4])
        store.close()

    run(go())


def test_a_broken_chain_falls_back_to_the_copy(tmp_path: Path) -> None:
    """After a full version or a rollback, the kept delta no longer bridges the other buffer
    to the active version: the copy is used, and the versions stay bit-exact."""
    layout, vs = _versions(6)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, _, store = _core(tmp_path, layout)
        await tx.send(core, 0, *tx.encoded(0, None))
        await tx.send(core, 1, *tx.encoded(1, 0))  # copy (the other buffer was empty)
        await tx.send(core, 2, *tx.encoded(2, None))  # a full version: nothing kept
        await tx.send(core, 3, *tx.encoded(3, 2))  # copy
        assert core.status_fields()["opened_by"] == {"settled": 0, "copy": 2, "catch_up": 0}
        await tx.send(core, 4, *tx.encoded(4, 3))  # the other buffer holds 2: delta 3 bridges
        assert core.status_fields()["opened_by"] == {"settled": 0, "copy": 2, "catch_up": 1}
        await core.on_rollback(Rollback(version=3))  # active 3; the other buffer holds 4
        await tx.send(core, 5, *tx.encoded(5, 3))  # kept 3->4 does not bring 4 to 3: copy
        assert core.status_fields()["opened_by"] == {"settled": 0, "copy": 3, "catch_up": 1}
        assert_active(store, vs, 5)
        store.close()

    run(go())


async def _refused_by_verify_then_copied(
    core: ApplyCore, store: WeightStore, tx: Sender, vs: list[np.ndarray]
) -> None:
    """Delta 2 -> 3, opened by a catch-up that left wrong bytes: its verify refuses it and
    version 2 stays; sent again, it opens by the copy and applies bit-exact."""
    await tx.send(core, 3, *tx.encoded(3, 2))
    state = core.receiver_state()
    assert core.status_fields()["last_opened_by"] == "catch_up"
    assert (state.active_version, state.failed_version) == (2, 3)
    assert "differ after apply" in state.failed_reason
    assert_active(store, vs, 2)
    core.finished.pop(3)  # a re-send in a new slot is accepted the same way
    await tx.send(core, 3, *tx.encoded(3, 2))
    assert_active(store, vs, 3)
    assert core.status_fields()["last_opened_by"] == "copy"


class _Crashing(KeptDelta):
    """A catch-up that writes garbage into part of the target, then fails."""

    def catch_up(self, layout: Layout, target: np.ndarray) -> None:
        target[: target.size // 3] = 0xA5
        raise RuntimeError("injected: the catch-up died half way")


def test_a_catch_up_that_fails_half_way_is_repaired_by_the_copy(tmp_path: Path) -> None:
    """Fault injection: the catch-up writes part of the target and raises. The agent copies the
    active buffer over it instead, and the version applies bit-exact."""
    layout, vs = _versions(5)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, _, store = _core(tmp_path, layout)
        for v, base in ((0, None), (1, 0), (2, 1)):
            await tx.send(core, v, *tx.encoded(v, base))
        assert core.kept is not None
        assert (core.kept.base, core.kept.version) == (1, 2)
        assert core.kept.nbytes > 0
        core.kept = _Crashing(2, 1, core.kept.chunks)
        await tx.send(core, 3, *tx.encoded(3, 2))
        assert core.status_fields()["last_opened_by"] == "copy"
        assert_active(store, vs, 3)
        store.close()

    run(go())


def test_a_catch_up_that_goes_wrong_never_activates_bad_bytes(tmp_path: Path) -> None:
    """Fault injection: the kept chunks decode cleanly as 1 -> 2 but carry other values (a
    delta 1 -> 2 of another run). The catch-up leaves wrong bytes; the new version's verify
    hashes every tensor and refuses it, the active version stays, and a re-send applies."""
    layout, vs = _versions(5)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, _, store = _core(tmp_path, layout)
        for v, base in ((0, None), (1, 0), (2, 1)):
            await tx.send(core, v, *tx.encoded(v, base))
        forged = tx.enc.encode(vs[4], vs[1], target_version=2, base_version=1)
        core.kept = KeptDelta(
            2,
            1,
            [
                owned(decode_chunk(c.data, layout, base=1, target=2, reference=vs[1]))
                for c in forged
            ],
        )
        await _refused_by_verify_then_copied(core, store, tx, vs)
        store.close()

    run(go())


class _WrongWhereTheNextDeltaWrites(KeptDelta):
    """A catch-up that brings the target to its version, but one byte of an element the
    next delta changes comes out wrong."""

    at = 0

    def catch_up(self, layout: Layout, target: np.ndarray) -> None:
        super().catch_up(layout, target)
        target[self.at] ^= 0x01


def test_a_delta_is_applied_against_its_target_so_a_wrong_base_fails_verify(
    tmp_path: Path,
) -> None:
    """The apply reads each changed element's base from the target it writes (in place), not
    from the active buffer. Fault injection: the target's base is wrong exactly where the next
    delta writes. That version is refused by its verify (its bytes are not the manifest's),
    the active version stays, and a re-send copies and applies bit-exact. Read from the active
    buffer, the wrong byte would have been overwritten and gone unnoticed."""
    layout, vs = _versions(5)
    tx = Sender(layout, vs)
    changed = np.flatnonzero(vs[3].view(np.uint16) != vs[2].view(np.uint16))
    assert changed.size > 0

    async def go() -> None:
        core, _, store = _core(tmp_path, layout)
        for v, base in ((0, None), (1, 0), (2, 1)):
            await tx.send(core, v, *tx.encoded(v, base))
        assert core.kept is not None
        wrong = _WrongWhereTheNextDeltaWrites(2, 1, core.kept.chunks)
        wrong.at = int(changed[0]) * 2  # the low byte of the first element delta 3 changes
        core.kept = wrong
        await _refused_by_verify_then_copied(core, store, tx, vs)
        store.close()

    run(go())


def test_kept_delta_bridges_only_its_own_base_to_its_own_version() -> None:
    k = KeptDelta(5, 4)
    assert k.nbytes == 0
    assert k.brings(4, 5)
    assert not k.brings(3, 5)
    assert not k.brings(4, 6)
    assert not k.brings(None, 5)


@pytest.mark.parametrize("steps", [1, 3])
def test_catch_up_in_place_equals_the_version(steps: int) -> None:
    """The kept chunks, applied in place to a copy of their base, give their version bit for
    bit (the reference is the buffer being written: each element is read before written)."""
    layout, vs = _versions(steps + 1)
    tx = Sender(layout, vs)
    for v in range(1, steps + 1):
        chunks, _ = tx.encoded(v, v - 1)
        decoded = [
            owned(decode_chunk(c, layout, base=v - 1, target=v, reference=vs[v - 1]))
            for c in chunks
        ]
        buf = vs[v - 1].copy()
        KeptDelta(v, v - 1, decoded).catch_up(layout, buf)
        assert np.array_equal(buf, vs[v])
    assert isinstance(layout, Layout)


def test_eager_keeps_the_inactive_buffer_current_and_rolls_back_by_undo(tmp_path: Path) -> None:
    """``eager`` (the default). Full 0, deltas 1..5: delta 1 copies (the other buffer was
    empty); after each commit the other buffer is settled at the active version, so every
    later delta opens on its base ("settled"): no copy, no catch-up on the refit's path. Both
    buffers then hold the active version; a rollback writes the undo back, verifies version 4
    and flips to it, bit-exact. The next delta (on 4) copies: the other buffer holds 5."""
    layout, vs = _versions(7)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, _, store = _core(tmp_path, layout, catch_up="eager")
        assert core.config.catch_up == ApplyConfig.catch_up == "eager"  # the default
        await tx.send(core, 0, *tx.encoded(0, None))
        assert core.undo is None  # a full version: nothing to settle with
        for v in range(1, 6):
            chunks, manifest = tx.encoded(v, v - 1)
            await tx.send(core, v, chunks, manifest)
            assert_active(store, vs, v)
            assert sorted(_buffers(store)) == [("READY", v, False), ("READY", v, True)]
            assert core.undo is not None
            assert (core.undo.holds, core.undo.restores) == (v, v - 1)
            # where the apply's time went, and the settle just made (deltarl ctl apply status)
            status = core.status_fields()
            last = status["last_applied"]
            assert last["chunks"] == len(chunks) > 0
            parts = last["decode_s"] + last["keep_s"] + last["early_hash_s"]
            assert 0 < parts <= last["apply_calls_s"] <= last["apply_s"]
            assert last["apply_cpu_s"] > 0
            assert status["last_settle"]["version"] == v
            assert status["last_settle"]["seconds"] > 0
        assert core.status_fields()["opened_by"] == {"settled": 4, "copy": 1, "catch_up": 0}
        assert core.status_fields()["undo"] == {"holds": 5, "restores": 4}
        wrong = await core.on_rollback(Rollback(version=3))
        assert isinstance(wrong, Error)
        assert "the only older version is 4" in wrong.message
        assert core.undo is not None  # a refused request changes nothing
        assert await core.on_rollback(Rollback(version=4)) == Ok("rolled back to version 4")
        assert_active(store, vs, 4)
        assert sorted(_buffers(store)) == [("READY", 4, True), ("READY", 5, False)]
        await tx.send(core, 6, *tx.encoded(6, 4))  # the other buffer holds 5: copy
        assert_active(store, vs, 6)
        assert core.status_fields()["last_opened_by"] == "copy"
        store.close()

    run(go())


def test_an_undo_that_does_not_verify_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """Fault injection: the undo is swapped for one that writes other values. The rollback
    verifies every tensor against the older version's manifest, refuses, and the active
    version stays, bit-exact."""
    layout, vs = _versions(4)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, _, store = _core(tmp_path, layout, catch_up="eager")
        for v, base in ((0, None), (1, 0), (2, 1), (3, 2)):
            await tx.send(core, v, *tx.encoded(v, base))
        undo = core.undo
        assert undo is not None
        other = tx.enc.encode(vs[0], vs[3], target_version=3, base_version=2)
        bogus = [
            owned(decode_chunk(c.data, layout, base=2, target=3, reference=vs[3])) for c in other
        ]
        core.undo = Undo(undo.holds, undo.restores, bogus, undo.manifest)
        refused = await core.on_rollback(Rollback())
        assert isinstance(refused, Error)
        assert "failed" in refused.message
        assert_active(store, vs, 3)
        store.close()

    run(go())


def _settle_crash(self: KeptDelta, layout: Layout, target: np.ndarray) -> list:
    target[: target.size // 2] = 0x5A
    raise RuntimeError("injected: settling died half way")


def test_a_settle_that_fails_leaves_the_next_delta_to_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: settling the inactive buffer writes half of it and raises. That buffer
    is marked EMPTY (never flipped to); the active version is untouched; the next delta
    copies; a rollback says there is nothing to roll back to."""
    layout, vs = _versions(4)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, _, store = _core(tmp_path, layout, catch_up="eager")
        for v, base in ((0, None), (1, 0)):
            await tx.send(core, v, *tx.encoded(v, base))
        with monkeypatch.context() as m:
            m.setattr(KeptDelta, "catch_up_with_undo", _settle_crash)
            await tx.send(core, 2, *tx.encoded(2, 1))
        assert core.status_fields()["settle_failures"] == 1
        assert core.undo is None
        assert sorted(_buffers(store)) == [("EMPTY", None, False), ("READY", 2, True)]
        assert_active(store, vs, 2)
        refused = await core.on_rollback(Rollback())
        assert isinstance(refused, Error)
        await tx.send(core, 3, *tx.encoded(3, 2))
        assert core.status_fields()["last_opened_by"] == "copy"
        assert_active(store, vs, 3)
        store.close()

    run(go())
