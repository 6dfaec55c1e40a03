"""Sealed manifests: a MAC under the cluster's data key, over the manifest's exact bytes.

A checksum proves a version arrived whole; it does not prove who made it. Where the cluster
has a data key (deltarl/transport/data_keys.py), the export agent seals each manifest, and
every receiver (whatever link, relayed or not) refuses a manifest whose seal does not hold
before reading anything in it. A sealed manifest lists a BLAKE2b-256 hash per chunk
(``ChunkEntry.blake2b``), so the seal covers every chunk's bytes too, not just their xxh3.

The sealed form is the manifest's JSON, then one line: ``\\n`` + TAG + 64 hex digits of
keyed BLAKE2b-256 over the JSON bytes (``person`` = b"deltarl-manifest", so a manifest MAC
can never be replayed as any other MAC made with the key). orjson never writes a raw newline,
so the seal line is found by the last ``\\n``. The MAC is over bytes, never a re-serialisation:
relays forward the bytes untouched, and every member of a relay tree checks the origin's seal.
"""

from __future__ import annotations

import hashlib
import hmac

from deltarl.codecs.manifest import ManifestError

TAG = b"deltarl-mac:blake2b-256:"
_MAC_HEX = 64


class SealError(ManifestError):
    """A manifest whose seal is missing, malformed or wrong, or one this agent cannot check."""


def _mac(body: bytes, key: bytes) -> bytes:
    h = hashlib.blake2b(body, digest_size=32, key=key, person=b"deltarl-manifest")
    return h.hexdigest().encode()


def seal(body: bytes, key: bytes) -> bytes:
    """The sealed form of a manifest's JSON."""
    if b"\n" in body:
        raise ValueError("a manifest's JSON must be on one line to be sealed")
    return body + b"\n" + TAG + _mac(body, key)


def open_sealed(data: bytes, key: bytes | None) -> bytes:
    """The manifest JSON inside ``data``, if its seal holds under ``key``; else SealError.

    ``key`` None (this agent holds no data key) accepts only unsealed manifests: a sealed one
    means the sender is configured with keys and this agent is not, which is refused loudly
    rather than activated unchecked.
    """
    cut = data.rfind(b"\n")
    if key is None:
        if cut != -1:
            raise SealError(
                "the manifest is sealed but this agent has no data key: set "
                "DELTARL_CURVE_KEYS here as on the sender"
            )
        return data
    if cut == -1:
        raise SealError("the manifest is not sealed, and this agent accepts only sealed ones")
    body, line = data[:cut], data[cut + 1 :]
    if not line.startswith(TAG) or len(line) != len(TAG) + _MAC_HEX:
        raise SealError("the manifest's seal line is malformed")
    if not hmac.compare_digest(line[len(TAG) :], _mac(body, key)):
        raise SealError("the manifest's MAC does not hold: not made with this cluster's key")
    return body
