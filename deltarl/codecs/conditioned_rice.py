"""Coding a sparse record conditioned on the reference, with Rice codes (POS_CONDITIONED,
model 2), and model 3's kernels (conditioned_huffman.py describes that model and its stream).

The same idea as conditioned.py (whether an element changes depends on the exponent of the
reference element both sides hold, so positions are coded per exponent, in members of that
exponent), coded as cheaply as the default Rice coding instead of through an adaptive range
coder: Rice codes with parameters per class of exponents, chosen by the encoder and sent in
the record's stream. On the simulated AdamW deltas this keeps most of the range coder's gain
(about 0.8x the ordered bound against its 0.70-0.78x, the default coding's 1.0x) for less
than half its time: what is left is mostly the walk over the reference's exponents, which
both sides make to find the positions, and the reading of each change.

Each exponent value has its own count of members (a change's position is coded as the
members of its exponent skipped since the last one): 256 of them, not one per class,
because a count per class would code the gaps over more elements. The walks take 64
elements at a time, with a mask of each exponent's members in the block ("64 elements at a
time" below). The parameters are per class, relative to a pivot (the lower median of
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
keys a kernel by its own file: a change here recompiles only these kernels. Model 3's kernels
are here too, for the same reason: they share this bit stream and the encoder's walk, and a
kernel in another file calling these helpers would keep stale machine code when they change.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

MODEL_EXPONENT_RICE = 2  # the frame's model id (a record's pos_k)
EXPONENTS = 256  # member counts, one per exponent value (the coded types' exponents fit a byte)
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
# threads (kernels.deal): two Rice codes and a select against an element's share of its
# block's masks; rough.
CHANGE_COST_ELEMS = 6

# Model 3 (values coded per exponent, by a Rice code or a Huffman code over a window):
MODEL_EXPONENT_HUFFMAN = 3
HEADER_BITS_HUFFMAN = 8 + CLASSES * PARAM_BITS
# A change of an inverted exponent costs no position bits, its value a bit at least.
MIN_BITS_PER_CHANGE_HUFFMAN = 1
KIND_RICE = 0  # an exponent's value code: Rice, its parameter in PARAM_BITS
KIND_HUFFMAN = 1  # or Huffman over WINDOW values from a base, and an escape
WINDOW = 16
ESCAPE = WINDOW  # the symbol after which a value outside the window follows (_put_count)
SYMBOLS = WINDOW + 1
LENGTH_BITS = 4  # a symbol's code length in the table (0: not used)
LENGTH_MAX = 11  # codes are at most this long, so a table lookup decodes one
SAMPLE = 64  # an exponent's first values the encoder places its window by

OK = 0
EXHAUSTED = 1
OUT_OF_RANGE = 2
TRAILING = 3
BAD_VALUE = 5
BAD_TABLE = 6
ERRORS = {
    EXHAUSTED: "the conditioned Rice stream ends before all changed elements were decoded",
    OUT_OF_RANGE: "the conditioned Rice stream codes more or fewer changes than the record claims",
    TRAILING: "the conditioned Rice stream has bytes left over after the last element",
    BAD_VALUE: "a decoded value does not fit the element width",
    BAD_TABLE: "a value code table of the conditioned stream is not a prefix code, "
    "or the stream holds a code it lacks",
}
_NONE = np.int64(1) << 61  # a countdown that never reaches zero within a range
_U0 = np.uint64(0)
_U1 = np.uint64(1)
WALK_SPAN = 4096  # elements whose exponents the decoders' walk takes out at a time (x 64)


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


# -- 64 elements at a time ----------------------------------------------------------------
#
# Both sides walk a range by its reference's exponents. Per element (load the exponent, then
# a count or a countdown of it) that costs about a nanosecond an element, most of a
# conditioned encode or apply; so the walks go 64 elements at a time: the exponents of a
# span as bytes (one vectorised pass), then per exponent that matters a 64-bit mask of its
# members in the block (one vector compare), counted by popcount and searched by select.


def _eq_mask64_typer(typingctx: Any, arr: Any, off: Any, val: Any) -> Any:  # noqa: ANN401
    if not (
        isinstance(arr, types.Array)
        and arr.dtype == types.uint8
        and isinstance(off, types.Integer)
        and isinstance(val, types.Integer)
    ):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ANN401
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        x = context.cast(builder, args[2], signature.args[2], types.uint8)
        lanes = ir.VectorType(ir.IntType(8), 64)
        ptr = builder.bitcast(builder.gep(ary.data, [i]), lanes.as_pointer())
        block = builder.load(ptr, align=1)
        one = builder.insert_element(
            ir.Constant(lanes, ir.Undefined), x, ir.Constant(ir.IntType(32), 0)
        )
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)
        splat = builder.shuffle_vector(one, ir.Constant(lanes, ir.Undefined), zeros)
        return builder.bitcast(builder.icmp_unsigned("==", block, splat), ir.IntType(64))

    return types.uint64(arr, off, val), codegen


# ``(bytes, i, x)``: the 64-bit mask of which of bytes[i : i + 64] equal x (bit t: byte
# i + t), in one vector compare (a loop that ORs each comparison in at its bit is not one
# to the compiler). The caller keeps i + 64 within the array.
_eq_mask64 = intrinsic(_eq_mask64_typer)


def _popcount_typer(typingctx: Any, m: Any) -> Any:  # noqa: ANN401
    if m != types.uint64:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ANN401
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64]), "llvm.ctpop.i64"
        )
        return builder.call(fn, [args[0]])

    return types.int64(m), codegen


_popcount = intrinsic(_popcount_typer)  # the set bits of a uint64, as an int64

# _IN_BYTE[8 * v + k]: the position of the k-th set bit of the byte v
_IN_BYTE = np.zeros(256 * 8, np.uint8)
for _v in range(256):
    _bits = [i for i in range(8) if _v >> i & 1]
    _IN_BYTE[8 * _v : 8 * _v + len(_bits)] = _bits


@njit(cache=True, inline="always")
def _select(m, k):
    """The position of the k-th (from 0) set bit of m, k below m's popcount: the byte that
    holds it from the bytes' running popcounts (all eight at once in one word), then the bit
    from a table. No loop and no branch: the walk selects at every change."""
    s = m - ((m >> np.uint64(1)) & np.uint64(0x5555555555555555))
    s = (s & np.uint64(0x3333333333333333)) + ((s >> np.uint64(2)) & np.uint64(0x3333333333333333))
    s = (s + (s >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    ones = np.uint64(0x0101010101010101)
    high = np.uint64(0x8080808080808080)
    below = s * ones  # byte i: the set bits in bytes 0 to i (at most 64, so no carry)
    # the bytes whose running count is at most k come first: their number is k's byte
    ks = np.uint64(k) * ones
    sh = np.uint64(_popcount(((ks | high) - below) & high) * 8)
    before = ((below << np.uint64(8)) >> sh) & np.uint64(0xFF)
    byte = (m >> sh) & np.uint64(0xFF)
    return np.int64(sh) + np.int64(_IN_BYTE[(byte << np.uint64(3)) + np.uint64(k) - before])


@njit(cache=True, boundscheck=False, nogil=True)
def _exponent_bytes(ref, b, span, shift, mask, ex):
    """ex[:span] = the exponents of ref[b : b + span], as bytes."""
    r = ref[b : b + span]
    e = ex[:span]
    sh = ref.dtype.type(shift)
    mk = ref.dtype.type(mask)
    for t in range(span):  # vectorised: a slice's index is known to be in range
        e[t] = (r[t] >> sh) & mk


@njit(cache=True)
def _tail_mask(left):
    """The bits of a block's elements that are in the range, ``left`` of them from the
    block's start on: the bytes past the range's end are stale."""
    if left >= 64:
        return np.uint64(0xFFFFFFFFFFFFFFFF)
    return (_U1 << np.uint64(left)) - _U1


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
def _rice_best(xs, start, count):
    """(parameter, bits) of the Rice code, of the five around the one the mean suggests,
    that codes ``xs[start : start + count]`` in the fewest bits (exactly counted; the lowest
    on ties). A contiguous run, a pass per parameter: the compiler vectorises it (one pass
    for all five, accumulating in an array, was slower)."""
    total = np.int64(0)
    for q in range(start, start + count):
        total += xs[q]
    mean = total // count if count else 0
    k0 = 0
    while k0 < 30 and (np.int64(1) << (k0 + 1)) <= mean:
        k0 += 1
    best_k = 0
    best = np.int64(-1)
    for k in range(max(0, k0 - 2), min(31, k0 + 2) + 1):
        bits = np.int64(0)
        for q in range(start, start + count):
            bits += _rice_cost(xs[q], k)
        if best < 0 or bits < best:
            best, best_k = bits, k
    return best_k, max(best, 0)


@njit(cache=True)
def _count_length(x):
    """The bit length _put_count writes for ``x`` (at most COUNT_LENGTH_MAX)."""
    nb = 0
    while nb < COUNT_LENGTH_MAX and (np.int64(1) << nb) <= x:
        nb += 1
    return nb


@njit(cache=True)
def _put_count(dst, end, st, x):
    nb = _count_length(x)
    st = _put(dst, end, st, np.int64(nb), COUNT_LENGTH_BITS)
    if nb > 1:
        rest = x & ((np.int64(1) << (nb - 1)) - 1)
        if nb - 1 > 16:
            st = _put(dst, end, st, rest & 0xFFFF, 16)
            return _put(dst, end, st, rest >> 16, nb - 17)
        return _put(dst, end, st, rest, nb - 1)
    return st


@njit(cache=True, boundscheck=False, nogil=True)
def _walk(ref, s, n, pos, o, c, shift, mask):
    """(each change's reference exponent, its rank among the range's elements of that
    exponent, each exponent's element count, for the exponents with a change: 0 for the
    others): the encoders' one walk over the reference.

    Per block of 64 elements, a mask of each changed exponent's members: their count is its
    popcount, a change's rank the members below it in the block plus those before the
    block. Measured on one core against counting the elements between two changes into
    four tables (60 items of 1M bf16 elements of the simulated 98M delta, the same results,
    two runs): step 1 (3.4% changed) 0.88 -> 0.54-0.55 ns an element, step 6 (1.4%) 0.59 ->
    0.52-0.53."""
    ex = np.empty(c, np.int64)
    rank = np.empty(c, np.int64)
    # the changed exponents, each in a slot a: xs[a]; slot[x]
    xs = np.empty(EXPONENTS, np.uint8)
    slot = np.full(EXPONENTS, -1, np.int64)
    na = 0
    for j in range(c):
        x = (np.int64(ref[s + np.int64(pos[o + j])]) >> shift) & mask
        ex[j] = x
        if slot[x] < 0:
            slot[x] = na
            xs[na] = x
            na += 1
    before = np.zeros(EXPONENTS, np.int64)  # slot a's members before the current block
    ms = np.zeros(EXPONENTS, np.uint64)
    span_bytes = np.zeros(WALK_SPAN, np.uint8)
    j = 0
    for s0 in range(0, n, WALK_SPAN):
        span = min(WALK_SPAN, n - s0)
        _exponent_bytes(ref, s + s0, span, shift, mask, span_bytes)
        for b0 in range(0, span, 64):
            valid = _tail_mask(span - b0)
            for a in range(na):
                ms[a] = _eq_mask64(span_bytes, b0, xs[a]) & valid
            block_end = s0 + b0 + 64
            while j < c and np.int64(pos[o + j]) < block_end:
                p = np.uint64(np.int64(pos[o + j]) - s0 - b0)
                a = slot[ex[j]]
                rank[j] = before[a] + _popcount(ms[a] & ((_U1 << p) - _U1))
                j += 1
            for a in range(na):
                before[a] += _popcount(ms[a])
    total = np.zeros(EXPONENTS, np.int64)
    for a in range(na):
        total[xs[a]] = before[a]
    return ex, rank, total


@njit(cache=True, boundscheck=False, nogil=True)
def _pivot(ex, c):
    """The lower median of the changed elements' exponents."""
    hist = np.zeros(EXPONENTS, np.int64)
    for j in range(c):
        hist[ex[j]] += 1
    pivot = 0
    seen = hist[0]
    while 2 * seen < c:
        pivot += 1
        seen += hist[pivot]
    return pivot


@njit(cache=True, boundscheck=False, nogil=True)
def _exponent_gaps(ex, rank, c):
    """Each change's gap: members of its exponent skipped since its exponent's previous
    change, or since the range's start."""
    last = np.full(EXPONENTS, -1, np.int64)
    gap = np.empty(c, np.int64)
    for j in range(c):
        x = ex[j]
        gap[j] = rank[j] - last[x] - 1
        last[x] = rank[j]
    return gap


@njit(cache=True, boundscheck=False, nogil=True)
def _gaps(ex, rank, c, low):
    """Each change's gap (members of its exponent skipped since its exponent's previous
    change, or since the range's start), its parameter class, and the changes of each class
    in position order (members[in_class[k]:in_class[k + 1]])."""
    gap = _exponent_gaps(ex, rank, c)
    cls = np.empty(c, np.int64)
    in_class = np.zeros(CLASSES + 1, np.int64)
    for j in range(c):
        cls[j] = _class(ex[j], low)
        in_class[cls[j] + 1] += 1
    for k in range(CLASSES):
        in_class[k + 1] += in_class[k]
    members = np.empty(c, np.int64)
    fill = in_class[:CLASSES].copy()
    for j in range(c):
        members[fill[cls[j]]] = j
        fill[cls[j]] += 1
    return gap, cls, in_class, members


@njit(cache=True, boundscheck=False, nogil=True)
def _successors(ex, c):
    """Each change's next change of its exponent (-1: none), each exponent's first change
    and change count, and the lowest and highest exponent with a change."""
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
    return succ, later, changes, lo, hi


@njit(cache=True, boundscheck=False, nogil=True)
def _encode_item(ref, s, n, pos, zval, o, c, shift, mask, dst, d, end):
    """Code one item's c changes (positions pos[o:o+c] relative to s, coded values zval);
    return the stream's end offset (past ``end``: it did not fit, nothing past end written)."""
    # 1) each change's exponent and rank among the elements of its exponent
    ex, rank, _ = _walk(ref, s, n, pos, o, c, shift, mask)
    # 2) the pivot: the lower median of the changed elements' exponents
    pivot = _pivot(ex, c)
    low = pivot - CLASSES // 2
    # 3) gaps (members of its exponent skipped before each change), and the changes of
    # each parameter class, for choosing its parameters
    gap, cls, in_class, members = _gaps(ex, rank, c, low)
    values = np.empty(c, np.int64)
    for j in range(c):
        values[j] = np.int64(zval[o + j]) - 1
    # each class's gaps and values as contiguous runs, its parameters chosen over them
    gc = np.empty(c, np.int64)
    vc = np.empty(c, np.int64)
    for q in range(c):
        gc[q] = gap[members[q]]
        vc[q] = values[members[q]]
    kg = np.zeros(CLASSES, np.int64)
    kv = np.zeros(CLASSES, np.int64)
    for k in range(CLASSES):
        m = in_class[k + 1] - in_class[k]
        if m:
            kg[k], _ = _rice_best(gc, in_class[k], m)
            kv[k], _ = _rice_best(vc, in_class[k], m)
    # 4) each change's successor within its exponent (-1: none), each exponent's first
    succ, later, changes, lo, hi = _successors(ex, c)
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
def encode_records(
    model,  # MODEL_EXPONENT_RICE or MODEL_EXPONENT_HUFFMAN
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
    """Model 2's or model 3's encode_conditioned (the encoder calls them by those names,
    below and in conditioned_huffman.py): after ``model``, the same arguments and results as
    conditioned.encode_conditioned."""
    for th in prange(bounds.shape[0] - 1):
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
            if counts[i] == 0:
                sizes[i] = 0
                continue
            d0 = cap_off[i]
            if model == MODEL_EXPONENT_HUFFMAN:
                sizes[i] = (
                    _encode_item_huffman(
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
                continue
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


@njit(cache=True)
def _end_error(st, r0, end, j, c):
    """A record's walk ended with the reader at bit ``st`` and ``j`` of its ``c`` changes
    decoded: OK if the stream (bytes r0 to end) holds exactly that, else why not."""
    used = st - 8 * r0  # bits read
    if used > 8 * (end - r0):
        return EXHAUSTED
    if j < c:
        return OUT_OF_RANGE
    if (used + 7) // 8 < end - r0:
        return TRAILING
    return OK


# -- the decoders' walk -------------------------------------------------------------------
#
# A decoder finds the changes by walking its range: an exponent's next change is its
# left[x]-th member from here. Per block, the exponents with changes to come each get their
# mask; where one's popcount exceeds left[x], its next change is in the block, at the
# left[x]-th set bit. The changes of a block are visited in position order through a mask
# of their positions, so the stream is read in the same order as by a per-element walk,
# and the streams are unchanged. Measured on one core against that walk (a countdown per
# exponent, decremented at each element; 60 records of 1M bf16 elements of the simulated
# 98M delta, decode_records on one thread, the same outputs, runs by turns): model 2
# 1.20-1.44x faster at steps 1 and 6 (3.4% and 1.4% changed), model 3 1.11-1.31x, and
# 2.1-2.2x where 0.01% change; what is left is mostly each change's reading and the
# branches it mispredicts (a branch-free select of its next change was slower, 0.91-0.97x).


@njit(cache=True, boundscheck=False, nogil=True)
def _walk_changes(
    ref, b, n, src, r0, end, st, c, o, shift, mask, vmax, positions, zval, lo, hi, codes
):
    """Walk the range ref[b : b + n] and decode its c changes from bit ``st`` on (positions
    and coded values to positions / zval from o), given each exponent's state from the
    record's head in ``codes`` (model 3's, as _decode_record_huffman reads it; model 2's is
    model 3's with no exponent inverted and every value Rice coded): both models' walk.
    Returns OK or why not, as ``_end_error`` and model 3's checks of inverted exponents."""
    (left, rest, inverted, run, ugaps, up, u_end, todo, kind, kv, kg, base, table, toff, tbits) = (
        codes
    )
    # slot a: a counted exponent xs[a] (not inverted, changes still to come); lf[a]: its
    # members to skip before its next change, counted from the current block's start
    xs = np.empty(EXPONENTS, np.uint8)
    lf = np.empty(EXPONENTS, np.int64)
    slot = np.zeros(EXPONENTS, np.int64)
    na = 0
    # the inverted exponents (model 3): every member is a change but those at run[x] (member
    # index from the current block's start of its next unchanged member), ugaps[up[x]], ...
    inv = np.empty(EXPONENTS, np.uint8)
    ni = 0
    for x in range(lo, hi + 1):
        if inverted[x]:
            inv[ni] = x
            ni += 1
        elif left[x] != _NONE:
            xs[na] = x
            lf[na] = left[x]
            slot[x] = na
            na += 1
    ex = np.zeros(WALK_SPAN, np.uint8)
    ms = np.zeros(EXPONENTS, np.uint64)
    pc = np.zeros(EXPONENTS, np.int64)
    due = np.zeros(EXPONENTS // 64, np.uint64)  # the slots with a change in the block
    j = 0
    s0 = 0
    while s0 < n and na + ni > 0:
        span = min(WALK_SPAN, n - s0)
        _exponent_bytes(ref, b + s0, span, shift, mask, ex)
        b0 = 0
        while b0 < span and na + ni > 0:
            valid = _tail_mask(span - b0)
            for a in range(na):
                ms[a] = _eq_mask64(ex, b0, xs[a]) & valid
            for w in range(EXPONENTS // 64):
                due[w] = _U0
            for a in range(na):
                pc[a] = _popcount(ms[a])
                due[a >> 6] |= np.uint64(lf[a] < pc[a]) << np.uint64(a & 63)
            fire = _U0  # the block's changes known so far (bit t: element b0 + t)
            for w in range((na + 63) >> 6):
                q = due[w]
                while q != _U0:
                    a = np.int64(trailing_zeros(q)) + 64 * w
                    q &= q - _U1
                    fire |= _U1 << np.uint64(_select(ms[a], lf[a]))
            for i in range(ni):
                x = inv[i]
                m = _eq_mask64(ex, b0, x) & valid
                count = _popcount(m)
                kept = _U0
                t = run[x]
                while t < count:
                    kept |= _U1 << np.uint64(_select(m, t))
                    q = up[x]
                    if q < u_end[x]:
                        t += 1 + ugaps[q]
                        up[x] = q + 1
                    else:
                        t = _NONE
                run[x] = t - count if t != _NONE else _NONE
                fire |= m & ~kept
            spent = False
            while fire != _U0:
                p = np.uint64(trailing_zeros(fire))
                fire &= fire - _U1
                x = np.int64(ex[np.uint64(b0) + p])
                if inverted[x]:
                    if todo[x] == 0:
                        return OUT_OF_RANGE
                    todo[x] -= 1
                if kind[x] == KIND_RICE:
                    st, v = _get_rice(src, end, st, kv[x])
                else:
                    entry = table[toff[x] + (_peek(src, end, st) & ((np.int64(1) << tbits[x]) - 1))]
                    if entry == 0:
                        return BAD_TABLE
                    st += entry >> 5
                    sym = entry & 31
                    if sym == ESCAPE:
                        st, v = _get_count(src, end, st)
                        if v < 0:
                            return BAD_VALUE
                    else:
                        v = base[x] + sym
                if v >= vmax:
                    return BAD_VALUE
                positions[o + j] = s0 + b0 + np.int64(p)
                zval[o + j] = np.uint64(v + 1)
                j += 1
                if inverted[x]:
                    continue
                a = slot[x]
                if rest[x] > 0:
                    st, g = _get_rice(src, end, st, kg[x])
                    rest[x] -= 1
                    # members of x up to this one, then g skipped: its next change's index
                    t = _popcount(ms[a] & ((_U1 << p) - _U1)) + 1 + g
                    lf[a] = t
                    if t < pc[a]:
                        fire |= _U1 << np.uint64(_select(ms[a], t))
                else:
                    lf[a] = _NONE
                    spent = True
            a = 0
            while spent and a < na:  # drop the exponents whose last change was met
                if lf[a] == _NONE:
                    na -= 1
                    xs[a], lf[a], pc[a] = xs[na], lf[na], pc[na]
                    slot[xs[a]] = a
                else:
                    a += 1
            for a in range(na):  # no branch, so vectorised: why the dropping is apart
                lf[a] -= pc[a]
            b0 += 64
        s0 += WALK_SPAN
    error = _end_error(st, r0, end, j, c)
    for i in range(ni):
        # an inverted exponent's unchanged members all met (the last one leaves run at
        # _NONE): none was claimed past the range's end
        x = inv[i]
        if error == OK and (up[x] < u_end[x] or run[x] != _NONE):
            error = OUT_OF_RANGE
    return error


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
    # model 3's state with no exponent inverted and every value Rice coded, the parameters
    # per exponent (nothing writes the zeros: only an inverted exponent's state is written)
    kvx = np.zeros(EXPONENTS, np.int64)
    kgx = np.zeros(EXPONENTS, np.int64)
    for x in range(lo, hi + 1):
        kvx[x] = kv[_class(x, low)]
        kgx[x] = kg[_class(x, low)]
    zeros = np.zeros(EXPONENTS, np.int64)  # no exponent inverted, every value Rice coded
    inverted = run = up = u_end = todo = kind = base = toff = tbits = zeros
    ugaps = table = np.zeros(1, np.int64)
    codes = (
        left,
        rest,
        inverted,
        run,
        ugaps,
        up,
        u_end,
        todo,
        kind,
        kvx,
        kgx,
        base,
        table,
        toff,
        tbits,
    )
    return _walk_changes(
        ref, b, n, src, r0, end, st, c, o, shift, mask, vmax, positions, zval, lo, hi, codes
    )


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def decode_records(
    model,  # MODEL_EXPONENT_RICE or MODEL_EXPONENT_HUFFMAN
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
            if model == MODEL_EXPONENT_HUFFMAN:
                errors[i] = _decode_record_huffman(
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
                continue
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


# -- model 3: values per exponent, Rice or Huffman ----------------------------------------
#
# On real RL deltas a changed element's value is nearly fixed by its exponent (the step is
# about the learning rate, so its size in ulps doubles per exponent down): per exponent a
# few values and their signs, which a Huffman code over a window of values codes in about
# two bits where model 2's Rice code per class of exponents spends 2.5 to 4.


@njit(cache=True)
def _count_bits(x):
    """Bits _put_count spends on ``x``."""
    return COUNT_LENGTH_BITS + max(_count_length(x) - 1, 0)


@njit(cache=True)
def _huffman_lengths(counts):
    """Code lengths (0: unused) of a Huffman code for the symbols' counts, at most
    LENGTH_MAX bits: where the plain code is longer, the counts are halved (kept nonzero)
    and the code built again, which flattens it."""
    w = counts.copy()
    lengths = np.zeros(SYMBOLS, np.int64)
    used = 0
    for s in range(SYMBOLS):
        if w[s] > 0:
            used += 1
            lengths[s] = 1
    if used <= 1:
        return lengths
    weight = np.zeros(2 * SYMBOLS, np.int64)
    parent = np.full(2 * SYMBOLS, -1, np.int64)
    alive = np.zeros(2 * SYMBOLS, np.bool_)
    while True:
        parent[:] = -1
        alive[:] = False
        for s in range(SYMBOLS):
            weight[s] = w[s]
            alive[s] = w[s] > 0
        nodes = SYMBOLS
        for _ in range(used - 1):
            pair = np.empty(2, np.int64)
            for h in range(2):  # the two lightest live nodes, the lower index first on ties
                best = -1
                for q in range(nodes):
                    if alive[q] and (best < 0 or weight[q] < weight[best]):
                        best = q
                alive[best] = False
                pair[h] = best
            weight[nodes] = weight[pair[0]] + weight[pair[1]]
            parent[pair[0]] = nodes
            parent[pair[1]] = nodes
            alive[nodes] = True
            nodes += 1
        longest = 0
        for s in range(SYMBOLS):
            if w[s] > 0:
                depth = 0
                q = s
                while parent[q] >= 0:
                    depth += 1
                    q = parent[q]
                lengths[s] = depth
                longest = max(longest, depth)
        if longest <= LENGTH_MAX:
            return lengths
        for s in range(SYMBOLS):
            if w[s] > 0:
                w[s] = (w[s] + 1) >> 1


@njit(cache=True)
def _canonical_codes(lengths, codes):
    """The canonical code of each symbol (shorter codes first, then by symbol), its bits
    reversed so that the code's first bit is the stream's next; False if the lengths
    oversubscribe the code space (Kraft sum over 1), which no prefix code has."""
    code = np.int64(0)
    for length in range(1, LENGTH_MAX + 1):
        for s in range(SYMBOLS):
            if lengths[s] == length:
                if code >= (np.int64(1) << length):
                    return False
                r = np.int64(0)
                for b in range(length):
                    r |= ((code >> b) & 1) << (length - 1 - b)
                codes[s] = r
                code += 1
        code <<= 1
    return True


@njit(cache=True)
def _window(vx, start, count):
    """The start of the WINDOW values that hold the most of the first SAMPLE of
    ``vx[start : start + count]`` (the lowest such start): a guess of where an exponent's
    values lie, from a sample so that no exponent's values are sorted whole."""
    ns = min(count, SAMPLE)
    sample = vx[start : start + ns].copy()
    sample.sort()
    base = sample[0]
    most = 0
    hi = 0
    for q in range(ns):
        while hi < ns and sample[hi] < sample[q] + WINDOW:
            hi += 1
        if hi - q > most:
            most, base = hi - q, sample[q]
    return base


@njit(cache=True)
def _value_code(vx, start, m, lengths, codes):
    """Choose an exponent's value code for its values ``vx[start : start + m]``: (kind,
    Rice parameter, window base); a Huffman code's lengths and codes go into ``lengths`` and
    ``codes``. Whichever is smaller, its table counted."""
    k, rice = _rice_best(vx, start, m)
    rice += PARAM_BITS
    b = _window(vx, start, m)
    counts = np.zeros(SYMBOLS, np.int64)
    huffman = _count_bits(b) + SYMBOLS * LENGTH_BITS
    for q in range(start, start + m):
        v = vx[q]
        if b <= v < b + WINDOW:
            counts[v - b] += 1
        else:
            counts[ESCAPE] += 1
            huffman += _count_bits(v)
    ls = _huffman_lengths(counts)
    for t in range(SYMBOLS):
        huffman += counts[t] * ls[t]
    if huffman >= rice:
        return KIND_RICE, k, np.int64(0)
    lengths[:] = ls
    _canonical_codes(ls, codes)
    return KIND_HUFFMAN, np.int64(0), b


@njit(cache=True)
def _unchanged_gaps(rx, start, m, members, out, at):
    """An exponent's unchanged members as gaps, into ``out[at:]``: before each, the number
    of its changes since the previous one (or the range's start); ``rx[start : start + m]``
    are the ranks of its changes among its ``members`` members, ascending. Returns how many."""
    u = 0
    run = np.int64(0)
    q = start
    for r in range(members):
        if q < start + m and rx[q] == r:
            run += 1
            q += 1
        else:
            out[at + u] = run
            u += 1
            run = 0
    return u


@njit(cache=True, boundscheck=False, nogil=True)
def _encode_item_huffman(ref, s, n, pos, zval, o, c, shift, mask, dst, d, end):
    """Model 3's _encode_item: the same arguments and result."""
    ex, rank, members = _walk(ref, s, n, pos, o, c, shift, mask)
    low = _pivot(ex, c) - CLASSES // 2
    gap = _exponent_gaps(ex, rank, c)
    succ, later, changes, lo, hi = _successors(ex, c)
    # each exponent's changes, in position order, as one contiguous run of gaps, ranks and
    # values (exponents in order, so a class's exponents' runs are contiguous too): every
    # choice below is a pass over runs
    in_exp = np.zeros(EXPONENTS + 1, np.int64)
    for x in range(EXPONENTS):
        in_exp[x + 1] = in_exp[x] + changes[x]
    gx = np.empty(c, np.int64)
    rx = np.empty(c, np.int64)
    vx = np.empty(c, np.int64)
    values = np.empty(c, np.int64)
    fill = in_exp[:EXPONENTS].copy()
    for j in range(c):
        values[j] = np.int64(zval[o + j]) - 1
        q = fill[ex[j]]
        gx[q], rx[q], vx[q] = gap[j], rank[j], values[j]
        fill[ex[j]] = q + 1
    # 1) positions: an exponent with more changed members than not is coded inverted
    # (its unchanged members' gaps, up front, with a parameter of its own) where smaller
    inverted = np.zeros(EXPONENTS, np.int64)
    kinv = np.zeros(EXPONENTS, np.int64)
    u_off = np.zeros(EXPONENTS + 1, np.int64)
    ugaps = np.empty(n - c, np.int64)
    used = 0
    for x in range(lo, hi + 1):
        u_off[x] = used
        m = changes[x]
        if m == 0 or 2 * m <= members[x]:
            continue
        _, plain = _rice_best(gx, in_exp[x], m)
        u = _unchanged_gaps(rx, in_exp[x], m, members[x], ugaps, used)
        ku, ubits = _rice_best(ugaps, used, u)
        if _count_bits(u) + PARAM_BITS + ubits < plain:
            inverted[x] = 1
            kinv[x] = ku
            used += u
    for x in range(hi + 1, EXPONENTS + 1):
        u_off[x] = used
    # the gap parameters per class, from the changes of exponents not inverted
    kg = np.zeros(CLASSES, np.int64)
    kept = np.empty(c, np.int64)
    for k in range(CLASSES):
        m = 0
        for x in range(lo, hi + 1):
            if _class(x, low) == k and not inverted[x]:
                for q in range(in_exp[x], in_exp[x + 1]):
                    kept[m] = gx[q]
                    m += 1
        if m:
            kg[k], _ = _rice_best(kept, 0, m)
    # 2) values: a code per exponent
    kind = np.zeros(EXPONENTS, np.int64)
    kv = np.zeros(EXPONENTS, np.int64)
    base = np.zeros(EXPONENTS, np.int64)
    lengths = np.zeros((EXPONENTS, SYMBOLS), np.int64)
    codes = np.zeros((EXPONENTS, SYMBOLS), np.int64)
    for x in range(lo, hi + 1):
        if changes[x]:
            h, k, b = _value_code(vx, in_exp[x], changes[x], lengths[x], codes[x])
            kind[x], kv[x], base[x] = h, k, b
    # 3) the stream
    st = (np.int64(0), np.int64(0), d)
    st = _put(dst, end, st, np.int64(low + CLASSES // 2), 8)
    for k in range(CLASSES):
        st = _put(dst, end, st, kg[k], PARAM_BITS)
    st = _put(dst, end, st, np.int64(lo), 8)
    st = _put(dst, end, st, np.int64(hi), 8)
    for x in range(lo, hi + 1):
        st = _put_count(dst, end, st, changes[x])
        if changes[x] == 0:
            continue
        st = _put(dst, end, st, inverted[x], 1)
        if inverted[x]:
            st = _put_count(dst, end, st, u_off[x + 1] - u_off[x])
            st = _put(dst, end, st, kinv[x], PARAM_BITS)
            for q in range(u_off[x], u_off[x + 1]):
                st = _put_rice(dst, end, st, ugaps[q], kinv[x])
        else:
            st = _put_rice(dst, end, st, gap[later[x]], kg[_class(x, low)])
        st = _put(dst, end, st, kind[x], 1)
        if kind[x] == KIND_RICE:
            st = _put(dst, end, st, kv[x], PARAM_BITS)
        else:
            st = _put_count(dst, end, st, base[x])
            for t in range(SYMBOLS):
                st = _put(dst, end, st, lengths[x, t], LENGTH_BITS)
    for j in range(c):
        x = ex[j]
        v = values[j]
        if kind[x] == KIND_RICE:
            st = _put_rice(dst, end, st, v, kv[x])
        elif base[x] <= v < base[x] + WINDOW:
            t = v - base[x]
            st = _put(dst, end, st, codes[x, t], lengths[x, t])
        else:
            st = _put(dst, end, st, codes[x, ESCAPE], lengths[x, ESCAPE])
            st = _put_count(dst, end, st, v)
        if succ[j] >= 0 and not inverted[x]:
            st = _put_rice(dst, end, st, gap[succ[j]], kg[_class(x, low)])
    return _flush(dst, end, st)


@njit(cache=True, boundscheck=False, nogil=True)
def _decode_record_huffman(  # noqa: PLR0911 - a kernel cannot raise: each refusal returns its code
    ref, b, n, src, r0, end, c, o, shift, mask, vmax, positions, zval
):
    st = 8 * r0
    st, pivot = _get(src, end, st, 8)
    low = pivot - CLASSES // 2
    kg = np.zeros(CLASSES, np.int64)
    for k in range(CLASSES):
        st, g = _get(src, end, st, PARAM_BITS)
        kg[k] = g
    st, lo = _get(src, end, st, 8)
    st, hi = _get(src, end, st, 8)
    # Per exponent, as model 2: members to skip before its next change (0 always for an
    # inverted exponent, whose every member the walk looks at) and changes after that one;
    # for an inverted one: its changes before its next unchanged member (run), the next of
    # its unchanged members' gaps (ugaps[up[x] : u_end[x]]), and its changes still to come.
    left = np.full(EXPONENTS, _NONE, np.int64)
    rest = np.zeros(EXPONENTS, np.int64)
    inverted = np.zeros(EXPONENTS, np.int64)
    run = np.zeros(EXPONENTS, np.int64)
    up = np.zeros(EXPONENTS, np.int64)
    u_end = np.zeros(EXPONENTS, np.int64)
    todo = np.zeros(EXPONENTS, np.int64)
    ugaps = np.empty(0, np.int64)
    kind = np.zeros(EXPONENTS, np.int64)
    kv = np.zeros(EXPONENTS, np.int64)
    base = np.zeros(EXPONENTS, np.int64)
    # the Huffman tables: exponent x's is table[toff[x] : toff[x] + 2**tbits[x]], indexed by
    # the stream's next tbits[x] bits; an entry is symbol | length << 5 (0: no such code)
    toff = np.zeros(EXPONENTS, np.int64)
    tbits = np.zeros(EXPONENTS, np.int64)
    lengths = np.zeros((max(hi - lo + 1, 1), SYMBOLS), np.int64)
    size = np.int64(0)
    total = np.int64(0)
    unchanged = np.int64(0)
    for x in range(lo, hi + 1):
        st, m = _get_count(src, end, st)
        if m < 0 or m > c - total:
            return OUT_OF_RANGE
        if m == 0:
            continue
        total += m
        st, flag = _get(src, end, st, 1)
        if flag:
            st, u = _get_count(src, end, st)
            # the range holds its changes and its unchanged members both
            if u < 0 or u > n - c - unchanged:
                return OUT_OF_RANGE
            st, k = _get(src, end, st, PARAM_BITS)
            if ugaps.shape[0] == 0:
                ugaps = np.empty(n - c, np.int64)
            for q in range(u):
                st, g = _get_rice(src, end, st, k)
                ugaps[unchanged + q] = g
            inverted[x] = 1
            left[x] = 0
            todo[x] = m
            run[x] = ugaps[unchanged] if u else _NONE
            up[x] = unchanged + 1
            u_end[x] = unchanged + u
            unchanged += u
        else:
            st, g = _get_rice(src, end, st, kg[_class(x, low)])
            left[x] = g
            rest[x] = m - 1
        st, h = _get(src, end, st, 1)
        kind[x] = h
        if h == KIND_RICE:
            st, k = _get(src, end, st, PARAM_BITS)
            kv[x] = k
            continue
        st, start = _get_count(src, end, st)
        if start < 0:
            return BAD_VALUE
        base[x] = start
        longest = 0
        for t in range(SYMBOLS):
            st, length = _get(src, end, st, LENGTH_BITS)
            if length > LENGTH_MAX:
                return BAD_TABLE
            lengths[x - lo, t] = length
            longest = max(longest, length)
        if longest == 0:
            return BAD_TABLE
        toff[x] = size
        tbits[x] = longest
        size += np.int64(1) << longest
    if total != c:
        return OUT_OF_RANGE
    table = np.zeros(max(size, 1), np.int64)
    codes = np.zeros(SYMBOLS, np.int64)
    for x in range(lo, hi + 1):
        if tbits[x] == 0:
            continue
        if not _canonical_codes(lengths[x - lo], codes):
            return BAD_TABLE
        for t in range(SYMBOLS):
            length = lengths[x - lo, t]
            if length:
                for q in range(codes[t], np.int64(1) << tbits[x], np.int64(1) << length):
                    table[toff[x] + q] = t | (length << 5)
    kgx = np.zeros(EXPONENTS, np.int64)
    for x in range(lo, hi + 1):
        kgx[x] = kg[_class(x, low)]
    codes = (
        left,
        rest,
        inverted,
        run,
        ugaps,
        up,
        u_end,
        todo,
        kind,
        kv,
        kgx,
        base,
        table,
        toff,
        tbits,
    )
    return _walk_changes(
        ref, b, n, src, r0, end, st, c, o, shift, mask, vmax, positions, zval, lo, hi, codes
    )


# -- model 2 under the names the encoder and decoder call a model by (model 3's: in
# conditioned_huffman.py) ----------------------------------------------------------------


def encode_conditioned(*args: np.ndarray | int) -> None:
    """Model 2's encoder: conditioned.encode_conditioned's arguments and results."""
    encode_records(MODEL_EXPONENT_RICE, *args)


def decode_conditioned(*args: np.ndarray | int) -> None:
    """Model 2's decoder: conditioned.decode_conditioned's arguments, results and bounds."""
    decode_records(MODEL_EXPONENT_RICE, *args)
