"""A daemon's control plane: a ROUTER server with typed handlers and a DEALER client.

Every daemon binds one ``ControlServer`` (``ipc://`` on one host, ``tcp://`` across hosts)
and answers the commands it has handlers for; ``deltarl ctl`` and the other daemons talk to
it with ``ControlClient``. Events (PUB/SUB) are in ``events.py``. The frames are described
in ``messages.py``. Nothing here knows what a command means: handlers are plain coroutines
registered per command class, so the server's decode table is exactly what it answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import zmq
import zmq.asyncio

from deltarl.transport.curve import CurveKeys
from deltarl.transport.messages import (
    COMMANDS,
    MAX_MESSAGE_BYTES,
    REPLIES,
    Command,
    Error,
    ErrorCode,
    MessageError,
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    peek_request_id,
)
from deltarl.transport.router import FROM_ENV, RouterServer, check_endpoint, connect_dealer

logger = logging.getLogger(__name__)
audit = logging.getLogger("deltarl.audit")  # deltarl/ops/logs.py: AUDIT_LOGGER

DEFAULT_TIMEOUT = 5.0  # seconds a client waits for a reply unless told otherwise
AUDITED = frozenset(
    {"shutdown", "drain", "rollback", "resync", "pause", "resume", "deltas", "restore"}
)
"""Command tags logged with their sender whenever a server receives them."""

# A handler takes the command instance of the class it is registered for. The mapping from
# class to handler is heterogeneous, which the type system cannot say, hence Any.
Handler = Callable[[Any], Awaitable[Reply]]


class ControlTimeoutError(TimeoutError):
    """No reply in time: the daemon is down, stuck, or the endpoint is wrong."""


class ControlProtocolError(ConnectionError):
    """The peer answered with something that is not a valid reply, or the client went away."""


@dataclass(frozen=True)
class _InFlight:
    """What the server must know to answer a running request if it has to cancel it."""

    identity: bytes
    request_id: int
    tag: str


class ControlServer(RouterServer):
    """Answers typed commands on a ROUTER socket with the handler registered for each class.

    Use as ``async with ControlServer(endpoint, {GetStatus: on_status, ...}) as server:``
    (binds, then serves in a task until the block ends or a handler calls ``stop()``), or
    ``server.bind()`` and ``await server.serve()`` to own the task yourself.

    Backpressure: at most ``max_in_flight`` handlers run at once; a request beyond that is
    answered ``busy`` at once rather than queued, so a flood cannot grow memory or make a
    ``status`` wait behind it. Replies never block: ROUTER drops a reply to a peer that is gone.
    """

    kind = "control"

    def __init__(
        self,
        endpoint: str,
        handlers: Mapping[type[Command], Handler],
        *,
        name: str = "daemon",
        commands: Mapping[str, type[Command]] = COMMANDS,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_in_flight: int = 64,
        default_timeout: float = 30.0,
        grace: float = 5.0,
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = FROM_ENV,
    ) -> None:
        super().__init__(
            endpoint,
            name=name,
            # Past this libzmq drops the connection without a word; below it, and above
            # max_message_bytes, the server still parses nothing and answers "too_large".
            hard_cap_bytes=16 * max_message_bytes,
            context=context,
            curve=curve,
        )
        self._handlers = dict(handlers)
        # The decode table: the standard commands (so an unhandled one is "unsupported"
        # rather than "unknown") plus every class a handler is registered for.
        self._commands = dict(commands)
        for cls in self._handlers:
            if self._commands.setdefault(cls.TAG, cls) is not cls:
                raise ValueError(f"{cls.__name__} reuses the tag {cls.TAG!r}")
        self._max_bytes = max_message_bytes
        self._max_in_flight = max_in_flight
        self._default_timeout = default_timeout
        self._grace = grace
        self._running: dict[asyncio.Task[None], _InFlight] = {}

    async def wait_stopped(self) -> None:
        """Return once the server has closed (after ``stop()`` or a failure)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def serve(self) -> None:
        """Answer requests until ``stop()``; then drain and close.

        One request, as the ROUTER sees it:

            RECEIVED  [identity, kind, id, body]
              | too large, malformed, unknown tag, bad fields --> reply Error(code), done
              | no handler for this command ---------------------> reply Error(unsupported)
              | max_in_flight handlers already running -----------> reply Error(busy)
              v
            RUNNING   the handler, in its own task, bounded by the request's timeout
              | returns a Reply ----------------------------------> reply it
              | raises, or returns something unsendable ----------> reply Error(handler_failed)
              | runs past the timeout (cancelled) ----------------> reply Error(timeout)
              | still running after stop() + grace (cancelled) ---> reply Error(stopping)
            REPLIED   exactly once; the reply echoes the id (0 when the id was unreadable)

        The server: BOUND -> SERVING -stop()-> DRAINING (nothing more is read; requests
        still queued are dropped with the socket and their clients time out) -> CLOSED.
        """
        try:
            # 1) wait for a request or for stop(); 2) decode it and answer at once, or start
            # its handler
            async for frames, peer in self.requests():
                await self._dispatch(frames, peer)
        finally:
            # 3) drain: running handlers finish or are cancelled and answered "stopping"
            await self._drain()
            self.close_socket()

    async def _dispatch(self, frames: list[bytes], peer: str = "") -> None:
        identity, payload = frames[0], frames[1:]
        request_id = peek_request_id(payload)
        try:
            request = decode_request(payload, self._commands, self._max_bytes)
        except MessageError as e:
            logger.warning("%s: bad request from %s (%s): %s", self.name, peer, identity.hex(), e)
            await self._reply(identity, request_id, Error(e.code, e.message))
            return
        tag = request.command.TAG
        who = f"{peer} ({identity.hex()})" if tag in AUDITED else None
        if who is not None:
            # Commands that change what a daemon does: always in its log, with who asked.
            logger.info("%s: %r asked by %s", self.name, tag, who)
        handler = self._handlers.get(type(request.command))
        if handler is None:
            handled = ", ".join(sorted(cls.TAG for cls in self._handlers))
            message = f"{self.name} does not handle {tag!r}; it handles: {handled}"
            await self._reply(identity, request_id, Error(ErrorCode.UNSUPPORTED, message))
            _audit(self.name, who, request, Error(ErrorCode.UNSUPPORTED, message))
            return
        if len(self._running) >= self._max_in_flight:
            message = f"{self.name} has {len(self._running)} requests in flight; retry later"
            await self._reply(identity, request_id, Error(ErrorCode.BUSY, message))
            _audit(self.name, who, request, Error(ErrorCode.BUSY, message))
            return
        task = asyncio.create_task(self._handle(identity, request, handler, who))
        self._running[task] = _InFlight(identity, request_id, tag)
        task.add_done_callback(self._running.pop)

    async def _handle(
        self, identity: bytes, request: Request, handler: Handler, who: str | None = None
    ) -> None:
        """Run the handler and reply; ``who``: the sender of an audited command."""
        tag, request_id = request.command.TAG, request.request_id
        timeout = request.timeout or self._default_timeout
        outcome: object = None
        try:
            async with asyncio.timeout(timeout) as deadline:
                outcome = await handler(request.command)
            frames = _encode_handler_reply(request_id, outcome)
        except Exception as e:
            if isinstance(e, TimeoutError) and deadline.expired():
                message = f"{self.name}: {tag!r} did not finish within {timeout:g} s"
                outcome = Error(ErrorCode.TIMEOUT, message)
            else:
                # A handler's bug must become an error reply, not take the control plane
                # down: this socket is how an operator finds out what went wrong.
                logger.exception("%s: handler for %r failed", self.name, tag)
                message = f"{self.name}: {tag!r} failed: {type(e).__name__}: {e}"
                outcome = Error(ErrorCode.HANDLER_FAILED, message)
            frames = encode_reply(request_id, outcome)
        finally:
            # Cancelled (the server stopping), it is audited too: it did not finish.
            _audit(self.name, who, request, outcome)
        await self._send(identity, frames)

    async def _reply(self, identity: bytes, request_id: int, reply: Reply) -> None:
        await self._send(identity, encode_reply(request_id, reply))

    async def _send(self, identity: bytes, frames: list[bytes]) -> None:
        if self._sock is not None:
            await self._sock.send_multipart([identity, *frames])

    async def _drain(self) -> None:
        if not self._running:
            return
        _, late = await asyncio.wait(list(self._running), timeout=self._grace)
        cancelled = [(task, self._running[task]) for task in late]
        for task, _ in cancelled:
            task.cancel()
        await asyncio.gather(*(task for task, _ in cancelled), return_exceptions=True)
        for _, req in cancelled:
            message = f"{self.name} is shutting down; {req.tag!r} was cancelled"
            await self._reply(req.identity, req.request_id, Error(ErrorCode.STOPPING, message))


def _audit(server: str, who: str | None, request: Request, outcome: object) -> None:
    """One audit record (deltarl/ops/logs.py) for an audited command: who, what, the result."""
    if who is None:
        return
    if isinstance(outcome, Error):
        result, text = outcome.code, outcome.message
    elif isinstance(outcome, Reply):
        result, text = "ok", str(getattr(outcome, "detail", "") or "")
    else:
        result, text = "cancelled", "the server stopped before the command finished"
    audit.info(
        "%s: %r from %s: %s%s",
        server,
        request.command.TAG,
        who,
        result,
        f" ({text})" if text else "",
        extra={
            "command": request.command.TAG,
            "peer": who,
            "request_id": request.request_id,
            "result": result,
            "reason": text or None,
        },
    )


def _encode_handler_reply(request_id: int, reply: object) -> list[bytes]:
    """A handler's reply as frames; TypeError if it is not a Reply or not JSON-encodable."""
    if not isinstance(reply, Reply):
        raise TypeError(f"handler returned {type(reply).__name__}, not a Reply")
    return encode_reply(request_id, reply)


class ControlClient:
    """Sends typed commands to one daemon and matches replies to requests by id.

    Several requests may be in flight at once; a reader task routes each reply to the
    request with its id. A reply that arrives after its request timed out is dropped.

    Invariant: no request outlives its timeout in this client's queues. A DEALER queues
    what it sends until a peer is connected, so a request to a daemon that is down would be
    delivered whenever the daemon comes back (a stale "shutdown" an hour later). After a
    timeout, once nothing else is in flight, the socket is therefore closed with LINGER 0,
    which drops anything still queued, and the next request opens a fresh one (the "lazy
    pirate" of the ZeroMQ guide). ZMQ_IMMEDIATE would not queue to absent peers in the first
    place, but it also discards replies that arrived just before the peer disconnected, which
    loses the "ok" of a ``shutdown``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replies: Mapping[str, type[Reply]] = REPLIES,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = FROM_ENV,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        self._curve = CurveKeys.from_env() if curve is FROM_ENV else curve
        self._replies = replies
        self._max_bytes = max_message_bytes
        self._context = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._stale = False  # a request timed out; its frames may still be queued
        self._ids = itertools.count(1)  # 0 is NO_REQUEST_ID

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
            sock = connect_dealer(self._context, self.endpoint, self._curve, 16 * self._max_bytes)
            self._sock = sock
            self._reader = asyncio.create_task(self._read(sock), name=f"ctl:{self.endpoint}")
            self._reader.add_done_callback(self._reader_done)
        return self._sock

    def _reset(self) -> None:
        """Close the socket, dropping whatever it still queues; the next request reopens."""
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._stale = False

    # The timeout is part of the request (the server bounds the handler by it), so it is a
    # parameter rather than the caller's asyncio.timeout.
    async def request(self, command: Command, timeout: float = DEFAULT_TIMEOUT) -> Reply:  # noqa: ASYNC109
        """Send ``command`` and return its reply (``Error`` replies are returned, not raised).

        Raises ControlTimeoutError, naming the endpoint and the command, if no reply comes
        in time, and ControlProtocolError if the reply is malformed.
        """
        sock = self._connect()
        request_id = next(self._ids)
        reply: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = reply
        try:
            async with asyncio.timeout(timeout) as deadline:
                await sock.send_multipart(encode_request(request_id, command, timeout))
                return await reply
        except TimeoutError:
            if not deadline.expired():
                raise
            self._stale = True
            raise ControlTimeoutError(
                f"no reply from {self.endpoint} to {command.TAG!r} within {timeout:g} s"
                " (is the daemon running, and is this its control endpoint?)"
            ) from None
        finally:
            self._pending.pop(request_id, None)
            if self._stale and not self._pending:
                self._reset()

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            waiter = self._pending.get(peek_request_id(frames))
            try:
                _, reply = decode_reply(frames, self._replies, self._max_bytes)
            except MessageError as e:
                if waiter is None or waiter.done():
                    logger.warning("malformed reply from %s: %s", self.endpoint, e)
                else:
                    waiter.set_exception(
                        ControlProtocolError(f"malformed reply from {self.endpoint}: {e}")
                    )
                continue
            if waiter is None or waiter.done():
                logger.debug("dropping a late reply from %s", self.endpoint)
                continue
            waiter.set_result(reply)

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        # The reader is only cancelled by _reset/close; if it died of an error instead, fail
        # every pending request now rather than letting each run into its timeout.
        if task.cancelled() or task.exception() is None:
            return
        error = ControlProtocolError(f"reading from {self.endpoint} failed: {task.exception()}")
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(error)

    async def close(self) -> None:
        """Close the socket; requests still in flight fail with ControlProtocolError."""
        reader = self._reader
        self._reset()
        if reader is not None:
            # Its fate is already reported (_reader_done); only wait for it to finish.
            await asyncio.gather(reader, return_exceptions=True)
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(ControlProtocolError(f"client for {self.endpoint} closed"))


def request_sync(
    endpoint: str,
    command: Command,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    replies: Mapping[str, type[Reply]] = REPLIES,
) -> Reply:
    """One request from synchronous code (the CLI): its own event loop, client and socket.

    Not for use inside a running event loop; there, use ``ControlClient`` directly.
    ``replies``: the reply types to decode (a daemon's own replies, e.g. the scheduler's).
    """

    async def once() -> Reply:
        async with ControlClient(endpoint, replies=replies) as client:
            return await client.request(command, timeout)

    return asyncio.run(once())
