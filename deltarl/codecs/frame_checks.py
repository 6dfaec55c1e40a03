"""A chunk's checks before anything is decoded: its versions, its records, its streams.

Every field a frame carries is checked against the receiver's state and layout before a byte
is decoded or written (docs/architecture.md, contract 6): a frame for another version, a
record outside its tensor, overlapping records, stream sizes that do not add up, unknown
codings. Each refusal is a FrameError that names the record and what is wrong.
"""

from __future__ import annotations

import numpy as np

from deltarl.codecs import conditioned, conditioned_huffman, conditioned_rice, kernels
from deltarl.codecs.compression import decompress
from deltarl.codecs.conditioned import (
    CODED_DTYPES,
    MIN_DECISION_BITS,
    MIN_DECISIONS_PER_NUMBER,
    OVERHEAD_BYTES,
)
from deltarl.codecs.frame import (
    COMP_ZSTD,
    KIND_DELTA,
    KIND_FULL,
    MAX_DECODED_ELEMS,
    POS_BITMAP,
    POS_CONDITIONED,
    POS_DENSE,
    POS_NAMES,
    POS_RICE,
    STREAM_BITMAP,
    STREAM_CONDITIONED,
    STREAM_PLANE0,
    STREAM_RICE,
    STREAM_VALUES,
    VAL_CLASSED,
    VAL_NAMES,
    VAL_ORDERED_DELTA,
    VAL_RAW,
    FrameError,
    FrameHeader,
    RecordHeader,
    StreamHeader,
)
from deltarl.engine.layout import Layout

# The conditioned models a receiver decodes: a record's pos_k -> the module that decodes it
# (each has decode_conditioned, work and ERRORS alike; the decoder dispatches on this).
CONDITIONED_MODELS = {
    conditioned.MODEL_EXPONENT: conditioned,
    conditioned_rice.MODEL_EXPONENT_RICE: conditioned_rice,
    conditioned_huffman.MODEL: conditioned_huffman,
}

# Adaptive decisions a changed element of a conditioned record costs at least: the bit
# lengths of its value and of its gap (conditioned.put_number).
_DECISIONS_PER_CHANGE = 2 * MIN_DECISIONS_PER_NUMBER


def check_versions(header: FrameHeader, base: int | None, target: int | None) -> None:
    if target is not None and header.target != target:
        raise FrameError(f"frame is for version {header.target}, expected version {target}")
    if header.kind == KIND_DELTA:
        if base is None:
            raise FrameError(
                f"delta {header.base}->{header.target} refused: the receiver holds no version"
            )
        if header.base != base:
            raise FrameError(
                f"delta {header.base}->{header.target} refused: the receiver holds version {base}"
            )


def check_records(header: FrameHeader, records: list[RecordHeader], layout: Layout) -> None:
    last: tuple[int, int] = (-1, 0)  # (tensor id, end) of the previous record
    sparse = 0  # changed elements of the sparse records
    for i, r in enumerate(records):
        where = f"record {i}"
        if r.tensor_id >= len(layout):
            raise FrameError(
                f"{where}: tensor id {r.tensor_id} is not in the layout ({len(layout)})"
            )
        spec = layout.tensors[r.tensor_id]
        where = f"record {i} ({spec.name!r})"
        if r.itemsize != spec.itemsize:
            raise FrameError(f"{where}: itemsize {r.itemsize}, the layout says {spec.itemsize}")
        if r.pos_coding not in POS_NAMES:
            raise FrameError(f"{where}: unknown position coding {r.pos_coding}")
        if r.val_coding not in VAL_NAMES:
            raise FrameError(f"{where}: unknown value coding {r.val_coding}")
        if header.kind == KIND_FULL and (r.pos_coding != POS_DENSE or r.val_coding != VAL_RAW):
            raise FrameError(f"{where}: a full frame must carry dense raw values")
        if r.length == 0 or r.start + r.length > spec.numel:
            raise FrameError(
                f"{where}: range [{r.start}, {r.start + r.length}) is empty or outside "
                f"the tensor's {spec.numel} elements"
            )
        if r.changed > r.length:
            raise FrameError(f"{where}: {r.changed} changed elements in a range of {r.length}")
        if (r.tensor_id, r.start) < last:
            raise FrameError(f"{where}: overlaps or precedes the previous record")
        last = (r.tensor_id, r.start + r.length)
        if r.pos_coding == POS_DENSE:
            if r.pos_len or r.val_len or r.pos_k or r.val_k:
                raise FrameError(f"{where}: a dense record carries stream bytes or parameters")
            continue
        if r.changed == 0:
            raise FrameError(f"{where}: a sparse record with no changed elements")
        if r.pos_coding == POS_CONDITIONED:
            _check_conditioned(where, r, spec.dtype)
            _check_position_room(where, r)
            sparse += r.changed
            continue
        if r.pos_k >= kernels.POSITION_WIDTH or r.val_k >= min(32, 8 * r.itemsize):
            raise FrameError(f"{where}: Rice parameters {r.pos_k}/{r.val_k} out of range")
        if r.pos_coding == POS_BITMAP and (r.pos_k or r.pos_len != (r.length + 7) // 8):
            raise FrameError(f"{where}: bitmap of {r.pos_len} bytes for {r.length} elements")
        # Every Rice code takes at least 1 + k bits: the bytes a record claims (which the
        # streams must then deliver, raw) bound the elements it decodes, before any is.
        if r.pos_coding == POS_RICE:
            _check_rice_room(where, r.changed, "pos_len", r.pos_len, r.pos_k)
        _check_rice_room(where, r.changed, "val_len", r.val_len, r.val_k)
        if r.val_coding == VAL_RAW:
            raise FrameError(f"{where}: a sparse record must be reference-coded")
        if r.val_coding == VAL_CLASSED and (r.itemsize not in (2, 4) or r.val_k):
            raise FrameError(
                f"{where}: values coded by class need 2- or 4-byte elements and val_k 0 "
                f"(the table carries the parameters), got {r.itemsize} bytes, val_k {r.val_k}"
            )
        _check_position_room(where, r)
        sparse += r.changed
    if sparse > MAX_DECODED_ELEMS:
        raise FrameError(
            f"records claim {sparse} changed elements in all, over the {MAX_DECODED_ELEMS} "
            "a chunk may decode"
        )


def _check_conditioned(where: str, r: RecordHeader, dtype: str) -> None:
    """A conditioned record: a known model, a float type it codes, ordered-delta values,
    no value stream, and room in its bytes for the changes it claims."""
    if r.pos_k not in CONDITIONED_MODELS or r.val_k or r.val_len:
        raise FrameError(
            f"{where}: conditioned record with model {r.pos_k} "
            f"(known: {sorted(CONDITIONED_MODELS)}), "
            f"val_k {r.val_k}, val_len {r.val_len} (both must be 0)"
        )
    if dtype not in CODED_DTYPES:
        raise FrameError(f"{where}: a conditioned record cannot code {dtype} elements")
    if r.val_coding != VAL_ORDERED_DELTA:
        raise FrameError(f"{where}: a conditioned record must carry ordered-delta values")
    if r.pos_k != conditioned.MODEL_EXPONENT:
        # Every change costs at least the model's MIN_BITS_PER_CHANGE after its header (two
        # Rice codes of a bit or more in model 2; a value's code of a bit or more in model 3,
        # where an inverted exponent's changes cost no position bits).
        coder = CONDITIONED_MODELS[r.pos_k]
        room = 8 * r.pos_len - coder.HEADER_BITS
        most = max(room, 0) // coder.MIN_BITS_PER_CHANGE
        if room < 0 or r.changed > most:
            raise FrameError(
                f"{where}: {kernels.ERRORS[kernels.EXHAUSTED]} (a conditioned Rice stream of "
                f"{r.pos_len} bytes codes at most {most} changes; the record claims {r.changed})"
            )
        return
    # A range decoder's interval narrows by at least MIN_DECISION_BITS per adaptive
    # decision and by at most 8 bits per byte it reads (32 more for its start).
    most = int((8 * r.pos_len + 32) / (_DECISIONS_PER_CHANGE * MIN_DECISION_BITS))
    if r.pos_len < OVERHEAD_BYTES or r.changed > most:
        raise FrameError(
            f"{where}: {kernels.ERRORS[kernels.EXHAUSTED]} (a conditioned stream of "
            f"{r.pos_len} bytes codes at most {most} changes; the record claims {r.changed})"
        )


def _check_position_room(where: str, r: RecordHeader) -> None:
    """A sparse record's positions are decoded relative to its start into 32-bit slots
    (decoder.DecodeScratch): its range must not be longer than they can address."""
    if r.length > 1 << kernels.POSITION_WIDTH:
        raise FrameError(
            f"{where}: a sparse range of {r.length} elements; positions are 32-bit, so "
            f"at most {1 << kernels.POSITION_WIDTH}"
        )


def _check_rice_room(where: str, changed: int, field: str, nbytes: int, k: int) -> None:
    """Refuse a record whose Rice stream of ``nbytes`` cannot hold ``changed`` codes."""
    if changed * (1 + k) > 8 * nbytes:
        raise FrameError(
            f"{where}: {kernels.ERRORS[kernels.EXHAUSTED]} ({field} {nbytes} bytes hold at most "
            f"{8 * nbytes // (1 + k)} codes of parameter {k}; the record claims {changed})"
        )


def read_streams(
    header: FrameHeader,
    records: list[RecordHeader],
    streams: list[StreamHeader],
    payload: memoryview,
) -> dict[int, np.ndarray]:
    expected: dict[int, int] = {}

    def need(kind: int, n: int) -> None:
        expected[kind] = expected.get(kind, 0) + n

    for r in records:
        if r.pos_coding == POS_DENSE:
            for p in range(r.itemsize):
                need(STREAM_PLANE0 + p, r.length)
        elif r.pos_coding == POS_CONDITIONED:
            need(STREAM_CONDITIONED, r.pos_len)
        else:
            need(STREAM_RICE if r.pos_coding == POS_RICE else STREAM_BITMAP, r.pos_len)
            need(STREAM_VALUES, r.val_len)
    kinds = [s.kind for s in streams]
    if len(set(kinds)) != len(kinds):
        raise FrameError(f"a stream kind appears twice: {kinds[:64]}")
    for s in streams:
        # Raw, so that the records' Rice bounds (check_records) are bounds in wire bytes.
        if (
            s.kind in (STREAM_RICE, STREAM_VALUES, STREAM_CONDITIONED)
            and s.compression == COMP_ZSTD
        ):
            raise FrameError(f"stream kind {s.kind}: a coded stream must be stored raw, not zstd")
    if sum(s.wire_len for s in streams) != len(payload):
        raise FrameError(
            f"streams claim {sum(s.wire_len for s in streams)} bytes; "
            f"{len(payload)} follow the tables"
        )
    if sum(s.raw_len for s in streams) != header.raw_len:
        raise FrameError("stream sizes do not add up to the header's raw length")
    got = {s.kind: s.raw_len for s in streams if s.raw_len}
    want = {k: v for k, v in expected.items() if v}
    if got != want:
        raise FrameError(f"stream sizes {got} do not match what the records need {want}")
    out: dict[int, np.ndarray] = {}
    off = 0
    for s in streams:
        wire = payload[off : off + s.wire_len]
        off += s.wire_len
        raw = decompress(s.compression, wire, s.raw_len, f"stream kind {s.kind}")
        out[s.kind] = np.frombuffer(raw, np.uint8)
    return out
