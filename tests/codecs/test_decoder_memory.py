"""A small frame cannot make the decoder allocate much: what it allocates is bounded by the bytes
received (and MAX_RAW_BYTES) before it is allocated (frame.py), and running out of memory anyway
is a refused frame, never a MemoryError a caller does not expect.

The frames are forged from scratch against layouts of 2**30 and 2**40 elements that are declared
and never allocated: the decoder refuses them before it touches a buffer, so the target here is a
few bytes that must come out unchanged.
"""

from __future__ import annotations

import resource
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import zstandard

from deltarl.codecs import decoder, encoder
from deltarl.codecs.decoder import DecodeScratch, VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import (
    COMP_NONE,
    COMP_ZSTD,
    KIND_DELTA,
    POS_BITMAP,
    POS_DENSE,
    POS_RICE,
    STREAM_BITMAP,
    STREAM_PLANE0,
    STREAM_RICE,
    STREAM_VALUES,
    VAL_ORDERED_DELTA,
    FrameError,
    RecordHeader,
)
from deltarl.engine.layout import Layout
from tests.codecs.forge import Forged, build_frame
from tests.codecs.sample_delta import BASE, ITEM, TARGET, Case

HUGE = 1 << 30  # elements of the declared tensor (2 GiB of bf16)
VAST = 1 << 40  # elements of the declared tensor in the frame that raised MemoryError

BUDGET = 32 << 20  # bytes the decoder may allocate (or grow its RSS by) for these frames


def _layout(numel: int) -> Layout:
    return Layout.pack([("big", "bfloat16", (numel,))])


def _frame(records: list[RecordHeader], streams: list[tuple[int, int, int, bytes]]) -> bytes:
    return build_frame(KIND_DELTA, BASE, TARGET, records, streams)


def _record(pos: int, length: int, changed: int, pos_len: int, val_len: int) -> RecordHeader:
    return RecordHeader(0, pos, VAL_ORDERED_DELTA, 2, 0, 0, 0, length, changed, pos_len, val_len)


def _zstd_lie(claimed: int) -> bytes:
    """A 13-byte zstd frame that declares ``claimed`` bytes and holds one 16-byte RLE block."""
    fhd = 0xA0  # 4-byte content size, single segment (no window descriptor)
    block = (16 << 3) | (1 << 1) | 1  # size 16, RLE, last block
    return struct.pack("<IBI", 0xFD2FB528, fhd, claimed) + block.to_bytes(3, "little") + b"\0"


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        (line,) = [x for x in f if x.startswith("VmSize:")]
    return int(line.split()[1]) * 1024


@contextmanager
def _bounded(budget: int = BUDGET) -> Iterator[None]:
    """Fail if the block allocates (numpy and zstd allocations are traced) or grows the peak RSS
    by more than ``budget`` bytes. The address space is capped meanwhile, so a decoder that
    would allocate gigabytes fails with MemoryError here instead of exhausting the machine."""
    rss = _maxrss()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + 16 * budget
    resource.setrlimit(
        resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard)
    )
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert peak < budget, f"the decoder allocated {peak} bytes"
    assert _maxrss() - rss < budget, f"the peak RSS grew by {_maxrss() - rss} bytes"


def _refused(layout: Layout, frame: bytes, match: str) -> None:
    target = np.zeros(64, np.uint8)
    reference = np.zeros(64, np.uint8)
    apply = VersionApply(layout, target, reference, base=BASE, version=TARGET)
    # a fresh scratch: the thread's own may already be large from another test
    decoder._thread_scratch.scratch = DecodeScratch()
    with _bounded(), pytest.raises(FrameError, match=match):
        apply.apply(frame)
    assert not target.any()
    assert not reference.any()
    assert not apply.applied


# -- the frames that blew memory ----------------------------------------------------------------


def _rice_everything(numel: int) -> bytes:
    """A Rice record claiming every element changed, with 8 bytes of each stream (180 bytes)."""
    ones = b"\xff" * 8
    return _frame(
        [_record(POS_RICE, numel, numel, 8, 8)],
        [(STREAM_RICE, COMP_NONE, 8, ones), (STREAM_VALUES, COMP_NONE, 8, ones)],
    )


def test_the_tiny_frame_that_raised_memory_error() -> None:
    """A 2**40-element claim: the decode scratch alone would have been 16 TiB."""
    frame = _rice_everything(VAST)
    assert len(frame) < 200
    _refused(_layout(VAST), frame, r"pos_len 8 bytes hold at most 64 codes of parameter 0; the rec")


def test_sparse_range_beyond_32_bit_positions() -> None:
    """Four changes in a range of 2**32 + 64 elements: room in its streams for them, but its
    positions could not be told apart in the decoder's 32-bit slots (one past 2**32 would
    land on an element near the start), so the frame is refused before any is decoded."""
    numel = (1 << 32) + 64
    frame = _frame(
        [_record(POS_RICE, numel, 4, 8, 8)],
        [(STREAM_RICE, COMP_NONE, 8, b"\1" * 8), (STREAM_VALUES, COMP_NONE, 8, b"\1" * 8)],
    )
    _refused(_layout(numel), frame, r"a sparse range of 4294967360 elements; positions are 32-bit")


def test_rice_record_claiming_every_element() -> None:
    _refused(_layout(HUGE), _rice_everything(HUGE), r"a bit stream ends before all changed")


def test_value_stream_too_short_for_the_claim() -> None:
    frame = _frame(
        [_record(POS_RICE, HUGE, 1000, 1000, 8)],
        [(STREAM_RICE, COMP_NONE, 1000, b"\1" * 1000), (STREAM_VALUES, COMP_NONE, 8, b"\1" * 8)],
    )
    _refused(
        _layout(HUGE), frame, r"\('big'\): a bit stream ends .*val_len 8 bytes hold at most 64"
    )


def _bitmap_frame(changed: int, values: int, compressed: bool) -> bytes:
    """A bitmap record over all 2**30 elements marking every one (``changed`` == 2**30) or one
    in eight (2**27), and ``values`` 1-bit coded values; repetitive, so zstd makes it KBs."""
    bitmap = (b"\xff" if changed == HUGE else b"\x01") * (HUGE // 8)
    coded = b"\xff" * (values // 8)
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    streams = [
        (STREAM_BITMAP, COMP_ZSTD, len(bitmap), cctx.compress(bitmap)),
        (STREAM_VALUES, COMP_ZSTD, len(coded), cctx.compress(coded))
        if compressed
        else (STREAM_VALUES, COMP_NONE, len(coded), coded),
    ]
    return _frame([_record(POS_BITMAP, HUGE, changed, HUGE // 8, len(coded))], streams)


def test_bitmap_claiming_every_element() -> None:
    """A 9 KB frame; decoding it once took 1 GiB of bits, 8 GiB of positions, 16 of scratch."""
    frame = _bitmap_frame(HUGE, HUGE, compressed=True)
    assert len(frame) < 10_000
    _refused(_layout(HUGE), frame, r"records claim 1073741824 changed elements in all, over")


def test_bitmap_with_zstd_values() -> None:
    """Under the chunk's limit, but its values would come from zstd: 4 KB for 2**27 codes."""
    frame = _bitmap_frame(HUGE // 8, HUGE // 8, compressed=True)
    assert len(frame) < 10_000
    _refused(_layout(HUGE), frame, r"stream kind 3: a coded stream must be stored raw, not zstd")


def test_bitmap_claiming_every_element_with_few_values() -> None:
    frame = _bitmap_frame(HUGE, 4096 * 8, compressed=False)
    assert len(frame) < 10_000
    _refused(_layout(HUGE), frame, r"val_len 4096 bytes hold at most 32768 codes")


def test_zstd_plane_claiming_more_than_zstd_can_hold() -> None:
    """A dense record's planes: 13-byte zstd frames that declare 1 GiB each."""
    lie = _zstd_lie(HUGE)
    assert zstandard.get_frame_parameters(lie).content_size == HUGE
    frame = _frame(
        [RecordHeader(0, POS_DENSE, VAL_ORDERED_DELTA, 2, 0, 0, 0, HUGE, HUGE, 0, 0)],
        [(STREAM_PLANE0 + p, COMP_ZSTD, HUGE, lie) for p in range(2)],
    )
    _refused(_layout(HUGE), frame, r"stream kind 8: zstd frame of 13 bytes claims 1073741824")


def test_chunk_over_the_decoded_element_limit() -> None:
    """Records each within their streams' room, over MAX_DECODED_ELEMS together."""
    n = 1 << 26
    per = n // 8  # 1-bit codes
    records = [
        RecordHeader(0, POS_RICE, VAL_ORDERED_DELTA, 2, 0, 0, i * n, n, n, per, per)
        for i in range(5)
    ]
    frame = _frame(records, [])  # refused before the streams are looked for
    _refused(_layout(HUGE), frame, r"records claim 335544320 changed elements in all, over")


# -- running out of memory anyway is a refused frame --------------------------------------------


def _raise_memory_error(*args: object, **kwargs: object) -> None:
    raise MemoryError


@pytest.mark.parametrize(
    ("where", "match"),
    [
        ("DecodeScratch.reset", r"frame refused: decoding it ran out of memory"),
        ("decode_values", r"chunk 0 of version 4: ran out of memory while writing it"),
    ],
)
def test_memory_error_is_a_frame_error(
    case: Case, monkeypatch: pytest.MonkeyPatch, where: str, match: str
) -> None:
    owner: object = decoder
    name = where
    if "." in where:
        owner, name = DecodeScratch, where.split(".")[1]
    fake: Callable[..., None] = _raise_memory_error
    monkeypatch.setattr(owner, name, fake)
    target = case.ref.copy()
    apply = VersionApply(case.layout, target, case.ref, base=BASE, version=TARGET)
    with pytest.raises(FrameError, match=match):
        apply.apply(case.chunk)
    assert not apply.applied
    if where == "DecodeScratch.reset":
        assert target.tobytes() == case.ref.tobytes()


# -- the encoder never makes a chunk the decoder would refuse ----------------------------------


def test_encoder_keeps_chunks_under_the_decoded_element_limit(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the limit at 100 elements, every chunk decodes at most 100, and the version applies."""
    monkeypatch.setattr(encoder, "MAX_DECODED_ELEMS", 100)
    enc = DeltaEncoder(case.layout, chunk_bytes=1 << 20, item_elems=ITEM, dense_threshold=0.5)
    assert enc.item_elems == 64  # items no larger than the limit
    chunks = [
        c.data for c in enc.encode(case.cur, case.ref, target_version=TARGET, base_version=BASE)
    ]
    assert len(chunks) > 5  # one 1 MiB chunk without the limit
    for data in chunks:
        records = Forged.parse(data).records
        assert sum(r.changed for r in records if r.pos_coding != POS_DENSE) <= 100
    target = case.ref.copy()
    apply = VersionApply(case.layout, target, case.ref, base=BASE, version=TARGET)
    for data in chunks:
        apply.apply(data)
    assert target.tobytes() == case.cur.tobytes()
