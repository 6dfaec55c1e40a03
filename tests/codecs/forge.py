"""Forging chunks for the fault tests: take a real chunk apart, edit it, seal it again.

A forged chunk carries a correct xxh3-64, so it passes the checksum and has to be caught by
the decoder's validation. ``rice_write`` is an independent Python model of the kernels' Rice
code (kernels.py describes it), used to write position and value streams by hand.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import zstandard

from deltarl.codecs.checksum import chunk_checksum
from deltarl.codecs.frame import (
    CHECKSUM_OFFSET,
    COMP_NONE,
    COMP_ZSTD,
    HEADER,
    HEADER_SIZE,
    POS_BITMAP,
    POS_CONDITIONED,
    POS_DENSE,
    POS_RICE,
    RECORD,
    STREAM,
    STREAM_BITMAP,
    STREAM_CONDITIONED,
    STREAM_PLANE0,
    STREAM_RICE,
    STREAM_VALUES,
    RecordHeader,
)

# Header field offsets (frame.py's table).
OFF_FORMAT, OFF_KIND, OFF_FLAGS, OFF_BASE, OFF_TARGET = 4, 6, 7, 8, 16
OFF_CHUNK_ID, OFF_N_RECORDS, OFF_N_STREAMS, OFF_RESERVED = 24, 28, 32, 36
OFF_BODY_LEN, OFF_RAW_LEN = 40, 48


def reseal(data: bytes | bytearray) -> bytes:
    """The same bytes with the checksum recomputed over header[0:56] + body."""
    buf = bytearray(data)
    cs = chunk_checksum([bytes(buf[:CHECKSUM_OFFSET]), bytes(buf[HEADER_SIZE:])])
    struct.pack_into("<Q", buf, CHECKSUM_OFFSET, cs)
    return bytes(buf)


def patch(data: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    """Overwrite one little-endian field and reseal."""
    buf = bytearray(data)
    struct.pack_into("<" + fmt, buf, offset, value)
    return reseal(buf)


@dataclasses.dataclass
class Stream:
    kind: int
    compression: int
    raw: bytes  # decompressed
    wire: bytes | None = None  # what goes on the wire, when it must not be derived from raw


@dataclasses.dataclass
class Forged:
    """A chunk taken apart: header fields, records, decompressed streams."""

    kind: int
    base: int
    target: int
    chunk_id: int
    records: list[RecordHeader]
    streams: list[Stream]

    @classmethod
    def parse(cls, data: bytes) -> Forged:
        f = HEADER.unpack_from(data)
        n_records, n_streams = f[7], f[8]
        body = memoryview(data)[HEADER_SIZE:]
        records = [RecordHeader.unpack_from(body, i * RECORD.size) for i in range(n_records)]
        off = n_records * RECORD.size
        at = off + n_streams * STREAM.size
        streams = []
        for i in range(n_streams):
            kind, comp, _, _, raw_len, wire_len = STREAM.unpack_from(body, off + i * STREAM.size)
            wire = bytes(body[at : at + wire_len])
            at += wire_len
            raw = zstandard.ZstdDecompressor().decompress(wire) if comp == COMP_ZSTD else wire
            assert len(raw) == raw_len
            streams.append(Stream(kind, comp, raw))
        return cls(f[2], f[4], f[5], f[6], records, streams)

    def seal(self) -> bytes:
        """Consistent framing (sizes, raw length, checksum) for whatever the parts say."""
        wires = [
            s.wire
            if s.wire is not None
            else zstandard.ZstdCompressor(write_content_size=True).compress(s.raw)
            if s.compression == COMP_ZSTD
            else s.raw
            for s in self.streams
        ]
        table = b"".join(r.pack() for r in self.records)
        stable = b"".join(
            STREAM.pack(s.kind, s.compression, 0, 0, len(s.raw), len(w))
            for s, w in zip(self.streams, wires, strict=True)
        )
        body = table + stable + b"".join(wires)
        raw_len = sum(len(s.raw) for s in self.streams)
        head = HEADER.pack(
            b"DRLF",
            1,
            self.kind,
            0,
            self.base,
            self.target,
            self.chunk_id,
            len(self.records),
            len(self.streams),
            0,
            len(body),
            raw_len,
            0,
        )
        return reseal(head + body)

    # -- navigation ------------------------------------------------------------------------

    def stream(self, kind: int) -> Stream:
        (s,) = [s for s in self.streams if s.kind == kind]
        return s

    def first(self, pos_coding: int, itemsize: int | None = None) -> int:
        """Index of the first record with this position coding (and element width)."""
        return next(
            i
            for i, r in enumerate(self.records)
            if r.pos_coding == pos_coding and itemsize in (None, r.itemsize)
        )

    def part(self, i: int, kind: int) -> tuple[int, int]:
        """(offset, length) of record i's part in the stream ``kind`` (raw bytes)."""
        at = 0
        for j, r in enumerate(self.records):
            if kind == STREAM_VALUES and r.pos_coding != POS_DENSE:
                n = r.val_len
            elif (
                (kind == STREAM_RICE and r.pos_coding == POS_RICE)
                or (kind == STREAM_BITMAP and r.pos_coding == POS_BITMAP)
                or (kind == STREAM_CONDITIONED and r.pos_coding == POS_CONDITIONED)
            ):
                n = r.pos_len
            elif kind >= STREAM_PLANE0 and r.pos_coding == POS_DENSE:
                n = r.length if r.itemsize > kind - STREAM_PLANE0 else 0
            else:
                n = 0
            if j == i:
                return at, n
            at += n
        raise IndexError(i)

    def replace_part(self, i: int, kind: int, new: bytes) -> None:
        """Put ``new`` in place of record i's part of stream ``kind``, and fix its length."""
        at, n = self.part(i, kind)
        s = self.stream(kind)
        s.raw = s.raw[:at] + new + s.raw[at + n :]
        r = self.records[i]
        field = "val_len" if kind == STREAM_VALUES else "pos_len"
        if kind in (STREAM_VALUES, STREAM_RICE, STREAM_BITMAP, STREAM_CONDITIONED):
            self.records[i] = dataclasses.replace(r, **{field: len(new)})

    def edit(self, i: int, **changes: int) -> None:
        self.records[i] = dataclasses.replace(self.records[i], **changes)


# -- the Rice code, written independently of the kernels ----------------------------------------


def rice_write(values: list[int], k: int, width: int) -> tuple[bytes, int]:
    """(bytes, bits used): each value as q zeros, a one, k low bits; or width zeros + n in full.

    Bits are packed least-significant first; the last byte is zero-padded.
    """
    bits: list[int] = []
    for n in values:
        q = n >> k
        if q < width:
            bits += [0] * q + [1] + [(n >> b) & 1 for b in range(k)]
        else:
            bits += [0] * width + [(n >> b) & 1 for b in range(width)]
    used = len(bits)
    bits += [0] * (-used % 8)
    packed = np.packbits(np.array(bits, np.uint8), bitorder="little").tobytes()
    return packed, used


def gaps(positions: list[int]) -> list[int]:
    """The Rice-coded numbers of ascending positions: p[0], then p[j] - p[j-1] - 1."""
    out, prev = [], -1
    for p in positions:
        out.append(p - prev - 1)
        prev = p
    return out


def raw_stream(kind: int, raw: bytes) -> Stream:
    return Stream(kind, COMP_NONE, raw)


def build_frame(
    kind: int,
    base: int,
    target: int,
    records: list[RecordHeader],
    streams: list[tuple[int, int, int, bytes]],
) -> bytes:
    """A sealed frame from records and (kind, compression, raw_len, wire) streams, written as
    given: raw lengths may lie about the wire bytes, which need not decompress to them."""
    table = b"".join(r.pack() for r in records)
    stable = b"".join(STREAM.pack(k, c, 0, 0, raw, len(w)) for k, c, raw, w in streams)
    body = table + stable + b"".join(w for *_, w in streams)
    raw_len = sum(raw for _, _, raw, _ in streams)
    fields = (kind, 0, base, target, 0, len(records), len(streams), 0, len(body), raw_len, 0)
    return reseal(HEADER.pack(b"DRLF", 1, *fields) + body)
