"""Coding a sparse record conditioned on the reference both sides hold (POS_CONDITIONED).

Whether an optimizer step moves a bf16 element depends on its magnitude: the update must
exceed half an ulp, and the ulp is set by the exponent. The receiver holds the reference, so
the sender may split a range's elements into classes by their reference exponent and code
each class's changes with that class's own statistics, for free: nothing about the split is
sent. Within a class, changes are coded as gaps counted in members of that class, and values
(the ordered-delta codes) with that class's own adaptive model, through the range coder
(below). On the simulated AdamW deltas the exponent is nearly the whole gain: the
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
from numba.cpython.unsafe.numbers import leading_zeros

# -- the range coder ------------------------------------------------------------------
#
# An adaptive binary range coder for the compiled kernels (LZMA's, in numba).
#
# Every decision is one bit coded with an adaptive probability: an 11-bit estimate of
# P(bit = 0) that moves 1/32 of the way towards each outcome seen. Both sides update the same
# estimates from the same bits, so nothing about the model is sent: the coder learns each
# context's statistics as it goes (the coding below says which contexts).
#
# Numbers are binarised Elias-gamma style (``put_number``): the bit length nb (< 36) as one
# adaptive decision (nb < 4?) and then a 2-bit tree (nb) or a 5-bit tree (nb - 4) of adaptive
# decisions, the two bits below the leading one adaptively per bit length, the rest as direct
# (equiprobable) bits. The small numbers that dominate a delta (gaps in a likely class, +-1
# ulp steps) are thus coded in few decisions, almost all adaptive: each decision is a link in
# one dependency chain, so their count, more than anything, sets the coder's speed.
#
# The encoder's state is (low, range, cache, pending, d) and the decoder's (code, range, r),
# plain int64s threaded through small @njit functions, which LLVM inlines so the kernels keep
# them in registers (numba's inline="always" measured 2.5x slower here: 13.8 against 5.7 ns a
# bit). An
# encoder writes only below ``end`` and counts on past it, so a caller learns how much room a
# stream would have needed without the coder ever writing out of bounds. A decoder reads only
# below ``end``, counts reads past it, and the kernel refuses a stream it overran.
#
# Each estimate stays within [31, 2017] of 2048, so every adaptive decision costs at least
# -log2(2017/2048) = 0.022 bits: frame_checks.py bounds the decisions (and so the elements) a
# stream of n bytes can make a decoder produce.
#
# It lives in this file, not a module of its own, because numba's cache (cache=True) keys a
# kernel by its own file only: a coder changed in another file would leave the kernels
# cached with the old one inlined, and two hosts could then disagree on the format.

PROB_BITS = 11
PROB_INIT = 1 << (PROB_BITS - 1)
_MOVE = 5
_TOP = 1 << 24
_MASK32 = (1 << 32) - 1
TREE_NODES = 64  # per number model: [1] nb < 4?, [2..4] its 2-bit tree, [33..63] the 5-bit one
_SMALL = 1  # where the small tree's node 1 sits (nodes 1..3 at 2..4)
_LARGE = 32  # where the large tree's node 1 sits (nodes 1..31 at 33..63)
# What put_number can code: bit lengths up to 4 + 31. Gaps are below 2**32 (an item's
# positions) and coded values below 2**33 (fp32's zigzagged ordered delta), well inside.
MAX_BIT_LENGTH = 35
MANTISSA_CTX = 4  # a 2-bit tree (nodes 1..3) per bit length
# Minimum information per adaptive decision (bits), from the estimates' clamp above
# (-log2(2017/2048) = 0.0220, less the rounding of the interval's split).
MIN_DECISION_BITS = 0.0219
# Adaptive decisions a number costs at least: nb < 4?, then the 2-bit tree.
MIN_DECISIONS_PER_NUMBER = 3
# What a changed element costs the kernels, in elements walked, for dealing items to threads:
# a change is ~8-12 range-coder decisions (~5.7 ns each), an element a class lookup and a
# countdown (~1-2 ns); a rough ratio, which only evens the threads' loads.
CHANGE_COST_ELEMS = 40


def work(lengths: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """Each item's cost to either kernel (every element walked, every change coded), in
    elements: what kernels.deal shares out between threads."""
    return lengths + CHANGE_COST_ELEMS * changed


# Bytes a stream has besides its decisions: the encoder's first (always zero) byte and the
# four its flush leaves.
OVERHEAD_BYTES = 5


@njit(cache=True)
def bit_length(x):
    return 0 if x == 0 else 64 - np.int64(leading_zeros(np.uint64(x)))


# -- encoder ------------------------------------------------------------------------------


@njit(cache=True)
def _shift_low(dst, end, low, cache, pending, d):
    if low < 0xFF000000 or low > _MASK32:
        carry = low >> 32
        temp = cache
        while True:
            if d < end:
                dst[d] = (temp + carry) & 0xFF
            d += 1
            temp = 0xFF
            pending -= 1
            if pending == 0:
                break
        cache = (low >> 24) & 0xFF
    pending += 1
    low = (low & 0x00FFFFFF) << 8
    return low, cache, pending, d


@njit(cache=True)
def enc_start(d):
    """A fresh encoder writing from ``d``: (low, range, cache, pending, d)."""
    return np.int64(0), np.int64(_MASK32), np.int64(0), np.int64(1), d


@njit(cache=True)
def put_bit(dst, end, st, probs, i, bit):
    low, rng, cache, pending, d = st
    p = np.int64(probs[i])
    bound = (rng >> PROB_BITS) * p
    # Branch-free: the bits that carry information are close to coin flips, and a branch on
    # each would be mispredicted half the time (m is 0 for a zero bit, all ones for a one).
    m = -np.int64(bit)
    low += bound & m
    rng = bound + ((rng - bound - bound) & m)
    up = p + (((1 << PROB_BITS) - p) >> _MOVE)
    probs[i] = up + (((p - (p >> _MOVE)) - up) & m)
    while rng < _TOP:
        rng <<= 8
        low, cache, pending, d = _shift_low(dst, end, low, cache, pending, d)
    return low, rng, cache, pending, d


@njit(cache=True)
def put_direct(dst, end, st, value, nbits):
    low, rng, cache, pending, d = st
    for b in range(nbits - 1, -1, -1):
        rng >>= 1
        if (value >> b) & 1:
            low += rng
        while rng < _TOP:
            rng <<= 8
            low, cache, pending, d = _shift_low(dst, end, low, cache, pending, d)
    return low, rng, cache, pending, d


@njit(cache=True)
def enc_finish(dst, end, st):
    """Flush; return the offset just past the stream (possibly past ``end``: too small)."""
    low, _, cache, pending, d = st
    for _ in range(5):
        low, cache, pending, d = _shift_low(dst, end, low, cache, pending, d)
    return d


@njit(cache=True)
def put_number(dst, end, st, tree, tree_at, mant, mant_at, x):
    """Code 0 <= x < 2**35: its bit length through ``tree[tree_at:tree_at+64]``, the two
    bits below its leading one through ``mant[mant_at + 4 * length ...]``, the rest direct."""
    nb = bit_length(x)
    small = nb < 4
    st = put_bit(dst, end, st, tree, tree_at + 1, 0 if small else 1)
    bits, at, rest = (2, _SMALL, nb) if small else (5, _LARGE, nb - 4)
    node = 1
    for b in range(bits - 1, -1, -1):
        bit = (rest >> b) & 1
        st = put_bit(dst, end, st, tree, tree_at + at + node, bit)
        node = 2 * node + bit
    if nb >= 2:
        rest = nb - 1  # bits below the leading one
        top = 2 if rest >= 2 else 1
        low_bits = rest - top
        head = (x >> low_bits) & ((1 << top) - 1)
        node = 1
        for b in range(top - 1, -1, -1):
            bit = (head >> b) & 1
            st = put_bit(dst, end, st, mant, mant_at + MANTISSA_CTX * nb + node, bit)
            node = 2 * node + bit
        if low_bits:
            st = put_direct(dst, end, st, x & ((1 << low_bits) - 1), low_bits)
    return st


# -- decoder ------------------------------------------------------------------------------


@njit(cache=True)
def _byte(src, r, end):
    return np.int64(src[r]) if r < end else np.int64(0)


@njit(cache=True)
def dec_start(src, r, end):
    """(code, range, r, ok): ok is False if the stream's first byte is not zero."""
    first = _byte(src, r, end)
    code = np.int64(0)
    for j in range(1, 5):
        code = (code << 8) | _byte(src, r + j, end)
    return code, np.int64(_MASK32), r + 5, first == 0


@njit(cache=True)
def get_bit(src, end, st, probs, i):
    code, rng, r = st
    p = np.int64(probs[i])
    bound = (rng >> PROB_BITS) * p
    bit = np.int64(code >= bound)
    m = -bit  # branch-free, as put_bit
    code -= bound & m
    rng = bound + ((rng - bound - bound) & m)
    up = p + (((1 << PROB_BITS) - p) >> _MOVE)
    probs[i] = up + (((p - (p >> _MOVE)) - up) & m)
    while rng < _TOP:
        rng <<= 8
        code = ((code << 8) | _byte(src, r, end)) & _MASK32
        r += 1
    return (code, rng, r), bit


@njit(cache=True)
def get_direct(src, end, st, nbits):
    code, rng, r = st
    x = np.int64(0)
    for _ in range(nbits):
        rng >>= 1
        bit = 1 if code >= rng else 0
        if bit:
            code -= rng
        x = (x << 1) | bit
        while rng < _TOP:
            rng <<= 8
            code = ((code << 8) | _byte(src, r, end)) & _MASK32
            r += 1
    return (code, rng, r), x


@njit(cache=True)
def get_number(src, end, st, tree, tree_at, mant, mant_at):
    st, large = get_bit(src, end, st, tree, tree_at + 1)
    bits, at, nb = (5, _LARGE, 4) if large else (2, _SMALL, 0)
    node = 1
    for _ in range(bits):
        st, bit = get_bit(src, end, st, tree, tree_at + at + node)
        node = 2 * node + bit
    nb += node - (1 << bits)
    if nb == 0:
        return st, np.int64(0)
    if nb == 1:
        return st, np.int64(1)
    rest = nb - 1
    top = 2 if rest >= 2 else 1
    low_bits = rest - top
    node = 1
    for _ in range(top):
        st, bit = get_bit(src, end, st, mant, mant_at + MANTISSA_CTX * nb + node)
        node = 2 * node + bit
    head = node - (1 << top)
    x = ((np.int64(1) << top) | head) << low_bits
    if low_bits:
        st, tail = get_direct(src, end, st, low_bits)
        x |= tail
    return st, x


# -- the conditioned coding -----------------------------------------------------------

MODEL_EXPONENT = 1  # the frame's model id (a record's pos_k): classes = reference exponent

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


@njit(cache=True)
def _init_class(model, k):
    at = k * _PER_CLASS
    for j in range(_PER_CLASS):
        model[at + j] = PROB_INIT


@njit(cache=True)
def _put_gap(dst, end, st, model, k, x):
    at = k * _PER_CLASS
    return put_number(dst, end, st, model, at + _GAP_TREE, model, at + _GAP_MANT, x)


@njit(cache=True)
def _put_val(dst, end, st, model, k, x):
    at = k * _PER_CLASS
    return put_number(dst, end, st, model, at + _VAL_TREE, model, at + _VAL_MANT, x)


@njit(cache=True)
def _get_gap(src, end, st, model, k):
    at = k * _PER_CLASS
    return get_number(src, end, st, model, at + _GAP_TREE, model, at + _GAP_MANT)


@njit(cache=True)
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
    order,  # int64[n]: the items, thread by thread (kernels.deal)
    bounds,  # int64[threads + 1]
):
    for th in prange(bounds.shape[0] - 1):
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
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
    positions,  # uint32 out (relative to each record's start)
    zval,  # out: coded values, uintN (N >= the element width)
    errors,  # int64 out
    order,  # int64[n]: the records, thread by thread (kernels.deal)
    bounds,  # int64[threads + 1]
):
    """Decode every record's positions and coded values, walking its reference range.

    Never reads outside a record's stream region or reference range, never writes outside
    its output region (at most ``counts[i]`` elements); the caller checks the regions."""
    for th in prange(bounds.shape[0] - 1):
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
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
