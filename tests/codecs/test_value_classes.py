"""Values coded by class (VAL_CLASSED): a Rice parameter per class of the reference element.

The encoder's value streams are checked against an independent Python model of the format
(kernels.py: the table, then each value's Rice code with its class's parameter), the coding
is checked to win where it should and to stay off where it cannot apply, and every lie a
forged stream can tell is refused with nothing written.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from deltarl.codecs import kernels
from deltarl.codecs.decoder import VersionApply, decode_chunk
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import (
    POS_DENSE,
    STREAM_VALUES,
    VAL_CLASSED,
    VAL_ORDERED_DELTA,
    VAL_XOR,
    FrameError,
    RecordHeader,
)
from deltarl.codecs.values import encode_values
from deltarl.engine.layout import Layout
from tests.codecs.forge import Forged
from tests.codecs.sample_delta import BASE, TARGET, Case, apply_ok, assert_refused

ITEM = 1024


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _layout() -> Layout:
    return Layout.pack(
        [
            ("w", "bfloat16", (32, 1024)),
            ("f", "float32", (8, 1024)),
            ("h", "float16", (8192,)),
            ("i", "int16", (4096,)),
            ("b", "int8", (2048,)),
        ]
    )


def _versions(seed: int = 11) -> tuple[Layout, np.ndarray, np.ndarray]:
    """A reference and an optimizer-like step: the same small update for every weight, so
    whether and by how many ulps an element moves depends on its exponent."""
    layout = _layout()
    rng = np.random.default_rng(seed)
    ref = np.zeros(layout.nbytes, np.uint8)
    cur = np.zeros(layout.nbytes, np.uint8)
    x = rng.normal(0, 0.02, 32 * 1024).astype(np.float32)
    u = (rng.normal(0, 2e-4, x.size) * (rng.random(x.size) < 0.3)).astype(np.float32)
    w = _bf16(x)
    layout.view(ref, "w")[:] = w
    held = (w.astype(np.uint32) << 16).view(np.float32)  # the reference's values
    layout.view(cur, "w")[:] = _bf16(held + u)
    f = rng.normal(0, 0.05, 8 * 1024).astype(np.float32)
    layout.view(ref, "f").view(np.float32)[:] = f
    step = rng.normal(0, 1e-5, f.size).astype(np.float32) * (rng.random(f.size) < 0.2)
    layout.view(cur, "f").view(np.float32)[:] = f + step
    h = rng.normal(0, 0.5, 8192).astype(np.float16)
    layout.view(ref, "h").view(np.float16)[:] = h
    dh = rng.normal(0, 2e-3, 8192).astype(np.float16) * (rng.random(8192) < 0.5)
    layout.view(cur, "h").view(np.float16)[:] = h + dh
    i = rng.integers(-1000, 1000, 4096).astype(np.int16)
    layout.view(ref, "i").view(np.int16)[:] = i
    layout.view(cur, "i").view(np.int16)[:] = i + (rng.random(4096) < 0.1) * 3
    b = rng.integers(-100, 100, 2048).astype(np.int8)
    layout.view(ref, "b").view(np.int8)[:] = b
    layout.view(cur, "b").view(np.int8)[:] = b + (rng.random(2048) < 0.1)
    return layout, ref, cur


def _encode(
    layout: Layout, ref: np.ndarray, cur: np.ndarray, item_elems: int = ITEM, **kw: object
) -> tuple[list[bytes], object]:
    enc = DeltaEncoder(layout, item_elems=item_elems, **kw)  # type: ignore[arg-type]
    e = enc.encode(cur, ref, target_version=TARGET, base_version=BASE)
    return [c.data for c in e], e.manifest


@functools.cache
def _case() -> Case:
    layout, ref, cur = _versions()
    (chunk,), manifest = _encode(layout, ref, cur, chunk_bytes=1 << 20)
    return Case(layout, ref, cur, chunk, manifest, [chunk], manifest)  # type: ignore[arg-type]


# -- an independent model of the format -------------------------------------------------------


def _class_of(old: int, width: int) -> int:
    return (old & ((1 << (width - 1)) - 1)) >> (width - 1 - kernels.CLASS_BITS)


def _bits(value: int, n: int) -> list[int]:
    return [(value >> b) & 1 for b in range(n)]


def _rice_bits(n: int, k: int, width: int) -> list[int]:
    q = n >> k
    if q < width:
        return [0] * q + [1] + _bits(n, k)
    return [0] * width + _bits(n, width)


def _pack(bits: list[int]) -> bytes:
    bits = bits + [0] * (-len(bits) % 8)
    return np.packbits(np.array(bits, np.uint8), bitorder="little").tobytes()


def _write_classed(
    values: list[int], classes: list[int], lo: int, ks: list[int], width: int
) -> bytes:
    """A value stream coded by class: lo, len(ks) - 1, each parameter, then the values."""
    bits = _bits(lo, 8) + _bits(len(ks) - 1, 8)
    for k in ks:
        bits += _bits(k, kernels.CLASS_K_BITS)
    for v, c in zip(values, classes, strict=True):
        bits += _rice_bits(v, ks[c - lo], width)
    return _pack(bits)


def _read_table(stream: bytes) -> tuple[int, list[int]]:
    bits = np.unpackbits(np.frombuffer(stream, np.uint8), bitorder="little").tolist()

    def take(at: int, n: int) -> int:
        return sum(b << j for j, b in enumerate(bits[at : at + n]))

    lo, n = take(0, 8), take(8, 8) + 1
    return lo, [take(16 + kernels.CLASS_K_BITS * j, kernels.CLASS_K_BITS) for j in range(n)]


def _record_values(case: Case, r: RecordHeader) -> tuple[list[int], list[int]]:
    """(coded values less one, classes) of a record's changed elements, from the versions."""
    name = case.layout.tensors[r.tensor_id].name
    bits = np.dtype(f"<u{r.itemsize}")
    old = case.layout.view(case.ref, name).reshape(-1).view(bits)[r.start : r.start + r.length]
    new = case.layout.view(case.cur, name).reshape(-1).view(bits)[r.start : r.start + r.length]
    where = old != new
    z = encode_values(new[where], old[where], VAL_ORDERED_DELTA, True)
    width = 8 * r.itemsize
    return [int(v) - 1 for v in z], [_class_of(int(o), width) for o in old[where]]


def _table(f: Forged, i: int) -> tuple[int, list[int]]:
    """Record i's class table, read from its value stream."""
    at, n = f.part(i, STREAM_VALUES)
    return _read_table(f.stream(STREAM_VALUES).raw[at : at + n])


def _classed(f: Forged) -> int:
    return next(i for i, r in enumerate(f.records) if r.val_coding == VAL_CLASSED)


# -- the coding ---------------------------------------------------------------------------------


def test_value_streams_match_the_model_and_apply() -> None:
    case = _case()
    f = Forged.parse(case.chunk)
    classed = [i for i, r in enumerate(f.records) if r.val_coding == VAL_CLASSED]
    names = {case.layout.tensors[f.records[i].tensor_id].name for i in classed}
    # bf16 and fp32 (a class is their exponent); fp16's classes hold 3 mantissa bits as well,
    # too many for its few changes here to pay for the table; never the ints
    assert {"w", "f"} <= names <= {"w", "f", "h"}
    for i in classed:
        r = f.records[i]
        assert r.val_k == 0
        at, n = f.part(i, STREAM_VALUES)
        stream = f.stream(STREAM_VALUES).raw[at : at + n]
        lo, ks = _read_table(stream)
        values, classes = _record_values(case, r)
        assert lo == min(classes)
        assert lo + len(ks) - 1 == max(classes)
        assert _write_classed(values, classes, lo, ks, 8 * r.itemsize) == stream
    assert apply_ok(case, case.chunk).tobytes() == case.cur.tobytes()


def test_classes_make_the_wire_smaller() -> None:
    layout, ref, cur = _versions()
    with_classes, _ = _encode(layout, ref, cur, chunk_bytes=1 << 20)
    without, _ = _encode(layout, ref, cur, chunk_bytes=1 << 20, value_classes=False)
    assert {r.val_coding for r in Forged.parse(without[0]).records} <= {VAL_ORDERED_DELTA}
    assert len(with_classes[0]) < 0.97 * len(without[0])


def test_no_classes_for_xor_values() -> None:
    layout, ref, cur = _versions()
    chunks, _ = _encode(layout, ref, cur, value_coding=VAL_XOR)
    assert all(r.val_coding == VAL_XOR for c in chunks for r in Forged.parse(c).records)


def test_advancing_the_reference_sends_the_same_bytes() -> None:
    layout, ref, cur = _versions()
    chunks, _ = _encode(layout, ref, cur)
    advanced = ref.copy()
    enc = DeltaEncoder(layout, item_elems=ITEM)
    same = [
        c.data
        for c in enc.encode(cur, advanced, target_version=TARGET, base_version=BASE, advance=True)
    ]
    assert same == chunks
    assert advanced.tobytes() == cur.tobytes()


def test_decoding_needs_the_reference() -> None:
    case = _case()
    with pytest.raises(FrameError, match=r"coded by class, and no reference was given"):
        decode_chunk(case.chunk, case.layout, base=BASE, target=TARGET)
    decoded = decode_chunk(case.chunk, case.layout, base=BASE, target=TARGET, reference=case.ref)
    assert sum(int(b.counts.sum()) for b in decoded.sparse) > 0


# -- forged streams and records: refused, nothing written --------------------------------------


def _rewrite(f: Forged, i: int, lo: int, ks: list[int], case: Case) -> None:
    values, classes = _record_values(case, f.records[i])
    f.replace_part(
        i, STREAM_VALUES, _write_classed(values, classes, lo, ks, 8 * f.records[i].itemsize)
    )


def test_forged_model_stream_applies() -> None:
    # the control for the forgeries below: a rewrite with the encoder's own table applies
    case = _case()
    f = Forged.parse(case.chunk)
    i = _classed(f)
    lo, ks = _table(f, i)
    _rewrite(f, i, lo, ks, case)
    assert apply_ok(case, f.seal()).tobytes() == case.cur.tobytes()


def test_a_class_missing_from_the_table() -> None:
    case = _case()
    f = Forged.parse(case.chunk)
    i = _classed(f)
    lo, ks = _table(f, i)
    values, classes = _record_values(case, f.records[i])
    # the lowest class dropped: the stream is consistent up to its first element
    stream = _write_classed(
        [v for v, c in zip(values, classes, strict=True) if c > lo],
        [c for c in classes if c > lo],
        lo + 1,
        ks[1:],
        8 * f.records[i].itemsize,
    )
    f.replace_part(i, STREAM_VALUES, stream + bytes(16))
    assert_refused(case, f.seal(), "class has no Rice parameter in the class table")


def test_a_class_missing_far_into_a_record() -> None:
    # The decoder looks the parameters up CLASS_LEAD changes ahead of the values: a class
    # missing only well past the start is found after earlier values were written, which
    # must be undone. Records of 32K elements, about 10K changes each.
    layout, ref, cur = _versions()
    (chunk,), manifest = _encode(layout, ref, cur, item_elems=1 << 15, chunk_bytes=1 << 22)
    case = Case(layout, ref, cur, chunk, manifest, [chunk], manifest)  # type: ignore[arg-type]
    f = Forged.parse(chunk)
    i = next(
        j
        for j, r in enumerate(f.records)
        if r.val_coding == VAL_CLASSED and r.changed > 4 * kernels.CLASS_LEAD
    )
    lo, ks = _table(f, i)
    values, classes = _record_values(case, f.records[i])
    # drop the end class of the table whose first change comes later
    first, dropped = max((classes.index(c), c) for c in (lo, lo + len(ks) - 1))
    assert first >= 2 * kernels.CLASS_LEAD
    kept_lo, kept_ks = (lo + 1, ks[1:]) if dropped == lo else (lo, ks[:-1])
    stream = _write_classed(
        values[:first], classes[:first], kept_lo, kept_ks, 8 * f.records[i].itemsize
    )
    f.replace_part(i, STREAM_VALUES, stream + bytes(f.records[i].val_len))
    assert_refused(case, f.seal(), "class has no Rice parameter in the class table")


@pytest.mark.parametrize(
    "table",
    [
        # classes past the last one (250 + 16 > 256)
        pytest.param(lambda lo, ks: (250, ks + [0] * 16), id="range"),
        # a Rice parameter as wide as the 16-bit element
        pytest.param(lambda lo, ks: (lo, [16, *ks[1:]]), id="k"),
    ],
)
def test_malformed_class_table(table: object) -> None:
    case = _case()
    f = Forged.parse(case.chunk)
    i = next(j for j, r in enumerate(f.records) if r.val_coding == VAL_CLASSED and r.itemsize == 2)
    lo, ks = _table(f, i)
    new_lo, new_ks = table(lo, ks)  # type: ignore[operator]
    head = _bits(new_lo, 8) + _bits(len(new_ks) - 1, 8)
    for k in new_ks:
        head += _bits(k, kernels.CLASS_K_BITS)
    # room enough after the table that only the table can be what is refused
    f.replace_part(i, STREAM_VALUES, _pack(head) + bytes(f.records[i].val_len))
    assert_refused(case, f.seal(), "class table is malformed")


def test_class_table_cut_short() -> None:
    case = _case()
    f = Forged.parse(case.chunk)
    i = _classed(f)
    r = f.records[i]
    # a head claiming every class, in as few bytes as the record's claimed changes allow
    room = max(2, -(-r.changed // 8))
    assert room < 2 + kernels.N_CLASSES * kernels.CLASS_K_BITS // 8
    f.replace_part(i, STREAM_VALUES, bytes([0, 255]) + bytes(room - 2))
    assert_refused(case, f.seal(), "a bit stream ends before all changed elements")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param({"val_k": 3}, r"values coded by class need .* val_k 3", id="val_k"),
        pytest.param({"val_coding": 9}, r"unknown value coding 9", id="unknown coding"),
    ],
)
def test_classed_record_headers(edit: dict[str, int], match: str) -> None:
    case = _case()
    f = Forged.parse(case.chunk)
    f.edit(_classed(f), **edit)
    assert_refused(case, f.seal(), match)


def test_classes_on_one_byte_elements() -> None:
    case = _case()
    f = Forged.parse(case.chunk)
    i = next(j for j, r in enumerate(f.records) if r.itemsize == 1 and r.pos_coding != POS_DENSE)
    f.edit(i, val_coding=VAL_CLASSED, val_k=0)
    assert_refused(case, f.seal(), r"values coded by class need 2- or 4-byte elements")


# -- a property: optimizer-like steps of any float type, size and density ----------------------


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    dtype=st.sampled_from(["bfloat16", "float32", "float16"]),
    numel=st.integers(1, 20_000),
    density=st.sampled_from([0.001, 0.05, 0.3, 0.9]),
    scale=st.sampled_from([1e-6, 1e-4, 1e-2]),
    item_elems=st.sampled_from([64, 1024, 1 << 20]),
    chunk_bytes=st.sampled_from([4096, 1 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_optimizer_steps_round_trip(
    dtype: str,
    numel: int,
    density: float,
    scale: float,
    item_elems: int,
    chunk_bytes: int,
    seed: int,
) -> None:
    layout = Layout.pack([("t", dtype, (numel,))])
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 0.05, numel).astype(np.float32)
    step = (rng.normal(0, scale, numel) * (rng.random(numel) < density)).astype(np.float32)
    ref = np.zeros(layout.nbytes, np.uint8)
    cur = np.zeros(layout.nbytes, np.uint8)
    if dtype == "bfloat16":
        held = _bf16(x)
        layout.view(ref, "t")[:] = held
        layout.view(cur, "t")[:] = _bf16((held.astype(np.uint32) << 16).view(np.float32) + step)
    else:
        np_type = np.dtype(dtype)
        held = x.astype(np_type)
        layout.view(ref, "t").view(np_type)[:] = held
        layout.view(cur, "t").view(np_type)[:] = (held.astype(np.float32) + step).astype(np_type)
    enc = DeltaEncoder(layout, item_elems=item_elems, chunk_bytes=chunk_bytes, dense_threshold=1.0)
    e = enc.encode(cur, ref, target_version=TARGET, base_version=BASE)
    chunks = [c.data for c in e]
    codings = {r.val_coding for c in chunks for r in Forged.parse(c).records}
    event("values by class" if VAL_CLASSED in codings else "no values by class")
    for inplace in (True, False):
        target = ref.copy()
        apply = VersionApply(layout, target, target if inplace else ref, base=BASE, version=TARGET)
        for c in chunks[::-1]:  # any order
            apply.apply(c)
        assert e.manifest is not None
        apply.verify(e.manifest)
        assert target.tobytes() == cur.tobytes()
