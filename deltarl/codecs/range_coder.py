"""An adaptive binary range coder for the compiled kernels (LZMA's, in numba).

Every decision is one bit coded with an adaptive probability: an 11-bit estimate of
P(bit = 0) that moves 1/32 of the way towards each outcome seen. Both sides update the same
estimates from the same bits, so nothing about the model is sent: the coder learns each
context's statistics as it goes (conditioned.py says which contexts).

Numbers are binarised Elias-gamma style (``put_number``): the bit length through a 6-bit
binary tree of adaptive decisions, the two bits below the leading one adaptively per bit
length, the rest as direct (equiprobable) bits. The small numbers that dominate a delta
(gaps in a likely class, +-1 ulp steps) are thus coded almost entirely adaptively.

The encoder's state is (low, range, cache, pending, d) and the decoder's (code, range, r),
plain int64s threaded through inline functions so the kernels keep them in registers. An
encoder writes only below ``end`` and counts on past it, so a caller learns how much room a
stream would have needed without the coder ever writing out of bounds. A decoder reads only
below ``end``, counts reads past it, and the kernel refuses a stream it overran.

Each estimate stays within [31, 2017] of 2048, so every adaptive decision costs at least
-log2(2017/2048) = 0.022 bits: frame_checks.py bounds the decisions (and so the elements) a
stream of n bytes can make a decoder produce.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

PROB_BITS = 11
PROB_INIT = 1 << (PROB_BITS - 1)
_MOVE = 5
_TOP = 1 << 24
_MASK32 = (1 << 32) - 1
TREE_BITS = 6  # bit lengths 0..63
TREE_NODES = 1 << TREE_BITS
MANTISSA_CTX = 4  # a 2-bit tree (nodes 1..3) per bit length
# Minimum information per adaptive decision (bits), from the estimates' clamp above.
MIN_DECISION_BITS = 0.0219
# Bytes a stream has besides its decisions: the encoder's first (always zero) byte and the
# four its flush leaves.
OVERHEAD_BYTES = 5


@njit(inline="always")
def bit_length(x):
    return 0 if x == 0 else 64 - np.int64(leading_zeros(np.uint64(x)))


# -- encoder ------------------------------------------------------------------------------


@njit(inline="always")
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


@njit(inline="always")
def enc_start(d):
    """A fresh encoder writing from ``d``: (low, range, cache, pending, d)."""
    return np.int64(0), np.int64(_MASK32), np.int64(0), np.int64(1), d


@njit(inline="always")
def put_bit(dst, end, st, probs, i, bit):
    low, rng, cache, pending, d = st
    p = probs[i]
    bound = (rng >> PROB_BITS) * p
    if bit == 0:
        rng = bound
        probs[i] = p + (((1 << PROB_BITS) - p) >> _MOVE)
    else:
        low += bound
        rng -= bound
        probs[i] = p - (p >> _MOVE)
    while rng < _TOP:
        rng <<= 8
        low, cache, pending, d = _shift_low(dst, end, low, cache, pending, d)
    return low, rng, cache, pending, d


@njit(inline="always")
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


@njit(inline="always")
def enc_finish(dst, end, st):
    """Flush; return the offset just past the stream (possibly past ``end``: too small)."""
    low, _, cache, pending, d = st
    for _ in range(5):
        low, cache, pending, d = _shift_low(dst, end, low, cache, pending, d)
    return d


@njit(inline="always")
def put_number(dst, end, st, tree, tree_at, mant, mant_at, x):
    """Code x >= 0 (< 2**63): its bit length through ``tree[tree_at:tree_at+64]``, the two
    bits below its leading one through ``mant[mant_at + 4 * length ...]``, the rest direct."""
    nb = bit_length(x)
    node = 1
    for b in range(TREE_BITS - 1, -1, -1):
        bit = (nb >> b) & 1
        st = put_bit(dst, end, st, tree, tree_at + node, bit)
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


@njit(inline="always")
def _byte(src, r, end):
    return np.int64(src[r]) if r < end else np.int64(0)


@njit(inline="always")
def dec_start(src, r, end):
    """(code, range, r, ok): ok is False if the stream's first byte is not zero."""
    first = _byte(src, r, end)
    code = np.int64(0)
    for j in range(1, 5):
        code = (code << 8) | _byte(src, r + j, end)
    return code, np.int64(_MASK32), r + 5, first == 0


@njit(inline="always")
def get_bit(src, end, st, probs, i):
    code, rng, r = st
    p = probs[i]
    bound = (rng >> PROB_BITS) * p
    if code < bound:
        rng = bound
        probs[i] = p + (((1 << PROB_BITS) - p) >> _MOVE)
        bit = 0
    else:
        code -= bound
        rng -= bound
        probs[i] = p - (p >> _MOVE)
        bit = 1
    while rng < _TOP:
        rng <<= 8
        code = ((code << 8) | _byte(src, r, end)) & _MASK32
        r += 1
    return (code, rng, r), bit


@njit(inline="always")
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


@njit(inline="always")
def get_number(src, end, st, tree, tree_at, mant, mant_at):
    node = 1
    for _ in range(TREE_BITS):
        st, bit = get_bit(src, end, st, tree, tree_at + node)
        node = 2 * node + bit
    nb = node - TREE_NODES
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
