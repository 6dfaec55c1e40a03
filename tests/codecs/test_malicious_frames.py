"""Malicious frames: valid checksums, lying tables and streams. Each is refused with a
FrameError that names what is wrong, and nothing is written (docs/architecture.md, contract 6).

They are forged from a real chunk (forge.py) so that every other part stays valid and the one
lie is what the decoder must catch.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

import numpy as np
import pytest
import zstandard

from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import (
    COMP_NONE,
    COMP_ZSTD,
    HEADER_SIZE,
    KIND_FULL,
    NO_BASE,
    POS_BITMAP,
    POS_DENSE,
    POS_RICE,
    RECORD,
    STREAM,
    STREAM_BITMAP,
    STREAM_PLANE0,
    STREAM_RICE,
    STREAM_VALUES,
    VAL_RAW,
    VAL_XOR,
    FrameError,
)
from deltarl.codecs.values import encode_values
from tests.codecs.forge import OFF_RAW_LEN, Forged, Stream, gaps, patch, rice_write
from tests.codecs.sample_delta import BASE, ITEM, TARGET, Case, apply_ok, assert_refused

# -- malicious records (valid checksum) ---------------------------------------------------------


def _edit(pick: Callable[[Forged], int], **changes: int) -> Callable[[Forged], bytes]:
    def run(f: Forged) -> bytes:
        f.edit(pick(f), **changes)
        return f.seal()

    return run


def _rice(f: Forged) -> int:
    return f.first(POS_RICE, 2)


def _bitmap(f: Forged) -> int:
    return f.first(POS_BITMAP)


def _dense(f: Forged) -> int:
    return f.first(POS_DENSE)


def _swap_first_two(f: Forged) -> bytes:
    f.records[0], f.records[1] = f.records[1], f.records[0]
    return f.seal()


def _as_full(f: Forged) -> bytes:
    f.kind, f.base = KIND_FULL, NO_BASE
    return f.seal()


def _overlap(f: Forged) -> bytes:
    f.edit(1, start=f.records[0].start + f.records[0].length - 1)
    return f.seal()


def _bitmap_pos_len(f: Forged) -> bytes:
    i = _bitmap(f)
    f.edit(i, pos_len=f.records[i].pos_len - 1)
    return f.seal()


def _rec0(f: Forged) -> int:
    return 0


def _rec3(f: Forged) -> int:
    return 3


def _i8(f: Forged) -> int:
    return f.first(POS_RICE, 1)


RECORD_CASES = [
    pytest.param(
        _edit(_rec0, tensor_id=6),
        r"record 0: tensor id 6 is not in the layout \(6\)",
        id="tensor id",
    ),
    pytest.param(
        _edit(_rec0, tensor_id=2**32 - 1), r"tensor id 4294967295 is not in", id="tensor id huge"
    ),
    pytest.param(
        _edit(_rec0, itemsize=4),
        r"record 0 \('emb'\): itemsize 4, the layout says 2",
        id="itemsize",
    ),
    pytest.param(
        _edit(_i8, itemsize=2), r"'i8'\): itemsize 2, the layout says 1", id="itemsize 1-byte"
    ),
    pytest.param(
        _edit(_rec3, length=1025),
        r"range \[3072, 4097\) is empty or outside the tensor's 4096 elements",
        id="past the end",
    ),
    pytest.param(
        _edit(_rec3, start=5000),
        r"range \[5000, 6024\) is empty or outside",
        id="start past the end",
    ),
    pytest.param(
        _edit(_rec3, start=2**64 - 1), r"is empty or outside the tensor's 4096", id="start overflow"
    ),
    pytest.param(
        _edit(_rec0, length=0), r"record 0 \('emb'\): range \[0, 0\) is empty", id="zero length"
    ),
    pytest.param(
        _edit(_dense, length=0), r"\('w'\): range \[0, 0\) is empty", id="dense zero length"
    ),
    pytest.param(
        _edit(_rec0, changed=1025),
        r"1025 changed elements in a range of 1024",
        id="changed > length",
    ),
    pytest.param(
        _edit(_dense, changed=301),
        r"301 changed elements in a range of 300",
        id="dense changed > length",
    ),
    pytest.param(
        _overlap, r"record 1 \('emb'\): overlaps or precedes the previous record", id="overlap"
    ),
    pytest.param(
        _swap_first_two,
        r"record 1 \('emb'\): overlaps or precedes the previous record",
        id="precedes",
    ),
    pytest.param(
        _edit(_rec0, pos_coding=9),
        r"record 0 \('emb'\): unknown position coding 9",
        id="position coding",
    ),
    pytest.param(_edit(_rec0, pos_coding=0), r"unknown position coding 0", id="position coding 0"),
    pytest.param(
        _edit(_rec0, val_coding=7), r"record 0 \('emb'\): unknown value coding 7", id="value coding"
    ),
    pytest.param(
        _edit(_dense, val_coding=0), r"\('w'\): unknown value coding 0", id="dense value coding"
    ),
    pytest.param(_edit(_rice, pos_k=32), r"Rice parameters 32/\d+ out of range", id="pos_k"),
    pytest.param(
        _edit(_rice, val_k=16), r"\('emb'\): Rice parameters \d+/16 out of range", id="val_k 16-bit"
    ),
    pytest.param(_edit(_i8, val_k=8), r"\('i8'\): Rice parameters \d+/8 out", id="val_k 8-bit"),
    pytest.param(
        _edit(_bitmap, pos_k=1),
        r"\('blk'\): bitmap of 128 bytes for 1024 elements",
        id="bitmap with pos_k",
    ),
    pytest.param(
        _bitmap_pos_len, r"\('blk'\): bitmap of 127 bytes for 1024 elements", id="bitmap pos_len"
    ),
    pytest.param(
        _edit(_rice, changed=0),
        r"\('emb'\): a sparse record with no changed",
        id="sparse, none changed",
    ),
    pytest.param(
        _edit(_rice, val_coding=VAL_RAW),
        r"a sparse record must be reference-coded",
        id="sparse raw",
    ),
    pytest.param(
        _edit(_dense, pos_k=1),
        r"\('w'\): a dense record carries stream bytes",
        id="dense with pos_k",
    ),
    pytest.param(
        _edit(_dense, val_len=4), r"a dense record carries stream bytes", id="dense with val_len"
    ),
    pytest.param(
        _as_full,
        r"record 0 \('emb'\): a full frame must carry dense raw values",
        id="full, not raw",
    ),
]


@pytest.mark.parametrize(("forge", "match"), RECORD_CASES)
def test_malicious_record(case: Case, forge: Callable[[Forged], bytes], match: str) -> None:
    frame = forge(Forged.parse(case.chunk))
    if "full frame" in match:
        assert_refused(case, frame, match, base=None)
        assert_refused(case, frame, match, base=BASE)
    else:
        assert_refused(case, frame, match)


@pytest.mark.parametrize(("byte", "fmt"), [(9, "B"), (10, "H")], ids=["u8", "u16"])
def test_record_reserved_fields(case: Case, byte: int, fmt: str) -> None:
    at = HEADER_SIZE + 2 * RECORD.size
    frame = patch(case.chunk, at + byte, fmt, 1)
    assert_refused(case, frame, rf"record at byte {2 * RECORD.size}: reserved fields are not zero")


# -- malicious stream tables (valid checksum) ---------------------------------------------------


def _stream_table(f: Forged) -> int:
    return HEADER_SIZE + len(f.records) * RECORD.size


@pytest.mark.parametrize(("byte", "fmt"), [(2, "H"), (4, "I")], ids=["u16", "u32"])
def test_stream_reserved_fields(case: Case, byte: int, fmt: str) -> None:
    f = Forged.parse(case.chunk)
    frame = patch(case.chunk, _stream_table(f) + STREAM.size + byte, fmt, 1)
    assert_refused(case, frame, r"stream 1: reserved fields are not zero")


def test_stream_sizes_not_matching_records(case: Case) -> None:
    f = Forged.parse(case.chunk)
    f.edit(0, val_len=f.records[0].val_len + 1)
    assert_refused(case, f.seal(), r"stream sizes \{.*\} do not match what the records need")


def test_missing_stream(case: Case) -> None:
    f = Forged.parse(case.chunk)
    f.streams = [s for s in f.streams if s.kind != STREAM_PLANE0 + 3]
    assert_refused(case, f.seal(), r"stream sizes \{.*\} do not match what the records need")


def test_unexpected_stream(case: Case) -> None:
    f = Forged.parse(case.chunk)
    f.streams.append(Stream(STREAM_PLANE0 + 7, COMP_NONE, b"\1\2\3"))
    assert_refused(case, f.seal(), r"stream sizes \{.*15: 3.*\} do not match")


def test_duplicate_stream_kinds(case: Case) -> None:
    f = Forged.parse(case.chunk)
    f.streams.append(dataclasses.replace(f.stream(STREAM_VALUES)))
    assert_refused(case, f.seal(), r"a stream kind appears twice: \[1, 2, 3, .*3\]")


def test_duplicate_empty_stream_kind(case: Case) -> None:
    f = Forged.parse(case.chunk)
    f.streams.append(Stream(STREAM_VALUES, COMP_NONE, b""))
    assert_refused(case, f.seal(), r"a stream kind appears twice")


def test_stream_wire_lengths_exceed_the_payload(case: Case) -> None:
    f = Forged.parse(case.chunk)
    at = _stream_table(f) + 16  # wire_len of stream 0
    wire_len = struct.unpack_from("<Q", case.chunk, at)[0]
    frame = patch(case.chunk, at, "Q", wire_len + 1)
    assert_refused(case, frame, r"streams claim \d+ bytes; \d+ follow the tables")


def test_stream_raw_lengths_disagree_with_the_header(case: Case) -> None:
    raw_len = struct.unpack_from("<Q", case.chunk, OFF_RAW_LEN)[0]
    frame = patch(case.chunk, OFF_RAW_LEN, "Q", raw_len + 1)
    assert_refused(case, frame, r"stream sizes do not add up to the header's raw length")


def test_stream_raw_length_over_the_limit(case: Case) -> None:
    """A stream claiming more than MAX_RAW_BYTES is refused before any allocation."""
    f = Forged.parse(case.chunk)
    at = _stream_table(f) + 8  # raw_len of stream 0
    frame = patch(case.chunk, at, "Q", 2**63)
    err = assert_refused(case, frame, r"raw length|do not match")
    assert "stream" in str(err)


def test_unknown_compression(case: Case) -> None:
    f = Forged.parse(case.chunk)
    f.stream(STREAM_VALUES).compression = 5
    assert_refused(case, f.seal(), r"stream kind 3: unknown compression id 5")


def test_raw_stream_of_the_wrong_size(case: Case) -> None:
    f = Forged.parse(case.chunk)
    s = f.stream(STREAM_RICE)
    s.wire = s.raw + b"\0"
    n = len(s.raw)
    assert_refused(
        case, f.seal(), rf"stream kind 1: stored raw with {n + 1} bytes, header says {n}"
    )


def test_not_a_zstd_frame(case: Case) -> None:
    f = Forged.parse(case.chunk)
    s = f.stream(STREAM_PLANE0 + 2)
    assert s.compression == COMP_ZSTD
    s.wire = b"\0" * 20
    assert_refused(case, f.seal(), r"stream kind 10: not a zstd frame")


def test_zstd_content_size_lies(case: Case) -> None:
    f = Forged.parse(case.chunk)
    s = f.stream(STREAM_PLANE0 + 2)
    s.wire = zstandard.ZstdCompressor(write_content_size=True).compress(s.raw + b"\0")
    n = len(s.raw)
    assert_refused(
        case, f.seal(), rf"stream kind 10: zstd frame holds {n + 1} bytes, header says {n}"
    )


def test_zstd_without_content_size(case: Case) -> None:
    f = Forged.parse(case.chunk)
    s = f.stream(STREAM_PLANE0 + 2)
    s.wire = zstandard.ZstdCompressor(write_content_size=False).compress(s.raw)
    assert_refused(case, f.seal(), r"stream kind 10: zstd frame holds \d+ bytes, header says 300")


def test_zstd_content_size_forged_to_match(case: Case) -> None:
    """The zstd header claims the right size, but the data inflates to more."""
    f = Forged.parse(case.chunk)
    s = f.stream(STREAM_PLANE0 + 2)
    n = len(s.raw)
    wire = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(s.raw + b"\7" * 9))
    assert wire[4] == 0x60  # single segment, 2-byte content size (value - 256)
    struct.pack_into("<H", wire, 5, n - 256)
    assert zstandard.get_frame_parameters(bytes(wire)).content_size == n
    s.wire = bytes(wire)
    assert_refused(case, f.seal(), r"stream kind 10: corrupt zstd data")


def test_corrupt_zstd_data(case: Case) -> None:
    f = Forged.parse(case.chunk)
    s = f.stream(STREAM_PLANE0 + 2)
    wire = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(s.raw))
    wire[len(wire) // 2 :] = b"\xff" * (len(wire) - len(wire) // 2)
    s.wire = bytes(wire)
    assert_refused(case, f.seal(), r"stream kind 10: (corrupt zstd data|decompressed to)")


# -- malicious bit streams (valid checksum) -----------------------------------------------------


def _positions(case: Case, f: Forged, i: int) -> list[int]:
    r = f.records[i]
    old = case.layout.view(case.ref, r.tensor_id)[r.start : r.start + r.length]
    new = case.layout.view(case.cur, r.tensor_id)[r.start : r.start + r.length]
    return np.flatnonzero(old != new).tolist()


def test_rice_position_past_the_range_end(case: Case) -> None:
    f = Forged.parse(case.chunk)
    i = _rice(f)
    r = f.records[i]
    pos = _positions(case, f, i)
    pos[-1] = r.length  # one past the last element
    stream, _ = rice_write(gaps(pos), r.pos_k, 32)
    f.replace_part(i, STREAM_RICE, stream)
    assert_refused(case, f.seal(), rf"record {i} \('emb'\): a decoded position lies outside")


def test_rice_position_far_past_the_range_end(case: Case) -> None:
    """An escaped gap of 2**32 - 1 is still caught (no wrap-around)."""
    f = Forged.parse(case.chunk)
    i = _rice(f)
    r = f.records[i]
    g = gaps(_positions(case, f, i))
    g[1] = 2**32 - 1
    stream, _ = rice_write(g, r.pos_k, 32)
    f.replace_part(i, STREAM_RICE, stream)
    assert_refused(case, f.seal(), r"a decoded position lies outside the record's range")


def test_hand_written_streams_apply(case: Case) -> None:
    """The control for the two tests above: the same rewrite with true positions applies."""
    f = Forged.parse(case.chunk)
    i = _rice(f)
    stream, _ = rice_write(gaps(_positions(case, f, i)), 0, 32)  # another k: other bytes
    f.replace_part(i, STREAM_RICE, stream)
    f.edit(i, pos_k=0)
    assert apply_ok(case, f.seal()).tobytes() == case.cur.tobytes()


@pytest.mark.parametrize("kind", [STREAM_RICE, STREAM_VALUES], ids=["positions", "values"])
def test_bit_stream_short_by_one_byte(case: Case, kind: int) -> None:
    f = Forged.parse(case.chunk)
    i = _rice(f)
    at, n = f.part(i, kind)
    f.replace_part(i, kind, f.stream(kind).raw[at : at + n - 1])
    assert_refused(case, f.seal(), rf"record {i} \('emb'\): a bit stream ends before all changed")


@pytest.mark.parametrize("kind", [STREAM_RICE, STREAM_VALUES], ids=["positions", "values"])
@pytest.mark.parametrize("extra", [b"\0", b"\1", b"\0" * 9])
def test_bit_stream_with_trailing_bytes(case: Case, kind: int, extra: bytes) -> None:
    f = Forged.parse(case.chunk)
    i = _rice(f)
    at, n = f.part(i, kind)
    f.replace_part(i, kind, f.stream(kind).raw[at : at + n] + extra)
    assert_refused(case, f.seal(), rf"record {i} \('emb'\): a bit stream has bytes left over")


def test_bitmap_record_values_with_trailing_bytes(case: Case) -> None:
    f = Forged.parse(case.chunk)
    i = _bitmap(f)
    at, n = f.part(i, STREAM_VALUES)
    f.replace_part(i, STREAM_VALUES, f.stream(STREAM_VALUES).raw[at : at + n] + b"\0")
    assert_refused(case, f.seal(), rf"record {i} \('blk'\): a bit stream has bytes left over")


@pytest.mark.parametrize("kind", [STREAM_RICE, STREAM_VALUES], ids=["positions", "values"])
def test_non_zero_padding_bits(case: Case, kind: int) -> None:
    f = Forged.parse(case.chunk)
    i = _rice(f)
    r = f.records[i]
    pos = _positions(case, f, i)
    # Rewrite the part with a parameter that leaves padding, then set the last padding bit.
    for k in range(8):
        if kind == STREAM_RICE:
            stream, used = rice_write(gaps(pos), k, 32)
        else:
            old = case.layout.view(case.ref, r.tensor_id)[r.start + np.array(pos)]
            new = case.layout.view(case.cur, r.tensor_id)[r.start + np.array(pos)]
            coded = encode_values(new, old, r.val_coding, True)
            stream, used = rice_write([int(z) - 1 for z in coded], k, 16)
        if used % 8:
            break
    assert used % 8
    f.replace_part(i, kind, stream)
    f.edit(i, **{"pos_k" if kind == STREAM_RICE else "val_k": k})
    assert apply_ok(case, f.seal()).tobytes() == case.cur.tobytes()  # the control
    f.replace_part(i, kind, stream[:-1] + bytes([stream[-1] | 0x80]))
    assert_refused(case, f.seal(), rf"record {i} \('emb'\): a bit stream's padding bits are not")


def test_value_that_does_not_fit_the_width(case: Case) -> None:
    """An escaped value of 0xFFFF would code 0x10000 in a 16-bit element."""
    f = Forged.parse(case.chunk)
    i = _rice(f)
    r = f.records[i]
    stream, _ = rice_write([0xFFFF] + [0] * (r.changed - 1), r.val_k, 16)
    f.replace_part(i, STREAM_VALUES, stream)
    assert_refused(case, f.seal(), r"a decoded value does not fit the element width")


def test_bitmap_with_the_wrong_popcount(case: Case) -> None:
    f = Forged.parse(case.chunk)
    i = _bitmap(f)
    c = f.records[i].changed
    f.edit(i, changed=c - 1)
    assert_refused(case, f.seal(), rf"record {i}: bitmap marks {c} elements, header says {c - 1}")


def test_bitmap_with_an_extra_bit(case: Case) -> None:
    f = Forged.parse(case.chunk)
    i = _bitmap(f)
    at, n = f.part(i, STREAM_BITMAP)
    bm = bytearray(f.stream(STREAM_BITMAP).raw[at : at + n])
    bits = np.unpackbits(np.frombuffer(bytes(bm), np.uint8), bitorder="little")
    free = int(np.flatnonzero(bits == 0)[0])
    bm[free // 8] |= 1 << (free % 8)
    f.replace_part(i, STREAM_BITMAP, bytes(bm))
    c = f.records[i].changed
    assert_refused(case, f.seal(), rf"bitmap marks {c + 1} elements, header says {c}")


def test_bitmap_padding_bits(case: Case) -> None:
    f = Forged.parse(case.chunk)
    i = max(j for j, r in enumerate(f.records) if r.pos_coding == POS_BITMAP)
    r = f.records[i]
    assert r.length % 8  # 953 elements: 7 padding bits
    at, n = f.part(i, STREAM_BITMAP)
    bm = bytearray(f.stream(STREAM_BITMAP).raw[at : at + n])
    bm[-1] |= 0x80
    f.replace_part(i, STREAM_BITMAP, bytes(bm))
    assert_refused(case, f.seal(), rf"record {i}: bitmap padding bits are not zero")


def test_reference_coded_chunk_without_a_reference(case: Case) -> None:
    target = case.ref.copy()
    before = target.tobytes()
    apply = VersionApply(case.layout, target, None, base=BASE, version=TARGET)
    with pytest.raises(FrameError, match="reference-coded and no reference was given"):
        apply.apply(case.chunk)
    assert target.tobytes() == before


def test_records_with_different_value_codings(case: Case) -> None:
    """The format gives every record its own value coding; a chunk may mix them."""
    f = Forged.parse(case.chunk)
    xor_enc = DeltaEncoder(
        case.layout,
        chunk_bytes=1 << 20,
        item_elems=ITEM,
        dense_threshold=0.5,
        value_coding=VAL_XOR,
    )
    (xor_chunk,) = [
        c.data for c in xor_enc.encode(case.cur, case.ref, target_version=TARGET, base_version=BASE)
    ]
    x = Forged.parse(xor_chunk)
    i = 1  # the second 'emb' record: same positions in both encodings
    assert x.records[i].pos_len == f.records[i].pos_len
    at, n = x.part(i, STREAM_VALUES)
    f.replace_part(i, STREAM_VALUES, x.stream(STREAM_VALUES).raw[at : at + n])
    f.edit(i, val_coding=VAL_XOR, val_k=x.records[i].val_k)
    target = apply_ok(case, f.seal())
    emb = case.layout.index("emb")
    assert np.array_equal(case.layout.view(target, emb), case.layout.view(case.cur, emb))
