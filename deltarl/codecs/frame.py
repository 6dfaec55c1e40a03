"""The wire format of one chunk: a fixed header, a record table, a stream table, the streams.

Every chunk is independently decodable and self-describing. All integers are little-endian.

    header (64 bytes)
      0  magic        4s   b"DRLF"
      4  format       u16  FORMAT_VERSION
      6  kind         u8   KIND_DELTA | KIND_FULL
      7  flags        u8   0 (reserved, must be 0)
      8  base         i64  base version (NO_BASE for a full version)
     16  target       i64  target version
     24  chunk_id     u32  position of this chunk in its version (0, 1, ...)
     28  n_records    u32
     32  n_streams    u32
     36  reserved     u32  0
     40  body_len     u64  bytes after the header
     48  raw_len      u64  decoded size of all streams (bounded by MAX_RAW_BYTES)
     56  checksum     u64  xxh3-64 of header[0:56] + body: the chunk's wire bytes

    record table: n_records x RECORD (52 bytes), one per tensor range
      tensor_id u32 | pos_coding u8 | val_coding u8 | itemsize u8 | pos_k u8 | val_k u8
      reserved u8 | reserved u16 | start u64 | length u64 | changed u64 | pos_len u64
      val_len u64

    stream table: n_streams x STREAM (24 bytes)
      kind u8 | compression u8 | reserved u16 | reserved u32 | raw_len u64 | wire_len u64

    streams: the payloads, in table order

Streams (each kind at most once per chunk):
- STREAM_RICE: the Rice-coded position gaps (parameter pos_k) of every POS_RICE record, each
  record's part byte-aligned and ``pos_len`` bytes long, in record order;
- STREAM_BITMAP: the little-endian bitmaps of every POS_BITMAP record, ceil(length/8) bytes each;
- STREAM_VALUES: the Rice-coded values (parameter val_k; each coded value minus one, since a
  changed element never codes to zero) of every POS_RICE and POS_BITMAP record, ``val_len``
  bytes each, in record order (kernels.py describes the code and its escape); a VAL_CLASSED
  record's part opens with its class table (first class u8-wide, classes less one u8-wide,
  then a 5-bit parameter per class, bit-packed like the codes; val_k 0), and each value
  takes the parameter of its reference element's class (kernels.CLASS_BITS);
- STREAM_PLANE0 + p: byte p of the coded values of every POS_DENSE record whose itemsize
  exceeds p, in record order (byte planes: bytes of equal significance compress far better);
- STREAM_CONDITIONED: the coded positions and values of every POS_CONDITIONED record,
  ``pos_len`` bytes each, in record order (coded against the reference's exponents, with
  model ``pos_k``: 1 the range coder of conditioned.py, 2 the Rice codes of
  conditioned_rice.py, 3 conditioned_huffman.py's; such a record has no value stream,
  val_len and val_k 0).

Sparse records carry ``changed`` values in STREAM_VALUES; dense ones ``length`` in the planes.

What a decoder allocates is bounded by what it received, before it allocates anything:
- STREAM_RICE and STREAM_VALUES are stored raw (never zstd: they are near their entropy
  anyway), and every Rice code takes at least 1 + k bits, so a sparse record's ``changed``
  is at most 8 * pos_len / (1 + pos_k) (Rice positions) and 8 * val_len / (1 + val_k): the
  positions and values it decodes are bounded by the wire bytes that carry them;
- STREAM_CONDITIONED is stored raw too, and each changed element costs at least six
  adaptive decisions of at least conditioned.MIN_DECISION_BITS each (model 1), or two bits
  (model 2) or one (model 3) after the stream's header, which bounds a conditioned record's
  ``changed`` by its ``pos_len`` in the same way (about 60 a byte at most);
- a chunk decodes at most MAX_DECODED_ELEMS sparse elements (16 bytes of scratch each);
- the streams' raw lengths add up to at most MAX_RAW_BYTES, and a zstd stream's to at most
  what zstd can expand its wire bytes to (compression.ZSTD_MAX_EXPANSION);
- a bitmap is read in one pass into room for the elements it claims, never expanded to a
  byte per element of its range.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"DRLF"
FORMAT_VERSION = 1
NO_BASE = -1
# Each send of a version numbers its chunks from its own slot of the u32 chunk id range, so a
# receiver tells a re-send from late chunks of an earlier attempt (and links that dedup by
# (version, chunk id) deliver the re-send): 16 TiB of 16 MiB chunks per send, 4096 slots.
CHUNKS_PER_SEND = 1 << 20
SEND_SLOTS = 1 << 12  # CHUNKS_PER_SEND * SEND_SLOTS = 2**32


def send_slot(chunk_id: int) -> int:
    """Which send of its version a chunk id belongs to."""
    return chunk_id // CHUNKS_PER_SEND


KIND_DELTA = 1
KIND_FULL = 2
KIND_NAMES = {KIND_DELTA: "delta", KIND_FULL: "full"}

# Position codings: how a record says which elements it carries.
POS_RICE = 1  # gaps between changed positions, Golomb-Rice coded with parameter pos_k
POS_BITMAP = 2  # one bit per element of the range
POS_DENSE = 3  # every element of the range
# positions and values range-coded against the reference's exponents (conditioned.py)
POS_CONDITIONED = 4
POS_NAMES = {
    POS_RICE: "rice",
    POS_BITMAP: "bitmap",
    POS_DENSE: "dense",
    POS_CONDITIONED: "conditioned",
}

# Value codings: how a carried element's new bits are written. The decoder may read the
# reference (the base version's bits at the same place) for the first two.
VAL_ORDERED_DELTA = 1  # zigzag(order(new) - order(ref)): small for the +-1 ulp steps of RL
VAL_XOR = 2  # new ^ ref
VAL_RAW = 3  # new bits, no reference (full versions)
# ordered-delta values, Rice coded with a parameter per class of the reference element (its
# exponent for bf16 and fp32: kernels.CLASS_BITS); the value stream opens with the table.
# Rice and bitmap records of 16- and 32-bit elements only.
VAL_CLASSED = 4
VAL_NAMES = {
    VAL_ORDERED_DELTA: "ordered-delta",
    VAL_XOR: "xor",
    VAL_RAW: "raw",
    VAL_CLASSED: "ordered-delta-by-class",
}


def value_arithmetic(coding: int) -> int:
    """The coding of a value's bits against the reference (VAL_CLASSED's is ordered-delta:
    only its Rice parameters differ)."""
    return VAL_ORDERED_DELTA if coding == VAL_CLASSED else coding


COMP_NONE = 0
COMP_ZSTD = 1

STREAM_RICE = 1
STREAM_BITMAP = 2
STREAM_VALUES = 3
STREAM_CONDITIONED = 4
STREAM_PLANE0 = 8  # STREAM_PLANE0 + p for byte plane p (0 <= p < 8)

# A decoder never decompresses more than this for one chunk, whatever the frame claims.
MAX_RAW_BYTES = 1 << 31
# Sparse elements (changed positions and their coded values) one chunk may decode: 4 GiB of
# decode scratch at 16 bytes each. The encoder starts a new chunk before it would exceed it.
MAX_DECODED_ELEMS = MAX_RAW_BYTES // 8
MAX_ITEMSIZE = 8

HEADER = struct.Struct("<4sHBBqqIIIIQQQ")
RECORD = struct.Struct("<IBBBBBBHQQQQQ")
STREAM = struct.Struct("<BBHIQQ")
HEADER_SIZE = HEADER.size
CHECKSUM_OFFSET = HEADER_SIZE - 8

assert (HEADER_SIZE, RECORD.size, STREAM.size) == (64, 52, 24)


class FrameError(ValueError):
    """A frame that is truncated, corrupted, mis-versioned or out of range. Nothing was applied."""


@dataclass(frozen=True)
class FrameHeader:
    kind: int
    base: int
    target: int
    chunk_id: int
    n_records: int
    n_streams: int
    body_len: int
    raw_len: int
    checksum: int

    def pack_prefix(self) -> bytes:
        """The first 56 header bytes: everything the checksum covers besides the body."""
        return HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.kind,
            0,
            self.base,
            self.target,
            self.chunk_id,
            self.n_records,
            self.n_streams,
            0,
            self.body_len,
            self.raw_len,
            0,
        )[:CHECKSUM_OFFSET]

    @classmethod
    def parse(cls, data: memoryview) -> FrameHeader:
        if len(data) < HEADER_SIZE:
            raise FrameError(f"truncated frame: {len(data)} bytes, a header alone is {HEADER_SIZE}")
        (
            magic,
            fmt,
            kind,
            flags,
            base,
            target,
            chunk_id,
            n_records,
            n_streams,
            reserved,
            body_len,
            raw_len,
            checksum,
        ) = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise FrameError(f"not a deltarl frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
        if fmt != FORMAT_VERSION:
            raise FrameError(
                f"frame format {fmt} is not supported (this build reads {FORMAT_VERSION})"
            )
        if kind not in KIND_NAMES:
            raise FrameError(f"unknown frame kind {kind}")
        if flags or reserved:
            raise FrameError("reserved header fields are not zero")
        if kind == KIND_FULL and base != NO_BASE:
            raise FrameError(f"a full frame names base version {base}; it must name none")
        if kind == KIND_DELTA and not 0 <= base < target:
            raise FrameError(
                f"delta frame from version {base} to {target}: the base must precede it"
            )
        if target < 0:
            raise FrameError(f"negative target version {target}")
        if raw_len > MAX_RAW_BYTES:
            raise FrameError(
                f"frame claims {raw_len} decoded bytes, over the {MAX_RAW_BYTES} limit"
            )
        return cls(kind, base, target, chunk_id, n_records, n_streams, body_len, raw_len, checksum)


@dataclass(frozen=True)
class RecordHeader:
    """One tensor range in a chunk."""

    tensor_id: int
    pos_coding: int
    val_coding: int
    itemsize: int
    pos_k: int
    val_k: int
    start: int
    length: int
    changed: int
    pos_len: int
    val_len: int

    def pack(self) -> bytes:
        return RECORD.pack(
            self.tensor_id,
            self.pos_coding,
            self.val_coding,
            self.itemsize,
            self.pos_k,
            self.val_k,
            0,
            0,
            self.start,
            self.length,
            self.changed,
            self.pos_len,
            self.val_len,
        )

    @classmethod
    def unpack_from(cls, buf: memoryview, offset: int) -> RecordHeader:
        f = RECORD.unpack_from(buf, offset)
        if f[6] or f[7]:
            raise FrameError(f"record at byte {offset}: reserved fields are not zero")
        return cls(*f[:6], *f[8:])


@dataclass(frozen=True)
class StreamHeader:
    kind: int
    compression: int
    raw_len: int
    wire_len: int

    def pack(self) -> bytes:
        return STREAM.pack(self.kind, self.compression, 0, 0, self.raw_len, self.wire_len)
