"""Writing while decoding (decoder.decode_apply_chunk): the same bytes as decoding first and
writing after, and a frame refused part way through the writes leaves the target as it was.

The refusals here are made to happen after the kernel has written: a record whose streams
hold one element more than it claims is refused only once the claimed ones are decoded (and
written), and a MemoryError is raised between the two element widths' kernel calls. A spy
around the real ``undo_sparse`` shows that writes were made and put back, so these tests
cannot pass by refusing the frame before the first write.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarl.codecs import kernels
from deltarl.codecs.decoder import (
    VersionApply,
    apply_chunk,
    decode_apply_chunk,
    decode_chunk,
)
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import POS_DENSE, POS_RICE, VAL_CLASSED, FrameError
from deltarl.engine.layout import Layout
from tests.codecs.forge import Forged
from tests.codecs.sample_delta import BASE, TARGET, Case, apply_ok, assert_refused
from tests.codecs.test_conditioned import LAYOUT as CONDITIONED_LAYOUT
from tests.codecs.test_conditioned import _as_f32, _bf16
from tests.codecs.test_conditioned import _versions as conditioned_versions


@pytest.fixture
def undone(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Elements each undo_sparse call put back (the real kernel runs)."""
    calls: list[int] = []
    real = kernels.undo_sparse

    def spy(*args: np.ndarray) -> None:
        calls.append(int(args[2].sum()))  # done: elements written
        real(*args)

    monkeypatch.setattr(kernels, "undo_sparse", spy)
    return calls


@pytest.mark.parametrize("in_place", [False, True])
def test_same_bytes_as_decoding_then_writing(case: Case, in_place: bool) -> None:
    for chunks in ([case.chunk], case.chunks):
        written = case.ref.copy()
        ref = written if in_place else case.ref.copy()
        replayed = case.ref.copy()
        decoded_first = case.ref.copy()
        for data in chunks:
            chunk = decode_apply_chunk(data, case.layout, written, ref, base=BASE, target=TARGET)
            # the chunk it returns writes the same elsewhere (what a kept delta replays)
            apply_chunk(chunk, case.layout, replayed, case.ref)
            plain = decode_chunk(data, case.layout, base=BASE, target=TARGET)
            apply_chunk(plain, case.layout, decoded_first, case.ref)
        assert written.tobytes() == case.cur.tobytes()
        assert replayed.tobytes() == case.cur.tobytes()
        assert decoded_first.tobytes() == case.cur.tobytes()


def test_conditioned_records_are_written_too() -> None:
    """Conditioned records are decoded before the Rice pass and written after it."""
    ref, cur = conditioned_versions()[:2]
    enc = DeltaEncoder(CONDITIONED_LAYOUT, item_elems=1024, conditioned=True)
    e = enc.encode(cur, ref, target_version=1, base_version=0)
    chunks = [c.data for c in e]
    assert e.manifest is not None
    assert "conditioned" in {t.coding for t in e.manifest.tensors}
    for in_place in (False, True):
        target = ref.copy()
        apply = VersionApply(
            CONDITIONED_LAYOUT, target, target if in_place else ref, base=0, version=1
        )
        for data in chunks:
            apply.apply(data)
        apply.verify(e.manifest)
        assert target.tobytes() == cur.tobytes()


def _trailing(case: Case, itemsize: int) -> tuple[bytes, int]:
    """The one-chunk delta with the last Rice record of this width claiming one element
    fewer than its streams hold: refused only after the others are decoded and written."""
    f = Forged.parse(case.chunk)
    i = max(
        j for j, r in enumerate(f.records) if r.pos_coding == POS_RICE and r.itemsize == itemsize
    )
    f.edit(i, changed=f.records[i].changed - 1)
    return f.seal(), i


@pytest.mark.parametrize("itemsize", [1, 2])
def test_a_record_refused_after_writing_is_undone(
    case: Case, undone: list[int], itemsize: int
) -> None:
    """Widths are decoded 1 then 2: failing in the 2-byte kernel undoes both calls' writes."""
    frame, i = _trailing(case, itemsize)
    assert_refused(
        case,
        frame,
        rf"record {i} .*(bytes left over after the last element|padding bits are not zero)",
    )
    # assert_refused applies it twice (separately, in place); each run undid real writes
    per_run = 2 if itemsize == 2 else 1
    assert len(undone) == 2 * per_run
    assert all(n > 0 for n in undone)


def test_an_error_between_the_widths_undoes_the_first(
    case: Case, monkeypatch: pytest.MonkeyPatch, undone: list[int]
) -> None:
    """Out of memory after the 1-byte records are written, before the 2-byte ones: the
    frame is refused as out of memory, and the 1-byte writes are put back."""
    real_deal = kernels.deal
    calls = {"n": 0}

    def deal_then_fail(costs: np.ndarray, threads: int | None = None) -> tuple:
        calls["n"] += 1
        if calls["n"] == 2:  # the 2-byte kernel's dealing: the 1-byte kernel has written
            raise MemoryError
        return real_deal(costs, threads)

    monkeypatch.setattr(kernels, "deal", deal_then_fail)
    target = case.ref.copy()
    apply = VersionApply(case.layout, target, target, base=BASE, version=TARGET)
    with pytest.raises(FrameError, match=r"frame refused: decoding it ran out of memory"):
        apply.apply(case.chunk)
    assert target.tobytes() == case.ref.tobytes()
    assert not apply.applied
    assert undone == [
        sum(
            r.changed
            for r in Forged.parse(case.chunk).records
            if r.itemsize == 1 and r.pos_coding != POS_DENSE
        )
    ]


def _one_tensor_delta(density: float, classes: bool) -> tuple[Case, int]:
    """A bf16 tensor of 64K elements in records of 32K, ``density`` of them changed by an
    optimizer-like step, in one chunk; and the first Rice record's index."""
    layout = Layout.pack([("w", "bfloat16", (1 << 16,))])
    rng = np.random.default_rng(7)
    bits = _bf16(rng.normal(0, 0.02, 1 << 16))
    ref = np.zeros(layout.nbytes, np.uint8)
    layout.view(ref, "w")[:] = bits
    cur = ref.copy()
    # the same small step for the elements that move: how many ulps it is depends on the
    # exponent (what classes code), and most of them move by at least one
    step = rng.normal(0, 1e-3, bits.size).astype(np.float32) * (rng.random(bits.size) < density)
    layout.view(cur, "w")[:] = _bf16(_as_f32(bits) + step)
    enc = DeltaEncoder(layout, item_elems=1 << 15, value_classes=classes)
    e = enc.encode(cur, ref, target_version=TARGET, base_version=BASE)
    (chunk,) = [c.data for c in e]
    assert e.manifest is not None
    case = Case(layout, ref, cur, chunk, e.manifest, [chunk], e.manifest)
    f = Forged.parse(chunk)
    i = next(j for j, r in enumerate(f.records) if r.pos_coding == POS_RICE)
    return case, i


@pytest.mark.parametrize("classes", [False, True], ids=["one-k", "classed"])
@pytest.mark.parametrize("density", [0.01, 0.2], ids=["sparse", "dense"])
def test_positions_decoded_ahead_of_the_values(
    undone: list[int], classes: bool, density: float
) -> None:
    """A written record decodes its positions CLASS_LEAD changes ahead of its values (and
    prefetches their cache lines) when its values are classed or it has fewer changes than
    cache lines; else each position as its value comes. Either way: the same bytes, and a
    record whose position stream runs out while the positions lead (it claims one change
    more than it holds) is refused with the writes made so far put back."""
    case, i = _one_tensor_delta(density, classes)
    f = Forged.parse(case.chunk)
    r = f.records[i]
    assert (r.val_coding == VAL_CLASSED) == classes
    assert (r.changed * 32 < r.length) == (density < 0.03)  # 32 bf16 elements a line
    assert r.changed > 4 * kernels.CLASS_LEAD
    assert apply_ok(case, case.chunk).tobytes() == case.cur.tobytes()
    f.edit(i, changed=r.changed + 1)
    assert_refused(case, f.seal(), rf"record {i} .*a bit stream ends before all changed")
    assert len(undone) == 2  # separately and in place, each after real writes
    assert all(n > 0 for n in undone)
