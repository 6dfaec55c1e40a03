"""decode(encode(ref, cur)) == cur, bit for bit, for every dtype, shape, density and setting
(docs/architecture.md, contract 1), and the manifest tells the truth about what was encoded."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deltarl.codecs.checksum import model_digest, tensor_digest
from deltarl.codecs.decoder import VersionApply, decode_chunk
from deltarl.codecs.encoder import DEFAULT_ITEM_ELEMS, DeltaEncoder
from deltarl.codecs.frame import (
    CHECKSUM_OFFSET,
    HEADER,
    KIND_DELTA,
    KIND_FULL,
    NO_BASE,
    RECORD,
    VAL_CLASSED,
    VAL_ORDERED_DELTA,
    VAL_RAW,
    VAL_XOR,
)
from deltarl.codecs.manifest import RefitManifest
from deltarl.engine.layout import Layout, dtype_of
from tests.codecs.forge import Forged

DTYPES = [
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
]
# Larger shapes first: hypothesis draws early entries more often, and shrinks towards them.
SHAPES = [
    (4100,),
    (3, 2051),
    (20000,),
    (96, 128),
    (1000,),
    (33, 17),
    (65,),
    (64,),
    (7,),
    (1,),
    (),
    (0,),
    (3, 0),
]
DELTA_CODINGS = {"rice", "bitmap", "dense", "unchanged"}

# Bit patterns that stress the value codings: signed zeros, infinities, NaNs with payloads
# and either sign, subnormals, the largest finite values, one.
SPECIALS: dict[str, list[int]] = {
    "bfloat16": [
        0x0000,
        0x8000,
        0x7F80,
        0xFF80,
        0x7FC0,
        0x7F81,
        0xFFC1,
        0x7FFF,
        0xFFFF,
        0x0001,
        0x8001,
        0x007F,
        0x807F,
        0x7F7F,
        0xFF7F,
        0x3F80,
    ],
    "float16": [
        0x0000,
        0x8000,
        0x7C00,
        0xFC00,
        0x7E00,
        0x7C01,
        0xFE01,
        0x7FFF,
        0xFFFF,
        0x0001,
        0x8001,
        0x03FF,
        0x83FF,
        0x7BFF,
        0xFBFF,
        0x3C00,
    ],
    "float32": [
        0x0,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0x7F800001,
        0xFFC00001,
        0x7FFFFFFF,
        0xFFFFFFFF,
        0x1,
        0x80000001,
        0x007FFFFF,
        0x7F7FFFFF,
        0xFF7FFFFF,
    ],
    "float64": [
        0x0,
        1 << 63,
        0x7FF0 << 48,
        0xFFF0 << 48,
        0x7FF8 << 48,
        (0x7FF0 << 48) | 1,
        (0xFFF8 << 48) | 5,
        (1 << 63) - 1,
        (1 << 64) - 1,
        0x1,
        (1 << 63) | 1,
        0x7FEFFFFFFFFFFFFF,
        0xFFEFFFFFFFFFFFFF,
        0x3FF0 << 48,
    ],
}
for _name in ("int8", "uint8", "int16", "int32", "int64"):
    _w = dtype_of(_name).itemsize * 8
    SPECIALS[_name] = [0, 1, 2, (1 << _w) - 1, 1 << (_w - 1), (1 << (_w - 1)) - 1]
SPECIALS["bool"] = [0, 1]

# The dtype of the same width and the other kind (float <-> int).
# -- building versions ----------------------------------------------------------------------------


def fill_reference(layout: Layout, rng: np.random.Generator, special: float) -> np.ndarray:
    """Random bits (padding included), with a fraction ``special`` of special patterns."""
    buf = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    for i, spec in enumerate(layout.tensors):
        v = layout.view(buf, i)
        if spec.dtype == "bool":
            v[:] = rng.integers(0, 2, v.size, dtype=np.uint8)
        pick = rng.random(v.size) < special
        v[pick] = rng.choice(np.array(SPECIALS[spec.dtype], v.dtype), int(pick.sum()))
    return buf


def changed_mask(rng: np.random.Generator, n: int, density: float, runs: bool) -> np.ndarray:
    """Which elements change: independently with probability ``density``, or in runs (of 32
    on average, as whole rows or blocks would) with gaps that keep that density."""
    if not runs or density in (0.0, 1.0):
        return rng.random(n) < density
    on = rng.geometric(1 / 32, n // 16 + 2)
    p_off = density / (32 * (1 - density) + density)  # gaps of 32 (1 - d) / d on average
    off = np.minimum(rng.geometric(max(p_off, 1e-9), on.size), n)
    pattern = np.repeat(np.tile([False, True], on.size), np.stack([off, on], 1).ravel())
    return np.resize(pattern, n) if pattern.size < n else pattern[:n]


def change(
    layout: Layout,
    ref: np.ndarray,
    rng: np.random.Generator,
    density: float,
    *,
    runs: bool = False,
) -> np.ndarray:
    """A next version: each element changes with probability ``density``, in one of several ways."""
    cur = ref.copy()
    for i, spec in enumerate(layout.tensors):
        v = layout.view(cur, i)
        where = np.flatnonzero(changed_mask(rng, v.size, density, runs))
        if where.size == 0:
            continue
        t = v.dtype.type
        old = v[where]
        if spec.dtype == "bool":
            v[where] = old ^ t(1)
            continue
        width = spec.itemsize * 8
        steps = rng.choice(
            np.array([1, 2, 3, (1 << width) - 1, (1 << width) - 2], v.dtype), where.size
        )
        options = np.stack(
            [
                old + steps,  # one to three units in the last place, either way
                rng.integers(0, 1 << width, where.size, dtype=np.uint64).astype(v.dtype),
                rng.choice(np.array(SPECIALS[spec.dtype], v.dtype), where.size),
                old ^ t(1 << (width - 1)),  # a sign flip
            ]
        )
        kind = rng.choice(4, where.size, p=[0.55, 0.2, 0.15, 0.1])
        v[where] = options[kind, np.arange(where.size)]
    return cur


def encode(
    layout: Layout,
    cur: np.ndarray,
    ref: np.ndarray | None,
    *,
    version: int = 1,
    advance: bool = False,
    **kw: object,
) -> tuple[list[bytes], RefitManifest]:
    enc = DeltaEncoder(layout, **kw)  # type: ignore[arg-type]
    e = enc.encode(
        cur,
        ref,
        target_version=version,
        base_version=None if ref is None else 0,
        advance=advance,
    )
    chunks = []
    for c in e:
        assert e.manifest is None  # set only once the iteration is exhausted
        assert c.checksum == struct.unpack_from("<Q", c.data, CHECKSUM_OFFSET)[0]
        chunks.append(c.data)
    assert e.manifest is not None
    return chunks, e.manifest


def apply(
    layout: Layout,
    chunks: list[bytes],
    manifest: RefitManifest,
    ref: np.ndarray | None,
    *,
    inplace: bool,
    order: np.ndarray | None = None,
    garbage: np.ndarray | None = None,
) -> np.ndarray:
    """Apply (in ``order``), verify against the manifest, return the target."""
    if ref is None:
        target = np.zeros(layout.nbytes, np.uint8) if garbage is None else garbage.copy()
        reference = None
        base = None
    else:
        reference = ref.copy()
        target = reference if inplace else ref.copy()
        base = 0
    va = VersionApply(layout, target, reference, base=base, version=manifest.version)
    for i in range(len(chunks)) if order is None else order:
        assert va.apply(chunks[i]) is True
    va.verify(manifest)
    va.verify(RefitManifest.from_json(manifest.to_json()))
    if reference is not None and not inplace:
        assert reference.tobytes() == ref.tobytes()  # the reference is only read
    return target


def assert_same_tensors(layout: Layout, a: np.ndarray, b: np.ndarray) -> None:
    for i in range(len(layout)):
        assert layout.view(a, i).tobytes() == layout.view(b, i).tobytes(), layout.tensors[i].name


def assert_tiles(pieces: list[tuple[int, int]], numel: int) -> None:
    """The pieces cover the tensor's elements once, in order."""
    at = 0
    for lo, hi in pieces:
        assert lo == at
        assert hi >= lo
        at = hi
    assert at == numel


def check_manifest(
    layout: Layout,
    chunks: list[bytes],
    manifest: RefitManifest,
    ref: np.ndarray | None,
    cur: np.ndarray,
    *,
    chunk_bytes: int,
    dense_threshold: float,
    item_elems: int = DEFAULT_ITEM_ELEMS,
) -> None:
    full = ref is None
    # The pieces of each tensor the encoder's waves held: each piece chooses its own coding,
    # and a tensor is named by the coding of its first piece that changed.
    waves = DeltaEncoder(layout, chunk_bytes=chunk_bytes, item_elems=item_elems)._waves()
    pieces: dict[int, list[tuple[int, int]]] = {}
    for wave in waves:
        for tid, lo, hi in wave:
            pieces.setdefault(tid, []).append((lo, hi))
    assert manifest.kind == ("full" if full else "delta")
    assert manifest.base_version == (NO_BASE if full else 0)
    digests = [tensor_digest(layout.view(cur, i)) for i in range(len(layout))]
    assert [t.xxh3_128 for t in manifest.tensors] == digests
    assert manifest.model_xxh3_128 == model_digest(digests)
    for i, (spec, t) in enumerate(zip(layout.tensors, manifest.tensors, strict=True)):
        assert (t.name, t.dtype, tuple(t.shape)) == (spec.name, spec.dtype, spec.shape)
        if full:
            assert t.changed == spec.numel
            assert t.coding == ("raw" if spec.numel else "unchanged")
            continue
        true_changed = int((layout.view(ref, i) != layout.view(cur, i)).sum())
        assert t.changed == true_changed, spec.name
        assert t.coding in DELTA_CODINGS
        assert (t.coding == "unchanged") == (true_changed == 0), spec.name
        # "dense past the threshold" (encoder.py), in the first piece that changed
        diff = layout.view(ref, i) != layout.view(cur, i)
        assert_tiles(pieces[i], spec.numel)
        counted = [(int(diff[lo:hi].sum()), hi - lo) for lo, hi in pieces[i]]
        first = next(((c, n) for c, n in counted if c), (0, 0))
        dense = first[0] > 0 and first[0] > dense_threshold * first[1]
        assert (t.coding == "dense") == dense, (spec.name, t.coding, true_changed, counted)
    assert manifest.changed == sum(t.changed for t in manifest.tensors)

    assert [c.id for c in manifest.chunks] == list(range(len(chunks)))
    for entry, data in zip(manifest.chunks, chunks, strict=True):
        h = HEADER.unpack_from(data)
        kind, base, target, chunk_id, n_records, raw_len, checksum = (
            h[2],
            h[4],
            h[5],
            h[6],
            h[7],
            h[11],
            h[12],
        )
        assert entry.size == len(data)
        assert entry.xxh3_64 == checksum
        assert (kind, base, target, chunk_id) == (
            KIND_FULL if full else KIND_DELTA,
            manifest.base_version,
            manifest.version,
            entry.id,
        )
        # at most chunk_bytes before compression (records, tables and raw streams)
        assert raw_len + n_records * RECORD.size <= chunk_bytes
    # Wire bytes are attributed to tensors in full, up to rounding (chunks without records
    # have no tensor to charge their header to).
    empty = sum(len(d) for d in chunks if HEADER.unpack_from(d)[7] == 0)
    attributed = sum(t.wire_bytes for t in manifest.tensors)
    assert abs(attributed - (manifest.wire_bytes - empty)) <= len(layout)


# -- the property -------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    """A layout (drawn, so it shrinks) and the encoder's settings and the kind of change
    (chosen by a drawn seed with fixed odds, so every combination comes up often)."""
    n = draw(st.integers(1, 6))
    entries = [
        (f"t{i}", draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES))) for i in range(n)
    ]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    runs = bool(rng.random() < 0.4)
    # runs of changes at medium density are what makes bitmaps win over Rice
    if runs:
        densities, thresholds = [0.1, 0.3, 0.5, 0.6], [0.3, 0.75, 1.0]
    else:
        densities = [0.0, 0.0005, 0.003, 0.01, 0.03, 0.1, 0.3, 0.6, 1.0, rng.random()]
        thresholds = [0.0, 0.05, 0.3, 0.5, 0.75, 1.0]
    return {
        "entries": entries,
        "seed": seed,
        "density": float(rng.choice(densities)),
        "runs": runs,
        "special": float(rng.choice([0.0, 0.05, 0.5])),
        "value_coding": int(rng.choice([VAL_ORDERED_DELTA, VAL_XOR])),
        "dense_threshold": float(rng.choice(thresholds)),
        "chunk_bytes": int(rng.choice([4096, 8192, 16384, 65536])),
        "item_elems": int(rng.choice([64, 128, 1024, 1 << 20])),
        "full": bool(rng.random() < 0.15),
        "inplace": bool(rng.random() < 0.5),
        "shuffle": bool(rng.random() < 0.5),
        "value_classes": bool(rng.random() < 0.7),
    }


PROPERTY = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@PROPERTY
@given(scenarios())
def test_round_trip(s: dict) -> None:
    entries = s["entries"]
    layout = Layout.pack(entries)
    rng = np.random.default_rng(s["seed"] + 1)
    ref = fill_reference(layout, rng, s["special"])
    cur = change(layout, ref, rng, s["density"], runs=s["runs"])
    base = None if s["full"] else ref
    settings = {
        "chunk_bytes": s["chunk_bytes"],
        "dense_threshold": s["dense_threshold"],
        "value_coding": s["value_coding"],
        "item_elems": s["item_elems"],
        "value_classes": s["value_classes"],
    }
    chunks, manifest = encode(layout, cur, base, **settings)  # type: ignore[arg-type]
    if base is not None:
        # The export agent's way: the reference brought to cur as it is coded, sparsely.
        # Same bytes on the wire, and every tensor of the reference ends equal to cur's.
        advanced = ref.copy()
        same, _ = encode(layout, cur, advanced, advance=True, **settings)  # type: ignore[arg-type]
        assert same == chunks
        assert_same_tensors(layout, advanced, cur)
    for t in manifest.tensors:  # what the examples covered (--hypothesis-show-statistics)
        event(f"coding {t.coding}")
    event("several chunks" if len(chunks) > 1 else "one chunk")
    codings = {r.val_coding for c in chunks for r in Forged.parse(c).records}
    event("values by class" if VAL_CLASSED in codings else "no values by class")
    if not s["value_classes"]:
        assert VAL_CLASSED not in codings
    check_manifest(
        layout,
        chunks,
        manifest,
        base,
        cur,
        chunk_bytes=s["chunk_bytes"],
        dense_threshold=s["dense_threshold"],
        item_elems=s["item_elems"],
    )
    order = rng.permutation(len(chunks)) if s["shuffle"] else None
    garbage = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    target = apply(
        layout, chunks, manifest, base, inplace=s["inplace"], order=order, garbage=garbage
    )
    if base is None:
        assert_same_tensors(layout, target, cur)
    else:
        assert target.tobytes() == cur.tobytes()  # padding included: it is never written


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(1, 3000),
    density=st.floats(0.0, 1.0),
    coding=st.sampled_from([VAL_ORDERED_DELTA, VAL_XOR]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_one_tensor_many_items(
    dtype: str, numel: int, density: float, coding: int, seed: int
) -> None:
    """One tensor of any length cut into 64-element items (ragged last item included)."""
    layout = Layout.pack([("x", dtype, (numel,))])
    rng = np.random.default_rng(seed)
    ref = fill_reference(layout, rng, 0.1)
    cur = change(layout, ref, rng, density)
    chunks, manifest = encode(
        layout, cur, ref, item_elems=64, value_coding=coding, dense_threshold=1.0
    )
    target = apply(layout, chunks, manifest, ref, inplace=True)
    assert target.tobytes() == cur.tobytes()


# -- deterministic cases ------------------------------------------------------------------------


def _runs_layout() -> tuple[Layout, np.ndarray, np.ndarray]:
    layout = Layout.pack(
        [("runs", "bfloat16", (8192,)), ("some", "float32", (2000,)), ("all", "int16", (1500,))]
    )
    rng = np.random.default_rng(11)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    runs = layout.view(cur, "runs")
    runs[np.arange(runs.size) % 70 < 30] += 1  # runs of 30 changes between gaps of 40
    some = layout.view(cur, "some")
    some[rng.choice(some.size, 20, replace=False)] ^= 1
    layout.view(cur, "all")[:] -= 1
    return layout, ref, cur


@pytest.mark.parametrize("coding", [VAL_ORDERED_DELTA, VAL_XOR], ids=["ordered", "xor"])
@pytest.mark.parametrize("inplace", [False, True], ids=["separate", "in-place"])
def test_runs_choose_bitmap_and_full_changes_choose_dense(coding: int, inplace: bool) -> None:
    layout, ref, cur = _runs_layout()
    chunks, manifest = encode(
        layout, cur, ref, dense_threshold=0.5, value_coding=coding, chunk_bytes=4096
    )
    codings = {t.name: t.coding for t in manifest.tensors}
    assert codings == {"runs": "bitmap", "some": "rice", "all": "dense"}
    assert len(chunks) > 1
    check_manifest(layout, chunks, manifest, ref, cur, chunk_bytes=4096, dense_threshold=0.5)
    target = apply(layout, chunks, manifest, ref, inplace=inplace)
    assert target.tobytes() == cur.tobytes()


def test_one_whole_contiguous_run() -> None:
    """A tensor with one contiguous run changed (e.g. new embedding rows)."""
    layout = Layout.pack([("emb", "bfloat16", (256, 64)), ("w", "bfloat16", (1000,))])
    rng = np.random.default_rng(3)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    layout.view(cur, "emb")[64 * 100 : 64 * 140] = rng.integers(0, 1 << 16, 64 * 40)
    # one wave: the tensor's coding is chosen on the whole of it (in small waves the piece
    # that holds the run would be dense, rightly)
    chunks, manifest = encode(layout, cur, ref, chunk_bytes=1 << 20)
    assert manifest.tensors[0].coding in ("rice", "bitmap")
    assert manifest.tensors[0].changed == int((layout.view(ref, 0) != layout.view(cur, 0)).sum())
    assert manifest.tensors[1].coding == "unchanged"
    assert apply(layout, chunks, manifest, ref, inplace=True).tobytes() == cur.tobytes()


@pytest.mark.parametrize(("changed", "coding"), [(299, "rice"), (300, "rice"), (301, "dense")])
def test_dense_threshold_is_strict(changed: int, coding: str) -> None:
    layout = Layout.pack([("x", "float16", (1000,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    cur = ref.copy()
    layout.view(cur, "x")[:changed] = 0x3C00
    chunks, manifest = encode(layout, cur, ref, dense_threshold=0.3)
    assert manifest.tensors[0].coding == coding
    assert manifest.tensors[0].changed == changed
    assert apply(layout, chunks, manifest, ref, inplace=False).tobytes() == cur.tobytes()


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_dense_threshold_extremes(threshold: float) -> None:
    layout = Layout.pack([("x", "bfloat16", (500,)), ("y", "int32", (500,))])
    rng = np.random.default_rng(4)
    ref = fill_reference(layout, rng, 0.1)
    for density in (0.002, 0.5, 1.0):
        cur = change(layout, ref, rng, density)
        chunks, manifest = encode(layout, cur, ref, dense_threshold=threshold)
        for t in manifest.tensors:
            if t.changed == 0:
                assert t.coding == "unchanged"
            elif threshold == 0.0:
                assert t.coding == "dense"
            else:
                assert t.coding in ("rice", "bitmap")
        assert apply(layout, chunks, manifest, ref, inplace=True).tobytes() == cur.tobytes()


@pytest.mark.parametrize("kind", ["float", "int"])
def test_special_values_in_every_dtype_through_every_path(kind: str) -> None:
    """Every special pattern to every other one, for each dtype, via dense, sparse and full.

    Floats and ints go in separate layouts: see test_float_and_int_tensors_of_one_width."""
    entries = [(d, d, (len(SPECIALS[d]) ** 2,)) for d in DTYPES if dtype_of(d).kind == kind]

    def build(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
        ref = np.zeros(layout.nbytes, np.uint8)
        cur = ref.copy()
        for spec in layout.tensors:
            sp = np.array(SPECIALS[spec.name], dtype_of(spec.dtype).bits)
            layout.view(ref, spec.name)[:] = np.repeat(sp, sp.size)
            layout.view(cur, spec.name)[:] = np.tile(sp, sp.size)
        return ref, cur

    layout = Layout.pack(entries)
    ref, cur = build(layout)
    for coding in (VAL_ORDERED_DELTA, VAL_XOR):
        chunks, manifest = encode(layout, cur, ref, value_coding=coding, dense_threshold=0.0)
        assert {t.coding for t in manifest.tensors} == {"dense"}
        for inplace in (False, True):
            assert apply(layout, chunks, manifest, ref, inplace=inplace).tobytes() == cur.tobytes()
    chunks, manifest = encode(layout, cur, None)
    assert_same_tensors(layout, apply(layout, chunks, manifest, None, inplace=False), cur)

    # Sparse records of every width.
    narrow = Layout.pack(entries)
    ref, cur = build(narrow)
    for coding in (VAL_ORDERED_DELTA, VAL_XOR):
        chunks, manifest = encode(narrow, cur, ref, value_coding=coding, dense_threshold=1.0)
        assert {t.coding for t in manifest.tensors} <= {"rice", "bitmap"}
        for inplace in (False, True):
            assert apply(narrow, chunks, manifest, ref, inplace=inplace).tobytes() == cur.tobytes()


def test_special_values_of_every_dtype_in_one_layout_xor() -> None:
    """With xor coding the float-ness of a tensor does not matter: all dtypes together."""
    layout = Layout.pack([(d, d, (len(SPECIALS[d]) ** 2,)) for d in DTYPES])
    ref = np.zeros(layout.nbytes, np.uint8)
    cur = ref.copy()
    for spec in layout.tensors:
        sp = np.array(SPECIALS[spec.name], dtype_of(spec.dtype).bits)
        layout.view(ref, spec.name)[:] = np.repeat(sp, sp.size)
        layout.view(cur, spec.name)[:] = np.tile(sp, sp.size)
    chunks, manifest = encode(layout, cur, ref, value_coding=VAL_XOR, dense_threshold=0.0)
    assert apply(layout, chunks, manifest, ref, inplace=True).tobytes() == cur.tobytes()


def test_full_version_applies_over_anything() -> None:
    layout = Layout.pack(
        [(f"t{i}", d, s) for i, (d, s) in enumerate(zip(DTYPES, SHAPES, strict=False))]
    )
    rng = np.random.default_rng(8)
    cur = fill_reference(layout, rng, 0.3)
    chunks, manifest = encode(layout, cur, None, chunk_bytes=4096, version=7)
    assert manifest.kind == "full"
    assert manifest.base_version == NO_BASE
    for garbage in (np.zeros(layout.nbytes, np.uint8), np.full(layout.nbytes, 0xFF, np.uint8)):
        target = apply(layout, chunks, manifest, None, inplace=False, garbage=garbage)
        assert_same_tensors(layout, target, cur)
    # a full resync also applies over a held version, through VersionApply with a base
    target = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    va = VersionApply(layout, target, target, base=6, version=7)
    for c in chunks:
        va.apply(c)
    assert_same_tensors(layout, target, cur)
    for c in chunks:
        d = decode_chunk(c, layout)
        assert all(r.val_coding == VAL_RAW for r in d.records)


@pytest.mark.parametrize("full", [False, True])
def test_nothing_to_send_still_names_the_version(full: bool) -> None:
    """No changes (or only empty tensors): one chunk without records carries the version."""
    for entries in (
        [("e", "float32", (0,)), ("f", "int8", (3, 0))],
        [("a", "bfloat16", (100,)), ("b", "int64", ())],
    ):
        layout = Layout.pack(entries)
        ref = np.random.default_rng(1).integers(0, 256, max(layout.nbytes, 8), dtype=np.uint8)
        ref = ref[: layout.nbytes]
        chunks, manifest = encode(layout, ref.copy(), None if full else ref, version=3)
        if not full or layout.numel == 0:
            assert len(chunks) == 1
            assert HEADER.unpack_from(chunks[0])[7] == 0  # no records
        assert manifest.version == 3
        target = apply(layout, chunks, manifest, None if full else ref, inplace=False)
        assert_same_tensors(layout, target, ref)


def test_many_chunks_and_versions_with_one_encoder() -> None:
    """One encoder, scratch reused across versions of different sparsity; chunks are small."""
    layout = Layout.pack(
        [
            ("a", "bfloat16", (20000,)),
            ("b", "float32", (5000,)),
            ("c", "int8", (9000,)),
            ("d", "float16", (7,)),
        ]
    )
    rng = np.random.default_rng(12)
    enc = DeltaEncoder(layout, chunk_bytes=4096)
    held = fill_reference(layout, rng, 0.01)
    for version, density in enumerate([0.01, 0.2, 0.0, 0.05, 1.0], start=1):
        cur = change(layout, held, rng, density)
        e = enc.encode(cur, held, target_version=version, base_version=version - 1)
        target = held.copy()
        va = VersionApply(layout, target, held, base=version - 1, version=version)
        n = 0
        for c in e:  # apply while the encoder is still encoding
            va.apply(c.data)
            n += 1
        assert e.manifest is not None
        if density >= 0.01:
            assert n > 1
        va.verify(e.manifest)
        assert target.tobytes() == cur.tobytes()
        held = target


def test_encode_leaves_its_inputs_alone() -> None:
    layout, ref, cur = _runs_layout()
    ref0, cur0 = ref.tobytes(), cur.tobytes()
    encode(layout, cur, ref, chunk_bytes=4096)
    encode(layout, cur, None, chunk_bytes=4096)
    assert ref.tobytes() == ref0
    assert cur.tobytes() == cur0


# -- encoder arguments --------------------------------------------------------------------------


def test_encoder_refuses_bad_settings() -> None:
    layout = Layout.pack([("x", "bfloat16", (10,))])
    with pytest.raises(ValueError, match="chunk_bytes must be at least 4096"):
        DeltaEncoder(layout, chunk_bytes=4095)
    for t in (-0.1, 1.5):
        with pytest.raises(ValueError, match="dense_threshold must lie in"):
            DeltaEncoder(layout, dense_threshold=t)
    with pytest.raises(ValueError, match="coded against the reference"):
        DeltaEncoder(layout, value_coding=VAL_RAW)


def test_encoder_refuses_bad_buffers_and_versions() -> None:
    layout = Layout.pack([("x", "bfloat16", (10,))])
    enc = DeltaEncoder(layout)
    ok = np.zeros(layout.nbytes, np.uint8)
    bad = {
        "wrong dtype": ok.view(np.uint16),
        "wrong size": np.zeros(layout.nbytes + 1, np.uint8),
        "2-d": ok.reshape(2, -1),
        "misaligned": np.zeros(layout.nbytes + 8, np.uint8)[3 : 3 + layout.nbytes],
    }
    for what, buf in bad.items():
        with pytest.raises(ValueError, match="the current buffer must be"):
            enc.encode(buf, None, target_version=1)
        with pytest.raises(ValueError, match="the reference buffer must be"):
            enc.encode(ok, buf, target_version=1, base_version=0)
        del what
    with pytest.raises(ValueError, match="a full version has no base version"):
        enc.encode(ok, None, target_version=1, base_version=0)
    with pytest.raises(ValueError, match="advance needs a reference"):
        enc.encode(ok, None, target_version=1, advance=True)
    frozen = ok.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="advance writes into the reference"):
        enc.encode(ok, frozen, target_version=1, base_version=0, advance=True)
    for base in (None, 1, 2, -1):
        with pytest.raises(ValueError, match="a delta needs a base version below its target 1"):
            enc.encode(ok, ok, target_version=1, base_version=base)


# -- regressions (found by these tests, fixed in the codec) --------------------------------------


@pytest.mark.parametrize("dtype", ["int64", "float64"])
@pytest.mark.parametrize("coding", [VAL_ORDERED_DELTA, VAL_XOR], ids=["ordered", "xor"])
@pytest.mark.parametrize(
    "values",
    [[0x4000000000003039, 0xC000000000003039], [0xFFFF000000000001, 0xFFFF000000000011]],
    ids=["refused", "wrong-bits"],
)
def test_64bit_large_changes_round_trip(dtype: str, coding: int, values: list[int]) -> None:
    layout = Layout.pack([("x", dtype, (64,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    cur = ref.copy()
    layout.view(cur, "x")[3 : 3 + len(values)] = values
    chunks, manifest = encode(layout, cur, ref, value_coding=coding)
    assert manifest.tensors[0].coding == "rice"
    assert apply(layout, chunks, manifest, ref, inplace=False).tobytes() == cur.tobytes()


@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_64bit_outliers_among_small_changes_round_trip(dtype: str) -> None:
    """Large 8-byte values are fine when the Rice parameter stays small (they escape)."""
    layout = Layout.pack([("x", dtype, (4096,)), ("y", dtype, (3000,))])
    rng = np.random.default_rng(9)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    for name in ("x", "y"):
        v = layout.view(cur, name)
        small = rng.choice(v.size, 200, replace=False)
        v[small] ^= rng.integers(1, 8, 200).astype(np.uint64)
        v[small[:3]] ^= np.uint64(1 << 63)  # sign flips: escaped outliers
    for coding in (VAL_ORDERED_DELTA, VAL_XOR):
        chunks, manifest = encode(layout, cur, ref, value_coding=coding)
        assert {t.coding for t in manifest.tensors} == {"rice"}
        assert apply(layout, chunks, manifest, ref, inplace=True).tobytes() == cur.tobytes()


@pytest.mark.parametrize("item_elems", [65, 129])
def test_item_elems_not_a_multiple_of_64(item_elems: int) -> None:
    layout = Layout.pack([("x", "bfloat16", (1000,))])
    rng = np.random.default_rng(1)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    layout.view(cur, "x")[::7] += 1
    enc = DeltaEncoder(layout, item_elems=item_elems)  # rounded down to a multiple of 64
    assert enc.item_elems % 64 == 0
    e = enc.encode(cur, ref, target_version=1, base_version=0)
    chunks = [c.data for c in e]
    assert e.manifest is not None
    assert e.manifest.tensors[0].changed == 143
    assert apply(layout, chunks, e.manifest, ref, inplace=False).tobytes() == cur.tobytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "uint8", "float32", "int64"])
@pytest.mark.parametrize("inplace", [False, True], ids=["separate", "in-place"])
def test_changes_at_the_mask_block_edges_of_one_long_item(inplace: bool, dtype: str) -> None:
    """One item of three whole mask blocks (4096 elements each), a partial one and a tail of
    fewer than 64 elements; changes on every block edge and at random between them, so each
    block's masks, the partial block and the scalar tail are all visited, and the streams are
    long enough for the decoder's word-at-a-time refill and its byte-at-a-time end. Every
    width builds its masks the same way (kernels._diff_item): each is checked, and some
    elements have their top bit flipped as well (sign flips: the largest coded values,
    which take the Rice escape)."""
    numel = 3 * 4096 + 640 + 5
    layout = Layout.pack([("x", dtype, (numel,))])
    rng = np.random.default_rng(5)
    ref = fill_reference(layout, rng, 0.1)
    cur = ref.copy()
    x = layout.view(cur, "x")
    bits = x.view(f"<u{x.dtype.itemsize}")
    edges = [0, 63, 64, 4095, 4096, 8191, 8192, 12287, 12288, 12288 + 639, numel - 5, numel - 1]
    chosen = np.union1d(edges, rng.choice(numel, 700, replace=False))
    bits[chosen] ^= bits.dtype.type(1)
    top = chosen[::7]
    bits[top] ^= bits.dtype.type(1 << (8 * bits.dtype.itemsize - 1))
    chunks, manifest = encode(layout, cur, ref, item_elems=1 << 20, dense_threshold=1.0)
    assert manifest.tensors[0].changed == chosen.size
    target = apply(layout, chunks, manifest, ref, inplace=inplace)
    assert target.tobytes() == cur.tobytes()


@pytest.mark.parametrize(
    ("first", "second", "threshold"),
    [
        ("bfloat16", "int16", 1.0),
        ("bfloat16", "int16", 0.0),
        ("int16", "float16", 1.0),
        ("int16", "float16", 0.0),
        ("float32", "int32", 1.0),
        ("int32", "float32", 0.0),
        ("float64", "int64", 0.0),
    ],
)
def test_float_and_int_tensors_of_one_width(first: str, second: str, threshold: float) -> None:
    layout = Layout.pack([("a", first, (64,)), ("b", second, (64,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    cur = ref.copy()
    b = layout.view(cur, "b")
    b[5] = b.dtype.type(1 << (8 * b.dtype.itemsize - 1))  # -0.0, or the most negative int
    layout.view(cur, "a")[7] = 1
    chunks, manifest = encode(
        layout, cur, ref, value_coding=VAL_ORDERED_DELTA, dense_threshold=threshold
    )
    assert apply(layout, chunks, manifest, ref, inplace=False).tobytes() == cur.tobytes()


def test_manifest_round_trips_through_json() -> None:
    layout, ref, cur = _runs_layout()
    _, manifest = encode(layout, cur, ref)
    again = RefitManifest.from_json(manifest.to_json())
    assert again == manifest
    assert dataclasses.asdict(again) == dataclasses.asdict(manifest)
