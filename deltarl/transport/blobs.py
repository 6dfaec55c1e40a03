"""The samples data path: content-addressed binary blobs over their own ZeroMQ socket.

Samples are megabytes (a group of 16 completions of 8k tokens), the control plane's messages
are capped at ``MAX_MESSAGE_BYTES`` and parsed as JSON; so samples travel here instead, raw, and
the control messages carry only their digest. A ``BlobServer`` (ROUTER) stores what it is given
and answers its digest; a ``BlobClient`` (DEALER) puts blobs and gets them back by digest.
A put repeated is harmless (the same bytes have the same digest), so a client retries freely.

Frames (integers little-endian; the ROUTER adds the peer's identity in front)::

    put      DEALER -> ROUTER   [b"P", request_id u64, blob]
    get      DEALER -> ROUTER   [b"G", request_id u64, digest, digest, ...]
    ok       ROUTER -> DEALER   [b"K", request_id u64, digest]          (put)
                                [b"K", request_id u64, blob, blob, ...] (get, in order)
    error    ROUTER -> DEALER   [b"E", request_id u64, code, message]

A digest is the xxh3-128 hex of the blob's bytes (``blob_digest``). Codes: ``too_large`` (a
frame over the server's ``max_frame_bytes``; the client refuses one over its own bound before
sending), ``missing`` (the message names the first digest the server does not hold),
``bad_frames``, ``store_failed``. Like the control sockets, a ``tcp://`` socket speaks CURVE
when ``DELTARL_CURVE_KEYS`` is set (``deltarl.transport.curve``), so nobody without the
cluster's keys can write samples.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, Self

import xxhash
import zmq
import zmq.asyncio

from deltarl.transport.control import DEFAULT_TIMEOUT
from deltarl.transport.curve import CurveKeys
from deltarl.transport.router import FROM_ENV, RouterServer, check_endpoint, connect_dealer

logger = logging.getLogger(__name__)

KIND_PUT = b"P"
KIND_GET = b"G"
KIND_OK = b"K"
KIND_ERROR = b"E"
DEFAULT_MAX_FRAME_BYTES = 256 << 20
MAX_DIGESTS = 4096
"""Digests one get may ask for."""
_ID = struct.Struct("<Q")
_DIGEST_CHARS = 32


def blob_digest(data: bytes | memoryview) -> str:
    """The address of a blob: the xxh3-128 hex digest of its bytes."""
    return xxhash.xxh3_128_hexdigest(data)


def samples_endpoint(control: str) -> str:
    """The samples endpoint that goes with a scheduler's control endpoint, when none is set:
    ``ipc://PATH`` -> ``ipc://PATH.samples``, ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT+1``
    (port 0, "any free port", stays 0: nobody can find either socket but by asking)."""
    check_endpoint(control)
    if control.startswith("ipc://"):
        return f"{control}.samples"
    host, colon, port = control.removeprefix("tcp://").rpartition(":")
    if colon and port == "0":
        return control
    if not colon or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(
            f"cannot derive a samples endpoint from {control!r} (a fixed tcp port is needed): "
            "set the samples endpoint explicitly"
        )
    return f"tcp://{host}:{int(port) + 1}"


class BlobError(Exception):
    """A request the server refused; ``code`` says why (module docstring)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BlobMissingError(BlobError, LookupError):
    """The server holds no blob of ``digest``."""

    def __init__(self, digest: str, message: str) -> None:
        super().__init__("missing", message)
        self.digest = digest


class BlobTooLargeError(BlobError):
    """A blob over the frame bound (the client's, before sending, or the server's)."""

    def __init__(self, message: str) -> None:
        super().__init__("too_large", message)


class BlobTimeoutError(TimeoutError):
    """No answer in time: the server is down, or this is not its samples endpoint."""


class BlobProtocolError(ConnectionError):
    """The answer is malformed, or its bytes do not have the digest asked for."""


class BlobStore(Protocol):
    """Where a server keeps its blobs (the scheduler: its sqlite store)."""

    def put_blob(self, digest: str, data: bytes) -> None: ...

    def get_blob(self, digest: str) -> bytes | None: ...


class MemoryBlobs:
    """Blobs in a dict: for tests, benches and a server whose blobs need not survive it."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put_blob(self, digest: str, data: bytes) -> None:
        self.blobs[digest] = data

    def get_blob(self, digest: str) -> bytes | None:
        return self.blobs.get(digest)


class BlobServer(RouterServer):
    """Stores and serves blobs on a ROUTER socket; one request at a time, in arrival order.

    Use as ``async with BlobServer(endpoint, store):`` (binds, then serves in a task until the
    block ends), or ``bind()`` and ``await serve()``. A put is answered only once ``store``
    holds the blob (the scheduler's store commits it first), so an answered digest survives a
    crash of the server.
    """

    kind = "samples"

    def __init__(
        self,
        endpoint: str,
        store: BlobStore | None = None,
        *,
        name: str = "samples",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = FROM_ENV,
    ) -> None:
        super().__init__(
            endpoint,
            name=name,
            # Up to twice the bound a frame is read and answered "too_large"; past that libzmq
            # drops the connection unread (the client, which checks first, times out).
            hard_cap_bytes=2 * max_frame_bytes + 4096,
            context=context,
            curve=curve,
        )
        self.store: BlobStore = MemoryBlobs() if store is None else store
        self._max_bytes = max_frame_bytes

    async def serve(self) -> None:
        """Answer puts and gets until ``stop()``; then close the socket."""
        try:
            async for frames, _ in self.requests():
                reply = self._answer(frames[1:])
                await self._reply(frames[0], reply)
        finally:
            self.close_socket()

    async def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        if self._sock is not None:
            await self._sock.send_multipart([identity, *frames])

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 2 or len(frames[1]) != _ID.size:
            return _error(b"\0" * _ID.size, "bad_frames", "a request is [kind, id u64, ...]")
        kind, rid, payload = frames[0], frames[1], frames[2:]
        try:
            if kind == KIND_PUT:
                return self._put(rid, payload)
            if kind == KIND_GET:
                return self._get(rid, payload)
        except Exception as e:  # a store failure is an answer, not the end of the socket
            logger.exception("%s: the store failed", self.name)
            return _error(rid, "store_failed", f"{self.name}: {type(e).__name__}: {e}")
        return _error(rid, "bad_frames", f"unknown request kind {kind[:8]!r}")

    def _put(self, rid: bytes, payload: list[bytes]) -> list[bytes]:
        if len(payload) != 1:
            return _error(rid, "bad_frames", f"a put holds one blob, got {len(payload)} frames")
        data = payload[0]
        if len(data) > self._max_bytes:
            message = (
                f"a blob of {len(data)} bytes is over {self.name}'s bound of {self._max_bytes}"
            )
            return _error(rid, "too_large", message)
        digest = blob_digest(data)
        self.store.put_blob(digest, data)
        return [KIND_OK, rid, digest.encode()]

    def _get(self, rid: bytes, payload: list[bytes]) -> list[bytes]:
        if not 0 < len(payload) <= MAX_DIGESTS:
            return _error(rid, "bad_frames", f"a get names 1 to {MAX_DIGESTS} digests")
        blobs = []
        for raw in payload:
            digest = raw.decode(errors="replace")
            data = self.store.get_blob(digest) if len(raw) == _DIGEST_CHARS else None
            if data is None:
                return _error(rid, "missing", f"{self.name} holds no blob {digest[:64]!r}")
            blobs.append(data)
        return [KIND_OK, rid, *blobs]


def _error(rid: bytes, code: str, message: str) -> list[bytes]:
    return [KIND_ERROR, rid, code.encode(), message.encode()]


class BlobClient:
    """Puts and gets blobs on one server, one request at a time.

    As with ``ControlClient``, a request that timed out must not be delivered later: the
    socket is then closed with LINGER 0 and the next request opens a fresh one.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = FROM_ENV,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        self._curve = CurveKeys.from_env() if curve is FROM_ENV else curve
        self._max_bytes = max_frame_bytes
        self._context = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _connect(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            cap = 2 * self._max_bytes + 4096
            self._sock = connect_dealer(self._context, self.endpoint, self._curve, cap)
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # The timeout bounds the whole exchange, as ControlClient.request's does.
    async def put(self, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> str:  # noqa: ASYNC109
        """Store ``data`` on the server; its digest. BlobTooLargeError over the bound."""
        if len(data) > self._max_bytes:
            raise BlobTooLargeError(
                f"a blob of {len(data)} bytes is over the client's bound of {self._max_bytes}"
            )
        digest = blob_digest(data)
        (answer,) = await self._request(KIND_PUT, [data], timeout, "put")
        if answer != digest.encode():
            raise BlobProtocolError(
                f"{self.endpoint} answered digest {answer[:64]!r} for a blob of digest {digest}"
            )
        return digest

    async def get(self, digests: Sequence[str], timeout: float = DEFAULT_TIMEOUT) -> list[bytes]:  # noqa: ASYNC109
        """The blobs of ``digests``, in order, each checked against its digest.

        BlobMissingError names a digest the server does not hold."""
        if not digests:
            return []
        blobs = await self._request(KIND_GET, [d.encode() for d in digests], timeout, "get")
        if len(blobs) != len(digests):
            raise BlobProtocolError(
                f"{self.endpoint} answered {len(blobs)} blobs for {len(digests)} digests"
            )
        for digest, blob in zip(digests, blobs, strict=True):
            if blob_digest(blob) != digest:
                raise BlobProtocolError(f"{self.endpoint} answered other bytes for {digest}")
        return blobs

    async def _request(
        self,
        kind: bytes,
        payload: list[bytes],
        timeout: float,  # noqa: ASYNC109
        what: str,
    ) -> list[bytes]:
        async with self._lock:
            sock = self._connect()
            rid = _ID.pack(next(self._ids))
            try:
                async with asyncio.timeout(timeout):
                    await sock.send_multipart([kind, rid, *payload], copy=False)
                    while True:
                        frames = await sock.recv_multipart()
                        if len(frames) >= 2 and frames[1] == rid:
                            break
                        logger.debug("dropping a stray answer from %s", self.endpoint)
            except TimeoutError:
                self._reset()
                raise BlobTimeoutError(
                    f"no answer from {self.endpoint} to a {what} within {timeout:g} s"
                    " (is the scheduler running, and is this its samples endpoint?)"
                ) from None
            except BaseException:
                self._reset()  # cancelled mid-request: its answer must not reach the next one
                raise
        if frames[0] == KIND_OK:
            return frames[2:]
        if frames[0] == KIND_ERROR and len(frames) == 4:
            code, message = frames[2].decode(errors="replace"), frames[3].decode(errors="replace")
            if code == "missing":
                asked = [p.decode(errors="replace") for p in payload]
                digest = next((d for d in asked if d in message), asked[0])
                raise BlobMissingError(digest, message)
            if code == "too_large":
                raise BlobTooLargeError(message)
            raise BlobError(code, message)
        raise BlobProtocolError(f"malformed answer from {self.endpoint}: {frames[0][:8]!r}")

    async def close(self) -> None:
        async with self._lock:
            self._reset()
