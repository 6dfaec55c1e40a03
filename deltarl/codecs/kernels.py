"""Compiled kernels for the work that has to run at memory speed.

``encode_sparse`` does, in one pass per item (a range of one tensor), what would otherwise be
five: it diffs the reference and the current version, codes each changed value against the
reference, and writes two Golomb-Rice bit streams, one for the gaps between changed
positions and one for the coded values. ``torch.ne`` + ``nonzero`` alone makes several full
passes and runs at about a tenth of memcpy here. The diff builds a 64-bit mask of changed
elements per 64 elements with vector compares, without branches, then visits only the set
bits.

``decode_sparse`` reads the two streams back into positions and coded values, validating
as it goes, and (``write``) writes each new element into the target as it is decoded, saving
the bits it overwrites; ``undo_sparse`` puts those back when any record of the frame turns
out bad, so a refused frame still leaves the target as it was. Writing while decoding cut
step 1's decode + write (98M bf16, 3.7% changed, before verify) from 29-42 ms to 24-25 when
the target is another buffer than the reference, and from 28-29 to 26-27 in place (where the
separate pass touched one buffer's lines, not two): the decode's arithmetic overlaps the
writes' cache misses, which a separate pass (``scatter_sparse``, still used for kept deltas
and conditioned records) has to wait out alone.

The values of 16- and 32-bit elements may be coded by class (CLASS_BITS below): the diff
records each change's class (its reference element's exponent) and tallies the values' bit
lengths per class, and an item whose values cost less with a Rice parameter per class than
with one writes the class table first and then each value with its class's parameter; the
decoder reads the table, then each change's position and its parameter from its reference
element CLASS_LEAD changes ahead of its value.

Items run in parallel, dealt to threads by cost (``deal``). Item ``i`` writes only into its
own regions of the output arrays, whose offsets the caller gives, so items never depend on
each other.

Hot loops index with ``np.uint64`` where the index is known not to be negative (the
callers check every region and range against the arrays, and positions ascend from 0):
numba wraps a signed index that is negative around to the array's end, a compare and a
select on every access, and that kept LLVM from vectorising the diff's mask loop at all.
Measured on one core (step 1 of the simulated 98M delta, 3.6M changes): the 2-byte masks
alone 56 -> 17-19 ms, the whole encode kernel 110 -> 61-65 ms, decode + write 54-83 ->
44-49 ms.

Positions lead the values, and their cache lines are prefetched. A change's value step reads
its reference element (its class; its old bits) and writes its target element. At a percent
or two changed, as in later RL steps, most changes have a cache line of their own, apart
from the last one's, which the hardware's stream prefetch does not fetch ahead; loaded in the
value's own step, each miss held the reorder buffer until it landed, so only a few were in
flight at once. On the simulated 98M delta (one core), decoding alone took 10.5 ns a change
at step 1 (3.6M changes, 3.7%) and 47 at step 8 (1.3M, 1.3%), more time for a third of the
changes, while records without classes (which read no reference) took 7 at both. So the
decoder reads positions CLASS_LEAD changes ahead of the values and prefetches each one's
lines (``llvm.prefetch``, which waits for nothing); the value step then hits. Measured with
the kernels before this against these, alternating, one core, two runs, apply with verify:
step 3 49.5-50.5 -> 37.3-40.4 ms, step 8 71.9-76.2 -> 44.7-51.1 ms (decoding alone 42 ->
19), step 1 unchanged (within 4%); a lead of 12 or 24 changes did about the same, 64 cost
step 1's decoding up to 15%. Records without classes lead only where they are sparse (fewer
changes than cache lines): leading them at step 1's density too cost their apply 38.4 ->
45.8 ms; as built, step 1 38.5 -> 39.2 and step 8 60.2 -> 45.3. Prefetching only a line not
prefetched for the change before (a branch taken about half the time at step 1) made step
1 slower than prefetching for every change.

Kernels never raise (a parallel loop cannot carry a message): decoders write an error code
per item, and Python turns it into a FrameError naming the record.

Rice code of an unsigned n with parameter k, bits packed least-significant first:
q = n >> k; if q < ESCAPE: q zero bits, a one bit, the k low bits of n; else ESCAPE zero
bits and then n in full width. The escape bounds the cost of an outlier (a sign flip, a
tensor that was reset) at ESCAPE + width bits instead of 2**width. Each item's stream is
byte-aligned and its last byte is padded with zero bits.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros
from numba.extending import intrinsic

# Value codings, as in frame.py (kept as plain ints for the compiled code).
_ORDERED_DELTA = 1
_XOR = 2

MASK_BLOCK = 64  # masks built before their bits are visited: 4096 elements (_diff_item)
POSITION_WIDTH = 32  # positions are relative to the item start, and an item is < 2**32 long

# Error codes of decode_sparse, per record.
OK = 0
EXHAUSTED = 1
OUT_OF_RANGE = 2
TRAILING = 3
PADDING = 4
BAD_VALUE = 5
BAD_CLASSES = 6
NO_CLASS = 7
ERRORS = {
    EXHAUSTED: "a bit stream ends before all changed elements were decoded",
    OUT_OF_RANGE: "a decoded position lies outside the record's range or does not ascend",
    TRAILING: "a bit stream has bytes left over after the last element",
    PADDING: "a bit stream's padding bits are not zero",
    BAD_VALUE: "a decoded value does not fit the element width or codes no change",
    BAD_CLASSES: "the value stream's class table is malformed",
    NO_CLASS: "a changed element's class has no Rice parameter in the class table",
}

# Values coded by class (VAL_CLASSED in frame.py): a changed element's class is the top
# CLASS_BITS bits of its reference element's magnitude (for bf16 and fp32, exactly its
# exponent). The update an optimizer step makes is a few ulps, and the ulp is set by the
# exponent, so the coded values' sizes depend on it: a Rice parameter per class takes the
# values of simulated AdamW deltas from about 2.5 bits a change to 1.85. The value stream
# opens with the table: the first class (8 bits), the number of classes less one (8 bits),
# then each class's Rice parameter (CLASS_K_BITS bits), every class in between included.
# Only for 16- and 32-bit elements (frame_checks).
CLASS_BITS = 8
N_CLASSES = 1 << CLASS_BITS
CLASS_K_BITS = 5  # a Rice parameter is < 32 (the bit writer's limit)
CLASS_TABLE_HEAD_BITS = 2 * CLASS_BITS
_CLASS_LENGTHS = 33  # bit lengths of a coded value less one, for widths up to 32
# How many changes ahead of its value the decoder reads a change's position and prefetches
# the cache lines the value step then reads (the reference element, for its class and its
# old bits) and writes (the target element): enough for them to have landed.
CLASS_LEAD = 32

_U0 = np.uint64(0)
_U1 = np.uint64(1)
_U8 = np.uint64(8)
_BYTE = np.uint64(0xFF)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def rice_escape(width: int) -> int:
    """Unary length at which a value is written in full instead (as in the kernels)."""
    return width


def deal(costs: np.ndarray, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds): the items dealt to the kernels' threads so their costs even out.

    Thread t runs items ``order[bounds[t]:bounds[t + 1]]`` (each kernel's parallel loop is
    over threads, one iteration each). Largest first, each to the least loaded thread
    (LPT, within 4/3 of the best split). The static split it replaces did badly: numba
    splits a prange into equal contiguous blocks, the kernels dealt items to them
    alternately (0, 2, 4, ... and 1, 3, 5, ...), and the tensors of a layer alternate in how
    many of their elements change, so on the simulated 98M model one thread had twice the
    other's changes: 55 ms against 43 to encode step 1, 24 against 16-20 to decode.
    Which thread runs an item never changes what it writes.
    """
    n_threads = max(1, get_num_threads() if threads is None else threads)
    n = costs.shape[0]
    if n_threads == 1 or n <= 1:
        return np.arange(n, dtype=np.int64), np.array([0, n], np.int64)
    load = [(0.0, t) for t in range(n_threads)]
    mine: list[list[int]] = [[] for _ in range(n_threads)]
    for i in np.argsort(-np.asarray(costs, np.float64), kind="stable").tolist():
        spent, t = heapq.heappop(load)
        mine[t].append(i)
        heapq.heappush(load, (spent + float(costs[i]), t))
    order = np.array([i for items in mine for i in items], np.int64)
    bounds = np.zeros(n_threads + 1, np.int64)
    np.cumsum([len(items) for items in mine], out=bounds[1:])
    return order, bounds


# -- value coding (the compiled twin of values.py, one element at a time) --------------------


def _prefetch_intrinsic(write: int) -> Any:  # noqa: ANN401 - a numba intrinsic
    """A numba intrinsic ``(array, index)`` that asks the CPU to bring the cache line of
    ``array[index]`` in (LLVM's prefetch, ``write``: 1 for a line about to be written) and
    waits for nothing: unlike a load, it leaves the reorder buffer at once, so many lines
    come in at a time. A hint: it never faults, whatever the address. Defined here, beside
    the kernels that use it, because numba's cache of a kernel is invalidated only by edits
    of the kernel's own source file."""

    def typer(typingctx: Any, arr: Any, idx: Any) -> Any:  # noqa: ANN401
        if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ANN401
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            i = context.cast(builder, args[1], signature.args[1], types.intp)
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            ptr = builder.bitcast(builder.gep(ary.data, [i]), i8p)
            # rw, locality 3 (keep in every cache level), cache type 1 (data)
            consts = [ir.Constant(i32, v) for v in (write, 3, 1)]
            builder.call(fn, [ptr, *consts])
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    return intrinsic(typer)


_prefetch_read = _prefetch_intrinsic(0)
_prefetch_write = _prefetch_intrinsic(1)


@njit(inline="always")
def _order(x, sign_shift, magnitude, is_float):
    if is_float:
        return x ^ ((x >> sign_shift) * magnitude)
    return x


@njit(inline="always")
def _code_value(new, old, coding, sign_shift, magnitude, mask, is_float):
    if coding == _XOR:
        return (new ^ old) & mask
    d = (
        _order(new, sign_shift, magnitude, is_float) - _order(old, sign_shift, magnitude, is_float)
    ) & mask
    return ((d << _U1) ^ (_U0 - (d >> sign_shift))) & mask


@njit(inline="always")
def _decode_value(z, old, coding, sign_shift, magnitude, mask, is_float):
    if coding == _XOR:
        return (z ^ old) & mask
    d = ((z >> _U1) ^ (_U0 - (z & _U1))) & mask
    o = (_order(old, sign_shift, magnitude, is_float) + d) & mask
    return _order(o, sign_shift, magnitude, is_float)


# -- Rice parameter choice ---------------------------------------------------------------------


@njit(inline="always")
def _tally(count, x):
    """Count x in its bit-length bucket (for _rice_choose)."""
    count[0 if x == _U0 else 64 - np.int64(leading_zeros(x))] += 1


@njit(cache=True)
def _rice_best(count, escape, width):
    """(k, estimated bits): the best Rice parameter for numbers tallied by bit length.

    The cost of every k is estimated from the buckets, taking the numbers of bit length L to
    lie at 3/4 of 2**L on average. A mean-based guess is not enough: a few outliers (a sign
    flip among +-1 ulp steps) would inflate k for every other value.
    """
    top = 0  # one past the longest length tallied
    for length in range(count.shape[0]):
        if count[length]:
            top = length + 1
    best_k = 0
    best = -1.0
    # the bit writer takes at most 32 bits at a time; a k past the longest length only costs
    for k in range(min(width, 32, max(top, 1))):
        cost = 0.0
        for length in range(top):
            c = count[length]
            if c == 0:
                continue
            q = max(0.0, 0.75 * 2.0 ** (length - k) - 0.5) if length > k else 0.0
            # unary + terminator + k bits, at most the escape's cost
            cost += c * min(q + 1 + k, escape + width)
        if best < 0 or cost < best:
            best = cost
            best_k = k
    return best_k, best


@njit(cache=True)
def _rice_choose(count, escape, width):
    """The best Rice parameter for numbers tallied by bit length (``_rice_best``)."""
    return _rice_best(count, escape, width)[0]


@njit(cache=True)
def _class_table(chist, ks, escape, width):
    """(first class, classes, estimated bits with the table) of coding an item's values
    with a Rice parameter per class (``ks``, filled in) from their tallies per class."""
    lo = -1
    hi = -1
    bits = float(CLASS_TABLE_HEAD_BITS)
    for cl in range(chist.shape[0]):
        if chist[cl].sum() == 0:
            ks[cl] = 0
            continue
        if lo < 0:
            lo = cl
        hi = cl
        k, cost = _rice_best(chist[cl], escape, width)
        ks[cl] = k
        bits += cost
    n = hi - lo + 1
    return lo, n, bits + CLASS_K_BITS * n


# -- bit writing and reading -------------------------------------------------------------------
# Writer state: (d, acc, nacc): next byte to write, pending bits, their count (< 32 between
# calls). Reader state: (r, acc, nacc): next byte to read, buffered bits, their count; the
# reader refills greedily up to 57..64 bits, and bits above nacc in acc are always zero.


@njit(inline="always")
def _put(dst, d, acc, nacc, value, nbits):
    """Append nbits (<= 32) of value; flush 32 bits at a time."""
    acc |= (value & ((_U1 << np.uint64(nbits)) - _U1)) << np.uint64(nacc)
    nacc += nbits
    if nacc >= 32:
        dst[d] = np.uint8(acc & _BYTE)
        dst[d + 1] = np.uint8((acc >> _U8) & _BYTE)
        dst[d + 2] = np.uint8((acc >> np.uint64(16)) & _BYTE)
        dst[d + 3] = np.uint8((acc >> np.uint64(24)) & _BYTE)
        d += 4
        acc >>= np.uint64(32)
        nacc -= 32
    return d, acc, nacc


@njit(cache=True)
def _flush(dst, d, acc, nacc):
    """Write the pending bits, zero-padded to a byte; return the end offset."""
    while nacc > 0:
        dst[d] = np.uint8(acc & _BYTE)
        d += 1
        acc >>= _U8
        nacc -= 8
    return d


@njit(inline="always")
def _put_rice(dst, d, acc, nacc, x, k, escape, width):
    q = x >> np.uint64(k)
    if q + np.uint64(k) < np.uint64(32) and q < np.uint64(escape):
        # the common case in one write: q zeros, the terminating one, k low bits
        qi = np.int64(q)
        code = (_U1 << q) | ((x & ((_U1 << np.uint64(k)) - _U1)) << (q + _U1))
        return _put(dst, d, acc, nacc, code, qi + 1 + k)
    if q < np.uint64(escape):
        qi = np.int64(q)
        while qi >= 31:
            d, acc, nacc = _put(dst, d, acc, nacc, _U0, 31)
            qi -= 31
        d, acc, nacc = _put(dst, d, acc, nacc, _U1 << np.uint64(qi), qi + 1)
        if k > 0:
            d, acc, nacc = _put(dst, d, acc, nacc, x, k)
    else:
        e = escape
        while e >= 31:
            d, acc, nacc = _put(dst, d, acc, nacc, _U0, 31)
            e -= 31
        d, acc, nacc = _put(dst, d, acc, nacc, _U0, e)
        if width > 32:
            d, acc, nacc = _put(dst, d, acc, nacc, x, 32)
            d, acc, nacc = _put(dst, d, acc, nacc, x >> np.uint64(32), width - 32)
        else:
            d, acc, nacc = _put(dst, d, acc, nacc, x, width)
    return d, acc, nacc


@njit(inline="always")
def _refill(src, r, end, acc, nacc):
    # Away from the stream's end, as many whole bytes as fit in one go: the eight byte
    # loads below compile to one 64-bit load, where a byte a time was a loop of up to eight
    # dependent steps (decode 11.6 -> 9.8 ms for 3.6M changes together with the joint loop
    # of decode_sparse). Near the end, a byte a time, never past ``end``.
    if r + 8 <= end:
        u = np.uint64(r)  # unsigned: no wraparound select on each load (module docstring)
        w = (
            np.uint64(src[u])
            | (np.uint64(src[u + _U1]) << np.uint64(8))
            | (np.uint64(src[u + np.uint64(2)]) << np.uint64(16))
            | (np.uint64(src[u + np.uint64(3)]) << np.uint64(24))
            | (np.uint64(src[u + np.uint64(4)]) << np.uint64(32))
            | (np.uint64(src[u + np.uint64(5)]) << np.uint64(40))
            | (np.uint64(src[u + np.uint64(6)]) << np.uint64(48))
            | (np.uint64(src[u + np.uint64(7)]) << np.uint64(56))
        )
        take = (63 - nacc) >> 3
        acc |= (w & ((_U1 << np.uint64(take * 8)) - _U1)) << np.uint64(nacc)
        return r + take, acc, nacc + take * 8
    while nacc <= 56 and r < end:
        acc |= np.uint64(src[r]) << np.uint64(nacc)
        r += 1
        nacc += 8
    return r, acc, nacc


@njit(inline="always")
def _get_bits(src, r, end, acc, nacc, nbits):
    """(value, r, acc, nacc, ok) for nbits <= 32."""
    if nacc < nbits:
        r, acc, nacc = _refill(src, r, end, acc, nacc)
        if nacc < nbits:
            return _U0, r, acc, nacc, False
    v = acc & ((_U1 << np.uint64(nbits)) - _U1)
    return v, r, acc >> np.uint64(nbits), nacc - nbits, True


@njit(inline="always")
def _get_rice(src, r, end, acc, nacc, k, escape, width):  # noqa: PLR0911 - one exit per outcome
    """(value, r, acc, nacc, ok)."""
    if nacc < 32:
        r, acc, nacc = _refill(src, r, end, acc, nacc)
    if acc != _U0:
        # the common case in one step: the terminator and the k low bits are buffered
        zeros = np.int64(trailing_zeros(acc))
        if zeros < escape and zeros + 1 + k <= nacc:
            acc >>= np.uint64(zeros + 1)
            low = acc & ((_U1 << np.uint64(k)) - _U1)
            acc >>= np.uint64(k)
            nacc -= zeros + 1 + k
            return (np.uint64(zeros) << np.uint64(k)) | low, r, acc, nacc, True
    q = 0
    while True:
        if nacc == 0:
            r, acc, nacc = _refill(src, r, end, acc, nacc)
            if nacc == 0:
                return _U0, r, acc, nacc, False
        zeros = nacc if acc == _U0 else np.int64(trailing_zeros(acc))
        if q + zeros >= escape:  # the escape: exactly `escape` zeros, no terminator
            used = escape - q
            acc >>= np.uint64(used)
            nacc -= used
            q = escape
            break
        if zeros < nacc:  # the terminating one is buffered
            acc >>= np.uint64(zeros + 1)
            nacc -= zeros + 1
            q += zeros
            break
        q += zeros
        acc = _U0
        nacc = 0
    if q < escape:
        low = _U0
        if k > 0:
            low, r, acc, nacc, ok = _get_bits(src, r, end, acc, nacc, k)
            if not ok:
                return _U0, r, acc, nacc, False
        return (np.uint64(q) << np.uint64(k)) | low, r, acc, nacc, True
    if width > 32:
        lo, r, acc, nacc, ok = _get_bits(src, r, end, acc, nacc, 32)
        if not ok:
            return _U0, r, acc, nacc, False
        hi, r, acc, nacc, ok = _get_bits(src, r, end, acc, nacc, width - 32)
        return lo | (hi << np.uint64(32)), r, acc, nacc, ok
    return _get_bits(src, r, end, acc, nacc, width)


@njit(cache=True)
def _finished(r, end, acc, nacc):
    """OK if the stream was read to its end and only zero padding (< 8 bits) is left."""
    if r != end or nacc >= 8:
        return TRAILING
    if acc != _U0:
        return PADDING
    return OK


# -- encode ------------------------------------------------------------------------------------


@njit(inline="always")
def _emit(ref, cur, e, s, o, c, prev, pos, zval, code, hist, adv, cls, chist):
    """Record element e as changed: its position, coded value, and both numbers' tallies;
    unless ``adv`` is None, write its new bits into it (the reference itself: read first);
    unless ``cls`` is None, its class into ``cls`` and its value's tally into ``chist``.

    ``code`` is the value coding's (coding, sign_shift, magnitude, mask, is_float).
    """
    p = e - s
    coding, sign_shift, magnitude, mask, is_float = code
    ue = np.uint64(e)  # both unsigned: no wraparound selects (module docstring)
    uo = np.uint64(o + c)
    new = cur[ue]
    old = np.uint64(ref[ue])
    z = _code_value(np.uint64(new), old, coding, sign_shift, magnitude, mask, is_float)
    if cls is not None:
        k = (old & magnitude) >> (sign_shift - np.uint64(CLASS_BITS))
        cls[uo] = k
        _tally(chist[k], z - _U1)
    if adv is not None:
        # Here the element's cache line was just read: a write now costs its write-back
        # only. A pass after the diff cost 15 ms on a 98M model at 2.5% changed (the
        # changes touch half the lines), as much as half a copy of the model.
        adv[ue] = new
    pos[uo] = p
    zval[uo] = z
    _tally(hist[0], np.uint64(p - prev - 1))
    _tally(hist[1], z - _U1)
    return c + 1, p


@njit(cache=True)
def _diff_item(ref, cur, s, n, o, pos, zval, code, hist, adv, cls, chist):
    """Write the changed positions (relative to s) and coded values of one item; return count.
    Unless ``adv`` is None, each changed element's new bits go into it too, after its mask is
    built and its old bits read (``adv`` may be ``ref``).

    ``hist`` (2 x 65) receives the bit-length tallies of the gaps (row 0) and of the coded
    values minus one (row 1) for choosing the Rice parameters; unless ``cls`` is None,
    ``chist`` (N_CLASSES x 33) those of the values per class, and ``cls`` each one's class.
    """
    c = 0
    prev = np.int64(-1)
    # Per 64 elements: one bit per element that differs makes a 64-bit mask of changed
    # elements, compiled to vector compares straight into a mask, for any width (17-19 ms
    # for 98M bf16 elements on one core, where gathering the top bits of the 16-bit lanes
    # of the words' XOR took 56, and other widths compared word by word). Two passes per
    # block of MASK_BLOCK masks: every mask first, in a loop that does nothing else, which
    # the compiler vectorises; then the set bits. Building each mask and visiting its bits
    # in one loop kept the mask arithmetic scalar: measured on 32M bf16 elements, 17.5 ms
    # against 6.0 for an unchanged range, 15.2 against 11.8 at 3.7% changed (bench/
    # codec.py's step 1). The block (8 KiB of each buffer at 2 bytes) is still in L1 when
    # its bits are visited and their values read; masks over a whole 1M-element item sent
    # those reads back to L3: 50 ms against 44 for 98M elements at 3.7%.
    nb = n // 64
    masks = np.empty(MASK_BLOCK, np.uint64)
    for b0 in range(0, nb, MASK_BLOCK):
        b1 = min(nb, b0 + MASK_BLOCK)
        for b in range(b0, b1):
            # unsigned: with signed indices this loop does not vectorise (docstring)
            base = np.uint64(s + b * 64)
            m = _U0
            for j in range(64):
                u = base + np.uint64(j)
                m |= np.uint64(ref[u] != cur[u]) << np.uint64(j)
            masks[b - b0] = m
        for b in range(b0, b1):
            m = masks[b - b0]
            e = s + b * 64
            while m != _U0:
                j = np.int64(trailing_zeros(m))
                c, prev = _emit(
                    ref, cur, e + j, s, o, c, prev, pos, zval, code, hist, adv, cls, chist
                )
                m &= m - _U1
    tail = s + nb * 64
    for e in range(tail, s + n):
        if ref[e] != cur[e]:
            c, prev = _emit(ref, cur, e, s, o, c, prev, pos, zval, code, hist, adv, cls, chist)
    return c


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def encode_sparse(  # numba kernels are typed by their arguments
    ref,  # flat uintN view of the reference buffer
    cur,  # flat uintN view of the current buffer
    starts,  # int64[n]: first element of each item in the flat view
    lengths,  # int64[n]: elements in each item
    out_off,  # int64[n]: each item's region in pos / zval (as long as the item)
    pos,  # uint32 scratch: changed positions relative to the item
    zval,  # uint64 scratch: coded values
    coding,  # VAL_ORDERED_DELTA or VAL_XOR
    is_float,  # order float bit patterns before differencing
    pos_dst,  # uint8: position streams; item i's region starts at pos_cap_off[i]
    pos_cap_off,
    val_dst,  # uint8: value streams; item i's region starts at val_cap_off[i]
    val_cap_off,
    adv,  # None, or the reference (as ref): each changed element's new bits are written there
    cls,  # None, or uint8 scratch as pos: each change's class, and its value tallied by class
    by_class_ok,  # with cls: code the values by class where that is smaller
    counts,  # out int64[n]: changed elements
    pos_k,  # out int64[n]: Rice parameter of the positions
    val_k,  # out int64[n]: Rice parameter of the values
    pos_len,  # out int64[n]: bytes of the position stream
    val_len,  # out int64[n]: bytes of the value stream
    classed,  # out bool[n]: the values are coded by class (the stream opens with the table)
    order,  # int64[n]: the items, thread by thread (deal())
    bounds,  # int64[threads + 1]: thread t takes order[bounds[t]:bounds[t + 1]]
):
    """Diff, code and Rice-write every item. Regions must hold the worst case (encoder.py):
    the class table adds at most 2 + 5 * N_CLASSES / 8 bytes to a value stream."""
    width = ref.itemsize * 8
    sign_shift = np.uint64(width - 1)
    mask = _ALL >> np.uint64(64 - width)
    magnitude = mask >> _U1
    escape = width
    code = (coding, sign_shift, magnitude, mask, is_float)
    for th in prange(bounds.shape[0] - 1):
        # every item's table is written whole into it (_class_table): one per thread
        ks = np.zeros(N_CLASSES if cls is not None else 0, np.int64)
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
            s = starts[i]
            n = lengths[i]
            o = out_off[i]
            hist = np.zeros((2, 65), np.int64)
            # no rows unless classes are tallied: zeroing them costs a little per item
            chist = np.zeros((N_CLASSES if cls is not None else 0, _CLASS_LENGTHS), np.int64)
            c = _diff_item(ref, cur, s, n, o, pos, zval, code, hist, adv, cls, chist)
            counts[i] = c
            classed[i] = False
            if c == 0:
                pos_k[i] = 0
                val_k[i] = 0
                pos_len[i] = 0
                val_len[i] = 0
                continue
            kp = _rice_choose(hist[0], POSITION_WIDTH, POSITION_WIDTH)
            kv, single = _rice_best(hist[1], escape, width)
            lo = 0
            n_cls = 0
            by_class = False
            if cls is not None and by_class_ok:
                lo, n_cls, bits = _class_table(chist, ks, escape, width)
                by_class = bits < single
            classed[i] = by_class
            pos_k[i] = kp
            val_k[i] = 0 if by_class else kv

            # Both streams in one loop: their writer states are independent, so the CPU works
            # on the two codes of an element at once.
            dp, accp, naccp = pos_cap_off[i], _U0, 0
            dv, accv, naccv = val_cap_off[i], _U0, 0
            if by_class:
                dv, accv, naccv = _put(val_dst, dv, accv, naccv, np.uint64(lo), CLASS_BITS)
                dv, accv, naccv = _put(val_dst, dv, accv, naccv, np.uint64(n_cls - 1), CLASS_BITS)
                for cl in range(lo, lo + n_cls):
                    dv, accv, naccv = _put(
                        val_dst, dv, accv, naccv, np.uint64(ks[cl]), CLASS_K_BITS
                    )
            prev = np.int64(-1)
            for j in range(c):
                oj = np.uint64(o + j)
                p = np.int64(pos[oj])
                gap = np.uint64(p - prev - 1)
                prev = p
                dp, accp, naccp = _put_rice(
                    pos_dst, dp, accp, naccp, gap, kp, POSITION_WIDTH, POSITION_WIDTH
                )
                k = kv
                if cls is not None and by_class:
                    k = ks[cls[oj]]
                dv, accv, naccv = _put_rice(
                    val_dst, dv, accv, naccv, zval[oj] - _U1, k, escape, width
                )
            pos_len[i] = _flush(pos_dst, dp, accp, naccp) - pos_cap_off[i]
            val_len[i] = _flush(val_dst, dv, accv, naccv) - val_cap_off[i]


# -- decode and apply --------------------------------------------------------------------------


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def decode_sparse(
    width,  # element width in bits (all records of one call share it)
    pos_src,  # uint8: Rice position streams
    pos_off,  # int64[n]: start of each record's position stream, -1: positions given
    pos_len,  # int64[n]
    pos_k,  # int64[n]
    val_src,  # uint8: Rice value streams
    val_off,  # int64[n]
    val_len,  # int64[n]
    val_k,  # int64[n]
    counts,  # int64[n]: changed elements per record
    lengths,  # int64[n]: range length per record
    out_off,  # int64[n]: each record's region in positions / zval
    positions,  # uint32 out (or in, for records whose pos_off is -1)
    zval,  # out: coded values, uintN (N >= width: a coded value is at most the mask)
    errors,  # int64 out
    order,  # int64[n]: the records, thread by thread (deal())
    bounds,  # int64[threads + 1]
    write,  # also write each decoded element into target (the arguments below)
    target,  # uintN: the buffer written, viewed at the element width
    reference,  # uintN: the buffer the coded values are decoded against (may be target);
    # read also without ``write`` where a record's values are coded by class
    bases,  # int64[n]: each record's first element in target / reference (with write or
    # classes)
    classed,  # bool[n]: the record's values are coded by class of the reference element
    codings,  # int64[n]: each record's value coding
    is_float,  # bool[n]: each record's elements are floats (their order is not the bits')
    prior,  # uintN out: the bits each write replaced, at the element's slot in zval
    done,  # int64 out: elements of each record written (a prefix of its positions)
):
    """Decode positions and coded values of every record, checking every bound; with
    ``write``, write every element as soon as it is decoded and checked.

    Never reads outside a record's stream regions nor writes outside its output region and
    its range of target (nor reads outside its range of reference); the caller checks that
    the regions and ranges lie inside the arrays.
    A record refused part way has written ``done[i]`` elements, each with its old bits in
    ``prior``: ``undo_sparse`` restores them.
    """
    mask = _ALL >> np.uint64(64 - width)
    sign_shift = np.uint64(width - 1)
    magnitude = mask >> _U1
    # classes exist for 16- and 32-bit elements only (frame_checks): no shift otherwise
    class_shift = np.uint64(max(width - 1 - CLASS_BITS, 0))
    per_line = max(512 // width, 1)  # elements per 64-byte cache line
    for th in prange(bounds.shape[0] - 1):
        ks = np.zeros(N_CLASSES, np.int64)  # a classed record's table: from its first class
        kc = np.zeros(N_CLASSES, np.int64)  # the same by class (below)
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
            n = counts[i]
            o = out_off[i]
            err = OK
            # Both streams in one loop, as the encoder writes them: the two readers' states are
            # independent, so the CPU decodes an element's position and value at once.
            rp = pos_off[i]
            endp = rp + pos_len[i]
            accp = _U0
            naccp = 0
            given = rp < 0  # positions already written (bitmap records)
            if given:
                rp = 0
                endp = 0
            rv = val_off[i]
            endv = rv + val_len[i]
            accv = _U0
            naccv = 0
            prev = np.int64(-1)
            kp = pos_k[i]
            kv = val_k[i]
            length = lengths[i]
            by_class = classed[i]
            # read once: the target's writes could alias these arrays for all LLVM knows
            b = bases[i] if write or by_class else 0
            coding = codings[i] if write else 0
            fl = is_float[i] if write else False
            lo = np.int64(0)
            n_cls = np.int64(0)
            if by_class:
                err, lo, n_cls, rv, accv, naccv = _read_class_table(
                    val_src, rv, endv, accv, naccv, ks, width
                )
            # Each element's stores come after both its reads, in a while loop: the same work
            # as a for loop that stored the position as soon as it was read took 28 ms
            # against 20 for step 1 of the simulated 98M delta, writing (p25 of 30 runs).
            j = 0
            ahead = np.int64(0)  # with lead: changes whose position is known, lines fetched
            # Classed values need their reference element anyway; written ones lead when the
            # record has fewer changes than cache lines: most changes then have a line of
            # their own, apart, which the hardware's stream prefetch does not fetch ahead
            # (denser, it does, and leading only costs: module docstring).
            lead = by_class or (write and n * per_line < length)
            if by_class and err == OK:  # a refused table's range may lie outside kc
                # Every class's parameter at its own index, -1 for those the table leaves
                # out: one load and one compare a change. (Reading the table straight into
                # this form, in _read_class_table, made the loop below slower for records
                # without classes, 0.91-0.93x at step 1: LLVM laid it out otherwise.)
                for c in range(N_CLASSES):
                    kc[c] = -1
                for c in range(n_cls):
                    kc[lo + c] = ks[c]
            # A change reads its reference element (its class; its old bits) and writes its
            # target element: loads from anywhere in the model. Made in the value's own step,
            # each load that misses holds the reorder buffer until it lands, so only a few are
            # in flight at once; at a percent or two changed, where each change has a cache
            # line of its own that the hardware does not fetch ahead, that wait was most of
            # the decode (module docstring). So positions run CLASS_LEAD changes ahead of the
            # values, each prefetching its lines, which then hit in the value step: the first
            # CLASS_LEAD here, then one a step in the loop below (a loop nested there instead,
            # as before, cost classed records 8-12% at step 1).
            if lead and err == OK:  # not past a refused class table
                while ahead < n and ahead < CLASS_LEAD:
                    slot = o + ahead
                    err, at, rp, accp, naccp = _next_position(
                        given, positions, slot, pos_src, rp, endp, accp, naccp, kp, prev, length
                    )
                    if err != OK:
                        break
                    prev = at
                    positions[np.uint64(slot)] = at
                    ra = np.uint64(b + at)
                    _prefetch_read(reference, ra)
                    if write:
                        _prefetch_write(target, ra)
                    ahead += 1
            while j < n and err == OK:
                oj = np.uint64(o + j)  # unsigned indices: module docstring
                if lead:
                    if ahead < n:
                        slot = o + ahead
                        err, at, rp, accp, naccp = _next_position(
                            given, positions, slot, pos_src, rp, endp, accp, naccp, kp, prev, length
                        )
                        if err != OK:
                            break
                        prev = at
                        positions[np.uint64(slot)] = at
                        ra = np.uint64(b + at)
                        _prefetch_read(reference, ra)
                        if write:
                            _prefetch_write(target, ra)
                        ahead += 1
                    p = np.int64(positions[oj])
                    e = np.uint64(b + p)
                    k = kv
                    if by_class:
                        # a hit: its line was prefetched CLASS_LEAD changes ago
                        k = kc[(np.uint64(reference[e]) & magnitude) >> class_shift]
                        if k < 0:
                            err = NO_CLASS
                            break
                else:
                    k = kv
                    err, p, rp, accp, naccp = _next_position(
                        given, positions, o + j, pos_src, rp, endp, accp, naccp, kp, prev, length
                    )
                    if err != OK:
                        break
                    prev = p
                    e = np.uint64(b + p)
                v, rv, accv, naccv, ok = _get_rice(val_src, rv, endv, accv, naccv, k, width, width)
                if not ok:
                    err = EXHAUSTED
                    break
                if v >= mask:
                    err = BAD_VALUE
                    break
                z = v + _U1
                if not lead:  # leading, the position is stored already
                    positions[oj] = p
                zval[oj] = z
                if write:
                    # reference before target: they may be one buffer
                    old = np.uint64(reference[e])
                    prior[oj] = target[e]
                    target[e] = _decode_value(z, old, coding, sign_shift, magnitude, mask, fl)
                j += 1
            done[i] = j if write else 0
            if err == OK and not given:
                err = _finished(rp, endp, accp, naccp)
            if err == OK:
                err = _finished(rv, endv, accv, naccv)
            errors[i] = err


@njit(inline="always")
def _next_position(given, positions, at, src, r, end, acc, nacc, k, prev, length):
    """(error, position, r, acc, nacc) of the next change: positions[at] where the positions
    are given (bitmap records), else the position after ``prev`` from its Rice-coded gap,
    checked to lie inside the range (it ascends by construction)."""
    if given:
        return OK, np.int64(positions[at]), r, acc, nacc
    g, r, acc, nacc, ok = _get_rice(src, r, end, acc, nacc, k, POSITION_WIDTH, POSITION_WIDTH)
    if not ok:
        return EXHAUSTED, prev, r, acc, nacc
    p = prev + 1 + np.int64(g)
    if p >= length:
        return OUT_OF_RANGE, p, r, acc, nacc
    return OK, p, r, acc, nacc


@njit(inline="always")
def _read_class_table(src, r, end, acc, nacc, ks, width):
    """(error, first class, classes, r, acc, nacc): a value stream's class table, its Rice
    parameters into ks[0:classes]."""
    lo, r, acc, nacc, ok1 = _get_bits(src, r, end, acc, nacc, CLASS_BITS)
    n, r, acc, nacc, ok2 = _get_bits(src, r, end, acc, nacc, CLASS_BITS)
    if not (ok1 and ok2):
        return EXHAUSTED, np.int64(0), np.int64(0), r, acc, nacc
    first = np.int64(lo)
    classes = np.int64(n) + 1
    if first + classes > N_CLASSES:
        return BAD_CLASSES, first, classes, r, acc, nacc
    for j in range(classes):
        k, r, acc, nacc, ok = _get_bits(src, r, end, acc, nacc, CLASS_K_BITS)
        if not ok:
            return EXHAUSTED, first, classes, r, acc, nacc
        if k >= np.uint64(min(32, width)):
            return BAD_CLASSES, first, classes, r, acc, nacc
        ks[j] = np.int64(k)
    return OK, first, classes, r, acc, nacc


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def undo_sparse(target, bases, done, out_off, positions, prior, order, bounds):
    """Put back the bits ``decode_sparse`` overwrote: the first ``done[i]`` elements of each
    record. Records cover disjoint ranges and a record's positions ascend, so every element
    was written at most once and its prior bits are the ones it held before the call."""
    for th in prange(bounds.shape[0] - 1):
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
            b = bases[i]
            o = out_off[i]
            for j in range(done[i]):
                oj = np.uint64(o + j)
                target[np.uint64(b + np.int64(positions[oj]))] = prior[oj]


@njit(cache=True, boundscheck=False, nogil=True)
def bitmap_positions(packed, out):
    """Write the positions of the set bits of ``packed`` (least-significant bit first), in
    ascending order, into ``out`` as far as it holds them; return how many bits are set.

    One pass over the bitmap's bytes and its set bits: the memory is what the caller gives
    (one slot per element the record claims), never a byte per bit of the range.
    """
    m = out.shape[0]
    c = 0
    for i in range(packed.shape[0]):
        b = np.uint64(packed[i])
        while b != _U0:
            if c < m:
                out[c] = i * 8 + np.int64(trailing_zeros(b))
            c += 1
            b &= b - _U1
    return c


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def scatter_sparse(
    target, reference, bases, counts, out_off, positions, zval, coding, is_float, order, bounds
):
    """target[bases[i] + p] = decode(z, reference[...]) for every decoded (p, z) of record i.

    Records cover disjoint ranges, so parallel records never write the same element. Reading
    the reference before writing the target makes it safe for the two to be one buffer.
    """
    for th in prange(bounds.shape[0] - 1):
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
            _scatter_record(
                target,
                reference,
                bases[i],
                counts[i],
                out_off[i],
                positions,
                zval,
                coding,
                is_float,
                zval,
                False,
            )


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def scatter_sparse_flips(
    target,
    reference,
    bases,
    counts,
    out_off,
    positions,
    zval,
    coding,
    is_float,
    flips,
    order,
    bounds,
):
    """``scatter_sparse``, also writing into ``flips`` (at each change's slot in zval) the XOR
    of the bits it replaced and the bits it wrote: what undoes the writes, in the same pass
    (refit/catch_up.py keeps it; two gathers of the changed elements around the scatter cost
    more than the scatter itself)."""
    for th in prange(bounds.shape[0] - 1):
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
            _scatter_record(
                target,
                reference,
                bases[i],
                counts[i],
                out_off[i],
                positions,
                zval,
                coding,
                is_float,
                flips,
                True,
            )


@njit(inline="always")
def _scatter_record(target, reference, b, n, o, positions, zval, coding, is_float, flips, record):
    """One record of ``scatter_sparse`` (``record``: of ``scatter_sparse_flips``)."""
    width = target.itemsize * 8
    sign_shift = np.uint64(width - 1)
    mask = _ALL >> np.uint64(64 - width)
    magnitude = mask >> _U1
    for j in range(n):
        oj = np.uint64(o + j)  # unsigned indices: module docstring
        e = np.uint64(b + np.int64(positions[oj]))
        old = np.uint64(reference[e])
        new = _decode_value(np.uint64(zval[oj]), old, coding, sign_shift, magnitude, mask, is_float)
        if record:
            flips[oj] = np.uint64(target[e]) ^ new
        target[e] = new
