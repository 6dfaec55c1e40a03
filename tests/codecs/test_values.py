"""The value codings of values.py: the ordered map, zigzag, encode/decode and byte planes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.codecs.frame import VAL_ORDERED_DELTA, VAL_RAW, VAL_XOR
from deltarl.codecs.values import (
    decode_values,
    encode_values,
    from_ordered,
    from_planes,
    to_ordered,
    to_planes,
    unzigzag,
    zigzag,
)

ALL16 = np.arange(1 << 16, dtype=np.uint64).astype(np.uint16)
ALL8 = np.arange(1 << 8, dtype=np.uint16).astype(np.uint8)
WIDTHS = [np.uint8, np.uint16, np.uint32, np.uint64]


def sample(bits: type, n: int = 5000, seed: int = 0) -> np.ndarray:
    """Random patterns plus the edges: 0, 1, the sign bit, all ones, the largest positive."""
    w = np.dtype(bits).itemsize * 8
    rng = np.random.default_rng(seed)
    edges = np.array(
        [0, 1, 2, 1 << (w - 1), (1 << w) - 1, (1 << (w - 1)) - 1, (1 << (w - 1)) + 1], np.uint64
    ).astype(bits)
    return np.concatenate([edges, rng.integers(0, 1 << 64, n, dtype=np.uint64).astype(bits)])


# -- the ordered map ------------------------------------------------------------------------------


@pytest.mark.parametrize("is_float", [True, False])
def test_to_ordered_is_an_involution_on_every_16bit_pattern(is_float: bool) -> None:
    once = to_ordered(ALL16, is_float)
    assert once.dtype == np.uint16
    assert np.array_equal(from_ordered(once, is_float), ALL16)
    assert np.unique(once).size == ALL16.size  # a bijection


@pytest.mark.parametrize("bits", WIDTHS)
def test_to_ordered_is_an_involution_on_every_width(bits: type) -> None:
    x = sample(bits)
    assert np.array_equal(to_ordered(to_ordered(x, True), True), x)
    assert np.array_equal(to_ordered(x, False), x)  # ints are already in order


def _assert_order_matches(bits: np.ndarray, values: np.ndarray, signed: type) -> None:
    """Sorted by float value, the ordered patterns (as signed ints) ascend; strictly where the
    values differ, and +0.0/-0.0 (equal values) are put apart, -0.0 first."""
    ordered = to_ordered(bits, True).view(signed)
    by_value = np.lexsort((ordered, values))
    o, v = ordered[by_value], values[by_value]
    assert np.all(o[1:] > o[:-1])  # no two patterns map to one integer, none out of order
    assert np.all((v[1:] > v[:-1]) | (v[1:] == 0))  # the only ties are the zeros


def test_to_ordered_is_monotonic_on_float16() -> None:
    values = ALL16.view(np.float16)
    keep = ~np.isnan(values)  # every finite value, both infinities, both zeros, subnormals
    _assert_order_matches(ALL16[keep], values[keep].astype(np.float64), np.int16)
    # -0.0 sorts just below +0.0: adjacent, distinct
    z = to_ordered(np.array([0x8000, 0x0000], np.uint16), True).view(np.int16)
    assert z.tolist() == [-1, 0]


def test_to_ordered_is_monotonic_on_bfloat16() -> None:
    values = (ALL16.astype(np.uint32) << 16).view(np.float32)
    keep = ~np.isnan(values)
    _assert_order_matches(ALL16[keep], values[keep].astype(np.float64), np.int16)


@pytest.mark.parametrize(
    ("bits", "floats", "signed"),
    [(np.uint32, np.float32, np.int32), (np.uint64, np.float64, np.int64)],
)
def test_to_ordered_is_monotonic_on_wide_floats(bits: type, floats: type, signed: type) -> None:
    x = sample(bits, 20000, seed=2)
    values = x.view(floats)
    keep = ~np.isnan(values)
    _assert_order_matches(x[keep], values[keep], signed)


def test_one_ulp_steps_code_to_one_or_two() -> None:
    """The point of the ordered delta: a step to the next float, either way, codes as 1 or 2."""
    rng = np.random.default_rng(4)
    old = rng.normal(0, 0.02, 10000).astype(np.float32)
    up = np.nextafter(old, np.float32(np.inf))
    down = np.nextafter(old, np.float32(-np.inf))
    o = old.view(np.uint32)
    assert set(encode_values(up.view(np.uint32), o, VAL_ORDERED_DELTA, True).tolist()) == {2}
    assert set(encode_values(down.view(np.uint32), o, VAL_ORDERED_DELTA, True).tolist()) == {1}
    # across zero too: +0.0 -> -0.0 -> the negative subnormal next to it
    old = np.array([0x00000000, 0x80000000], np.uint32)
    new = np.array([0x80000000, 0x80000001], np.uint32)
    assert encode_values(new, old, VAL_ORDERED_DELTA, True).tolist() == [1, 1]


# -- zigzag ---------------------------------------------------------------------------------------


def test_zigzag_is_a_bijection_on_every_16bit_pattern() -> None:
    z = zigzag(ALL16)
    assert z.dtype == np.uint16
    assert np.unique(z).size == ALL16.size
    assert np.array_equal(unzigzag(z), ALL16)
    assert np.array_equal(zigzag(unzigzag(ALL16)), ALL16)


def test_zigzag_folds_small_signed_numbers() -> None:
    d = np.array([0, -1, 1, -2, 2, -32768, 32767], np.int16).view(np.uint16)
    assert zigzag(d).tolist() == [0, 1, 2, 3, 4, 65535, 65534]
    assert zigzag(ALL8).dtype == np.uint8  # no widening
    assert np.array_equal(unzigzag(zigzag(ALL8)), ALL8)


@pytest.mark.parametrize("bits", WIDTHS)
def test_zigzag_inverse_on_every_width(bits: type) -> None:
    x = sample(bits)
    assert np.array_equal(unzigzag(zigzag(x)), x)
    assert np.array_equal(zigzag(unzigzag(x)), x)
    assert zigzag(x).dtype == x.dtype


# -- encode_values / decode_values --------------------------------------------------------------


@pytest.mark.parametrize("coding", [VAL_ORDERED_DELTA, VAL_XOR, VAL_RAW])
@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("is_float", [True, False])
def test_encode_decode_values_round_trip(coding: int, bits: type, is_float: bool) -> None:
    new = sample(bits, seed=1)
    old = sample(bits, seed=2)
    old[::3] = new[::3] + bits(1)  # one-unit steps
    coded = encode_values(new, old, coding, is_float)
    assert coded.dtype == new.dtype
    assert np.array_equal(decode_values(coded, old, coding, is_float), new)
    if coding == VAL_RAW:
        assert np.array_equal(coded, new)
    if coding == VAL_XOR:
        assert np.array_equal(coded, new ^ old)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)), max_size=50),
    coding=st.sampled_from([VAL_ORDERED_DELTA, VAL_XOR]),
    is_float=st.booleans(),
)
def test_encode_decode_values_any_16bit(pairs: list, coding: int, is_float: bool) -> None:
    arr = np.array(pairs, np.uint16).reshape(-1, 2)
    new, old = arr[:, 0].copy(), arr[:, 1].copy()
    coded = encode_values(new, old, coding, is_float)
    assert np.array_equal(decode_values(coded, old, coding, is_float), new)
    assert np.array_equal(coded == 0, new == old)  # an unchanged element, and only that, codes 0


def test_value_coding_errors() -> None:
    x = np.zeros(3, np.uint16)
    for coding in (VAL_ORDERED_DELTA, VAL_XOR):
        with pytest.raises(ValueError, match="needs the reference values"):
            encode_values(x, None, coding, True)
        with pytest.raises(ValueError, match="needs the reference values"):
            decode_values(x, None, coding, True)
    with pytest.raises(ValueError, match="unknown value coding 9"):
        encode_values(x, x, 9, True)
    with pytest.raises(ValueError, match="unknown value coding 9"):
        decode_values(x, x, 9, True)
    assert encode_values(x, None, VAL_RAW, True) is x


# -- byte planes --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_planes_round_trip(bits: type, n: int) -> None:
    x = sample(bits)[:n]
    planes = to_planes(x)
    isz = np.dtype(bits).itemsize
    assert planes.shape == (isz, n)
    assert planes.dtype == np.uint8
    assert planes.flags.c_contiguous
    for p in range(isz):  # row p is byte p, little-endian
        assert np.array_equal(planes[p], ((x.astype(np.uint64) >> np.uint64(8 * p)) & 0xFF))
    back = from_planes(planes, np.dtype(bits))
    assert back.dtype == np.dtype(bits)
    assert np.array_equal(back, x)
