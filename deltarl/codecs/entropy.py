"""The i.i.d. entropy bound a delta is measured against.

For a delta with ``c`` of ``n`` elements changed, an encoder that sees the positions as
independent coin flips needs n*H(c/n) bits for them (H(p)/p per change), and an encoder that
sees the new values only through their XOR with the reference needs the empirical entropy of
those XOR values. Their sum per changed element is the bound. Coders that condition on the
reference (the ordered delta does) may beat it.
"""

from __future__ import annotations

import math

import numpy as np

from deltarl.engine.layout import Layout


def binary_entropy(p: float) -> float:
    """H(p) in bits."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))


def empirical_entropy_bits(symbols: np.ndarray) -> float:
    """Total bits of ``symbols`` under their own empirical (order-0) distribution."""
    if symbols.size == 0:
        return 0.0
    if symbols.dtype.itemsize <= 2:
        freq = np.bincount(symbols.astype(np.int64, copy=False))
        freq = freq[freq > 0]
    else:
        _, freq = np.unique(symbols, return_counts=True)
    p = freq / symbols.size
    return float(-(freq * np.log2(p)).sum())


def iid_bound_bytes_per_change(
    layout: Layout, ref: np.ndarray, cur: np.ndarray
) -> tuple[int, float]:
    """(changed elements, bound in bytes per changed element) for the delta ref -> cur."""
    total = layout.numel
    changed = 0
    value_bits = 0.0
    by_size: dict[int, list[np.ndarray]] = {}
    for i, spec in enumerate(layout.tensors):
        a, b = layout.view(ref, i), layout.view(cur, i)
        diff = a != b
        if diff.any():
            by_size.setdefault(spec.itemsize, []).append(a[diff] ^ b[diff])
    for parts in by_size.values():
        xor = np.concatenate(parts)
        changed += xor.size
        value_bits += empirical_entropy_bits(xor)
    if changed == 0:
        return 0, 0.0
    position_bits = total * binary_entropy(changed / total)
    return changed, (position_bits + value_bits) / changed / 8.0
