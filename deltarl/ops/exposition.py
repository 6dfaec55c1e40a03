"""Serve the metrics registry over HTTP on the daemon's own event loop: ``GET /metrics``.

The address is the daemon table's ``metrics`` key: ``HOST:PORT`` (what Prometheus scrapes;
``[::1]:PORT`` for IPv6) or ``unix:PATH`` (for a local agent or a proxy that reads a unix
socket, when no port may be opened). On the daemon's loop rather than a thread on purpose: a
stalled event loop then fails its scrapes, and Prometheus's ``up`` goes to 0, which is the
alert an operator needs (a thread would keep serving the last figures of a dead loop).

The server answers one request per connection (``Connection: close``), reads at most
``MAX_REQUEST_BYTES`` of request head, and gives up on a client after ``CLIENT_TIMEOUT_S``:
a scraper is never trusted to be well-behaved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from prometheus_client import generate_latest

from deltarl.ops.metrics import REGISTRY

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
CLIENT_TIMEOUT_S = 5.0
UNIX_PREFIX = "unix:"
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
"""What ``generate_latest`` writes: the classic text format, which every Prometheus reads
(the library's CONTENT_TYPE_LATEST announces 1.0.0, which older servers do not know)."""


def parse_address(address: str) -> tuple[str, int] | Path:
    """``HOST:PORT`` as (host, port), or ``unix:PATH`` as the path; ValueError says why not."""
    if address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX) :]
        if not path.startswith("/"):
            raise ValueError(f"metrics {address!r}: a unix socket path must be absolute")
        return Path(path)
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"metrics {address!r}: want HOST:PORT or unix:/PATH")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics {address!r}: the port must be 0-65535")
    return host, int(port)


class MetricsServer:
    """``GET /metrics`` on one address; ``start`` binds (raising OSError), ``stop`` closes."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.where = parse_address(address)
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        """Bind and serve; the bound address (the real port when 0 was asked)."""
        if isinstance(self.where, Path):
            with contextlib.suppress(FileNotFoundError):
                self.where.unlink()  # a socket left by a killed daemon
            self._server = await asyncio.start_unix_server(
                self._client, path=self.where, limit=MAX_REQUEST_BYTES
            )
            os.chmod(self.where, 0o660)
            return f"{UNIX_PREFIX}{self.where}"
        host, port = self.where
        self._server = await asyncio.start_server(self._client, host, port, limit=MAX_REQUEST_BYTES)
        bound = self._server.sockets[0].getsockname()
        return f"{host}:{bound[1]}"

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        await self._server.wait_closed()
        self._server = None
        if isinstance(self.where, Path):
            with contextlib.suppress(FileNotFoundError):
                self.where.unlink()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
                status, body, ctype = _answer(head)
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            # A slow, truncated or oversized request (over MAX_REQUEST_BYTES): no answer.
            logger.debug("metrics: dropped a client: %s", type(e).__name__)
        except ConnectionError:
            pass  # the scraper went away
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _answer(head: bytes) -> tuple[str, bytes, str]:
    """(status line, body, content type) for a request head."""
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return "400 Bad Request", b"bad request\n", "text/plain"
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method != b"GET":
        return "405 Method Not Allowed", b"GET only\n", "text/plain"
    if target != b"/metrics":
        return "404 Not Found", b"try /metrics\n", "text/plain"
    return "200 OK", generate_latest(REGISTRY), TEXT_FORMAT
