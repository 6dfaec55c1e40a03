"""WrittenRanges: a record is refused exactly when it reaches into an element another chunk
of the version wrote, checked against a plain set of written elements."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.codecs.frame import POS_RICE, VAL_ORDERED_DELTA, FrameError, RecordHeader
from deltarl.codecs.written_ranges import WrittenRanges
from deltarl.engine.layout import Layout

LAYOUT = Layout.pack([("a", "bfloat16", (200,)), ("b", "float32", (50,))])


def _record(tensor_id: int, start: int, length: int) -> RecordHeader:
    return RecordHeader(
        tensor_id=tensor_id,
        pos_coding=POS_RICE,
        val_coding=VAL_ORDERED_DELTA,
        itemsize=LAYOUT.tensors[tensor_id].itemsize,
        pos_k=0,
        val_k=0,
        start=start,
        length=length,
        changed=1,
        pos_len=1,
        val_len=1,
    )


@st.composite
def _chunk(draw: st.DrawFn) -> list[RecordHeader]:
    """Disjoint ascending records, as a frame that passed its own checks holds."""
    records = []
    for tid, spec in enumerate(LAYOUT.tensors):
        cuts = sorted(draw(st.sets(st.integers(0, spec.numel), max_size=6)))
        for lo, hi in zip(cuts[::2], cuts[1::2], strict=False):
            if hi > lo:
                records.append(_record(tid, lo, hi - lo))
    return records


@settings(max_examples=300, deadline=None)
@given(st.lists(_chunk(), min_size=1, max_size=8))
def test_refused_exactly_when_an_element_was_written(chunks: list[list[RecordHeader]]) -> None:
    ranges = WrittenRanges(LAYOUT)
    written: set[tuple[int, int]] = set()
    for cid, records in enumerate(chunks):
        elements = {(r.tensor_id, e) for r in records for e in range(r.start, r.start + r.length)}
        if elements & written:
            with pytest.raises(FrameError, match=rf"chunk {cid} of version 7: record \d+"):
                ranges.check(cid, 7, records)
            continue  # refused: nothing of it counts as written
        ranges.check(cid, 7, records)
        ranges.add(cid, records)
        written |= elements


def test_the_refusal_names_the_record_and_the_chunk_that_wrote_first() -> None:
    ranges = WrittenRanges(LAYOUT)
    ranges.add(3, [_record(0, 10, 20), _record(0, 100, 50), _record(1, 0, 50)])
    ranges.check(4, 7, [_record(0, 0, 10), _record(0, 30, 70), _record(0, 150, 50)])  # between
    with pytest.raises(
        FrameError,
        match=r"chunk 5 of version 7: record 1 \('a'\) writes elements \[140, 160\), but chunk 3 "
        r"of this version already wrote \[100, 150\)",
    ):
        ranges.check(5, 7, [_record(0, 0, 10), _record(0, 140, 20)])
    with pytest.raises(FrameError, match=r"record 0 \('b'\) writes elements \[49, 50\)"):
        ranges.check(5, 7, [_record(1, 49, 1)])
