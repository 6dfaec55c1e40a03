"""Truncated, corrupted and mis-versioned frames are refused with a FrameError that names what
is wrong, and the target buffer is left exactly as it was (docs/architecture.md, contracts 3 and 6).

Header fields are edited and the checksum recomputed (forge.py), so only the field check
can catch them. test_malicious_frames.py does the same for the tables and streams.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from deltarl.codecs.decoder import VersionApply, decode_chunk, verify_tensors
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import (
    CHECKSUM_OFFSET,
    HEADER_SIZE,
    KIND_FULL,
    MAX_RAW_BYTES,
    NO_BASE,
    POS_DENSE,
    POS_RICE,
    RECORD,
    STREAM,
    STREAM_RICE,
    STREAM_VALUES,
    FrameError,
)
from deltarl.codecs.values import encode_values
from tests.codecs.forge import (
    OFF_BASE,
    OFF_BODY_LEN,
    OFF_CHUNK_ID,
    OFF_FLAGS,
    OFF_FORMAT,
    OFF_KIND,
    OFF_N_RECORDS,
    OFF_RAW_LEN,
    OFF_RESERVED,
    OFF_TARGET,
    Forged,
    gaps,
    patch,
    rice_write,
)
from tests.codecs.sample_delta import BASE, TARGET, Case, apply_ok, assert_refused

# -- the baseline: the real chunk and its faithful re-sealing apply ----------------------------


def test_real_chunk_applies(case: Case) -> None:
    target = apply_ok(case, case.chunk)
    assert target.tobytes() == case.cur.tobytes()


def test_forge_round_trip_is_byte_exact(case: Case) -> None:
    assert Forged.parse(case.chunk).seal() == case.chunk


def test_rice_model_matches_the_kernels(case: Case) -> None:
    """The independent Python Rice writer reproduces every sparse record's streams."""
    f = Forged.parse(case.chunk)
    for i, r in enumerate(f.records):
        if r.pos_coding == POS_DENSE:
            continue
        spec = case.layout.tensors[r.tensor_id]
        old = case.layout.view(case.ref, r.tensor_id)[r.start : r.start + r.length]
        new = case.layout.view(case.cur, r.tensor_id)[r.start : r.start + r.length]
        where = np.flatnonzero(old != new)
        assert where.size == r.changed
        coded = encode_values(new[where], old[where], r.val_coding, spec.dtype != "int8")
        vals, _ = rice_write([int(z) - 1 for z in coded], r.val_k, 8 * r.itemsize)
        at, n = f.part(i, STREAM_VALUES)
        assert f.stream(STREAM_VALUES).raw[at : at + n] == vals
        if r.pos_coding == POS_RICE:
            pos, _ = rice_write(gaps(where.tolist()), r.pos_k, 32)
            at, n = f.part(i, STREAM_RICE)
            assert f.stream(STREAM_RICE).raw[at : at + n] == pos


# -- integrity: truncation, extra bytes, flipped bits --------------------------------------------


@pytest.mark.parametrize("cut", [0, 1, 10, 40, 63])
def test_truncated_inside_the_header(case: Case, cut: int) -> None:
    assert_refused(case, case.chunk[:cut], rf"truncated frame: {cut} bytes, a header alone is 64")


def test_truncated_inside_the_tables_and_streams(case: Case) -> None:
    f = Forged.parse(case.chunk)
    records_end = HEADER_SIZE + len(f.records) * RECORD.size
    streams_end = records_end + len(f.streams) * STREAM.size
    size = len(case.chunk)
    for cut in [
        64,
        65,
        HEADER_SIZE + 30,
        records_end - 1,
        records_end + 5,
        streams_end + 3,
        size // 2,
        size - 1,
    ]:
        assert_refused(case, case.chunk[:cut], rf"truncated frame: {cut} bytes, header says {size}")


def test_one_extra_trailing_byte(case: Case) -> None:
    size = len(case.chunk)
    assert_refused(
        case, case.chunk + b"\0", rf"oversized frame: {size + 1} bytes, header says {size}"
    )


def test_flipped_bits_are_refused(case: Case) -> None:
    """Any single flipped bit: in the body and the checksum the checksum catches it; in the
    other header fields a field check may name the field first. Nothing is ever written."""
    rng = np.random.default_rng(5)
    size = len(case.chunk)
    body_bits = rng.choice(np.arange(HEADER_SIZE * 8, size * 8), 300, replace=False)
    bits = [*range(HEADER_SIZE * 8), *body_bits.tolist()]
    ref = case.ref.copy()
    target = case.ref.copy()
    before = target.tobytes()
    apply = VersionApply(case.layout, target, ref, base=BASE, version=TARGET)
    for bit in bits:
        frame = bytearray(case.chunk)
        frame[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError) as err:
            apply.apply(bytes(frame))
        byte = bit // 8
        if byte >= CHECKSUM_OFFSET or OFF_CHUNK_ID <= byte < OFF_N_RECORDS:
            assert "checksum mismatch" in str(err.value), (bit, str(err.value))
    assert target.tobytes() == before
    assert ref.tobytes() == before
    assert not apply.applied


def test_checksum_message_names_chunk_and_both_checksums(case: Case) -> None:
    frame = bytearray(case.chunk)
    frame[-1] ^= 0x10
    err = assert_refused(case, bytes(frame), "checksum mismatch")
    msg = str(err)
    stated = struct.unpack_from("<Q", case.chunk, CHECKSUM_OFFSET)[0]
    assert f"chunk 0 of version {TARGET}" in msg
    assert f"{stated:016x}" in msg


# -- header fields (resealed, so only the field check can catch them) ---------------------------


HEADER_CASES: list[tuple[str, int, str, int | bytes, str]] = [
    ("magic", 0, "4s", b"DRLX", r"not a deltarl frame: magic b'DRLX', expected b'DRLF'"),
    ("format", OFF_FORMAT, "H", 2, r"frame format 2 is not supported \(this build reads 1\)"),
    ("kind", OFF_KIND, "B", 7, r"unknown frame kind 7"),
    ("kind zero", OFF_KIND, "B", 0, r"unknown frame kind 0"),
    ("flags", OFF_FLAGS, "B", 1, r"reserved header fields are not zero"),
    ("reserved", OFF_RESERVED, "I", 1, r"reserved header fields are not zero"),
    ("full with base", OFF_KIND, "B", KIND_FULL, r"full frame names base version 3; it must name"),
    ("base = target", OFF_BASE, "q", TARGET, r"delta frame from version 4 to 4: the base must"),
    ("base > target", OFF_BASE, "q", 9, r"delta frame from version 9 to 4: the base must"),
    ("negative base", OFF_BASE, "q", -1, r"delta frame from version -1 to 4: the base must"),
    ("raw_len", OFF_RAW_LEN, "Q", MAX_RAW_BYTES + 1, rf"claims {MAX_RAW_BYTES + 1} decoded bytes"),
    ("raw_len huge", OFF_RAW_LEN, "Q", 2**64 - 1, r"over the 2147483648 limit"),
    ("body_len short", OFF_BODY_LEN, "Q", 100, r"oversized frame: \d+ bytes, header says 164"),
    ("body_len long", OFF_BODY_LEN, "Q", 10**9, r"truncated frame: \d+ bytes, header says"),
    ("n_records", OFF_N_RECORDS, "I", 10**6, r"frame claims 1000000 records and \d+ streams"),
]


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "match"),
    [c[1:] for c in HEADER_CASES],
    ids=[c[0] for c in HEADER_CASES],
)
def test_bad_header_field(
    case: Case, offset: int, fmt: str, value: int | bytes, match: str
) -> None:
    assert_refused(case, patch(case.chunk, offset, fmt, value), match)


def test_negative_target_version(case: Case) -> None:
    frame = patch(case.chunk, OFF_KIND, "B", KIND_FULL)
    frame = patch(frame, OFF_BASE, "q", NO_BASE)
    frame = patch(frame, OFF_TARGET, "q", -5)
    assert_refused(case, frame, r"negative target version -5", version=-5)


# -- versions (contract 3) -------------------------------------------------------------------------


def test_delta_on_another_base_names_both_versions(case: Case) -> None:
    err = assert_refused(
        case, case.chunk, r"delta 3->4 refused: the receiver holds version 2", base=2
    )
    assert "3->4" in str(err)


def test_delta_when_the_receiver_holds_nothing(case: Case) -> None:
    assert_refused(
        case, case.chunk, r"delta 3->4 refused: the receiver holds no version", base=None
    )


def test_frame_for_another_target_version(case: Case) -> None:
    assert_refused(case, case.chunk, r"frame is for version 4, expected version 5", version=5)


def test_decode_chunk_checks_the_target_only_when_given(case: Case) -> None:
    decode_chunk(case.chunk, case.layout, base=BASE)
    decode_chunk(case.chunk, case.layout, base=BASE, target=TARGET)
    with pytest.raises(FrameError, match="holds version 0"):
        decode_chunk(case.chunk, case.layout, base=0)
    with pytest.raises(FrameError, match="holds no version"):
        decode_chunk(case.chunk, case.layout)  # base None: the receiver holds nothing


def test_full_frame_is_accepted_over_any_held_version(case: Case) -> None:
    """A full resync (contract 4) needs no base: it applies whatever the receiver holds."""
    enc = DeltaEncoder(case.layout, chunk_bytes=1 << 20)
    e = enc.encode(case.cur, None, target_version=TARGET)
    chunks = [c.data for c in e]
    target = np.zeros_like(case.ref)
    apply = VersionApply(case.layout, target, case.ref, base=BASE, version=TARGET)
    for c in chunks:
        assert apply.apply(c)
    for i in range(len(case.layout)):
        assert np.array_equal(case.layout.view(target, i), case.layout.view(case.cur, i))
    verify_tensors(case.layout, target, e.manifest)  # type: ignore[arg-type]
