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

from deltarl.codecs.conditioned import EXPONENT
from deltarl.codecs.frame import VAL_ORDERED_DELTA
from deltarl.codecs.values import encode_values
from deltarl.engine.layout import Layout, dtype_of


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


def ordered_bound_bytes_per_change(
    layout: Layout, ref: np.ndarray, cur: np.ndarray
) -> tuple[int, float]:
    """(changed elements, bytes per changed element) of the delta's own symbols: positions as
    i.i.d. coin flips, plus the order-0 entropy of the ordered-delta symbols the codec codes
    (``values.encode_values`` with ``VAL_ORDERED_DELTA``, per element width).

    This is the bound for a coder of those symbols that conditions on nothing; the XOR bound
    above prices the values as the reference's XOR, which the ordered delta already beats, so
    a codec can sit below the XOR bound without beating anything."""
    total = layout.numel
    by_size: dict[int, list[np.ndarray]] = {}
    for i, spec in enumerate(layout.tensors):
        a, b = layout.view(ref, i), layout.view(cur, i)
        diff = a != b
        if diff.any():
            is_float = dtype_of(spec.dtype).kind == "float"
            coded = encode_values(b[diff], a[diff], VAL_ORDERED_DELTA, is_float)
            by_size.setdefault(spec.itemsize, []).append(coded)
    changed = sum(x.size for parts in by_size.values() for x in parts)
    if changed == 0:
        return 0, 0.0
    value_bits = sum(empirical_entropy_bits(np.concatenate(p)) for p in by_size.values())
    position_bits = total * binary_entropy(changed / total)
    return changed, (position_bits + value_bits) / changed / 8.0


def changed_mask(layout: Layout, ref: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """One bool per element, tensors in layout order: did the delta change it."""
    return np.concatenate(
        [layout.view(ref, i) != layout.view(cur, i) for i in range(len(layout.tensors))]
    )


def change_contexts(
    layout: Layout, ref: np.ndarray, previous: np.ndarray | None
) -> tuple[np.ndarray, int]:
    """Each element's context, from what sender and receiver both hold: its tensor, its
    reference exponent (whether a step moves a bf16 value depends on the ulp its exponent
    sets) and whether it changed in the previous delta (``previous``: a bool per element, or
    None). Returns (context id per element, number of contexts)."""
    ids = np.empty(layout.numel, np.int64)
    start = 0
    width = 2 * 2048  # exponent values (up to 11 bits) x changed-before
    for i, spec in enumerate(layout.tensors):
        bits = layout.view(ref, i)
        n = bits.size
        shift_mask = EXPONENT.get(spec.dtype)
        if shift_mask is None:
            exponent = np.zeros(n, np.int64)
        else:
            exponent = ((bits >> bits.dtype.type(shift_mask[0])) & shift_mask[1]).astype(np.int64)
        before = (
            previous[start : start + n].astype(np.int64)
            if previous is not None
            else np.zeros(n, np.int64)
        )
        ids[start : start + n] = i * width + exponent * 2 + before
        start += n
    return ids, len(layout.tensors) * width


def conditioned_bound_bytes_per_change(
    layout: Layout, ref: np.ndarray, cur: np.ndarray, previous: np.ndarray | None = None
) -> tuple[int, float]:
    """(changed elements, bytes per changed element) for a coder that conditions on the
    contexts of ``change_contexts``: each context's own P(change) for the positions and its
    own distribution of ordered-delta symbols for the values, plus what learning them costs
    an adaptive coder (half a bit times log2 of the context's count, per parameter). What
    coding against the reference could reach; not what the codec does today."""
    ctx, _ = change_contexts(layout, ref, previous)
    diff = changed_mask(layout, ref, cur)
    changed = int(diff.sum())
    if changed == 0:
        return 0, 0.0
    n_ctx = np.bincount(ctx)
    c_ctx = np.bincount(ctx[diff], minlength=n_ctx.size)
    used = n_ctx > 0
    n, c = n_ctx[used].astype(np.float64), c_ctx[used].astype(np.float64)
    p = c / n
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(c > 0, p * np.log2(p), 0.0) + np.where(c < n, (1 - p) * np.log2(1 - p), 0.0))
    position_bits = float((n * h).sum()) + float((0.5 * np.log2(n)).sum())
    changed_ctx = ctx[diff]
    symbols = []
    for i, spec in enumerate(layout.tensors):
        a, b = layout.view(ref, i), layout.view(cur, i)
        d = a != b
        if d.any():
            is_float = dtype_of(spec.dtype).kind == "float"
            symbols.append(encode_values(b[d], a[d], VAL_ORDERED_DELTA, is_float).astype(np.uint64))
    coded = np.concatenate(symbols)
    # Order-0 entropy of the symbols within each context, plus the regret of learning each
    # context's distribution (half a bit x log2(count) per distinct symbol seen there).
    order = np.lexsort((coded, changed_ctx))
    key_ctx, key_sym = changed_ctx[order], coded[order]
    new_pair = np.ones(key_ctx.size, bool)
    new_pair[1:] = (key_ctx[1:] != key_ctx[:-1]) | (key_sym[1:] != key_sym[:-1])
    pair_start = np.flatnonzero(new_pair)
    pair_count = np.diff(np.append(pair_start, key_ctx.size)).astype(np.float64)
    pair_ctx = key_ctx[pair_start]
    ctx_total = np.bincount(pair_ctx, weights=pair_count)
    value_bits = float(-(pair_count * np.log2(pair_count / ctx_total[pair_ctx])).sum())
    value_bits += float((0.5 * np.log2(np.maximum(ctx_total[pair_ctx], 1.0))).sum())
    return changed, (position_bits + value_bits) / changed / 8.0


# -- a design not built yet: Rice coding per reference-exponent class ---------------------

CLASS_HEADER_BITS = 32 + 5 + 5
"""What a class of a record would cost besides its streams: its change count and its two
Rice parameters."""


def rice_bits(x: np.ndarray, width: int) -> int:
    """Bits of Rice coding the numbers ``x`` (>= 0) with the best parameter, as the codec's
    writer codes them: ``q = x >> k`` zeros, a one and k low bits, or, for ``q >= width``, an
    escape of ``width`` zeros and the number in ``width`` bits."""
    if x.size == 0:
        return 0
    x = x.astype(np.uint64, copy=False)
    best = -1
    for k in range(min(width, 32)):
        q = x >> np.uint64(k)
        bits = int(np.where(q < width, q + 1 + k, 2 * width).sum())
        if best < 0 or bits < best:
            best = bits
    return best


def classed_rice_bytes_per_change(
    layout: Layout,
    ref: np.ndarray,
    cur: np.ndarray,
    classes: int = 8,
    item_elems: int = 1 << 20,
) -> tuple[int, float]:
    """(changed elements, bytes per changed element) of a coding the codec does not have yet:
    today's Rice coding, but per class of reference exponent within each record.

    Per record (an item of ``item_elems`` elements with changes) the sender would send a
    pivot: the median exponent of its changed elements (a byte). Element e's class is then
    ``clip(exponent(e) - pivot + classes // 2, 0, classes - 1)``, which the receiver computes
    from its reference too. Each class's changes are coded as Rice gaps counted in members of
    that class, and their ordered-delta values with the class's own Rice parameter (exact
    sizes with the best parameters, plus ``CLASS_HEADER_BITS`` per class that changed and a
    bit per class saying whether it did). Tensors without an exponent are one class. This
    prices the idea before building it: how much of what conditioning on the reference
    gains survives with coding as cheap as today's (a decoder would still walk every
    element's exponent to find the positions)."""
    changed = 0
    bits = 0
    for i, spec in enumerate(layout.tensors):
        a, b = layout.view(ref, i), layout.view(cur, i)
        field = EXPONENT.get(spec.dtype)
        is_float = dtype_of(spec.dtype).kind == "float"
        width = spec.itemsize * 8
        for s in range(0, spec.numel, item_elems):
            ra, rb = a[s : s + item_elems], b[s : s + item_elems]
            diff = ra != rb
            c = int(diff.sum())
            if c == 0:
                continue
            changed += c
            values = encode_values(rb[diff], ra[diff], VAL_ORDERED_DELTA, is_float)
            values = values.astype(np.uint64) - np.uint64(1)
            if field is None or classes == 1:
                cls = np.zeros(ra.size, np.int64)
                bits += 1  # one class, one presence bit
            else:
                exponent = ((ra >> ra.dtype.type(field[0])) & field[1]).astype(np.int64)
                pivot = int(np.median(exponent[diff]))
                cls = np.clip(exponent - pivot + classes // 2, 0, classes - 1)
                bits += 8 + classes  # the pivot, then a presence bit per class
            changed_cls = cls[diff]
            for k in np.unique(changed_cls):
                local = np.flatnonzero(diff[cls == k])
                gaps = np.diff(local, prepend=-1) - 1
                bits += CLASS_HEADER_BITS + rice_bits(gaps, 32)
                bits += rice_bits(values[changed_cls == k], width)
    if changed == 0:
        return 0, 0.0
    return changed, bits / changed / 8.0
