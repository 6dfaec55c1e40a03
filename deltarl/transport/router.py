"""What every server socket of the project shares: a ZeroMQ ROUTER, bound once, with CURVE.

The control server (``control.py``: typed commands) and the samples server (``blobs.py``: raw
frames) differ in what they read; they share the endpoint rules, the binding (with libzmq's hard
frame cap, past which it drops a connection unread), CURVE on ``tcp://`` (``curve=FROM_ENV``:
keys from ``DELTARL_CURVE_KEYS``, see curve.py), the receive loop that ends on ``stop()``, and
``async with`` serving in a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import zmq
import zmq.asyncio

from deltarl.config.errors import ConfigError
from deltarl.ownership import check_socket_dir
from deltarl.transport.curve import CurveKeys, secure_client, secure_server

SCHEMES = ("ipc://", "tcp://")

FROM_ENV: Any = object()
"""``curve=FROM_ENV`` (the default): CURVE keys from ``DELTARL_CURVE_KEYS`` (see curve.py)."""


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is an ``ipc://`` or ``tcp://`` address, else a clear ValueError."""
    if not endpoint.startswith(SCHEMES) or endpoint.endswith("://"):
        raise ValueError(
            f"bad control endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT"
        )
    return endpoint


def bind_endpoint(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind and return the address actually bound (``tcp://127.0.0.1:*`` gets its port).

    An ``ipc://`` socket file is made owner-only (0600) whatever the umask: it is bound with
    the umask 0177 (so it is never reachable by others, not even for an instant) and set to
    its mode after: 0600, or 0660 where ``DELTARL_IPC_MODE=0660`` grants the group access
    (the systemd units do, for the operators in the group ``deltarl``); others never. Its
    directory must be the euid's or root's and writable by nobody else
    (``deltarl.ownership.check_socket_dir``): in a shared writable directory, /tmp included,
    another user could take the name first and answer our clients. Abstract (``ipc://@name``)
    and wildcard (``ipc://*``) addresses have no directory of ours to check.
    """
    check_endpoint(endpoint)
    path = ipc_path(endpoint)
    mode = ipc_mode()
    if path is not None:
        check_socket_dir(os.path.dirname(os.path.abspath(path)), f"socket {endpoint}")
    old_umask = os.umask(0o177) if path is not None else None
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind {endpoint}: {e}") from e
    finally:
        if old_umask is not None:
            os.umask(old_umask)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if path is not None:
        os.chmod(path, mode)
    return bound


IPC_MODE_ENV = "DELTARL_IPC_MODE"
_IPC_MODES = {"0600": 0o600, "0660": 0o660}


def ipc_mode() -> int:
    """The mode of a bound ipc socket file: 0600, or 0660 if ``DELTARL_IPC_MODE`` says so."""
    value = os.environ.get(IPC_MODE_ENV, "0600")
    if value not in _IPC_MODES:
        raise ConfigError(
            f"{IPC_MODE_ENV}={value!r}: expected 0600 (owner only, the default) or 0660 "
            f"(and the group); an ipc socket is never open to others"
        )
    return _IPC_MODES[value]


def ipc_path(endpoint: str) -> str | None:
    """The file an ``ipc://`` endpoint binds, or None (tcp, abstract ``@``, wildcard ``*``)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    return None if path.startswith("@") or path == "*" else path


def connect_dealer(
    context: zmq.asyncio.Context, endpoint: str, curve: CurveKeys | None, hard_cap_bytes: int
) -> zmq.asyncio.Socket:
    """A client's DEALER socket to a RouterServer at ``endpoint``: CURVE on ``tcp://`` with
    ``curve``, replies over ``hard_cap_bytes`` dropped by libzmq, nothing lingering on close."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, hard_cap_bytes)
    secure_client(sock, endpoint, curve)
    sock.connect(endpoint)
    return sock


class RouterServer:
    """A ROUTER server: ``bind``, ``serve`` (a subclass's), ``stop``; or ``async with``."""

    kind = "server"
    """For messages and task names: "control", "samples"."""

    def __init__(
        self,
        endpoint: str,
        *,
        name: str,
        hard_cap_bytes: int,
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = FROM_ENV,
    ) -> None:
        self.name = name
        self._endpoint = check_endpoint(endpoint)
        self._hard_cap = hard_cap_bytes
        self._curve = CurveKeys.from_env() if curve is FROM_ENV else curve
        self._context = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """The bound address once bound (with the real port), the configured one before."""
        return self._endpoint

    def bind(self) -> str:
        """Bind the ROUTER (once; again is a no-op) and return the bound endpoint."""
        if self._sock is not None:
            return self._endpoint
        sock = self._context.socket(zmq.ROUTER)
        # The hard cap at which libzmq drops the connection without a word; below it a
        # server still answers an oversize request with an error of its own.
        sock.setsockopt(zmq.MAXMSGSIZE, self._hard_cap)
        # On close, give replies already queued a moment to leave (a shutdown's own "ok").
        sock.setsockopt(zmq.LINGER, 500)
        secure_server(sock, self._endpoint, self._curve)
        self._endpoint = bind_endpoint(sock, self._endpoint)
        self._sock = sock
        return self._endpoint

    def stop(self) -> None:
        """Stop receiving (what a subclass does with work in flight is its own). Safe from a
        handler."""
        self._stopping.set()

    async def requests(self) -> AsyncIterator[tuple[list[bytes], str]]:
        """Each request's frames and who sent it (``peer``), until ``stop()``."""
        if self._sock is None:
            self.bind()
        sock = self._sock
        if sock is None:  # for the type checker: bind() sets it or raises
            raise RuntimeError(f"{self.name}: {self.kind} socket is not bound")
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while True:
                receive = asyncio.ensure_future(sock.recv_multipart(copy=False))
                await asyncio.wait({receive, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not receive.done():
                    receive.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await receive
                    return
                frames = receive.result()
                yield [f.bytes for f in frames], self._peer(frames[-1])
        finally:
            stopping.cancel()

    def _peer(self, frame: zmq.Frame) -> str:
        """Who sent a request, for the log: the CURVE key the authenticator accepted (its
        first 12 characters), or how the socket is reached when there is none."""
        with contextlib.suppress(zmq.ZMQError, KeyError, UnicodeDecodeError):
            user = frame.get("User-Id")
            if user:
                return f"key {str(user)[:12]}"
        return "a local peer" if self._endpoint.startswith("ipc://") else "an unauthenticated peer"

    def close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def serve(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self.bind()
        self._task = asyncio.create_task(self.serve(), name=f"{self.kind}:{self.name}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._task is not None:
            await self._task
