"""Conditioned coding's model 3 (codecs/conditioned_huffman.py: values by a code per
exponent, Rice or Huffman; dense exponents' positions inverted): bit-exact, smaller than
model 2 where it is kept, the stream an independent Python reader of the documented format
decodes to the delta and writes back byte for byte, and every lie or corruption refused.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.codecs import conditioned_huffman as ch
from deltarl.codecs import conditioned_rice as cr
from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.frame import POS_CONDITIONED, STREAM_CONDITIONED, VAL_ORDERED_DELTA
from deltarl.codecs.values import encode_values
from tests.codecs.conditioned_faults import (
    assert_flipped_bytes_never_verify,
    assert_fuzzed_frames_applied_or_refused,
    assert_refused_unwritten,
)
from tests.codecs.forge import Forged
from tests.codecs.test_conditioned import LAYOUT, _versions
from tests.codecs.test_conditioned_rice import _Bits, _encode, _round_trip

EXPONENT_FIELD = {"bfloat16": (7, 0xFF), "float16": (10, 0x1F), "float32": (23, 0xFF)}


@functools.cache
def _delta() -> tuple[bytes, object]:
    v = _versions()
    (chunk,), manifest = _encode(v[0], v[1], coder="huffman")
    return chunk, manifest


@functools.cache
def _partly_dense() -> np.ndarray:
    """Version 1 with one in seven changes of emb's exponent-114 elements undone: that
    exponent, all changed in the test delta, is then inverted with unchanged members."""
    v = _versions()
    cur = v[1].copy()
    ref_emb, cur_emb = LAYOUT.view(v[0], 0), LAYOUT.view(cur, 0)
    hit = np.flatnonzero(((ref_emb >> 7) & 0xFF == 114) & (ref_emb != cur_emb))
    cur_emb[hit[::7]] = ref_emb[hit[::7]]
    return cur


@functools.cache
def _dense_delta() -> tuple[bytes, object]:
    (chunk,), manifest = _encode(_versions()[0], _partly_dense(), coder="huffman")
    return chunk, manifest


# -- what it does ---------------------------------------------------------------------------


def test_a_chain_of_deltas_is_bit_exact_and_smaller_than_model_2() -> None:
    v = _versions()
    for base in range(len(v) - 1):
        ref, cur = v[base], v[base + 1]
        chunks, manifest = _encode(ref, cur, coder="huffman", base=base)
        records = Forged.parse(chunks[0]).records
        assert {r.pos_k for r in records if r.pos_coding == POS_CONDITIONED} == {ch.MODEL}
        wire = sum(map(len, chunks))
        model_2, _ = _encode(ref, cur, coder="rice", base=base)
        default, _ = _encode(ref, cur, coder=None, base=base)
        assert wire < sum(map(len, model_2)) < sum(map(len, default))
        advanced = ref.copy()
        same, _ = _encode(advanced, cur, coder="huffman", base=base, advance=True)
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


# -- the stream, read and written independently -----------------------------------------------


class _Reader:
    """Reads the little-endian bit stream the module docstrings describe, from a Python int."""

    def __init__(self, data: bytes) -> None:
        self.value = int.from_bytes(data, "little")
        self.p = 0
        self.size = 8 * len(data)

    def get(self, nbits: int) -> int:
        x = (self.value >> self.p) & ((1 << nbits) - 1)
        self.p += nbits
        return x

    def rice(self, k: int) -> int:
        if self.get(cr.ESCAPE_Q) == 0:
            return self.get(cr.ESCAPE_BITS)
        self.p -= cr.ESCAPE_Q
        q = 0
        while not self.get(1):
            q += 1
        return (q << k) | self.get(k)

    def count(self) -> int:
        nb = self.get(cr.COUNT_LENGTH_BITS)
        return nb if nb <= 1 else (1 << (nb - 1)) | self.get(nb - 1)


def _canonical(lengths: list[int]) -> dict[int, tuple[int, int]]:
    """symbol -> (code, length), canonical: shorter codes first, then by symbol."""
    out, code = {}, 0
    for length in range(1, cr.LENGTH_MAX + 1):
        for s, n in enumerate(lengths):
            if n == length:
                out[s] = (code, length)
                code += 1
        code <<= 1
    return out


@dataclasses.dataclass
class _Exponent:
    count: int
    inverted: bool = False
    first: int = 0  # plain: the rank of its first change
    kinv: int = 0  # inverted: the parameter of its unchanged members' gaps
    ugaps: list[int] = dataclasses.field(default_factory=list)
    kind: int = cr.KIND_RICE
    kv: int = 0
    base: int = 0
    lengths: list[int] = dataclasses.field(default_factory=list)
    table_at: int = 0  # the bit offset of its code lengths (Huffman)


@dataclasses.dataclass
class _Stream:
    pivot: int
    kg: list[int]
    lo: int
    hi: int
    exponents: dict[int, _Exponent]
    changes: list[tuple[int, int, int | None]]  # (position, coded value - 1, next gap)

    def cls(self, x: int) -> int:
        return min(max(x - self.pivot + cr.CLASSES // 2, 0), cr.CLASSES - 1)


def _read(data: bytes, ex: list[int]) -> _Stream:
    """Decode a model 3 stream of a range whose elements have reference exponents ``ex``,
    as the module docstring describes it, checking it is used up exactly."""
    r = _Reader(data)
    pivot = r.get(8)
    kg = [r.get(cr.PARAM_BITS) for _ in range(cr.CLASSES)]
    s = _Stream(pivot, kg, r.get(8), r.get(8), {}, [])
    for x in range(s.lo, s.hi + 1):
        e = s.exponents[x] = _Exponent(r.count())
        if not e.count:
            continue
        e.inverted = bool(r.get(1))
        if e.inverted:
            u = r.count()
            e.kinv = r.get(cr.PARAM_BITS)
            e.ugaps = [r.rice(e.kinv) for _ in range(u)]
        else:
            e.first = r.rice(kg[s.cls(x)])
        e.kind = r.get(1)
        if e.kind == cr.KIND_RICE:
            e.kv = r.get(cr.PARAM_BITS)
        else:
            e.base = r.count()
            e.table_at = r.p
            e.lengths = [r.get(cr.LENGTH_BITS) for _ in range(cr.SYMBOLS)]
    decode = {
        x: {(code, n): sym for sym, (code, n) in _canonical(e.lengths).items()}
        for x, e in s.exponents.items()
        if e.count and e.kind == cr.KIND_HUFFMAN
    }
    # per exponent: members to skip before its next change (plain) or changes before its
    # next unchanged member (inverted), and the gaps still to read
    skip = {x: e.ugaps[0] if e.ugaps else math.inf for x, e in s.exponents.items() if e.inverted}
    skip |= {x: e.first for x, e in s.exponents.items() if e.count and not e.inverted}
    later = {x: list(e.ugaps[1:]) for x, e in s.exponents.items() if e.inverted}
    left = {x: e.count - 1 for x, e in s.exponents.items() if e.count and not e.inverted}
    for position, x in enumerate(ex):
        e = s.exponents.get(x)
        if e is None or not e.count:
            continue
        if skip[x] and not e.inverted:
            skip[x] -= 1
            continue
        if e.inverted and skip[x] == 0:  # an unchanged member
            skip[x] = later[x].pop(0) if later[x] else math.inf
            continue
        if e.inverted:
            skip[x] -= 1
        if e.kind == cr.KIND_RICE:
            value = r.rice(e.kv)
        else:
            code, n = 0, 0
            while (code, n) not in decode[x]:
                code, n = (code << 1) | r.get(1), n + 1
                assert n <= cr.LENGTH_MAX
            sym = decode[x][(code, n)]
            value = r.count() if sym == cr.ESCAPE else e.base + sym
        gap = None
        if not e.inverted and left[x] > 0:
            gap = skip[x] = r.rice(kg[s.cls(x)])
            left[x] -= 1
        elif not e.inverted:
            skip[x] = math.inf
        s.changes.append((position, value, gap))
    assert (r.p + 7) // 8 == len(data), "the stream is used up exactly"
    return s


def _write(s: _Stream, ex: list[int], claimed_u: dict[int, int] | None = None) -> bytes:
    """The stream ``s`` describes, written as the module docstring says (``claimed_u``:
    counts of unchanged members to claim in place of the true ones, for forgeries)."""
    bits = _Bits()
    bits.put(s.pivot, 8)
    for k in s.kg:
        bits.put(k, cr.PARAM_BITS)
    bits.put(s.lo, 8)
    bits.put(s.hi, 8)
    for x in range(s.lo, s.hi + 1):
        e = s.exponents[x]
        bits.count(e.count)
        if not e.count:
            continue
        bits.put(int(e.inverted), 1)
        if e.inverted:
            bits.count((claimed_u or {}).get(x, len(e.ugaps)))
            bits.put(e.kinv, cr.PARAM_BITS)
            for g in e.ugaps:
                bits.rice(g, e.kinv)
        else:
            bits.rice(e.first, s.kg[s.cls(x)])
        bits.put(e.kind, 1)
        if e.kind == cr.KIND_RICE:
            bits.put(e.kv, cr.PARAM_BITS)
        else:
            bits.count(e.base)
            for n in e.lengths:
                bits.put(n, cr.LENGTH_BITS)
    codes = {x: _canonical(e.lengths) for x, e in s.exponents.items() if e.lengths}
    for position, value, gap in s.changes:
        x = ex[position]
        e = s.exponents[x]
        if e.kind == cr.KIND_RICE:
            bits.rice(value, e.kv)
        else:
            sym = value - e.base if 0 <= value - e.base < cr.WINDOW else cr.ESCAPE
            code, n = codes[x][sym]
            for b in range(n - 1, -1, -1):  # first bit first
                bits.put((code >> b) & 1, 1)
            if sym == cr.ESCAPE:
                bits.count(value)
        if gap is not None:
            bits.rice(gap, s.kg[s.cls(x)])
    return bits.data()


def _record(
    i: int | None = None, chunk: bytes | None = None
) -> tuple[Forged, int, bytes, list[int]]:
    """A delta's frame (the test delta's unless ``chunk``), a conditioned bf16 record of it
    (the first, or record i), its stream and its range's reference exponents."""
    f = Forged.parse(_delta()[0] if chunk is None else chunk)
    i = f.first(POS_CONDITIONED, 2) if i is None else i
    r = f.records[i]
    spec = LAYOUT.tensors[r.tensor_id]
    at, n = f.part(i, STREAM_CONDITIONED)
    shift, mask = EXPONENT_FIELD[spec.dtype]
    ref = LAYOUT.view(_versions()[0], r.tensor_id)[r.start : r.start + r.length]
    ex = [(int(x) >> shift) & mask for x in ref]
    return f, i, bytes(f.stream(STREAM_CONDITIONED).raw[at : at + n]), ex


@pytest.mark.parametrize("dense", [False, True], ids=["delta", "partly_dense"])
def test_the_reader_decodes_the_delta_and_the_writer_gives_back_the_same_bytes(
    dense: bool,
) -> None:
    chunk = (_dense_delta if dense else _delta)()[0]
    f = Forged.parse(chunk)
    v0, v1 = _versions()[0], _partly_dense() if dense else _versions()[1]
    seen: Counter[str] = Counter()
    for i, r in enumerate(f.records):
        if r.pos_coding != POS_CONDITIONED:
            continue
        _, _, part, ex = _record(i, chunk)
        spec = LAYOUT.tensors[r.tensor_id]
        ref = LAYOUT.view(v0, r.tensor_id)[r.start : r.start + r.length]
        cur = LAYOUT.view(v1, r.tensor_id)[r.start : r.start + r.length]
        s = _read(part, ex)
        changed = np.flatnonzero(ref != cur)
        coded = encode_values(cur[changed], ref[changed], VAL_ORDERED_DELTA, True)
        assert [p for p, _, _ in s.changes] == changed.tolist()
        assert [v for _, v, _ in s.changes] == (coded.astype(np.int64) - 1).tolist()
        assert _write(s, ex) == part
        members = Counter(ex)
        for x, e in s.exponents.items():
            if not e.count:
                continue
            # only exponents with more changed members than not are inverted
            assert not e.inverted or 2 * e.count > members[x]
            seen["inverted" if e.inverted else "plain"] += 1
            seen["unchanged members"] += len(e.ugaps)
            seen["huffman" if e.kind == cr.KIND_HUFFMAN else "rice"] += 1
            if e.kind == cr.KIND_HUFFMAN:
                used = [n for n in e.lengths if n]
                kraft = sum(2.0**-n for n in used)
                assert kraft == 1.0 or len(used) == 1  # a Huffman code is complete
        seen[spec.dtype] += 1
    # the test delta exercises every branch of the format, in every float width
    assert min(seen[k] for k in ("inverted", "plain", "huffman", "rice")) > 0, seen
    assert {"bfloat16", "float16", "float32"} <= set(seen)
    assert (seen["unchanged members"] > 0) == dense


def _huffman_cost(counts: list[int]) -> int:
    """The bits of an optimal (unlimited) Huffman code for ``counts``."""
    heap = [c for c in counts if c]
    if len(heap) == 1:
        return heap[0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


def _check_lengths(counts: list[int]) -> int:
    """The kernel's code lengths for ``counts``: a prefix code within the limit for the
    symbols counted, none for the rest. Returns its cost in bits."""
    lengths = cr._huffman_lengths(np.array(counts, np.int64))
    used = [n for n, c in zip(lengths, counts, strict=True) if c]
    assert all(1 <= n <= cr.LENGTH_MAX for n in used)
    assert all(n == 0 for n, c in zip(lengths, counts, strict=True) if not c)
    assert sum(2.0**-n for n in used) <= 1.0
    assert cr._canonical_codes(lengths, np.zeros(cr.SYMBOLS, np.int64))
    return sum(int(n) * c for n, c in zip(lengths, counts, strict=True))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=cr.SYMBOLS, max_size=cr.SYMBOLS))
def test_huffman_lengths_are_prefix_codes_within_the_limit(counts: list[int]) -> None:
    if not any(counts):
        counts[0] = 1
    _check_lengths(counts)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.just(0), st.integers(1 << 10, 1 << 11)),
        min_size=cr.SYMBOLS,
        max_size=cr.SYMBOLS,
    )
)
def test_huffman_lengths_are_optimal_where_no_limit_binds(counts: list[int]) -> None:
    """Counts within a factor of two of each other: no Huffman code for them is longer
    than five bits, so the kernel's must cost what an optimal code costs."""
    if sum(1 for c in counts if c) < 2:
        counts[:2] = [1 << 10, 1 << 10]
    assert _check_lengths(counts) == _huffman_cost(counts)


def test_huffman_lengths_are_limited_on_skewed_counts() -> None:
    fib = [1, 1]
    while len(fib) < cr.SYMBOLS:
        fib.append(fib[-1] + fib[-2])
    lengths = cr._huffman_lengths(np.array(fib, np.int64))
    assert max(lengths) <= cr.LENGTH_MAX
    assert sum(2.0 ** -int(n) for n in lengths) <= 1.0
    # unlimited, the two rarest would be 16 bits long
    assert cr._canonical_codes(lengths, np.zeros(cr.SYMBOLS, np.int64))


def test_canonical_codes_refuse_lengths_that_overfill_the_code_space() -> None:
    codes = np.zeros(cr.SYMBOLS, np.int64)
    assert not cr._canonical_codes(np.ones(cr.SYMBOLS, np.int64), codes)
    three = np.zeros(cr.SYMBOLS, np.int64)
    three[:3] = [1, 2, 2]
    assert cr._canonical_codes(three, codes)
    # reversed, so the first bit is the lowest: 0, 10, 11 -> 0, 01, 11
    assert codes[:3].tolist() == [0b0, 0b01, 0b11]


# -- the kernels alone, on any changes and values --------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5000),
    exponents=st.integers(1, 40),
    width=st.sampled_from([2, 4]),
    values=st.integers(1, 40),
    value_bits=st.integers(1, 32),
)
def test_any_changes_and_values_decode_to_what_was_coded(
    seed: int, n: int, exponents: int, width: int, values: int, value_bits: int
) -> None:
    """Exponents each with a density of its own (some all changed, some inverted, some
    sparse), values from a few (Huffman's case) or many (Rice's), escapes, the widest value."""
    rng = np.random.default_rng(seed)
    shift = 7 if width == 2 else 23
    low_bits = rng.integers(0, 1 << shift, n, dtype=np.uint64)
    exps = rng.integers(100, 100 + exponents, n, dtype=np.uint64)
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(8 * width - 1)
    ref = (sign | (exps << np.uint64(shift)) | low_bits).astype(f"<u{width}")
    density = rng.random(exponents) ** rng.choice([0.2, 1.0, 5.0])
    hit = rng.random(n) < density[(exps - 100).astype(np.int64)]
    pos = np.flatnonzero(hit).astype(np.uint32)
    if pos.size == 0:
        pos = np.array([rng.integers(n)], np.uint32)
    top = min(value_bits, 8 * width)
    few = rng.integers(1, 1 << top, values, dtype=np.uint64, endpoint=False)
    zval = few[rng.integers(0, values, pos.size)]
    zval[rng.random(pos.size) < 0.01] = (1 << (8 * width)) - 1  # the odd escape
    zval = np.maximum(zval, 1)
    stream = _round_trip(ref, pos, zval, shift, coder=ch)
    # and the documented format, read independently, holds the same changes
    s = _read(stream, [(int(x) >> shift) & 0xFF for x in ref])
    assert [p for p, _, _ in s.changes] == pos.tolist()
    assert [v + 1 for _, v, _ in s.changes] == zval.tolist()


# -- refusals ---------------------------------------------------------------------------------


def _set_bits(data: bytes, at: int, nbits: int, x: int) -> bytes:
    bits = int.from_bytes(data, "little")
    bits = (bits & ~(((1 << nbits) - 1) << at)) | (x << at)
    return bits.to_bytes(len(data), "little")


def _forgeable() -> int:
    """The first conditioned record with a Huffman coded exponent and an inverted one with
    unchanged members."""
    f = Forged.parse(_dense_delta()[0])
    for i, r in enumerate(f.records):
        if r.pos_coding == POS_CONDITIONED:
            _, _, part, ex = _record(i, _dense_delta()[0])
            es = _read(part, ex).exponents.values()
            if any(e.kind == cr.KIND_HUFFMAN for e in es) and any(e.ugaps for e in es):
                return i
    raise AssertionError("the test delta has no record to forge")


def _forge(edit: str) -> bytes:
    f, i, part, ex = _record(_forgeable(), _dense_delta()[0])
    r = f.records[i]
    s = _read(part, ex)
    huffman = next(x for x, e in s.exponents.items() if e.kind == cr.KIND_HUFFMAN)
    inverted = next(x for x, e in s.exponents.items() if e.inverted and e.ugaps)
    table_at = s.exponents[huffman].table_at
    if edit == "model":
        f.edit(i, pos_k=4)
    elif edit == "claims_too_many":
        # eight bytes hold the header and at most a change or two
        f.replace_part(i, STREAM_CONDITIONED, part[:8])
        assert r.changed > 16
    elif edit in ("lo", "hi"):
        # the exponent range with changes, one narrower: its counts no longer add up
        offset = 8 + cr.PARAM_BITS * cr.CLASSES + (0 if edit == "lo" else 8)
        x = s.lo + 1 if edit == "lo" else s.hi - 1
        f.replace_part(i, STREAM_CONDITIONED, _set_bits(part, offset, 8, x))
    elif edit == "length_over_the_limit":
        f.replace_part(i, STREAM_CONDITIONED, _set_bits(part, table_at, cr.LENGTH_BITS, 12))
    elif edit in ("overfull_table", "empty_table"):
        one = 1 if edit == "overfull_table" else 0
        lengths = sum(one << (cr.LENGTH_BITS * t) for t in range(cr.SYMBOLS))
        bits = _set_bits(part, table_at, cr.LENGTH_BITS * cr.SYMBOLS, lengths)
        f.replace_part(i, STREAM_CONDITIONED, bits)
    elif edit == "unchanged_past_the_end":
        # one more unchanged member, far past the range's end
        s.exponents[inverted].ugaps.append(r.length)
        f.replace_part(i, STREAM_CONDITIONED, _write(s, ex))
    elif edit == "unchanged_missing":
        # the last unchanged member dropped: it becomes a change the counts do not have
        s.exponents[inverted].ugaps.pop()
        f.replace_part(i, STREAM_CONDITIONED, _write(s, ex))
    elif edit == "unchanged_beyond_the_range":
        # more unchanged members claimed than the range has room for
        f.replace_part(i, STREAM_CONDITIONED, _write(s, ex, {inverted: r.length}))
    else:
        new = {"short": part[:-1], "long": part + b"\x00"}[edit]
        f.replace_part(i, STREAM_CONDITIONED, new)
    return f.seal()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("model", r"conditioned record with model 4 \(known: \[1, 2, 3\]\)"),
        ("claims_too_many", r"conditioned Rice stream of 8 bytes codes at most"),
        ("lo", r"more or fewer changes than the record claims"),
        ("hi", r"more or fewer changes than the record claims"),
        ("length_over_the_limit", r"not a prefix code"),
        ("overfull_table", r"not a prefix code"),
        ("empty_table", r"not a prefix code"),
        ("unchanged_past_the_end", r"more or fewer changes than the record claims"),
        ("unchanged_missing", r"more or fewer changes than the record claims"),
        ("unchanged_beyond_the_range", r"more or fewer changes than the record claims"),
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
    assert_fuzzed_frames_applied_or_refused(LAYOUT, 13, [chunk, *rice], _versions()[0], 10_000)
