"""A daemon's event channel: one PUB socket per daemon, SUB sockets filtered by topic.

Each daemon binds an ``EventPublisher``; whoever cares about versions connects an
``EventSubscriber`` with the topics it wants. The frames are described in ``messages.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping

import zmq
import zmq.asyncio

from deltarl.transport.curve import CurveKeys, secure_client, secure_server
from deltarl.transport.messages import (
    EVENTS,
    MAX_MESSAGE_BYTES,
    Event,
    MessageError,
    decode_event,
    encode_event,
)
from deltarl.transport.router import FROM_ENV, bind_endpoint, check_endpoint

logger = logging.getLogger(__name__)


class EventPublisher:
    """A daemon's PUB socket: every event goes to every subscriber whose topic matches.

    PUB never blocks: a subscriber that is slow (over the high-water mark) or not yet
    connected misses events. Events are notices, never the only record of a fact: a
    subscriber that must not miss a version asks ``status`` after it connects.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = FROM_ENV,
    ) -> None:
        self._endpoint = check_endpoint(endpoint)
        self._context = context or zmq.asyncio.Context.instance()
        self._curve = CurveKeys.from_env() if curve is FROM_ENV else curve
        self._sock: zmq.asyncio.Socket | None = None

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def bind(self) -> str:
        """Bind the PUB socket (once; again is a no-op) and return the bound endpoint."""
        if self._sock is not None:
            return self._endpoint
        sock = self._context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        # tcp://: the same CURVE keys as the control sockets, so only the cluster's own
        # daemons can subscribe (the receiver state drives the export agent's reference).
        secure_server(sock, self._endpoint, self._curve)
        self._endpoint = bind_endpoint(sock, self._endpoint)
        self._sock = sock
        return self._endpoint

    async def publish(self, event: Event) -> None:
        if self._sock is None:
            raise RuntimeError(f"publisher for {self._endpoint} is not bound")
        await self._sock.send_multipart(encode_event(event))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class EventSubscriber:
    """A SUB socket that yields the typed events whose tag starts with one of ``topics``.

    Topics are ZeroMQ prefixes of the tag: ``"version."`` selects ``version.published`` and
    ``version.applied``; the default ``("",)`` selects everything.
    """

    def __init__(
        self,
        endpoint: str,
        topics: Iterable[str] = ("",),
        *,
        events: Mapping[str, type[Event]] = EVENTS,
        context: zmq.asyncio.Context | None = None,
        curve: CurveKeys | None = FROM_ENV,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        self._events = events
        self._sock = (context or zmq.asyncio.Context.instance()).socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 16 * MAX_MESSAGE_BYTES)
        for topic in topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        keys = CurveKeys.from_env() if curve is FROM_ENV else curve
        secure_client(self._sock, self.endpoint, keys)
        self._sock.connect(self.endpoint)

    async def receive(self) -> Event:
        """The next event; malformed or unknown ones are logged and skipped."""
        while True:
            frames = await self._sock.recv_multipart()
            try:
                return decode_event(frames, self._events)
            except MessageError as e:
                # A newer publisher may send event types this subscriber does not know yet;
                # skipping them keeps old subscribers working through a rolling upgrade.
                logger.warning("skipping an event from %s: %s", self.endpoint, e)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            yield await self.receive()

    def close(self) -> None:
        self._sock.close()
