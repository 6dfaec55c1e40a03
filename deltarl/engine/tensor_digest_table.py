"""A buffer's tensor digest table (segment.py): 16 bytes a tensor, in layout order.

The writer fills it with the xxh3-128 of each tensor of the version it commits, before the
buffer is marked READY (``VersionPointer.set_tensor_digests`` says whether it holds them); a
reader reads it under its lease on the buffer, so the digests belong to the very bytes it
leased (I2 in weight_store.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16  # one xxh3-128 a tensor
HEX_DIGITS = 2 * DIGEST_BYTES


def pack_digests(digests: Sequence[str]) -> bytes:
    """The table's bytes for ``digests`` (32 hex digits each, as ``tensor_digest`` gives
    them); ValueError naming the first that is not one."""
    for i, digest in enumerate(digests):
        if not isinstance(digest, str) or len(digest) != HEX_DIGITS:
            raise ValueError(f"tensor digest {i} is not {HEX_DIGITS} hex digits: {digest!r}")
    try:
        return bytes.fromhex("".join(digests))
    except ValueError:
        raise ValueError("a tensor digest holds a character that is not a hex digit") from None


def write_table(table: np.ndarray, packed: bytes) -> None:
    """Store ``pack_digests``' bytes at the start of ``table``."""
    if len(packed) > len(table):
        raise ValueError(f"{len(packed)} bytes of digests do not fit a table of {len(table)}")
    table[: len(packed)] = np.frombuffer(packed, np.uint8)


def read_table(table: np.ndarray, tensors: int) -> list[str]:
    """The first ``tensors`` digests of ``table``, as ``tensor_digest`` spells them."""
    text = table[: tensors * DIGEST_BYTES].tobytes().hex()
    return [text[i : i + HEX_DIGITS] for i in range(0, len(text), HEX_DIGITS)]
