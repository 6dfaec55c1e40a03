"""zstd for the byte planes, with a decoder that never trusts a frame's sizes.

A plane is stored raw when zstd does not make it smaller (the Rice stream, for instance, is
already close to its entropy), so incompressible data costs nothing extra.
"""

from __future__ import annotations

import zstandard

from deltarl.codecs.frame import COMP_NONE, COMP_ZSTD, FrameError

DEFAULT_LEVEL = 3


class PlaneCompressor:
    """Compress streams at one level. Not thread-safe: one per encoding thread."""

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self._cctx = zstandard.ZstdCompressor(
            level=level, write_checksum=False, write_content_size=True
        )

    def compress(self, raw: bytes | memoryview) -> tuple[int, bytes | memoryview]:
        """(compression id, wire bytes): zstd if it saves anything, else the raw bytes."""
        if len(raw) == 0:
            return COMP_NONE, raw
        packed = self._cctx.compress(raw)
        if len(packed) < len(raw):
            return COMP_ZSTD, packed
        return COMP_NONE, raw


# The most bytes zstd can produce per byte of frame: a block holds at most 128 KiB and takes at
# least 4 bytes (3 of header, 1 of RLE content). A frame claiming more is a lie, refused before
# its output is allocated (every real frame, even of zeros, stays under it: 32,600x measured).
ZSTD_MAX_EXPANSION = (128 << 10) // 4


class ZstdFrameError(ValueError):
    """A zstd frame that is malformed, corrupt, or larger than its reader allows."""


ZSTD_FRAME_HEADER_MAX = 18
"""The longest zstd frame header: its first this many bytes tell a frame's content size."""


def zstd_content_size(
    wire: bytes | memoryview, *, exact: int | None = None, limit: int | None = None
) -> int:
    """The content size a zstd frame declares, checked as ``zstd_frame`` checks it, from the
    frame or just its first ``ZSTD_FRAME_HEADER_MAX`` bytes; else ZstdFrameError.

    A reader can thus reserve memory for the frame before it reads or decodes the rest."""
    try:
        size: int = zstandard.get_frame_parameters(wire).content_size
    except zstandard.ZstdError as exc:
        raise ZstdFrameError(f"not a zstd frame ({exc})") from exc
    if exact is not None and size != exact:  # an unknown size (-1) is never the exact one
        raise ZstdFrameError(f"zstd frame holds {size} bytes, header says {exact}")
    if size == zstandard.CONTENTSIZE_UNKNOWN:
        raise ZstdFrameError("zstd frame of unknown size; a sized frame is required")
    if limit is not None and size > limit:
        raise ZstdFrameError(f"zstd frame of {size} bytes; the limit is {limit}")
    return size


def zstd_frame(
    wire: bytes | memoryview, *, exact: int | None = None, limit: int | None = None
) -> bytes:
    """The bytes of one zstd frame, or ZstdFrameError: the one bounded zstd decoder of the
    project (the codec's byte planes, the stream link's payloads).

    The frame must declare its content size, and it must equal ``exact`` (or be at most
    ``limit``) and be no more than ZSTD_MAX_EXPANSION times the frame's bytes before anything
    is decoded; the decoder then never writes more than that, so a forged frame cannot make a
    reader allocate more than it allowed, nor more than its own bytes could hold.
    """
    size = zstd_content_size(wire, exact=exact, limit=limit)
    if size > ZSTD_MAX_EXPANSION * len(wire):
        raise ZstdFrameError(
            f"zstd frame of {len(wire)} bytes claims {size}: more than zstd can expand it to"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(wire, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ZstdFrameError(f"corrupt zstd data ({exc})") from exc
    if len(raw) != size:
        raise ZstdFrameError(f"decompressed to {len(raw)} bytes, the frame claims {size}")
    return raw


def decompress(compression: int, wire: memoryview, raw_len: int, what: str) -> bytes | memoryview:
    """The raw bytes of one stream, exactly raw_len of them, or a FrameError naming ``what``."""
    if compression == COMP_NONE:
        if len(wire) != raw_len:
            raise FrameError(f"{what}: stored raw with {len(wire)} bytes, header says {raw_len}")
        return wire
    if compression != COMP_ZSTD:
        raise FrameError(f"{what}: unknown compression id {compression}")
    try:
        return zstd_frame(wire, exact=raw_len)
    except ZstdFrameError as exc:
        raise FrameError(f"{what}: {exc}") from exc
