"""The stream link's wire format: one header and one payload per message, both directions.

    header (21 bytes, little-endian)
      0  type      u8   message type; bit 0x80 set: the payload is one zstd frame
      1  version   u64  the version the message is about (< 2**63: an i64 in the chunk frame)
      9  chunk_id  u32  the chunk (0 for a manifest or a query)
     13  length    u64  payload bytes that follow
     21  payload

    sender -> receiver
      CHUNK     0x01  payload: the chunk's bytes (zstd only if that made them smaller)
      MANIFEST  0x02  payload: the manifest's JSON (likewise)
      QUERY     0x03  no payload: "which chunk ids of this version do you hold?"
      PROBE     0x04  payload: bytes to throw away (``deltarl doctor`` measures the link)
    receiver -> sender
      ACK       0x11  no payload: this chunk is held (delivered, or was already)
      MANIFEST_ACK 0x12  no payload: this version's manifest is held
      HELD      0x13  payload: the ids asked for by a QUERY, ascending, u32 each
      PROBE_ACK 0x14  no payload: this probe's bytes arrived (and were thrown away)

Each side reads only the types it may receive. A header naming another type, a length over
the reader's limit, or a payload where there must be none is a protocol error: the reader
logs what was wrong and closes that connection (a byte stream cannot be resynchronised).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

from deltarl.codecs.compression import ZstdFrameError, zstd_content_size, zstd_frame
from deltarl.transport.base import MAX_VERSION

HEADER = struct.Struct("<BQIQ")

MSG_CHUNK = 0x01
MSG_MANIFEST = 0x02
MSG_QUERY = 0x03
MSG_PROBE = 0x04
MSG_ACK = 0x11
MSG_MANIFEST_ACK = 0x12
MSG_HELD = 0x13
MSG_PROBE_ACK = 0x14
FLAG_ZSTD = 0x80

TO_RECEIVER = {
    MSG_CHUNK: "chunk",
    MSG_MANIFEST: "manifest",
    MSG_QUERY: "query",
    MSG_PROBE: "probe",
}
TO_SENDER = {MSG_ACK: "ack", MSG_MANIFEST_ACK: "manifest-ack", MSG_HELD: "held"}
TO_PROBER = {MSG_PROBE_ACK: "probe-ack"}  # a sender never probes: it accepts none of these
_COMPRESSIBLE = (MSG_CHUNK, MSG_MANIFEST)
_EMPTY = (MSG_QUERY, MSG_ACK, MSG_MANIFEST_ACK, MSG_PROBE_ACK)
_ID = np.dtype("<u4")


class WireError(ValueError):
    """A message that breaks the protocol; the text names what was wrong."""


@dataclass(frozen=True)
class Header:
    kind: int  # without FLAG_ZSTD
    compressed: bool
    version: int
    chunk_id: int
    length: int


def pack_header(
    kind: int, version: int, chunk_id: int = 0, length: int = 0, *, compressed: bool = False
) -> bytes:
    return HEADER.pack(kind | (FLAG_ZSTD if compressed else 0), version, chunk_id, length)


def parse_header(raw: bytes, allowed: Mapping[int, str], max_payload: int) -> Header:
    """The header in ``raw``, checked against what this side may receive; else WireError."""
    if len(raw) != HEADER.size:
        raise WireError(f"bad header: {len(raw)} bytes, a header is {HEADER.size}")
    code, version, chunk_id, length = HEADER.unpack(raw)
    kind, compressed = code & ~FLAG_ZSTD, bool(code & FLAG_ZSTD)
    name = allowed.get(kind)
    if name is None:
        raise WireError(
            f"unknown message type {code:#04x} (this side accepts "
            f"{', '.join(f'{k:#04x} {n}' for k, n in allowed.items())})"
        )
    if compressed and kind not in _COMPRESSIBLE:
        raise WireError(f"a {name} message cannot be compressed (type {code:#04x})")
    if version > MAX_VERSION:
        raise WireError(f"{name} message for version {version}, over 2**63 - 1")
    if kind in _EMPTY and length:
        raise WireError(f"bad length: a {name} message has no payload, this one claims {length}")
    if length > max_payload:
        raise WireError(
            f"bad length: {name} message of version {version} claims {length} bytes, "
            f"over the {max_payload}-byte limit"
        )
    if kind == MSG_HELD and length % _ID.itemsize:
        raise WireError(f"bad length: a held list of {length} bytes is not whole u32 ids")
    if kind == MSG_MANIFEST and chunk_id:
        raise WireError(f"manifest message of version {version} names chunk {chunk_id}")
    return Header(kind, compressed, version, chunk_id, length)


async def read_message(
    reader: asyncio.StreamReader, allowed: Mapping[int, str], max_payload: int
) -> tuple[Header, bytes] | None:
    """The next message, or None at a clean end of stream (between messages).

    WireError for a bad header; asyncio.IncompleteReadError for a stream cut mid-message.
    """
    header = await read_header(reader, allowed, max_payload)
    if header is None:
        return None
    payload = await reader.readexactly(header.length) if header.length else b""
    return header, payload


async def read_header(
    reader: asyncio.StreamReader, allowed: Mapping[int, str], max_payload: int
) -> Header | None:
    """The next message's header (its payload not read), or None at a clean end of stream."""
    try:
        raw = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    return parse_header(raw, allowed, max_payload)


def compress(data: bytes | memoryview, level: int) -> tuple[bool, bytes | memoryview]:
    """(compressed, payload): zstd when it saves bytes, else the data itself."""
    if not len(data):
        return False, data
    packed = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)
    return (True, packed) if len(packed) < len(data) else (False, data)


def claimed_size(prefix: bytes, max_bytes: int, what: str) -> int:
    """The decompressed size a zstd payload declares, from its first ``ZSTD_FRAME_HEADER_MAX``
    bytes (or all of it, if shorter); WireError naming ``what`` if it is not one, has no size,
    or claims more than ``max_bytes``."""
    try:
        return zstd_content_size(prefix, limit=max_bytes)
    except ZstdFrameError as exc:
        raise WireError(f"{what}: {exc}") from exc


def decompress(payload: bytes, max_bytes: int, what: str) -> bytes:
    """The bytes of one zstd frame, at most ``max_bytes`` of them; WireError naming ``what``."""
    try:
        return zstd_frame(payload, limit=max_bytes)
    except ZstdFrameError as exc:
        raise WireError(f"{what}: {exc}") from exc


def pack_ids(ids: Iterable[int]) -> bytes:
    return np.fromiter(ids, dtype=_ID).tobytes()


def unpack_ids(payload: bytes) -> set[int]:
    return set(np.frombuffer(payload, dtype=_ID).tolist())
