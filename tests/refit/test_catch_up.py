"""The apply agent brings the inactive buffer to the active version with the last delta again
(deltarl/refit/catch_up.py) instead of copying the whole model, falls back to the copy when
the chain is broken, and never activates a byte the verify did not pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from deltarl.engine.layout import Layout
from deltarl.refit.catch_up import KeptDelta
from deltarl.transport.messages import Ok, Rollback, VersionApplied
from tests.refit.test_apply_core import Sender, _core, _versions


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_a_chain_of_deltas_catches_up_after_the_first_copy(tmp_path: Path) -> None:
    """Full 0, then deltas 1..5: delta 1 finds the other buffer empty (copy); from delta 2 on,
    the other buffer holds the version before the active one, and the last delta bridges it.
    Each version is bit-exact, and after each commit the other buffer still holds the version
    before (the rollback target)."""
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
        assert status["opened_by"] == {"copy": 1, "catch_up": 4}
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
        assert core.status_fields()["opened_by"] == {"copy": 2, "catch_up": 0}
        await tx.send(core, 4, *tx.encoded(4, 3))  # the other buffer holds 2: delta 3 bridges
        assert core.status_fields()["opened_by"] == {"copy": 2, "catch_up": 1}
        await core.on_rollback(Rollback(version=3))  # active 3; the other buffer holds 4
        await tx.send(core, 5, *tx.encoded(5, 3))  # kept 3->4 does not bring 4 to 3: copy
        assert core.status_fields()["opened_by"] == {"copy": 3, "catch_up": 1}
        with store.lease() as snap:
            assert (snap.version, np.array_equal(snap.buffer, vs[5])) == (5, True)
        store.close()

    run(go())


def test_a_kept_delta_the_decoder_refuses_falls_back_to_the_copy(tmp_path: Path) -> None:
    """Fault injection: the kept chunks are another version's (3 -> 4, not 1 -> 2). The
    decoder refuses them before writing; the agent copies instead, and the version applies."""
    layout, vs = _versions(5)
    tx = Sender(layout, vs)

    async def go() -> None:
        core, _, store = _core(tmp_path, layout)
        for v, base in ((0, None), (1, 0), (2, 1)):
            await tx.send(core, v, *tx.encoded(v, base))
        assert core.kept is not None
        assert (core.kept.base, core.kept.version) == (1, 2)
        core.kept = KeptDelta(2, 1, tx.encoded(4, 3)[0])
        await tx.send(core, 3, *tx.encoded(3, 2))
        assert core.status_fields()["last_opened_by"] == "copy"
        with store.lease() as snap:
            assert (snap.version, np.array_equal(snap.buffer, vs[3])) == (3, True)
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
        core.kept = KeptDelta(2, 1, [c.data for c in forged])
        await tx.send(core, 3, *tx.encoded(3, 2))
        state = core.receiver_state()
        assert (state.active_version, state.failed_version) == (2, 3)
        assert "differ after apply" in state.failed_reason
        with store.lease() as snap:
            assert np.array_equal(snap.buffer, vs[2])
        core.finished.pop(3)  # a re-send in a new slot is accepted the same way
        await tx.send(core, 3, *tx.encoded(3, 2))
        with store.lease() as snap:
            assert (snap.version, np.array_equal(snap.buffer, vs[3])) == (3, True)
        assert core.status_fields()["last_opened_by"] == "copy"
        store.close()

    run(go())


def test_kept_delta_bridges_only_its_own_base_to_its_own_version() -> None:
    k = KeptDelta(5, 4, [b"x" * 3, b"y"])
    assert k.nbytes == 4
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
        buf = vs[v - 1].copy()
        KeptDelta(v, v - 1, chunks).catch_up(layout, buf)
        assert np.array_equal(buf, vs[v])
    assert isinstance(layout, Layout)
