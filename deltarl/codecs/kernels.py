"""Compiled kernels for the two jobs that numpy cannot do at memory speed.

1. The bitwise diff. ``torch.ne`` + ``nonzero`` makes several full passes and runs at about a
   tenth of memcpy here; the diff has to read the reference and the current version once,
   compare them a 64-bit word at a time (four bf16 values), and only look at elements inside
   a word that differs. It runs over many independent items (tensor ranges) in parallel.
2. Golomb-Rice coding of the gaps between changed positions. It is a sequential bit-level
   loop per item, which is what interpreters are worst at; items are coded in parallel.

Each item writes only into its own region of the output arrays (region ``i`` starts at
``out_off[i]`` and is as long as the item), so parallel items never share a cache line of
output except at region edges, and no item's result depends on another's.

Error handling: kernels never raise (numba's parallel loops cannot carry a message); the
decoder kernels write an error code per item, and Python turns it into a FrameError that
names the record.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# Error codes of rice_decode, per record.
RICE_OK = 0
RICE_EXHAUSTED = 1  # the stream ended before every position was decoded
RICE_OUT_OF_RANGE = 2  # a decoded position lies beyond the record's range
RICE_TRAILING = 3  # bytes left over after the last position
RICE_PADDING = 4  # the last byte's padding bits are not zero
RICE_ERRORS = {
    RICE_EXHAUSTED: "the position stream ends before all changed positions were decoded",
    RICE_OUT_OF_RANGE: "a decoded position lies outside the record's range",
    RICE_TRAILING: "the position stream has bytes left over after the last position",
    RICE_PADDING: "the position stream's padding bits are not zero",
}


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def diff_items(  # noqa: ANN201 - numba kernels are typed by their arguments
    ref,  # noqa: ANN001 - flat uintN view of the reference buffer
    cur,  # noqa: ANN001 - flat uintN view of the current buffer
    refw,  # noqa: ANN001 - the same reference bytes as uint64 words
    curw,  # noqa: ANN001 - the same current bytes as uint64 words
    starts,  # noqa: ANN001 - int64[n]: first element of each item, in units of the itemsize
    lengths,  # noqa: ANN001 - int64[n]: elements in each item
    out_off,  # noqa: ANN001 - int64[n]: start of each item's output region
    pos,  # noqa: ANN001 - uint32[total]: changed positions, relative to the item's start
    new_vals,  # noqa: ANN001 - uintN[total]: current bits at those positions
    old_vals,  # noqa: ANN001 - uintN[total]: reference bits at those positions
    counts,  # noqa: ANN001 - int64[n]: changed elements per item (output)
):
    """Find every element whose bits differ; write positions and both values per item.

    Items must start on an 8-byte boundary (tensor offsets are 64-byte aligned and item
    starts are multiples of the item size), so ``starts * itemsize / 8`` is a word index.
    """
    lanes = 8 // ref.itemsize
    for i in prange(starts.shape[0]):
        s = starts[i]
        n = lengths[i]
        o = out_off[i]
        c = 0
        w0 = s // lanes
        nw = n // lanes
        for w in range(w0, w0 + nw):
            if refw[w] != curw[w]:
                e = w * lanes
                for j in range(lanes):
                    if ref[e + j] != cur[e + j]:
                        pos[o + c] = e + j - s
                        new_vals[o + c] = cur[e + j]
                        old_vals[o + c] = ref[e + j]
                        c += 1
        for e in range(s + nw * lanes, s + n):
            if ref[e] != cur[e]:
                pos[o + c] = e - s
                new_vals[o + c] = cur[e]
                old_vals[o + c] = ref[e]
                c += 1
        counts[i] = c


@njit(cache=True, boundscheck=False, nogil=True)
def _rice_bits(pos, o, n, k):  # noqa: ANN001, ANN202
    """Exact bit count of coding n positions (pos[o:o+n], ascending) with Rice parameter k."""
    total = n * (k + 1)
    prev = -1
    for j in range(n):
        p = np.int64(pos[o + j])
        total += (p - prev - 1) >> k
        prev = p
    return total


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def rice_plan(pos, out_off, counts, ks, nbytes):  # noqa: ANN001, ANN201
    """Choose each item's Rice parameter (the exact best of three near the optimum) and size.

    For geometric gaps of mean m the optimal parameter is near log2(m * ln 2); the exact
    cost of that k and its two neighbours is computed and the cheapest taken.
    """
    for i in prange(counts.shape[0]):
        n = counts[i]
        if n == 0:
            ks[i] = 0
            nbytes[i] = 0
            continue
        o = out_off[i]
        span = np.int64(pos[o + n - 1]) + 1
        mean_gap = max(1.0, (span - n) / n)
        k0 = max(0, int(np.log2(mean_gap * 0.6931471805599453)))
        best_k = 0
        best_bits = np.int64(-1)
        for k in range(max(0, k0 - 1), min(31, k0 + 2)):
            bits = _rice_bits(pos, o, n, k)
            if best_bits < 0 or bits < best_bits:
                best_bits = bits
                best_k = k
        ks[i] = best_k
        nbytes[i] = (best_bits + 7) // 8


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def rice_encode(pos, out_off, counts, ks, dst, dst_off):  # noqa: ANN001, ANN201
    """Write each item's gaps as Rice codes: q = gap >> k zero bits, a one bit, k low bits.

    Bits are packed least-significant first; each item starts on a byte boundary of ``dst``
    at ``dst_off[i]`` and its last byte is padded with zero bits.
    """
    for i in prange(counts.shape[0]):
        n = counts[i]
        o = out_off[i]
        k = np.uint64(ks[i])
        mask = (np.uint64(1) << k) - np.uint64(1)
        d = dst_off[i]
        acc = np.uint64(0)
        nacc = np.uint64(0)
        prev = np.int64(-1)
        for j in range(n):
            p = np.int64(pos[o + j])
            gap = np.uint64(p - prev - 1)
            prev = p
            q = gap >> k
            # unary part: q zeros then a one; flush in pieces so the accumulator never overflows
            while q >= np.uint64(32):
                nacc += np.uint64(32)
                while nacc >= np.uint64(8):
                    dst[d] = np.uint8(acc & np.uint64(0xFF))
                    d += 1
                    acc >>= np.uint64(8)
                    nacc -= np.uint64(8)
                q -= np.uint64(32)
            acc |= np.uint64(1) << (nacc + q)
            nacc += q + np.uint64(1)
            while nacc >= np.uint64(8):
                dst[d] = np.uint8(acc & np.uint64(0xFF))
                d += 1
                acc >>= np.uint64(8)
                nacc -= np.uint64(8)
            if k > np.uint64(0):
                acc |= (gap & mask) << nacc
                nacc += k
                while nacc >= np.uint64(8):
                    dst[d] = np.uint8(acc & np.uint64(0xFF))
                    d += 1
                    acc >>= np.uint64(8)
                    nacc -= np.uint64(8)
        if nacc > np.uint64(0):
            dst[d] = np.uint8(acc & np.uint64(0xFF))


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def rice_decode(src, src_off, src_len, counts, ks, lengths, out, out_off, errors):  # noqa: ANN001, ANN201
    """Decode each record's Rice stream into absolute positions, validating as it goes.

    Never reads outside [src_off[i], src_off[i] + src_len[i]) nor writes outside
    out[out_off[i] : out_off[i] + counts[i]]; a position must be below lengths[i].
    The caller checks that the regions themselves lie inside ``src`` and ``out``.
    """
    for i in prange(counts.shape[0]):
        n = counts[i]
        k = ks[i]
        length = lengths[i]
        r = src_off[i]
        end = r + src_len[i]
        o = out_off[i]
        acc = np.uint64(0)
        nacc = 0
        prev = np.int64(-1)
        err = RICE_OK
        for j in range(n):
            q = np.int64(0)
            while True:
                if nacc == 0:
                    if r >= end:
                        err = RICE_EXHAUSTED
                        break
                    acc = np.uint64(src[r])
                    r += 1
                    nacc = 8
                bit = acc & np.uint64(1)
                acc >>= np.uint64(1)
                nacc -= 1
                if bit:
                    break
                q += 1
                if q > length:  # no gap can be longer than the range
                    err = RICE_OUT_OF_RANGE
                    break
            if err != RICE_OK:
                break
            while nacc < k:
                if r >= end:
                    err = RICE_EXHAUSTED
                    break
                acc |= np.uint64(src[r]) << np.uint64(nacc)
                r += 1
                nacc += 8
            if err != RICE_OK:
                break
            low = np.int64(acc & ((np.uint64(1) << np.uint64(k)) - np.uint64(1)))
            acc >>= np.uint64(k)
            nacc -= k
            p = prev + 1 + ((q << k) | low)
            if p >= length:
                err = RICE_OUT_OF_RANGE
                break
            out[o + j] = p
            prev = p
        if err == RICE_OK:
            if r != end:
                err = RICE_TRAILING
            elif acc != np.uint64(0):
                err = RICE_PADDING
        errors[i] = err
