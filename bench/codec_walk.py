"""The floor under the conditioned coding's apply on this machine: its walk alone.

A decoder of the conditioned coding (deltarl/codecs/conditioned.py) finds every position by
walking the reference: for each element, its class (the exponent of its reference bits) and
that class's countdown to its next change, loaded, decremented and stored back. The walk is
the same whatever the delta, and it is a chain through memory wherever neighbours share a
class (a store, then a load of the same slot), so it costs the same on every step however
few elements changed. ``walker`` gives that loop and nothing else: no coding, no event
but a class's first element. The conditioned apply cannot be faster than it, so
``bench codec`` reports it beside it, as it reports the writes and the verify beside the
default coding's apply. (Models 2 and 3 walk 64 elements at a time, with a mask per
exponent and block, conditioned_rice._walk and _walk_changes: their walks are cheaper than
this one, which is the range coder's.)

The ranges are the float tensors the conditioned coding may code, each walked whole, dealt
to the kernels' threads as the decoder deals its records (``kernels.deal``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from deltarl.codecs import kernels
from deltarl.codecs.conditioned import CLASSES, EXPONENT
from deltarl.engine.layout import Layout, dtype_of

_NEVER = np.int64(1) << 62  # a countdown that never runs out: no events past the first


@njit(cache=True, boundscheck=False, nogil=True)
def _walk_range(ref, s, n, shift, mask):
    """The conditioned decoder's walk over one range, without its decoding: the number of
    classes met (returned, so the loop is not optimised away)."""
    left = np.zeros(CLASSES, np.int64)
    met = 0
    for e in range(n):
        k = (np.int64(ref[s + e]) >> shift) & mask
        x = left[k]
        if x == 0:
            met += 1
            x = _NEVER
        else:
            x -= 1
        left[k] = x
    return met


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _walk(ref, starts, lengths, shift, mask, met, order, bounds):
    for th in prange(bounds.shape[0] - 1):
        for q in range(bounds[th], bounds[th + 1]):
            i = order[q]
            met[i] = _walk_range(ref, starts[i], lengths[i], shift, mask)


def walker(layout: Layout, ref: np.ndarray) -> Callable[[], None]:
    """One walk over every tensor of ``ref`` the conditioned coding may code, ready to time
    (its arrays made here; the kernel compiles at the first call, which the caller leaves
    untimed)."""
    groups: dict[str, list[int]] = {}
    for i, spec in enumerate(layout.tensors):
        if spec.dtype in EXPONENT and spec.itemsize <= 4 and spec.numel:
            groups.setdefault(spec.dtype, []).append(i)
    calls = []
    for dtype, ids in groups.items():
        bits = dtype_of(dtype).bits
        size = np.dtype(bits).itemsize
        starts = np.array([layout.tensors[i].offset // size for i in ids], np.int64)
        lengths = np.array([layout.tensors[i].numel for i in ids], np.int64)
        shift, mask = EXPONENT[dtype]
        met = np.zeros(len(ids), np.int64)
        calls.append((ref.view(bits), starts, lengths, shift, mask, met, *kernels.deal(lengths)))

    def walk() -> None:
        for args in calls:
            _walk(*args)

    return walk
