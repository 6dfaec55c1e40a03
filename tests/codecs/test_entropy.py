"""The entropy bounds of entropy.py (i.i.d. with XOR values, i.i.d. with ordered-delta values,
conditioned on the reference and the previous delta), on cases whose answer is known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deltarl.codecs.entropy import (
    CLASS_HEADER_BITS,
    binary_entropy,
    change_contexts,
    changed_mask,
    classed_rice_bytes_per_change,
    conditioned_bound_bytes_per_change,
    empirical_entropy_bits,
    iid_bound_bytes_per_change,
    ordered_bound_bytes_per_change,
    rice_bits,
)
from deltarl.engine.layout import Layout


@pytest.mark.parametrize("p", [0.0, 1.0, -0.5, 1.5, -math.inf, math.inf])
def test_binary_entropy_is_zero_at_and_beyond_the_ends(p: float) -> None:
    assert binary_entropy(p) == 0.0


def test_binary_entropy_known_values() -> None:
    assert binary_entropy(0.5) == pytest.approx(1.0)
    assert binary_entropy(0.25) == pytest.approx(0.8112781244591328)
    assert binary_entropy(0.11) == pytest.approx(0.4999, abs=1e-3)
    assert binary_entropy(1e-300) == pytest.approx(0.0, abs=1e-290)
    for p in (0.01, 0.2, 0.37):
        assert binary_entropy(p) == pytest.approx(binary_entropy(1 - p))
        assert 0.0 < binary_entropy(p) < 1.0


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_empirical_entropy_of_a_known_distribution(dtype: type) -> None:
    # probabilities 1/2, 1/4, 1/8, 1/8: 1.75 bits a symbol, 14 bits for these 8
    symbols = np.array([7, 7, 7, 7, 200, 200, 3, 0], dtype)
    assert empirical_entropy_bits(symbols) == pytest.approx(14.0)
    assert empirical_entropy_bits(np.repeat(symbols, 5)) == pytest.approx(70.0)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_empirical_entropy_edges(dtype: type) -> None:
    assert empirical_entropy_bits(np.zeros(0, dtype)) == 0.0
    assert empirical_entropy_bits(np.full(100, 5, dtype)) == 0.0
    top = np.iinfo(dtype).max
    assert empirical_entropy_bits(np.array([0, top], dtype)) == pytest.approx(2.0)
    # n distinct symbols: log2(n) bits each
    assert empirical_entropy_bits(np.arange(256).astype(dtype)) == pytest.approx(256 * 8.0)


def test_iid_bound_on_a_hand_computed_delta() -> None:
    layout = Layout.pack([("a", "uint8", (8,)), ("b", "bfloat16", (8,)), ("c", "int8", (0,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    assert iid_bound_bytes_per_change(layout, ref, ref.copy()) == (0, 0.0)
    cur = ref.copy()
    layout.view(cur, "a")[:4] = 1  # xor 1, four times
    layout.view(cur, "b")[:4] = 3  # xor 3, four times
    changed, bound = iid_bound_bytes_per_change(layout, ref, cur)
    assert changed == 8
    # positions: 16 elements, 8 changed: 16 bits; values: one symbol per width: 0 bits
    assert bound == pytest.approx(16 / 8 / 8)


ONE = 0x3F80  # bf16 1.0: exponent 127
FOUR = 0x4080  # bf16 4.0: exponent 129


def test_the_ordered_bound_prices_the_symbols_the_codec_codes() -> None:
    """Four bf16 1.0s, two moved up by one ulp and none down: the XOR of 0x3F80 and 0x3F81
    is 1 (0x3F81 ^ 0x3F82 would be 3: a carry); here both XORs are 1, both ordered deltas +1,
    so both bounds price the values at 0 bits. Moving one up and one down makes XORs 1 and
    0xFF (0x3F80 ^ 0x3F7F) and ordered deltas +1 and -1: both one bit a value."""
    layout = Layout.pack([("w", "bfloat16", (4,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    layout.view(ref, "w")[:] = ONE
    assert ordered_bound_bytes_per_change(layout, ref, ref.copy()) == (0, 0.0)
    cur = ref.copy()
    layout.view(cur, "w")[:2] = ONE + 1
    assert ordered_bound_bytes_per_change(layout, ref, cur) == (2, pytest.approx(4 / 2 / 8))
    layout.view(cur, "w")[1] = ONE - 1
    changed, ordered = ordered_bound_bytes_per_change(layout, ref, cur)
    assert (changed, ordered) == (2, pytest.approx((4 + 2) / 2 / 8))
    assert iid_bound_bytes_per_change(layout, ref, cur)[1] == pytest.approx((4 + 2) / 2 / 8)


def test_a_carry_costs_the_xor_bound_bits_the_ordered_bound_does_not() -> None:
    """0x3F81 -> 0x3F82 and 0x3F80 -> 0x3F81: XORs 3 and 1 (two symbols: one bit each), both
    ordered deltas +1 (one symbol: no bits)."""
    layout = Layout.pack([("w", "bfloat16", (2,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    layout.view(ref, "w")[:] = [ONE + 1, ONE]
    cur = ref.copy()
    layout.view(cur, "w")[:] = [ONE + 2, ONE + 1]
    assert iid_bound_bytes_per_change(layout, ref, cur)[1] == pytest.approx(2 / 2 / 8)
    assert ordered_bound_bytes_per_change(layout, ref, cur)[1] == pytest.approx(0.0)


def test_contexts_are_the_tensor_the_exponent_and_the_previous_change() -> None:
    layout = Layout.pack([("a", "bfloat16", (2,)), ("b", "int8", (2,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    layout.view(ref, "a")[:] = [ONE, FOUR]
    ids, count = change_contexts(layout, ref, np.array([True, False, False, True]))
    assert ids[0] == 127 * 2 + 1
    assert ids[1] == 129 * 2
    assert ids[2] == count // 2  # tensor b, no exponent (an int), not changed before
    assert ids[3] == count // 2 + 1
    assert len(set(ids.tolist())) == 4
    assert (change_contexts(layout, ref, None)[0] % 2 == 0).all()  # no previous delta


def _half_moving() -> tuple[Layout, np.ndarray, np.ndarray]:
    """64 bf16 elements alternating 1.0 and 4.0; the delta moves every 1.0 up one ulp."""
    layout = Layout.pack([("w", "bfloat16", (64,))])
    ref = np.zeros(layout.nbytes, np.uint8)
    w = layout.view(ref, "w")
    w[::2], w[1::2] = ONE, FOUR
    cur = ref.copy()
    layout.view(cur, "w")[::2] = ONE + 1
    return layout, ref, cur


def test_the_conditioned_bound_sees_what_the_reference_predicts() -> None:
    """64 elements: the 32 at 1.0 all move one ulp, the 32 at 4.0 never do. Blind to the
    exponent, the positions cost 64 bits (p = 1/2); conditioned on it, each context is
    certain, and what is left is an adaptive coder's cost of learning two probabilities and
    one value distribution: half a bit x log2(32) each."""
    layout, ref, cur = _half_moving()
    changed, ordered = ordered_bound_bytes_per_change(layout, ref, cur)
    assert (changed, ordered) == (32, pytest.approx(64 / 32 / 8))
    _, conditioned = conditioned_bound_bytes_per_change(layout, ref, cur)
    regret = 3 * 0.5 * math.log2(32)
    assert conditioned == pytest.approx(regret / 32 / 8)
    # the previous delta changed the same elements: the context says so too
    previous = changed_mask(layout, ref, cur)
    assert previous.sum() == 32
    _, again = conditioned_bound_bytes_per_change(layout, ref, cur, previous)
    assert again == pytest.approx(regret / 32 / 8)


def _rice_by_hand(x: list[int], width: int) -> int:
    return min(
        sum(v // 2**k + 1 + k if v // 2**k < width else 2 * width for v in x)
        for k in range(min(width, 32))
    )


@pytest.mark.parametrize("width", [16, 32])
def test_rice_bits_is_the_best_parameter_s_exact_size_escapes_included(width: int) -> None:
    rng = np.random.default_rng(7)
    for x in ([0], [5, 0, 3], list(rng.geometric(0.05, 200)), [0] * 50 + [1 << (width - 1)]):
        assert rice_bits(np.array(x, np.uint64), width) == _rice_by_hand(x, width)
    assert rice_bits(np.array([], np.uint64), width) == 0


def test_rice_per_exponent_class_prices_what_the_reference_predicts() -> None:
    """The 64 elements of the conditioned bound's case: the 32 at 1.0 all move one ulp, the 32
    at 4.0 never do. One class for all: gaps 0, 1, 1, ... (63 bits at k = 0) and values of
    one ulp (zigzag 2, coded as 1: 64 bits). Classed around the changed elements' median
    exponent (1.0's), the elements at 1.0 are one class whose gaps are all 0 (32 bits), the
    elements at 4.0 another that never changed (its presence bit only)."""
    layout, ref, cur = _half_moving()
    changed, one = classed_rice_bytes_per_change(layout, ref, cur, classes=1)
    assert (changed, one) == (32, pytest.approx((1 + CLASS_HEADER_BITS + 63 + 64) / 32 / 8))
    _, eight = classed_rice_bytes_per_change(layout, ref, cur, classes=8)
    assert eight == pytest.approx((8 + 8 + CLASS_HEADER_BITS + 32 + 64) / 32 / 8)
    # an integer tensor has no exponent: one class, whatever ``classes`` says
    ints = Layout.pack([("n", "int32", (64,))])
    a = np.zeros(ints.nbytes, np.uint8)
    b = a.copy()
    ints.view(b, "n")[::2] = 1
    assert classed_rice_bytes_per_change(ints, a, b, classes=8) == classed_rice_bytes_per_change(
        ints, a, b, classes=1
    )
    assert classed_rice_bytes_per_change(layout, ref, ref) == (0, 0.0)
