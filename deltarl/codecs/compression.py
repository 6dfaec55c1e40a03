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


def decompress(compression: int, wire: memoryview, raw_len: int, what: str) -> bytes | memoryview:
    """The raw bytes of one stream, exactly raw_len of them, or a FrameError naming ``what``."""
    if compression == COMP_NONE:
        if len(wire) != raw_len:
            raise FrameError(f"{what}: stored raw with {len(wire)} bytes, header says {raw_len}")
        return wire
    if compression != COMP_ZSTD:
        raise FrameError(f"{what}: unknown compression id {compression}")
    try:
        params = zstandard.get_frame_parameters(wire)
    except zstandard.ZstdError as exc:
        raise FrameError(f"{what}: not a zstd frame ({exc})") from exc
    if params.content_size != raw_len:
        raise FrameError(
            f"{what}: zstd frame holds {params.content_size} bytes, header says {raw_len}"
        )
    try:
        # max_output_size bounds the allocation whatever the zstd frame claims.
        raw = zstandard.ZstdDecompressor().decompress(wire, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise FrameError(f"{what}: corrupt zstd data ({exc})") from exc
    if len(raw) != raw_len:
        raise FrameError(f"{what}: decompressed to {len(raw)} bytes, header says {raw_len}")
    return raw
