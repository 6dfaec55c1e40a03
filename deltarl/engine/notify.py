"""sd_notify: tell systemd (``Type=notify``) how the daemon is doing. No dependency.

The protocol is one datagram of ``KEY=value`` lines to the AF_UNIX socket named by
``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). Without that variable
every call is a no-op, so daemons run the same by hand and under systemd.

``WATCHDOG=1`` must come from the event loop itself (``watchdog_loop`` is a task), never from a
side thread: a stalled loop then really stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)


class Notifier:
    """One daemon's channel to systemd; build it with ``from_environ`` once, early in main."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        # '@' stands for the abstract namespace, whose names start with a NUL byte.
        self.address = "\0" + address[1:] if address and address.startswith("@") else address
        # systemd asks for pings at least every WATCHDOG_USEC; half of it leaves room for jitter.
        self.watchdog_interval_s = watchdog_usec / 2e6 if watchdog_usec else None
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the event loop on a full receive queue: such a message is dropped.
            self._sock.setblocking(False)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Read and remove the systemd variables, so that child processes don't inherit them."""
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None) or None
        usec = env.pop("WATCHDOG_USEC", None)
        pid = env.pop("WATCHDOG_PID", None)
        # The watchdog is meant for the process systemd named (if it named one).
        for_us = pid is None or pid == str(os.getpid())
        return cls(address, int(usec) if usec and for_us else None)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> None:
        """Send ``KEY=value`` fields in one datagram."""
        if self._sock is None or self.address is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            # Tolerated: a lost notification must not take the daemon down; a missing READY or
            # WATCHDOG shows up in systemd's own state, which is where it matters.
            logger.warning("sd_notify %s to %r failed: %s", fields, self.address, exc)

    def ready(self, status: str | None = None) -> None:
        self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    async def watchdog_loop(self) -> None:
        """Ping the watchdog from this event loop until cancelled; returns at once if off."""
        if not self.enabled or self.watchdog_interval_s is None:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(self.watchdog_interval_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
