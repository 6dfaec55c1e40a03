"""Conditioned coding (codecs/conditioned.py): bit-exact, smaller where it is kept, the same
bytes as an independent Python model of its stream, and every lie or corruption refused.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np
import pytest

from deltarl.codecs.decoder import (
    ChecksumMismatchError,
    VersionApply,
    decode_chunk,
)
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import (
    COMP_ZSTD,
    POS_CONDITIONED,
    POS_RICE,
    STREAM_CONDITIONED,
    VAL_ORDERED_DELTA,
    VAL_XOR,
    FrameError,
)
from deltarl.codecs.values import encode_values
from deltarl.engine.layout import Layout
from tests.codecs.conditioned_faults import (
    assert_flipped_bytes_never_verify,
    assert_fuzzed_frames_applied_or_refused,
    assert_refused_unwritten,
)
from tests.codecs.forge import Forged

ITEM = 4096


def _bf16(w: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even bf16 bits of float32 values (what a cast does)."""
    bits = w.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _as_f32(bf16: np.ndarray) -> np.ndarray:
    return (bf16.astype(np.uint32) << 16).view(np.float32)


LAYOUT = Layout.pack(
    [
        ("emb", "bfloat16", (16, 1024)),  # several items, weights over four decades
        ("proj", "float32", (3000,)),  # float32: its own exponent field; last item partial
        ("half", "float16", (2048,)),
        ("noise", "bfloat16", (4096,)),  # changes that do not depend on the exponent
        ("i8", "int8", (700,)),  # not a float: never conditioned
    ]
)


@functools.cache
def _versions(n: int = 4) -> list[np.ndarray]:
    """n versions of LAYOUT: tiny AdamW-like steps, which move mostly the small weights."""
    rng = np.random.default_rng(7)
    buf = np.zeros(LAYOUT.nbytes, np.uint8)
    for i, spec in enumerate(LAYOUT.tensors):
        w = rng.choice([-1.0, 1.0], spec.numel) * 10 ** rng.uniform(-4, 0, spec.numel)
        view = LAYOUT.view(buf, i)
        if spec.dtype == "bfloat16":
            view[:] = _bf16(w)
        elif spec.dtype == "float32":
            view[:] = w.astype(np.float32).view(np.uint32)
        elif spec.dtype == "float16":
            view[:] = w.astype(np.float16).view(np.uint16)
        else:
            view[:] = rng.integers(0, 256, spec.numel, dtype=np.uint8)
    out = [buf]
    for _ in range(n - 1):
        cur = out[-1].copy()
        for i, spec in enumerate(LAYOUT.tensors):
            view = LAYOUT.view(cur, i)
            step = rng.choice([-1.0, 1.0], spec.numel).astype(np.float32)
            if spec.name == "noise":
                # one element in twenty gets one ulp, whatever its size
                hit = rng.random(spec.numel) < 0.05
                view[hit] += 1
            elif spec.dtype == "bfloat16":
                view[:] = _bf16(_as_f32(view) + np.float32(2e-6) * step)
            elif spec.dtype == "float32":
                view[:] = (view.view(np.float32) + np.float32(3e-11) * step).view(np.uint32)
            elif spec.dtype == "float16":
                w = view.view(np.float16).astype(np.float32) + np.float32(3e-7) * step
                view[:] = w.astype(np.float16).view(np.uint16)
            else:
                view[rng.choice(spec.numel, 20, replace=False)] += 1
        out.append(cur)
    return out


def _encode(
    ref: np.ndarray, cur: np.ndarray, *, conditioned: bool, base: int = 0, advance: bool = False
) -> tuple[list[bytes], object]:
    enc = DeltaEncoder(LAYOUT, item_elems=ITEM, chunk_bytes=1 << 20, conditioned=conditioned)
    e = enc.encode(cur, ref, target_version=base + 1, base_version=base, advance=advance)
    chunks = [c.data for c in e]
    return chunks, e.manifest


@functools.cache
def _delta() -> tuple[bytes, object]:
    v = _versions()
    (chunk,), manifest = _encode(v[0], v[1], conditioned=True)
    return chunk, manifest


def _apply(frame: bytes, reference: np.ndarray, *, in_place: bool = False) -> np.ndarray:
    target = reference if in_place else reference.copy()
    VersionApply(LAYOUT, target, reference, base=0, version=1).apply(frame)
    return target


# -- what it does ---------------------------------------------------------------------------


def test_a_chain_of_deltas_is_bit_exact_and_smaller_where_it_is_kept() -> None:
    v = _versions()
    for base in range(len(v) - 1):
        ref, cur = v[base], v[base + 1]
        chunks, manifest = _encode(ref, cur, conditioned=True, base=base)
        rice, _ = _encode(ref, cur, conditioned=False, base=base)
        codings = {t.name: t.coding for t in manifest.tensors}  # type: ignore[attr-defined]
        # the float tensors whose changes follow their exponents are coded against them;
        # the one whose changes do not keeps Rice, as does the int8 tensor
        assert codings["emb"] == codings["proj"] == codings["half"] == "conditioned"
        assert codings["noise"] == codings["i8"] == "rice"
        assert sum(map(len, chunks)) < 0.9 * sum(map(len, rice))
        # Advancing the reference as it codes (the export agent's way) changes nothing on
        # the wire: the conditioned streams read the reference before its wave is advanced.
        advanced = ref.copy()
        same, _ = _encode(advanced, cur, conditioned=True, base=base, advance=True)
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


def test_each_range_falls_back_to_rice_where_conditioning_does_not_pay() -> None:
    chunk, _ = _delta()
    f = Forged.parse(chunk)
    by_tensor: dict[str, set[int]] = defaultdict(set)
    for r in f.records:
        by_tensor[LAYOUT.tensors[r.tensor_id].name].add(r.pos_coding)
    assert by_tensor["noise"] == {POS_RICE}
    assert POS_CONDITIONED in by_tensor["emb"]


def test_the_encoder_refuses_conditioned_xor_values() -> None:
    with pytest.raises(ValueError, match="ordered-delta"):
        DeltaEncoder(LAYOUT, value_coding=VAL_XOR, conditioned=True)


# -- the stream, modelled independently -------------------------------------------------------


class _PyRangeEncoder:
    """LZMA's binary range encoder, in plain Python, with 11-bit probabilities."""

    def __init__(self) -> None:
        self.low, self.range, self.cache, self.pending = 0, 0xFFFFFFFF, 0, 1
        self.out = bytearray()
        self.probs: dict[tuple[object, ...], int] = defaultdict(lambda: 1024)

    def _shift_low(self) -> None:
        if self.low < 0xFF000000 or self.low > 0xFFFFFFFF:
            carry, temp = self.low >> 32, self.cache
            while True:
                self.out.append((temp + carry) & 0xFF)
                temp, self.pending = 0xFF, self.pending - 1
                if self.pending == 0:
                    break
            self.cache = (self.low >> 24) & 0xFF
        self.pending += 1
        self.low = (self.low & 0xFFFFFF) << 8

    def _normalise(self) -> None:
        while self.range < 1 << 24:
            self.range <<= 8
            self._shift_low()

    def bit(self, ctx: tuple[object, ...], b: int) -> None:
        p = self.probs[ctx]
        bound = (self.range >> 11) * p
        if b:
            self.low, self.range = self.low + bound, self.range - bound
            self.probs[ctx] = p - (p >> 5)
        else:
            self.range = bound
            self.probs[ctx] = p + ((2048 - p) >> 5)
        self._normalise()

    def direct(self, x: int, n: int) -> None:
        for b in range(n - 1, -1, -1):
            self.range >>= 1
            if (x >> b) & 1:
                self.low += self.range
            self._normalise()

    def number(self, ctx: tuple[object, ...], x: int) -> None:
        """Elias-gamma style: the bit length as "under 4?" and a 2-bit or a 5-bit tree, two
        adaptive bits below the top, the rest direct (conditioned.put_number)."""
        nb = x.bit_length()
        small = nb < 4
        self.bit((*ctx, "small?"), 0 if small else 1)
        bits, rest = (2, nb) if small else (5, nb - 4)
        node = 1
        for b in range(bits - 1, -1, -1):
            self.bit((*ctx, "len", small, node), (rest >> b) & 1)
            node = 2 * node + ((rest >> b) & 1)
        if nb >= 2:
            rest = nb - 1
            top = min(2, rest)
            node = 1
            for b in range(top - 1, -1, -1):
                bit = (x >> (rest - top + b)) & 1
                self.bit((*ctx, "mant", nb, node), bit)
                node = 2 * node + bit
            self.direct(x & ((1 << (rest - top)) - 1), rest - top)

    def finish(self) -> bytes:
        for _ in range(5):
            self._shift_low()
        return bytes(self.out)


def _model_stream(ref: np.ndarray, cur: np.ndarray, shift: int, mask: int) -> bytes:
    """The conditioned stream of one range, from its description in conditioned.py."""
    classes = [(int(x) >> shift) & mask for x in ref]
    changed = [int(a) != int(b) for a, b in zip(ref, cur, strict=True)]
    coded = encode_values(cur, ref, VAL_ORDERED_DELTA, True)
    ranks: dict[int, list[int]] = defaultdict(list)  # class -> ranks of its changed members
    seen: dict[int, int] = defaultdict(int)
    for k, c in zip(classes, changed, strict=True):
        if c:
            ranks[k].append(seen[k])
        seen[k] += 1
    enc = _PyRangeEncoder()
    met: dict[int, int] = {}  # class -> members met so far
    for e, k in enumerate(classes):
        if k not in met:
            met[k] = 0
            enc.number((k, "gap"), ranks[k][0] + 1 if ranks[k] else 0)
        if changed[e]:
            enc.number((k, "val"), int(coded[e]))
            later = [r for r in ranks[k] if r > met[k]]
            enc.number((k, "gap"), later[0] - met[k] if later else 0)
        met[k] += 1
    return enc.finish()


def test_the_kernel_writes_the_stream_the_model_describes() -> None:
    chunk, _ = _delta()
    v = _versions()
    f = Forged.parse(chunk)
    stream = f.stream(STREAM_CONDITIONED).raw
    checked = 0
    for i, r in enumerate(f.records):
        if r.pos_coding != POS_CONDITIONED or r.itemsize != 2:
            continue
        spec = LAYOUT.tensors[r.tensor_id]
        at, n = f.part(i, STREAM_CONDITIONED)
        where = slice(r.start, r.start + r.length)
        shift, mask = (7, 0xFF) if spec.dtype == "bfloat16" else (10, 0x1F)
        ref = LAYOUT.view(v[0], r.tensor_id)[where]
        cur = LAYOUT.view(v[1], r.tensor_id)[where]
        assert bytes(stream[at : at + n]) == _model_stream(ref, cur, shift, mask), spec.name
        checked += 1
    assert checked >= 3


# -- refusals ---------------------------------------------------------------------------------


def test_decoding_needs_the_reference() -> None:
    chunk, _ = _delta()
    with pytest.raises(FrameError, match="no reference was given"):
        decode_chunk(chunk, LAYOUT, base=0, target=1)
    decode_chunk(chunk, LAYOUT, base=0, target=1, reference=_versions()[0])


def test_another_reference_under_the_same_version_number_never_verifies() -> None:
    """A receiver whose base differs from the sender's (same number, other bytes) decodes
    other positions: refused by the kernel or by the checksums, never activated."""
    chunk, manifest = _delta()
    other = _versions()[2]  # a different version, claimed as base 0
    target = other.copy()
    apply = VersionApply(LAYOUT, target, other, base=0, version=1)

    def apply_and_verify() -> None:
        apply.apply(chunk)
        apply.verify(manifest)  # type: ignore[arg-type]

    with pytest.raises((FrameError, ChecksumMismatchError)):
        apply_and_verify()
    assert np.array_equal(other, _versions()[2])


def _forge(edit: str) -> bytes:
    chunk, _ = _delta()
    f = Forged.parse(chunk)
    i = f.first(POS_CONDITIONED, 2)
    r = f.records[i]
    if edit == "model":
        f.edit(i, pos_k=4)
    elif edit == "val_len":
        f.edit(i, val_len=3)
    elif edit == "xor":
        f.edit(i, val_coding=VAL_XOR)
    elif edit == "claims_too_many":
        # five bytes cannot code the record's changes: refused before decoding any
        at, n = f.part(i, STREAM_CONDITIONED)
        f.replace_part(i, STREAM_CONDITIONED, f.stream(STREAM_CONDITIONED).raw[at : at + 5])
        assert r.changed > 300
    elif edit == "int8":
        j = f.first(POS_RICE, 1)
        f.edit(j, pos_coding=POS_CONDITIONED, pos_k=1, val_k=0, val_len=0)
    elif edit == "zstd":
        f.stream(STREAM_CONDITIONED).compression = COMP_ZSTD
    else:
        at, n = f.part(i, STREAM_CONDITIONED)
        part = f.stream(STREAM_CONDITIONED).raw[at : at + n]
        new = {
            "short": part[:-1],
            "long": part + b"\x00",
            "first_byte": b"\x01" + part[1:],
        }[edit]
        f.replace_part(i, STREAM_CONDITIONED, new)
    return f.seal()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("model", r"conditioned record with model 4"),
        ("val_len", r"val_len 3"),
        ("xor", r"must carry ordered-delta values"),
        ("claims_too_many", r"codes at most"),
        ("int8", r"cannot code int8"),
        ("zstd", r"must be stored raw"),
        ("short", r"ends before all changed elements|more changed elements"),
        ("long", r"left over|more changed elements|ends before"),
        ("first_byte", r"does not start with a zero byte"),
    ],
)
def test_lies_are_refused_before_anything_is_written(edit: str, match: str) -> None:
    assert_refused_unwritten(LAYOUT, _forge(edit), _versions()[0], match)


def test_corrupted_stream_bytes_never_verify() -> None:
    chunk, manifest = _delta()
    v = _versions()
    assert_flipped_bytes_never_verify(LAYOUT, chunk, manifest, v[0], v[1])  # type: ignore[arg-type]


def test_fuzzed_conditioned_frames_are_applied_or_refused_cleanly() -> None:
    chunk, _ = _delta()
    rice, _ = _encode(_versions()[0], _versions()[1], conditioned=False)
    assert_fuzzed_frames_applied_or_refused(LAYOUT, 11, [chunk, *rice], _versions()[0], 20_000)
