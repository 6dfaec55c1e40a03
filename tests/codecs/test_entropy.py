"""The i.i.d. entropy bound of entropy.py, on cases whose answer is known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deltarl.codecs.entropy import (
    binary_entropy,
    empirical_entropy_bits,
    iid_bound_bytes_per_change,
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
