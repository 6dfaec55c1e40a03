"""The peers ``deltarl bench codec --peers`` measures the codec against, on the same deltas.

Two sparse-delta coders as their public descriptions give them, written here in numpy (the
bench is their only user), each checked bit for bit by decoding what it encoded:

- ``xor_gaps_zstd``: NeMo-style. Per tensor, the changed positions as gaps (the first from 0)
  in LEB128 varints, and the new values as their XOR with the reference; both streams
  together through zstd at level 1.
- ``absolute_index``: the plain sparse overwrite. Per tensor, each changed element's index as
  a little-endian uint32 and its new value raw; each stream through zstd at level 1.

Their apply is decode + scatter, without the per-tensor checksums the codec's apply verifies;
their encode includes the diff. Both run single-threaded in numpy: their speed is that of this
implementation, not of the systems that describe them, so the bench reports their wire size
as the comparison and their speed for what it is.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from deltarl.engine.layout import Layout

_LEVEL = 1


def leb128(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of every value (uint64), concatenated."""
    v = values.astype(np.uint64)
    nbytes = np.ones(v.size, np.int64)
    rest = v >> np.uint64(7)
    while rest.any():
        nbytes += rest > 0
        rest >>= np.uint64(7)
    out = np.empty(int(nbytes.sum()), np.uint8)
    starts = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    for k in range(int(nbytes.max(initial=0))):
        live = nbytes > k
        byte = ((v[live] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        more = (nbytes[live] > k + 1).astype(np.uint8) << 7
        out[starts[live] + k] = byte | more
    return out.tobytes()


def unleb128(data: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """The first ``count`` LEB128 values of ``data`` (uint8) and the bytes they took."""
    ends = np.flatnonzero((data & 0x80) == 0)[:count]
    if ends.size < count:
        raise ValueError("LEB128 stream ends early")
    used = int(ends[-1]) + 1 if count else 0
    body = data[:used]
    starts = np.concatenate(([0], ends[:-1] + 1)) if count else np.zeros(0, np.int64)
    index = np.arange(used) - np.repeat(starts, np.diff(np.append(starts, used)))
    parts = (body & 0x7F).astype(np.uint64) << (7 * index).astype(np.uint64)
    return np.add.reduceat(parts, starts) if count else np.zeros(0, np.uint64), used


def _changed(layout: Layout, ref: np.ndarray, cur: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(layout.view(ref, i) != layout.view(cur, i)) for i in range(len(layout))]


def encode_xor_gaps(layout: Layout, ref: np.ndarray, cur: np.ndarray) -> bytes:
    parts = []
    for i, pos in enumerate(_changed(layout, ref, cur)):
        a, b = layout.view(ref, i), layout.view(cur, i)
        gaps = np.diff(pos, prepend=0) if pos.size else pos
        if pos.size:
            gaps[1:] -= 1  # a gap of 0: the next element
        parts += [struct.pack("<Q", pos.size), leb128(gaps), (a[pos] ^ b[pos]).tobytes()]
    return zstandard.ZstdCompressor(level=_LEVEL).compress(b"".join(parts))


def apply_xor_gaps(layout: Layout, target: np.ndarray, data: bytes) -> None:
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(data), np.uint8)
    at = 0
    for i in range(len(layout)):
        (count,) = struct.unpack_from("<Q", raw, at)
        at += 8
        gaps, used = unleb128(raw[at:], count)
        at += used
        pos = np.cumsum(gaps.astype(np.int64) + 1) - 1 if count else gaps.astype(np.int64)
        t = layout.view(target, i)
        xor = raw[at : at + count * t.itemsize].view(t.dtype)
        at += count * t.itemsize
        t[pos] ^= xor
    if at != raw.size:
        raise ValueError("trailing bytes")


def encode_absolute(layout: Layout, ref: np.ndarray, cur: np.ndarray) -> bytes:
    index, values = [], []
    for i, pos in enumerate(_changed(layout, ref, cur)):
        index += [struct.pack("<Q", pos.size), pos.astype("<u4").tobytes()]
        values.append(layout.view(cur, i)[pos].tobytes())
    c = zstandard.ZstdCompressor(level=_LEVEL)
    first = c.compress(b"".join(index))
    return struct.pack("<Q", len(first)) + first + c.compress(b"".join(values))


def apply_absolute(layout: Layout, target: np.ndarray, data: bytes) -> None:
    (n,) = struct.unpack_from("<Q", data, 0)
    d = zstandard.ZstdDecompressor()
    index = np.frombuffer(d.decompress(data[8 : 8 + n]), np.uint8)
    values = np.frombuffer(d.decompress(data[8 + n :]), np.uint8)
    at = vat = 0
    for i in range(len(layout)):
        (count,) = struct.unpack_from("<Q", index, at)
        at += 8
        pos = index[at : at + 4 * count].view("<u4")
        at += 4 * count
        t = layout.view(target, i)
        t[pos] = values[vat : vat + count * t.itemsize].view(t.dtype)
        vat += count * t.itemsize


@dataclass(frozen=True)
class Peer:
    name: str
    encode: Callable[[Layout, np.ndarray, np.ndarray], bytes]
    apply: Callable[[Layout, np.ndarray, bytes], None]


PEERS = (
    Peer("xor_gaps_zstd", encode_xor_gaps, apply_xor_gaps),
    Peer("absolute_index", encode_absolute, apply_absolute),
)
