"""What the encoder builds: sparse-kernel scratch, records, and chunks packed for the wire.

Packing (``pack_chunk``) turns a wave's records into the frame that goes on the wire
(codecs/frame.py): the records' header table, a stream table, and the streams: Rice
positions, bitmaps, Rice values (stored raw: they are near their entropy already) and the
byte planes of dense records (zstd). The checksum covers the header prefix and the whole
body, so a receiver checks a chunk before it reads any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltarl.codecs.checksum import chunk_checksum
from deltarl.codecs.compression import PlaneCompressor
from deltarl.codecs.frame import (
    HEADER_SIZE,
    NO_BASE,
    POS_BITMAP,
    POS_CONDITIONED,
    POS_RICE,
    RECORD,
    STREAM_BITMAP,
    STREAM_CONDITIONED,
    STREAM_PLANE0,
    STREAM_RICE,
    STREAM_VALUES,
    FrameHeader,
    RecordHeader,
    StreamHeader,
)
from deltarl.codecs.values import to_planes

# An item's class table at most: two bytes of head and a 5-bit parameter for each of 256
# classes (kernels.CLASS_BITS, CLASS_K_BITS), rounded up to whole words.
CLASS_TABLE_BYTES = 168


@dataclass
class SparseScratch:
    """Output arrays of the sparse kernel, sized for the worst case, reused across versions.

    Worst cases per element of an item: one position (uint32) and one coded value;
    a Rice-coded gap costs at most 64 bits (unary < 32 plus k < 32, or the 32-bit escape plus
    32 bits), a coded value at most twice its width (escape plus the value), and an item's
    value stream at most CLASS_TABLE_BYTES more (values coded by class open with a table).
    Pages that are never written are never committed, so the reservation costs address
    space, not memory.
    """

    pos: np.ndarray
    zval: np.ndarray
    cls: np.ndarray  # uint8: each changed element's class (values coded by class)
    pos_dst: np.ndarray
    val_dst: np.ndarray
    items: int  # the items whose class tables val_dst has room for

    @classmethod
    def sized(cls, elems: int, itemsize: int, items: int) -> SparseScratch:
        return cls(
            np.empty(elems, np.uint32),
            np.empty(elems, np.uint64),
            np.empty(elems, np.uint8),
            np.empty(elems * 8 + 8, np.uint8),
            np.empty(elems * 2 * itemsize + items * CLASS_TABLE_BYTES + 8, np.uint8),
            items,
        )


@dataclass(frozen=True)
class Chunk:
    """One encoded chunk, ready for the wire."""

    chunk_id: int
    data: bytes
    checksum: int
    n_records: int


@dataclass
class Record:
    header: RecordHeader
    pos: bytes | memoryview = b""  # Rice, bitmap or conditioned bytes (sparse records)
    vals: bytes | memoryview = b""  # Rice-coded values (sparse records)
    planes: np.ndarray | None = None  # coded values to split into byte planes (dense records)

    @property
    def raw_bytes(self) -> int:
        dense = 0 if self.planes is None else self.planes.nbytes
        return RECORD.size + len(self.pos) + len(self.vals) + dense


@dataclass
class TensorTally:
    coding: str = "unchanged"
    changed: int = 0
    wire_bytes: float = 0.0
    digest: str = ""


def pack_chunk(
    compressor: PlaneCompressor,
    kind: int,
    base: int | None,
    target: int,
    chunk_id: int,
    records: list[Record],
    tallies: list[TensorTally],
) -> Chunk:
    table = b"".join(r.header.pack() for r in records)
    raw_streams: list[tuple[int, bytes | memoryview]] = []
    for skind, parts in (
        (STREAM_RICE, [r.pos for r in records if r.header.pos_coding == POS_RICE]),
        (STREAM_BITMAP, [r.pos for r in records if r.header.pos_coding == POS_BITMAP]),
        (STREAM_VALUES, [r.vals for r in records if r.vals]),
        (STREAM_CONDITIONED, [r.pos for r in records if r.header.pos_coding == POS_CONDITIONED]),
    ):
        if parts:
            raw_streams.append((skind, b"".join(parts)))
    dense = [r for r in records if r.planes is not None]
    planes = [to_planes(r.planes) for r in dense if r.planes is not None]
    for p in range(max((r.header.itemsize for r in dense), default=0)):
        parts = [pl[p] for pl, r in zip(planes, dense, strict=True) if r.header.itemsize > p]
        raw_streams.append((STREAM_PLANE0 + p, b"".join(memoryview(x) for x in parts)))

    # Rice and range-coded streams are near their entropy already; only bitmaps and planes
    # go to zstd.
    streams: list[tuple[StreamHeader, bytes | memoryview]] = []
    ratio: dict[int, float] = {}
    for skind, raw in raw_streams:
        if skind in (STREAM_RICE, STREAM_VALUES, STREAM_CONDITIONED):
            comp, wire = 0, raw
        else:
            comp, wire = compressor.compress(raw)
        streams.append((StreamHeader(skind, comp, len(raw), len(wire)), wire))
        ratio[skind] = len(wire) / max(1, len(raw))

    stream_table = b"".join(h.pack() for h, _ in streams)
    body_parts: list[bytes | memoryview] = [table, stream_table, *(w for _, w in streams)]
    body_len = sum(len(p) for p in body_parts)
    raw_len = sum(h.raw_len for h, _ in streams)
    header = FrameHeader(
        kind,
        NO_BASE if base is None else base,
        target,
        chunk_id,
        len(records),
        len(streams),
        body_len,
        raw_len,
        0,
    )
    prefix = header.pack_prefix()
    checksum = chunk_checksum([prefix, *body_parts])
    data = b"".join([prefix, checksum.to_bytes(8, "little"), *body_parts])

    # Attribute wire bytes to tensors: exact for Rice streams (stored raw), pro rata for
    # zstd streams, and the chunk's fixed overhead shared equally among its records.
    overhead = (HEADER_SIZE + len(stream_table)) / max(1, len(records))
    for r in records:
        h = r.header
        share = RECORD.size + overhead + len(r.vals)
        share += len(r.pos) * (ratio.get(STREAM_BITMAP, 1.0) if h.pos_coding == POS_BITMAP else 1.0)
        if r.planes is not None:
            share += sum(ratio[STREAM_PLANE0 + p] * r.planes.size for p in range(h.itemsize))
        tallies[h.tensor_id].wire_bytes += share
    return Chunk(chunk_id, data, checksum, len(records))
