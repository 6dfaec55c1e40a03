"""Conditioned coding with Rice codes (codecs/conditioned_rice.py, model 2): bit-exact,
smaller where it is kept, the same bytes as an independent Python model of its stream, every
width of Rice code decoded, and every lie or corruption refused.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from deltarl.codecs import conditioned_huffman, kernels
from deltarl.codecs import conditioned_rice as cr
from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DELTA_CODINGS, DeltaEncoder, delta_coding_options
from deltarl.codecs.frame import (
    POS_CONDITIONED,
    STREAM_CONDITIONED,
    VAL_ORDERED_DELTA,
)
from deltarl.codecs.values import encode_values
from tests.codecs.conditioned_faults import (
    assert_flipped_bytes_never_verify,
    assert_fuzzed_frames_applied_or_refused,
    assert_refused_unwritten,
)
from tests.codecs.forge import Forged
from tests.codecs.test_conditioned import ITEM, LAYOUT, _versions


def _encode(
    ref: np.ndarray,
    cur: np.ndarray,
    *,
    coder: str | None = "rice",
    base: int = 0,
    advance: bool = False,
) -> tuple[list[bytes], object]:
    enc = DeltaEncoder(
        LAYOUT,
        item_elems=ITEM,
        chunk_bytes=1 << 20,
        conditioned=coder is not None,
        conditioned_coder=coder or "range",
    )
    e = enc.encode(cur, ref, target_version=base + 1, base_version=base, advance=advance)
    return [c.data for c in e], e.manifest


@functools.cache
def _delta() -> tuple[bytes, object]:
    v = _versions()
    (chunk,), manifest = _encode(v[0], v[1])
    return chunk, manifest


# -- what it does ---------------------------------------------------------------------------


def test_a_chain_of_deltas_is_bit_exact_and_smaller_where_it_is_kept() -> None:
    v = _versions()
    for base in range(len(v) - 1):
        ref, cur = v[base], v[base + 1]
        chunks, manifest = _encode(ref, cur, base=base)
        rice, _ = _encode(ref, cur, coder=None, base=base)
        ranged, _ = _encode(ref, cur, coder="range", base=base)
        codings = {t.name: t.coding for t in manifest.tensors}  # type: ignore[attr-defined]
        assert codings["emb"] == codings["proj"] == codings["half"] == "conditioned"
        assert codings["noise"] == codings["i8"] == "rice"
        records = Forged.parse(chunks[0]).records
        models = {r.pos_k for r in records if r.pos_coding == POS_CONDITIONED}
        assert models == {cr.MODEL_EXPONENT_RICE}
        # smaller than the default coding, larger than the range coder's (its adaptive
        # models learn more than two parameters a class)
        wire = sum(map(len, chunks))
        assert wire < 0.9 * sum(map(len, rice))
        assert wire > sum(map(len, ranged))
        advanced = ref.copy()
        same, _ = _encode(advanced, cur, base=base, advance=True)
        assert same == chunks
        assert np.array_equal(advanced, cur)
        for in_place in (False, True):
            target = ref.copy()
            apply = VersionApply(
                LAYOUT, target, target if in_place else ref, base=base, version=base + 1
            )
            for c in chunks:
                apply.apply(c)
            apply.verify(manifest)  # type: ignore[arg-type]
            assert np.array_equal(target, cur)


def test_the_settings_name_each_coding() -> None:
    assert delta_coding_options("rice") == (False, "range")
    assert delta_coding_options("conditioned") == (True, "range")
    assert delta_coding_options("conditioned_rice") == (True, "rice")
    assert delta_coding_options("conditioned_huffman") == (True, "huffman")
    assert set(DELTA_CODINGS) == {
        "rice",
        "conditioned",
        "conditioned_rice",
        "conditioned_huffman",
    }
    with pytest.raises(ValueError, match="unknown delta_coding 'zstd'"):
        delta_coding_options("zstd")
    with pytest.raises(ValueError, match="conditioned_coder must be one of"):
        DeltaEncoder(LAYOUT, conditioned=True, conditioned_coder="lz4")


# -- the stream, modelled independently -------------------------------------------------------


class _Bits:
    """A little-endian bit stream in a Python int, as the module docstring describes it."""

    def __init__(self) -> None:
        self.value = 0
        self.n = 0

    def put(self, x: int, nbits: int) -> None:
        assert 0 <= x < 1 << nbits
        self.value |= x << self.n
        self.n += nbits

    def rice(self, x: int, k: int) -> None:
        q = x >> k
        if q >= cr.ESCAPE_Q:
            self.put(0, cr.ESCAPE_Q)
            self.put(x, cr.ESCAPE_BITS)
        else:
            self.put(1 << q, q + 1)
            self.put(x & ((1 << k) - 1), k)

    def count(self, m: int) -> None:
        nb = m.bit_length()
        self.put(nb, cr.COUNT_LENGTH_BITS)
        if nb > 1:
            self.put(m & ((1 << (nb - 1)) - 1), nb - 1)

    def data(self) -> bytes:
        return self.value.to_bytes((self.n + 7) // 8, "little")


def _rice_bits(xs: list[int], k: int) -> int:
    return sum(
        (x >> k) + 1 + k if (x >> k) < cr.ESCAPE_Q else cr.ESCAPE_Q + cr.ESCAPE_BITS for x in xs
    )


def _model_stream(
    ref: np.ndarray, cur: np.ndarray, shift: int, mask: int, kernel_stream: bytes
) -> bytes:
    """The stream of one range, from the module's description. The Rice parameters are the
    encoder's choice: read from the kernel's stream, and checked to be near the best."""
    ex = [(int(x) >> shift) & mask for x in ref]
    changes = [e for e in range(len(ref)) if int(ref[e]) != int(cur[e])]
    coded = encode_values(cur, ref, VAL_ORDERED_DELTA, True)
    values = {e: int(coded[e]) - 1 for e in changes}
    pivot = sorted(ex[e] for e in changes)[(len(changes) - 1) // 2]  # the lower median
    header = int.from_bytes(kernel_stream, "little")
    assert header & 0xFF == pivot
    kg = [(header >> (8 + 10 * k)) & 31 for k in range(cr.CLASSES)]
    kv = [(header >> (13 + 10 * k)) & 31 for k in range(cr.CLASSES)]

    def cls(x: int) -> int:
        return min(max(x - pivot + cr.CLASSES // 2, 0), cr.CLASSES - 1)

    seen: dict[int, int] = defaultdict(int)
    ranks: dict[int, list[int]] = defaultdict(list)  # exponent -> ranks of its changes
    for e, x in enumerate(ex):
        if e in values:
            ranks[x].append(seen[x])
        seen[x] += 1
    gaps: dict[int, list[int]] = {  # exponent -> members skipped before each change
        x: [r - p - 1 for p, r in zip([-1, *rs[:-1]], rs, strict=True)] for x, rs in ranks.items()
    }
    for k in range(cr.CLASSES):
        g = [v for x, gs in gaps.items() if cls(x) == k for v in gs]
        vs = [values[e] for e in changes if cls(ex[e]) == k]
        for xs, chosen in ((g, kg[k]), (vs, kv[k])):
            if xs:
                best = min(_rice_bits(xs, j) for j in range(32))
                assert _rice_bits(xs, chosen) <= best * 1.02 + 8, (k, chosen)
    bits = _Bits()
    bits.put(pivot, 8)
    for k in range(cr.CLASSES):
        bits.put(kg[k], 5)
        bits.put(kv[k], 5)
    lo, hi = min(ranks), max(ranks)
    bits.put(lo, 8)
    bits.put(hi, 8)
    for x in range(lo, hi + 1):
        bits.count(len(ranks.get(x, [])))
        if x in ranks:
            bits.rice(gaps[x][0], kg[cls(x)])
    met: dict[int, int] = defaultdict(int)  # exponent -> its changes met so far
    for e in changes:
        x = ex[e]
        bits.rice(values[e], kv[cls(x)])
        met[x] += 1
        if met[x] < len(gaps[x]):
            bits.rice(gaps[x][met[x]], kg[cls(x)])
    return bits.data()


def test_the_kernel_writes_the_stream_the_model_describes() -> None:
    chunk, _ = _delta()
    v = _versions()
    f = Forged.parse(chunk)
    stream = f.stream(STREAM_CONDITIONED).raw
    checked = set()
    for i, r in enumerate(f.records):
        if r.pos_coding != POS_CONDITIONED:
            continue
        spec = LAYOUT.tensors[r.tensor_id]
        at, n = f.part(i, STREAM_CONDITIONED)
        where = slice(r.start, r.start + r.length)
        shift, mask = {"bfloat16": (7, 0xFF), "float16": (10, 0x1F), "float32": (23, 0xFF)}[
            spec.dtype
        ]
        ref = LAYOUT.view(v[0], r.tensor_id)[where]
        cur = LAYOUT.view(v[1], r.tensor_id)[where]
        part = bytes(stream[at : at + n])
        assert part == _model_stream(ref, cur, shift, mask, part), spec.name
        checked.add(spec.dtype)
    assert checked == {"bfloat16", "float16", "float32"}


# -- the kernels alone, on any changes and values --------------------------------------------


def _round_trip(
    ref: np.ndarray, pos: np.ndarray, zval: np.ndarray, shift: int, coder: Any = cr
) -> bytes:
    """Encode one item's changes with ``coder``'s kernel (a module with encode_conditioned,
    decode_conditioned and work: model 2's by default), decode them back (checked equal), and
    check that one byte less of room is reported too small and one byte less of stream is
    refused. Returns the stream."""
    n, c = ref.size, pos.size
    one = np.zeros(1, np.int64)
    starts, lengths, out_off, counts = one, np.array([n]), one, np.array([c])
    deal = kernels.deal(coder.work(lengths, counts))
    sizes = np.zeros(1, np.int64)
    cap = np.array([16 * c + 512])  # counts of up to 256 exponents: 192 bytes
    dst = np.zeros(int(cap[0]), np.uint8)
    coder.encode_conditioned(
        ref, starts, lengths, out_off, counts, pos, zval, shift, 0xFF, dst, one, cap, sizes, *deal
    )
    size = int(sizes[0])
    assert 0 < size <= cap[0]
    stream = dst[:size].copy()
    short = np.array([size - 1])
    coder.encode_conditioned(
        ref, starts, lengths, out_off, counts, pos, zval, shift, 0xFF, dst, one, short, sizes, *deal
    )
    assert sizes[0] == size  # the room it needed, though it had less
    vmax = (1 << (8 * ref.itemsize)) - 1
    for length in (size, size - 1):
        positions = np.zeros(c, np.uint32)
        values = np.zeros(c, ref.dtype)
        errors = np.full(1, -1, np.int64)
        coder.decode_conditioned(
            ref,
            starts,
            lengths,
            stream,
            one,
            np.array([length]),
            counts,
            out_off,
            shift,
            0xFF,
            vmax,
            positions,
            values,
            errors,
            *deal,
        )
        if length == size:
            assert errors[0] == cr.OK
            assert np.array_equal(positions, pos)
            assert np.array_equal(values.astype(np.uint64), zval)
        else:
            assert errors[0] in (cr.EXHAUSTED, cr.OUT_OF_RANGE)
    return stream.tobytes()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5000),
    density=st.floats(0.0005, 1.0),
    width=st.sampled_from([2, 4]),
    value_bits=st.integers(1, 32),
)
def test_any_changes_and_values_decode_to_what_was_coded(
    seed: int, n: int, density: float, width: int, value_bits: int
) -> None:
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 1 << (8 * width), n, dtype=np.uint64).astype(f"<u{width}")
    pos = np.flatnonzero(rng.random(n) < density).astype(np.uint32)
    if pos.size == 0:
        pos = np.array([rng.integers(n)], np.uint32)
    top = min(value_bits, 8 * width)
    zval = rng.integers(1, 1 << top, pos.size, dtype=np.uint64, endpoint=False)
    zval[rng.random(pos.size) < 0.01] = (1 << (8 * width)) - 1  # the odd escape
    _round_trip(ref, pos, np.maximum(zval, 1), 7 if width == 2 else 23)


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 2**64 - 1), data=st.data())
def test_select_finds_the_kth_set_bit_and_popcount_counts_them(m: int, data: Any) -> None:
    """The walks' bit primitives against Python: popcount, and select for every k below
    it (the byte from the bytes' running counts, the bit from a table)."""
    ones = [t for t in range(64) if m >> t & 1]
    k = data.draw(st.integers(0, len(ones) - 1))
    assert cr._select(np.uint64(m), k) == ones[k]
    assert _bits_set(np.uint64(m)) == len(ones)


@njit(cache=False)
def _bits_set(m: np.uint64) -> int:
    return cr._popcount(m)


@pytest.mark.parametrize("model", ["rice", "huffman"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 4095, 4096, 4097, 2 * cr.WALK_SPAN + 64])
def test_the_walks_meet_changes_at_every_block_and_span_edge(model: str, n: int) -> None:
    """Both sides walk 64 elements at a time, WALK_SPAN at a time taken out as bytes: a
    range of any length, its changes on each side of every block edge and at its ends,
    round-trips; with three exponents only, so each has many members in a block, and one
    changed throughout (model 3 codes it inverted)."""
    rng = np.random.default_rng(n)
    exponents = np.array([120, 121, 122], np.uint16)
    ref = (exponents[rng.integers(0, 3, n)] << 7) | rng.integers(0, 128, n).astype(np.uint16)
    edges = [p for e in range(0, n + 1, 64) for p in (e - 1, e) if 0 <= p < n]
    dense = np.flatnonzero(ref >> 7 == 122)  # nearly all of its members change
    pos = np.union1d(edges, dense[rng.random(dense.size) < 0.9]).astype(np.uint32)
    zval = rng.integers(1, 5, pos.size).astype(np.uint64)
    _round_trip(ref, pos, zval, 7, coder=cr if model == "rice" else conditioned_huffman)


@pytest.mark.parametrize("k", [0, 5, 26, 27, 31])
def test_every_rice_code_is_read_back_at_every_bit_offset(k: int) -> None:
    """Rice codes of every length the streams can hold (q + 1 + k up to 55 bits, longer
    than the decoder's 49-bit peek: read in two), escapes included, from each of the eight
    bit offsets within a byte, followed by other bits that must not leak in."""
    xs = [0, 1, (1 << k) - 1 if k else 0, 23 << k, (23 << k) | ((1 << k) - 1), 24 << k]
    xs += [(1 << 32) - 1, (1 << cr.ESCAPE_BITS) - 1]
    for offset in range(8):
        for x in xs:
            bits = _Bits()
            bits.put((1 << offset) - 1, offset)  # ones before it
            bits.rice(x, k)
            end = bits.n
            bits.put((1 << 40) - 1, 40)  # and after it
            src = np.frombuffer(bits.data(), np.uint8).copy()
            p, got = cr._get_rice(src, src.size, offset, k)
            assert (p, got) == (end, x), (offset, x, k)


# -- refusals ---------------------------------------------------------------------------------


def _forge(edit: str) -> bytes:
    chunk, _ = _delta()
    f = Forged.parse(chunk)
    i = f.first(POS_CONDITIONED, 2)
    r = f.records[i]
    at, n = f.part(i, STREAM_CONDITIONED)
    part = f.stream(STREAM_CONDITIONED).raw[at : at + n]
    if edit == "model":
        f.edit(i, pos_k=4)
    elif edit == "claims_too_many":
        # twelve bytes hold the header and at most a change or two
        f.replace_part(i, STREAM_CONDITIONED, part[:12])
        assert r.changed > 10
    elif edit in ("lo", "hi"):
        # the exponent range with changes, one narrower: its counts no longer add up
        bits = int.from_bytes(part, "little")
        offset = 8 + 10 * cr.CLASSES + (0 if edit == "lo" else 8)
        x = (bits >> offset) & 0xFF
        bits += (1 if edit == "lo" else -1) << offset
        assert ((bits >> offset) & 0xFF) == (x + (1 if edit == "lo" else -1)) & 0xFF
        f.replace_part(i, STREAM_CONDITIONED, bits.to_bytes(len(part), "little"))
    else:
        new = {"short": part[:-1], "long": part + b"\x00"}[edit]
        f.replace_part(i, STREAM_CONDITIONED, new)
    return f.seal()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("model", r"conditioned record with model 4 \(known: \[1, 2, 3\]\)"),
        ("claims_too_many", r"conditioned Rice stream of 12 bytes codes at most"),
        ("lo", r"more or fewer changes than the record claims"),
        ("hi", r"more or fewer changes than the record claims"),
        ("short", r"ends before all changed elements|more or fewer changes"),
        ("long", r"left over"),
    ],
)
def test_lies_are_refused_before_anything_is_written(edit: str, match: str) -> None:
    assert_refused_unwritten(LAYOUT, _forge(edit), _versions()[0], match)


def test_corrupted_stream_bytes_never_verify() -> None:
    chunk, manifest = _delta()
    v = _versions()
    assert_flipped_bytes_never_verify(LAYOUT, chunk, manifest, v[0], v[1])  # type: ignore[arg-type]


def test_fuzzed_frames_are_applied_or_refused_cleanly() -> None:
    chunk, _ = _delta()
    rice, _ = _encode(_versions()[0], _versions()[1], coder=None)
    assert_fuzzed_frames_applied_or_refused(LAYOUT, 12, [chunk, *rice], _versions()[0], 10_000)
