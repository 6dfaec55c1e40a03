"""Coding a sparse record conditioned on the reference, with Rice codes (POS_CONDITIONED,
model 2).

The same idea as conditioned.py (whether an element changes depends on the exponent of the
reference element both sides hold, so positions are coded per exponent, in members of that
exponent), coded as cheaply as the default Rice coding instead of through an adaptive range
coder: Rice codes with parameters per class of exponents, chosen by the encoder and sent in
the record's stream. On the simulated AdamW deltas this keeps most of the range coder's gain
(about 0.8x the ordered bound against its 0.70-0.78x, the default coding's 1.0x) for less
than half its time: what is left is mostly the walk over the reference's exponents, which
both sides make to find the positions.

Each exponent value has its own countdown (a decoder walking the range decrements the
countdown of each element's exponent; a change is where it reaches zero): 256 countdowns,
not one per class, because neighbouring elements then rarely share one, and a countdown
stored and loaded again by the next element is a chain through memory that made the walk
four times slower. The parameters are per class, relative to a pivot (the lower median of
the changed elements' exponents): an exponent x is of class
``clip(x - pivot + CLASSES // 2, 0, CLASSES - 1)``.

The stream, a little-endian bit stream (the first bit is bit 0 of the first byte):
- the pivot (8 bits); per class, its gap parameter and its value parameter (5 bits each);
- the lowest and the highest exponent with a change (8 bits each), lo and hi;
- per exponent x from lo to hi: its change count m (``_put_count``: the bit length of m in 6
  bits, then m's bits below its leading one), and, if m > 0, the rank among the range's
  elements of exponent x of its first change (Rice, the gap parameter of x's class);
- then at each changed element in position order: its coded value less one (Rice, the value
  parameter of its class), then, unless it was its exponent's last change, the number of
  elements of that exponent skipped before the next change (Rice, the gap parameter);
- zero bits up to the next byte.
Rice codes are as in kernels.py: q = x >> k zeros, a one, the k low bits; for q >= ESCAPE_Q,
ESCAPE_Q zeros and x in ESCAPE_BITS bits. Everything is bounded before it is decoded: the
counts must add up to the record's changed count (so at most that many are written), the
bits read must stay within the record's bytes and use them all.

It has its own module, not a place in conditioned.py or kernels.py, because numba's cache
keys a kernel by its own file: a change here recompiles only these kernels.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros

MODEL_EXPONENT_RICE = 2  # the frame's model id (a record's pos_k)
EXPONENTS = 256  # countdowns, one per exponent value (the coded types' exponents fit a byte)
CLASSES = 8  # Rice parameter pairs
COUNT_LENGTH_BITS = 6  # an exponent's change count: its bit length, then the bits below
COUNT_LENGTH_MAX = 33  # counts are at most 2**32 (a sparse range's length)
ESCAPE_Q = 24
ESCAPE_BITS = 40  # gaps are below 2**32, coded values below 2**33 (fp32's ordered delta)
PARAM_BITS = 5
PEEK_BITS = 49  # what a read sees at once: seven bytes less the offset within the first
HEADER_BITS = 8 + CLASSES * 2 * PARAM_BITS
# Bits a changed element costs at least: its value and a gap (the one to it from its
# exponent's previous change, or, for the first, its rank coded up front), a bit each.
MIN_BITS_PER_CHANGE = 2
# What a changed element costs the kernels against an element walked, for dealing items to
# threads (kernels.deal): two Rice codes against an exponent lookup and a countdown; rough.
CHANGE_COST_ELEMS = 6

OK = 0
EXHAUSTED = 1
OUT_OF_RANGE = 2
TRAILING = 3
BAD_VALUE = 5
ERRORS = {
    EXHAUSTED: "the conditioned Rice stream ends before all changed elements were decoded",
    OUT_OF_RANGE: "the conditioned Rice stream codes more or fewer changes than the record claims",
    TRAILING: "the conditioned Rice stream has bytes left over after the last element",
    BAD_VALUE: "a decoded value does not fit the element width",
}
_NONE = np.int64(1) << 61  # a countdown that never reaches zero within a range


def work(lengths: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """Each item's cost to either kernel, in elements: what kernels.deal shares out."""
    return lengths + CHANGE_COST_ELEMS * changed


# -- bits ---------------------------------------------------------------------------------
#
# The writer's state is (acc, nacc, d): nacc < 32 pending bits in acc, the next byte at d.
# A write adds at most 31 bits, so acc stays below 2**63 and plain int64 arithmetic holds.
# It writes only below ``end`` and counts on past it, so the caller learns how much room the
# stream needed without a write out of bounds. The reader's state is the offset of its next
# bit in ``src``; each read peeks at the seven bytes from there (unaligned, so no refill
# branch), past ``end`` it reads zeros and counts on, and the kernel refuses a stream it
# overran.


@njit(cache=True)
def _put(dst, end, st, value, nbits):
    acc, nacc, d = st
    acc |= value << nacc
    nacc += nbits
    if nacc >= 32:
        for j in range(4):
            if d + j < end:
                dst[d + j] = (acc >> (8 * j)) & 0xFF
        d += 4
        acc >>= 32
        nacc -= 32
    return acc, nacc, d


@njit(cache=True)
def _put_rice(dst, end, st, x, k):
    q = x >> k
    if q >= ESCAPE_Q:
        st = _put(dst, end, st, np.int64(0), ESCAPE_Q)
        st = _put(dst, end, st, x & 0xFFFFF, 20)
        return _put(dst, end, st, x >> 20, ESCAPE_BITS - 20)
    st = _put(dst, end, st, np.int64(1) << q, q + 1)
    if k:
        st = _put(dst, end, st, x & ((np.int64(1) << k) - 1), k)
    return st


@njit(cache=True)
def _flush(dst, end, st):
    """The offset just past the stream (possibly past ``end``: the room was too small)."""
    acc, nacc, d = st
    while nacc > 0:
        if d < end:
            dst[d] = acc & 0xFF
        d += 1
        acc >>= 8
        nacc -= 8
    return d


@njit(cache=True)
def _peek(src, end, p):
    """At least PEEK_BITS bits of the stream from bit ``p`` on (zeros past ``end``)."""
    q = p >> 3
    if q + 7 <= end:
        w = (
            np.int64(src[q])
            | (np.int64(src[q + 1]) << 8)
            | (np.int64(src[q + 2]) << 16)
            | (np.int64(src[q + 3]) << 24)
            | (np.int64(src[q + 4]) << 32)
            | (np.int64(src[q + 5]) << 40)
            | (np.int64(src[q + 6]) << 48)
        )
    else:
        w = np.int64(0)
        for j in range(7):
            if q + j < end:
                w |= np.int64(src[q + j]) << (8 * j)
    return w >> (p & 7)


@njit(cache=True)
def _get(src, end, p, nbits):
    """(the bit after, the next ``nbits`` <= 32 bits as a number)."""
    return p + nbits, _peek(src, end, p) & ((np.int64(1) << nbits) - 1)


@njit(cache=True)
def _get_rice(src, end, p, k):
    w = _peek(src, end, p)
    low = w & ((1 << ESCAPE_Q) - 1)
    if low == 0:
        p, lo = _get(src, end, p + ESCAPE_Q, 20)
        p, hi = _get(src, end, p, ESCAPE_BITS - 20)
        return p, lo | (hi << 20)
    q = np.int64(trailing_zeros(np.uint64(low)))
    if q + 1 + k > PEEK_BITS:  # the low bits go past what was peeked: peek again
        p, tail = _get(src, end, p + q + 1, k)
        return p, (q << k) | tail
    return p + q + 1 + k, (q << k) | ((w >> (q + 1)) & ((np.int64(1) << k) - 1))


# -- encoder ------------------------------------------------------------------------------


@njit(cache=True)
def _class(x, low):
    """The parameter class of exponent ``x``, ``low`` being the pivot less CLASSES // 2."""
    return min(max(x - low, 0), CLASSES - 1)


@njit(cache=True)
def _rice_cost(x, k):
    q = x >> k
    return q + 1 + k if q < ESCAPE_Q else ESCAPE_Q + ESCAPE_BITS


@njit(cache=True)
def _best_k(xs, sel, count, total):
    """The Rice parameter, of those near the one the mean suggests, that codes the numbers
    ``xs[sel[:count]]`` in the fewest bits (exactly counted)."""
    mean = total // count if count else 0
    k0 = 0
    while k0 < 30 and (np.int64(1) << (k0 + 1)) <= mean:
        k0 += 1
    best_k = 0
    best = np.int64(-1)
    for k in range(max(0, k0 - 2), min(31, k0 + 2) + 1):
        bits = np.int64(0)
        for j in range(count):
            bits += _rice_cost(xs[sel[j]], k)
        if best < 0 or bits < best:
            best, best_k = bits, k
    return best_k


@njit(cache=True)
def _put_count(dst, end, st, x):
    nb = 0
    while nb < COUNT_LENGTH_MAX and (np.int64(1) << nb) <= x:
        nb += 1
    st = _put(dst, end, st, np.int64(nb), COUNT_LENGTH_BITS)
    if nb > 1:
        rest = x & ((np.int64(1) << (nb - 1)) - 1)
        if nb - 1 > 16:
            st = _put(dst, end, st, rest & 0xFFFF, 16)
            return _put(dst, end, st, rest >> 16, nb - 17)
        return _put(dst, end, st, rest, nb - 1)
    return st


@njit(cache=True, boundscheck=False, nogil=True)
def _encode_item(ref, s, n, pos, zval, o, c, shift, mask, dst, d, end):
    """Code one item's c changes (positions pos[o:o+c] relative to s, coded values zval);
    return the stream's end offset (past ``end``: it did not fit, nothing past end written)."""
    # 1) each change's exponent and rank among the elements of its exponent
    count = np.zeros(EXPONENTS, np.int64)
    ex = np.empty(c, np.int64)
    rank = np.empty(c, np.int64)
    j = 0
    nxt = np.int64(pos[o]) if c > 0 else n
    for e in range(n):
        x = (np.int64(ref[s + e]) >> shift) & mask
        if e == nxt:
            ex[j] = x
            rank[j] = count[x]
            j += 1
            nxt = np.int64(pos[o + j]) if j < c else n
        count[x] += 1
    # 2) the pivot: the lower median of the changed elements' exponents
    hist = np.zeros(EXPONENTS, np.int64)
    for j in range(c):
        hist[ex[j]] += 1
    pivot = 0
    seen = hist[0]
    while 2 * seen < c:
        pivot += 1
        seen += hist[pivot]
    low = pivot - CLASSES // 2
    # 3) gaps (members of its exponent skipped before each change), and the changes of
    # each parameter class, for choosing its parameters
    last = np.full(EXPONENTS, -1, np.int64)
    gap = np.empty(c, np.int64)
    cls = np.empty(c, np.int64)
    in_class = np.zeros(CLASSES + 1, np.int64)
    for j in range(c):
        x = ex[j]
        gap[j] = rank[j] - last[x] - 1
        last[x] = rank[j]
        cls[j] = _class(x, low)
        in_class[cls[j] + 1] += 1
    for k in range(CLASSES):
        in_class[k + 1] += in_class[k]
    members = np.empty(c, np.int64)  # the changes of each class, in position order
    fill = in_class[:CLASSES].copy()
    for j in range(c):
        members[fill[cls[j]]] = j
        fill[cls[j]] += 1
    values = np.empty(c, np.int64)
    for j in range(c):
        values[j] = np.int64(zval[o + j]) - 1
    kg = np.zeros(CLASSES, np.int64)
    kv = np.zeros(CLASSES, np.int64)
    for k in range(CLASSES):
        m = in_class[k + 1] - in_class[k]
        if m == 0:
            continue
        sel = members[in_class[k] : in_class[k + 1]]
        gsum = np.int64(0)
        vsum = np.int64(0)
        for q in range(m):
            gsum += gap[sel[q]]
            vsum += values[sel[q]]
        kg[k] = _best_k(gap, sel, m, gsum)
        kv[k] = _best_k(values, sel, m, vsum)
    # 4) each change's successor within its exponent (-1: none), each exponent's first
    succ = np.empty(c, np.int64)
    later = np.full(EXPONENTS, -1, np.int64)
    changes = np.zeros(EXPONENTS, np.int64)
    for j in range(c - 1, -1, -1):
        succ[j] = later[ex[j]]
        later[ex[j]] = j
        changes[ex[j]] += 1
    lo = 0
    while changes[lo] == 0:
        lo += 1
    hi = EXPONENTS - 1
    while changes[hi] == 0:
        hi -= 1
    # 5) the stream
    st = (np.int64(0), np.int64(0), d)
    st = _put(dst, end, st, np.int64(pivot), 8)
    for k in range(CLASSES):
        st = _put(dst, end, st, kg[k], PARAM_BITS)
        st = _put(dst, end, st, kv[k], PARAM_BITS)
    st = _put(dst, end, st, np.int64(lo), 8)
    st = _put(dst, end, st, np.int64(hi), 8)
    for x in range(lo, hi + 1):
        st = _put_count(dst, end, st, changes[x])
        if changes[x]:
            st = _put_rice(dst, end, st, gap[later[x]], kg[_class(x, low)])
    for j in range(c):
        k = cls[j]
        st = _put_rice(dst, end, st, values[j], kv[k])
        if succ[j] >= 0:
            st = _put_rice(dst, end, st, gap[succ[j]], kg[k])
    return _flush(dst, end, st)


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
    """The same arguments and results as conditioned.encode_conditioned, so the encoder
    calls either."""
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


# -- decoder ------------------------------------------------------------------------------


@njit(cache=True)
def _get_count(src, end, st):
    """(state, count), count -1 for a length no count can have."""
    st, nb = _get(src, end, st, COUNT_LENGTH_BITS)
    if nb > COUNT_LENGTH_MAX:
        return st, np.int64(-1)
    if nb <= 1:
        return st, nb
    if nb - 1 > 16:
        st, lo = _get(src, end, st, 16)
        st, hi = _get(src, end, st, nb - 17)
        return st, (np.int64(1) << (nb - 1)) | lo | (hi << 16)
    st, rest = _get(src, end, st, nb - 1)
    return st, (np.int64(1) << (nb - 1)) | rest


@njit(cache=True, boundscheck=False, nogil=True)
def _decode_record(ref, b, n, src, r0, end, c, o, shift, mask, vmax, positions, zval):
    st = 8 * r0  # the reader's state: the next bit's offset in src
    st, pivot = _get(src, end, st, 8)
    low = pivot - CLASSES // 2
    kg = np.zeros(CLASSES, np.int64)
    kv = np.zeros(CLASSES, np.int64)
    for k in range(CLASSES):
        st, g = _get(src, end, st, PARAM_BITS)
        st, v = _get(src, end, st, PARAM_BITS)
        kg[k], kv[k] = g, v
    st, lo = _get(src, end, st, 8)
    st, hi = _get(src, end, st, 8)
    # Per exponent: members to skip before its next change, and changes still to come
    # after that one.
    left = np.full(EXPONENTS, _NONE, np.int64)
    rest = np.zeros(EXPONENTS, np.int64)
    total = np.int64(0)
    for x in range(lo, hi + 1):
        st, m = _get_count(src, end, st)
        if m < 0 or m > c - total:
            return OUT_OF_RANGE
        if m:
            total += m
            st, g = _get_rice(src, end, st, kg[_class(x, low)])
            left[x] = g
            rest[x] = m - 1
    if total != c:
        return OUT_OF_RANGE
    j = 0
    for e in range(n):
        x = (np.int64(ref[b + e]) >> shift) & mask
        g = left[x]
        if g == 0:
            k = _class(x, low)
            st, v = _get_rice(src, end, st, kv[k])
            if v >= vmax:
                return BAD_VALUE
            positions[o + j] = e
            zval[o + j] = np.uint64(v + 1)
            j += 1
            if rest[x] > 0:
                st, g = _get_rice(src, end, st, kg[k])
                rest[x] -= 1
            else:
                g = _NONE
        else:
            g -= 1
        left[x] = g
    used = st - 8 * r0  # bits read
    error = OK
    if used > 8 * (end - r0):
        error = EXHAUSTED
    elif j < c:
        error = OUT_OF_RANGE
    elif (used + 7) // 8 < end - r0:
        error = TRAILING
    return error


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
    """Decode every record's positions and coded values, walking its reference range: the
    same arguments and results as conditioned.decode_conditioned.

    Never reads outside a record's stream region or reference range, never writes outside
    its output region (at most ``counts[i]`` elements: the class counts must add up to it,
    and a class stops at its count); the caller checks the regions."""
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
