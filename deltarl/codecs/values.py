"""Value codings: how the new bits of a carried element are written, and byte planes.

The ordered delta is the default for deltas. An optimizer step at RL learning rates moves
most changed bf16 values by one unit in the last place. Their XOR with the reference is a
carry pattern (0x0001, 0x0003, 0x0007, ...) whose length depends on the reference's low
bits, so it costs two to three bits; the difference of the two bit patterns, taken in an
order where adjacent floats are adjacent integers, is +1 or -1 and costs about one bit.

The mapping to that order is a bijection on bit patterns (NaN payloads, -0.0 and +0.0
included), and the difference wraps, so the coding is lossless for every input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deltarl.codecs.frame import VAL_ORDERED_DELTA, VAL_RAW, VAL_XOR

UInt = np.ndarray[Any, np.dtype[np.unsignedinteger[Any]]]


def _masks(bits: np.dtype[Any]) -> tuple[Any, Any, Any]:
    width = bits.itemsize * 8
    t = bits.type
    return t(width - 1), t((1 << (width - 1)) - 1), t(1)


def to_ordered(x: UInt, is_float: bool) -> UInt:
    """Map float bit patterns to integers in numeric order (negatives reversed); ints as is."""
    if not is_float:
        return x
    shift, magnitude, _ = _masks(x.dtype)
    # A set sign bit means "count downwards": flip the magnitude bits. The sign bit is kept,
    # so the map is its own inverse.
    return x ^ ((x >> shift) * magnitude)


from_ordered = to_ordered  # the map is an involution


def zigzag(d: UInt) -> UInt:
    """Fold a wrapped signed difference into small unsigned numbers: 0,-1,1,-2 -> 0,1,2,3."""
    _, _, one = _masks(d.dtype)
    signed = d.view(np.dtype(f"<i{d.dtype.itemsize}"))
    # Arithmetic shift of the signed view: all ones for negatives, zero otherwise. The shift
    # count has the signed type so numpy does not widen the result.
    sign = signed >> signed.dtype.type(d.dtype.itemsize * 8 - 1)
    return (d << one) ^ sign.view(d.dtype)


def unzigzag(z: UInt) -> UInt:
    _, _, one = _masks(z.dtype)
    return (z >> one) ^ (-(z & one))


def encode_values(new: UInt, old: UInt | None, coding: int, is_float: bool) -> UInt:
    """The coded values for ``new`` given the reference values ``old`` at the same places."""
    if coding == VAL_RAW:
        return new
    if old is None:
        raise ValueError("a reference-coded value needs the reference values")
    if coding == VAL_XOR:
        return new ^ old
    if coding == VAL_ORDERED_DELTA:
        return zigzag(to_ordered(new, is_float) - to_ordered(old, is_float))
    raise ValueError(f"unknown value coding {coding}")


def decode_values(coded: UInt, old: UInt | None, coding: int, is_float: bool) -> UInt:
    """Invert encode_values: the new bits, from the coded values and the reference."""
    if coding == VAL_RAW:
        return coded
    if old is None:
        raise ValueError("a reference-coded value needs the reference values")
    if coding == VAL_XOR:
        return coded ^ old
    if coding == VAL_ORDERED_DELTA:
        return from_ordered(to_ordered(old, is_float) + unzigzag(coded), is_float)
    raise ValueError(f"unknown value coding {coding}")


def to_planes(values: UInt) -> np.ndarray:
    """Split values into byte planes: row p holds byte p (little-endian) of every value."""
    isz = values.dtype.itemsize
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, isz).T)


def from_planes(planes: np.ndarray, bits: np.dtype[Any]) -> UInt:
    """Join byte planes (itemsize rows of n bytes) back into n values of type ``bits``."""
    return np.ascontiguousarray(planes.T).view(bits).reshape(-1)
