"""Coding a sparse record conditioned on the reference both sides hold (POS_CONDITIONED).

Whether an optimizer step moves a bf16 element depends on its magnitude: the update must
exceed half an ulp, and the ulp is set by the exponent. The receiver holds the reference, so
the sender may split a range's elements into classes by their reference exponent and code
each class's changes with that class's own statistics, for free: nothing about the split is
sent. Within a class, changes are coded as gaps counted in members of that class, and values
(the ordered-delta codes) with that class's own adaptive model, through the range coder
(range_coder.py). On the simulated AdamW deltas the exponent is nearly the whole gain: the
conditioned bound with it alone is 0.63-0.76 bytes per change, with whether the element
changed in the previous delta added 0.71-0.75 (`deltarl bench codec`), so that second
context, which would tie every delta to the one before it, is not used.

The stream, in the order a decoder walking the range's elements meets them:
- at the first element of a class: the rank (within the class) of its first changed
  member, plus one, or 0 if none of the class changed;
- at each changed element: its coded value, then the gap in class members to the next
  changed member of its class, or 0 if it was the last.
A decoder keeps one countdown per class and needs nothing else: it finds every position by
walking the reference's exponents, which is why this mode costs a pass over the range on both
sides (the Rice mode touches only the changed elements), and why it is chosen per range only
where it is smaller, and only when the encoder is asked for it.

Models start fresh in every record (records decode in parallel); a class's probabilities are
set up when the class first appears, so a record pays only for the classes it holds.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from deltarl.codecs.range_coder import (
    PROB_INIT,
    TREE_NODES,
    dec_start,
    enc_finish,
    enc_start,
    get_number,
    put_number,
)

MODEL_EXPONENT = 1  # the frame's model id (a record's pos_k): classes = reference exponent
MODELS = {MODEL_EXPONENT: "reference exponent"}

# Where the exponent sits in each float type's bit pattern: (shift, mask).
EXPONENT = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float64": (52, 0x7FF),
}
# The dtypes this mode codes: exponents of at most 8 bits, values of at most 32 bits.
CODED_DTYPES = ("bfloat16", "float16", "float32")
CLASSES = 256
# Per class: gap bit-length tree, gap mantissa contexts, value tree, value mantissa contexts.
_GAP_TREE = 0
_GAP_MANT = _GAP_TREE + TREE_NODES
_VAL_TREE = _GAP_MANT + 4 * TREE_NODES
_VAL_MANT = _VAL_TREE + TREE_NODES
_PER_CLASS = _VAL_MANT + 4 * TREE_NODES
_NONE = np.int64(1) << 61  # a countdown that never reaches zero within a range

# Error codes (as kernels.py's, so decoder.py names them the same way).
OK = 0
EXHAUSTED = 1
OUT_OF_RANGE = 2
TRAILING = 3
BAD_VALUE = 5
BAD_START = 6
ERRORS = {
    EXHAUSTED: "the conditioned stream ends before all changed elements were decoded",
    OUT_OF_RANGE: "the conditioned stream codes more changed elements than the record claims",
    TRAILING: "the conditioned stream has bytes left over after the last element",
    BAD_VALUE: "a decoded value does not fit the element width or codes no change",
    BAD_START: "the conditioned stream does not start with a zero byte",
}


def exponent_field(dtype: str) -> tuple[int, int]:
    """(shift, mask) of the exponent in ``dtype``'s bit pattern."""
    return EXPONENT[dtype]


@njit(inline="always")
def _init_class(model, k):
    at = k * _PER_CLASS
    for j in range(_PER_CLASS):
        model[at + j] = PROB_INIT


@njit(inline="always")
def _put_gap(dst, end, st, model, k, x):
    at = k * _PER_CLASS
    return put_number(dst, end, st, model, at + _GAP_TREE, model, at + _GAP_MANT, x)


@njit(inline="always")
def _put_val(dst, end, st, model, k, x):
    at = k * _PER_CLASS
    return put_number(dst, end, st, model, at + _VAL_TREE, model, at + _VAL_MANT, x)


@njit(inline="always")
def _get_gap(src, end, st, model, k):
    at = k * _PER_CLASS
    return get_number(src, end, st, model, at + _GAP_TREE, model, at + _GAP_MANT)


@njit(inline="always")
def _get_val(src, end, st, model, k):
    at = k * _PER_CLASS
    return get_number(src, end, st, model, at + _VAL_TREE, model, at + _VAL_MANT)


@njit(cache=True, boundscheck=False, nogil=True)
def _encode_item(ref, s, n, pos, zval, o, c, shift, mask, dst, d, end):
    """Code one item's c changes (positions pos[o:o+c] relative to s, coded values zval);
    return the stream's end offset (past ``end``: it did not fit, nothing past end written)."""
    # 1) each change's class and rank in its class; each class's first element
    count = np.zeros(CLASSES, np.int64)
    first = np.full(CLASSES, n, np.int64)
    cls = np.empty(c, np.int64)
    rank = np.empty(c, np.int64)
    j = 0
    nxt = np.int64(pos[o]) if c > 0 else n
    for e in range(n):
        k = (np.int64(ref[s + e]) >> shift) & mask
        if first[k] == n:
            first[k] = e
        if e == nxt:
            cls[j] = k
            rank[j] = count[k]
            j += 1
            nxt = np.int64(pos[o + j]) if j < c else n
        count[k] += 1
    # 2) each change's gap to the next change of its class; each class's first change
    later = np.full(CLASSES, -1, np.int64)
    gap = np.empty(c, np.int64)
    for j in range(c - 1, -1, -1):
        k = cls[j]
        gap[j] = later[k] - rank[j] if later[k] >= 0 else 0
        later[k] = rank[j]
    # 3) the stream, in the order a decoder walking the range meets its events
    order = np.argsort(first, kind="mergesort")
    model = np.empty(CLASSES * _PER_CLASS, np.int32)
    st = enc_start(d)
    f = 0
    for j in range(c + 1):
        p = np.int64(pos[o + j]) if j < c else n
        while f < CLASSES and first[order[f]] <= p and first[order[f]] < n:
            k = order[f]
            _init_class(model, k)
            st = _put_gap(dst, end, st, model, k, later[k] + 1)
            f += 1
        if j < c:
            k = cls[j]
            st = _put_val(dst, end, st, model, k, np.int64(zval[o + j]))
            st = _put_gap(dst, end, st, model, k, gap[j])
    return enc_finish(dst, end, st)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def encode_conditioned(
    ref,  # flat uintN view of the reference
    starts,  # int64[n]: first element of each item in the flat view
    lengths,  # int64[n]
    out_off,  # int64[n]: each item's region in pos / zval
    counts,  # int64[n]: changed elements per item (0: skipped)
    pos,  # uint32: changed positions relative to each item (kernels.encode_sparse)
    zval,  # uint64: their coded values (ordered delta)
    shift,  # exponent field of the element type
    mask,
    dst,  # uint8: item i's stream goes to dst[cap_off[i] : cap_off[i] + cap[i]]
    cap_off,
    cap,
    sizes,  # out int64[n]: bytes each item's stream needs (> cap[i]: it did not fit)
):
    n_items = starts.shape[0]
    for t in prange(n_items):
        i = (2 * t) if t < (n_items + 1) // 2 else 2 * (t - (n_items + 1) // 2) + 1
        if counts[i] == 0:
            sizes[i] = 0
            continue
        d0 = cap_off[i]
        sizes[i] = (
            _encode_item(
                ref,
                starts[i],
                lengths[i],
                pos,
                zval,
                out_off[i],
                counts[i],
                shift,
                mask,
                dst,
                d0,
                d0 + cap[i],
            )
            - d0
        )


@njit(cache=True, boundscheck=False, nogil=True)
def _decode_record(ref, b, n, src, r0, end, c, o, shift, mask, vmax, positions, zval):
    model = np.empty(CLASSES * _PER_CLASS, np.int32)
    left = np.full(CLASSES, -1, np.int64)  # -1: class not met yet
    code, rng, r, ok = dec_start(src, r0, end)
    if not ok:
        return BAD_START
    st = (code, rng, r)
    j = 0
    for e in range(n):
        k = (np.int64(ref[b + e]) >> shift) & mask
        x = left[k]
        if x < 0:
            _init_class(model, k)
            st, g = _get_gap(src, end, st, model, k)
            x = g - 1 if g > 0 else _NONE
        if x == 0:
            if j == c:
                return OUT_OF_RANGE
            st, v = _get_val(src, end, st, model, k)
            if v == 0 or v > vmax:
                return BAD_VALUE
            positions[o + j] = e
            zval[o + j] = np.uint64(v)
            j += 1
            st, g = _get_gap(src, end, st, model, k)
            x = g - 1 if g > 0 else _NONE
        else:
            x -= 1
        left[k] = x
    r = st[2]
    if j < c or r > end:
        return EXHAUSTED
    if r < end:
        return TRAILING
    return OK


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def decode_conditioned(
    ref,  # flat uintN view of the reference the frame's base names
    bases,  # int64[n]: each record's first element in that view
    lengths,  # int64[n]
    src,  # uint8: the conditioned streams
    src_off,  # int64[n]
    src_len,  # int64[n]
    counts,  # int64[n]: changed elements each record claims
    out_off,  # int64[n]: each record's region in positions / zval
    shift,
    mask,
    vmax,  # the largest coded value of the element width
    positions,  # int64 out
    zval,  # uint64 out
    errors,  # int64 out
):
    """Decode every record's positions and coded values, walking its reference range.

    Never reads outside a record's stream region or reference range, never writes outside
    its output region (at most ``counts[i]`` elements); the caller checks the regions."""
    n_items = counts.shape[0]
    for t in prange(n_items):
        i = (2 * t) if t < (n_items + 1) // 2 else 2 * (t - (n_items + 1) // 2) + 1
        errors[i] = _decode_record(
            ref,
            bases[i],
            lengths[i],
            src,
            src_off[i],
            src_off[i] + src_len[i],
            counts[i],
            out_off[i],
            shift,
            mask,
            vmax,
            positions,
            zval,
        )
