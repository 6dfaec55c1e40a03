"""Compile every codec kernel once, for every element width, before anything is timed.

numba compiles a kernel the first time it sees a new combination of argument types (here:
the element width) and caches the result beside the sources. The first use of a width
otherwise costs about ten seconds, which a benchmark must not time and a refit must not pay.
"""

from __future__ import annotations

import numpy as np

from deltarl.codecs import kernels
from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import VAL_ORDERED_DELTA, VAL_XOR
from deltarl.engine.layout import Layout

# One float and one int tensor of every width the codec supports.
_WIDTHS = [
    ("b8", "int8", (256,)),
    ("f16", "bfloat16", (256,)),
    ("i16", "int16", (256,)),
    ("f32", "float32", (256,)),
    ("i32", "int32", (256,)),
    ("f64", "float64", (256,)),
    ("i64", "int64", (256,)),
]


def warm_up() -> None:
    """Encode and apply a small delta of every width, with both value codings."""
    layout = Layout.pack(_WIDTHS)
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    cur[::97] ^= 1
    # The export agent encodes straight from a store's read-only mapping, and the apply agent
    # applies against one: numba types a read-only array apart from a writable one, so both
    # are compiled (else the first refit of a process compiles for seconds).
    cur_ro = cur.copy()
    cur_ro.flags.writeable = False
    ref_ro = ref.copy()
    ref_ro.flags.writeable = False
    for coding, current in ((VAL_ORDERED_DELTA, cur), (VAL_XOR, cur), (VAL_ORDERED_DELTA, cur_ro)):
        encoding = DeltaEncoder(layout, value_coding=coding).encode(
            current, ref, target_version=1, base_version=0
        )
        chunks = list(encoding)
        # The apply agent's reference is the store's read-only view of the active buffer.
        reference = ref_ro if current is cur_ro else ref
        apply = VersionApply(layout, ref.copy(), reference, base=0, version=1)
        for chunk in chunks:
            apply.apply(chunk.data)
        assert encoding.manifest is not None
        apply.verify(encoding.manifest)
    # The delta above has no bitmap records. A bitmap comes from zstd or the frame's bytes
    # (read-only), or from a bytearray frame (writable).
    marks = np.packbits(np.arange(64) % 3 == 0, bitorder="little")
    readonly = marks.copy()
    readonly.flags.writeable = False
    for packed in (marks, readonly):
        assert kernels.bitmap_positions(packed, np.empty(22, np.int64)) == 22


if __name__ == "__main__":
    warm_up()
