"""Compile every codec kernel once, for every element width, before anything is timed.

numba compiles a kernel the first time it sees a new combination of argument types (here:
the element width) and caches the result beside the sources. The first use of a width
otherwise costs about ten seconds, which a benchmark must not time and a refit must not pay.
"""

from __future__ import annotations

import numpy as np

from deltarl.codecs import kernels
from deltarl.codecs.decoder import (
    DecodedChunk,
    VersionApply,
    apply_chunk,
    apply_chunk_flips,
    read_only,
)
from deltarl.codecs.encoder import CONDITIONED_CODERS, DeltaEncoder
from deltarl.codecs.frame import VAL_ORDERED_DELTA, VAL_XOR
from deltarl.engine.layout import Layout

# One float and one int tensor of every width the codec supports.
_WIDTHS = [
    ("b8", "int8", (256,)),
    ("f16", "bfloat16", (4096,)),
    ("i16", "int16", (256,)),
    ("f32", "float32", (4096,)),
    ("i32", "int32", (256,)),
    ("f64", "float64", (256,)),
    ("i64", "int64", (256,)),
]


def warm_up() -> None:
    """Encode and apply a small delta of every width, with both value codings."""
    layout = Layout.pack(_WIDTHS)
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    _weights(layout, ref)
    cur = ref.copy()
    cur[::97] ^= 1
    # The export agent encodes straight from a store's read-only mapping or from a writable
    # copy: numba types a read-only array apart from a writable one, so both are compiled
    # (else the first refit of a process compiles for seconds). The decoder passes its inputs
    # read-only whatever it is given (decoder.read_only): the applies compile the same
    # kernels whether their reference is the target (in place) or another buffer.
    cur_ro = read_only(cur.copy())
    cases = [
        (VAL_ORDERED_DELTA, cur, None),
        (VAL_XOR, cur, None),
        (VAL_ORDERED_DELTA, cur_ro, None),
    ]
    # conditioned records of every float width they code (bf16, f32) and of every coder,
    # from a delta where they win: a tiny step that moves only the smallest weights
    for coder in CONDITIONED_CODERS:
        cases.append((VAL_ORDERED_DELTA, _tiny_step(layout, ref), coder))
        cases.append((VAL_ORDERED_DELTA, read_only(_tiny_step(layout, ref)), coder))
    for coding, current, coder in cases:
        conditioned = coder is not None
        encoding = DeltaEncoder(
            layout,
            value_coding=coding,
            conditioned=conditioned,
            conditioned_coder=coder or "range",
        ).encode(current, ref, target_version=1, base_version=0)
        chunks = list(encoding)
        # As the apply agent applies a delta: in place, its target (holding the base) being
        # its own reference.
        kept: list[DecodedChunk] = []
        target = ref.copy()
        apply = VersionApply(layout, target, target, base=0, version=1, keep=kept)
        for chunk in chunks:
            apply.apply(chunk.data)
        assert encoding.manifest is not None
        apply.verify(encoding.manifest)
        # The apply agent then brings its other buffer from the base to the version by the
        # chunks it kept, in place (refit/catch_up.py): the scatter of every record, which
        # the apply itself wrote as it decoded and so compiled only for the conditioned.
        # After a commit (``eager``), the same while recording what undoes it.
        behind, settled = ref.copy(), ref.copy()
        for decoded in kept:
            apply_chunk(decoded, layout, behind, behind)
            apply_chunk_flips(decoded, layout, settled)
        assert np.array_equal(behind, current)
        assert np.array_equal(settled, current)
        if conditioned:
            codings = {t.dtype: t.coding for t in encoding.manifest.tensors}
            assert codings["bfloat16"] == codings["float32"] == "conditioned", codings
    # The export agent advances its reference as it encodes (from a writable or a read-only
    # current version): the diff kernel with its writes, for every width; with conditioned
    # coding, the scatter that writes after the conditioned streams.
    for current, coder in (
        (cur, None),
        (cur_ro, None),
        *((read_only(_tiny_step(layout, ref)), coder) for coder in CONDITIONED_CODERS),
    ):
        advanced = ref.copy()
        encoder = DeltaEncoder(
            layout, conditioned=coder is not None, conditioned_coder=coder or "range"
        )
        list(encoder.encode(current, advanced, target_version=1, base_version=0, advance=True))
        assert np.array_equal(advanced, current)
    # The delta above has no bitmap records. A bitmap comes from zstd or the frame's bytes
    # (read-only), or from a bytearray frame (writable).
    marks = np.packbits(np.arange(64) % 3 == 0, bitorder="little")
    for packed in (marks, read_only(marks)):
        assert kernels.bitmap_positions(packed, np.empty(22, np.int64)) == 22
    # The fault path: a frame refused after some of its records were written has them put
    # back (decoder._decode_sparse). Compiled here for every width, with no work to do, so
    # the first refused frame of a process does not wait for a compile.
    none = np.zeros(0, np.int64)
    for width in (1, 2, 4, 8):
        bits = np.dtype(f"<u{width}")
        kernels.undo_sparse(
            np.zeros(8, bits),
            none,
            none,
            none,
            np.zeros(0, np.uint32),
            np.zeros(0, bits),
            none,
            np.zeros(1, np.int64),
        )


def _weights(layout: Layout, buf: np.ndarray) -> None:
    """Fill the float tensors of ``buf`` with weights spread over four decades."""
    rng = np.random.default_rng(1)
    for i, spec in enumerate(layout.tensors):
        if spec.dtype in ("bfloat16", "float32"):
            w = rng.choice([-1.0, 1.0], spec.numel) * 10 ** rng.uniform(-4, 0, spec.numel)
            bits = w.astype(np.float32).view(np.uint32)
            view = layout.view(buf, i)
            view[:] = bits >> 16 if spec.dtype == "bfloat16" else bits


def _tiny_step(layout: Layout, ref: np.ndarray) -> np.ndarray:
    cur = ref.copy()
    for i, spec in enumerate(layout.tensors):
        if spec.dtype == "bfloat16":
            w = (layout.view(ref, i).astype(np.uint32) << 16).view(np.float32)
            bits = (w + np.float32(1e-6)).view(np.uint32)
            # round to nearest even, as a cast to bf16 does
            layout.view(cur, i)[:] = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        elif spec.dtype == "float32":
            w = layout.view(ref, i).view(np.float32)
            layout.view(cur, i)[:] = (w + np.float32(1e-11)).view(np.uint32)
    return cur


if __name__ == "__main__":
    warm_up()
