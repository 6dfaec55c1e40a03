"""Free loopback ports for processes that are started together and told a port in advance.

The benches, the tests and a host's trainer ranks pick a port here, write it into a config,
and start the process that will listen on it. Binding port 0 and closing it, the usual
trick, picks from the kernel's ephemeral range: the port is free again the moment it is
closed, and until the listener binds it any outgoing connection on the host may take it as
its source port. Worse, a client that is already connecting to ``127.0.0.1:P`` (retrying
until the listener comes up, as our links do) can be given source port ``P`` itself and
connect to itself (TCP's simultaneous open), holding the port so that the listener never
binds it ("Device is busy" from UCX, EADDRINUSE from asyncio).

The kernel never gives out a source port outside the ephemeral range, so a port below it
(or above it) can only be taken by another explicit bind. The ports here are drawn at random
from outside that range, checked by binding them, and never handed out twice by one process,
so two picks in a row never collide before either is bound.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default, where the range cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)
# Below this are the well-known and registered ports services tend to sit on.
LOWEST = 15000
HIGHEST = 65535
TRIES = 200

_handed_out: set[int] = set()
_lock = threading.Lock()
# Not the module's global generator: hypothesis and seeded tests reset that one, and two
# processes seeded alike would draw the same ports.
_draw = random.SystemRandom()


class NoFreePortError(RuntimeError):
    """No free port outside the ephemeral range was found on the host."""


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections, inclusive."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def _outside(low: int, high: int, count: int) -> list[range]:
    """Ranges of first ports whose ``count`` consecutive ports all lie outside [low, high]."""
    spans = [range(LOWEST, low - count + 1), range(max(high + 1, LOWEST), HIGHEST - count + 2)]
    return [span for span in spans if len(span) > 0]


def _bindable(host: str, port: int) -> bool:
    # No SO_REUSEADDR: a port with a connection still in TIME_WAIT counts as taken, since a
    # listener without the option could not bind it either.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(
    count: int = 1,
    host: str = "127.0.0.1",
    *,
    ephemeral: tuple[int, int] | None = None,
    draw: random.Random | None = None,
) -> int:
    """The first of ``count`` consecutive free TCP ports on ``host``, all outside the
    ephemeral range and none handed out before by this process.

    ``ephemeral`` and ``draw`` are for tests (a given range, a seeded generator)."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    low, high = ephemeral if ephemeral is not None else ephemeral_range()
    spans = _outside(low, high, count)
    if not spans:
        raise NoFreePortError(
            f"the ephemeral range {low}-{high} leaves no {count} consecutive ports between "
            f"{LOWEST} and {HIGHEST}; narrow net.ipv4.ip_local_port_range"
        )
    pick = draw or _draw
    weights = [len(span) for span in spans]
    with _lock:
        for _ in range(TRIES):
            span = pick.choices(spans, weights)[0]
            first = span[pick.randrange(len(span))]
            ports = range(first, first + count)
            if any(p in _handed_out for p in ports):
                continue
            if all(_bindable(host, p) for p in ports):
                _handed_out.update(ports)
                return first
    raise NoFreePortError(
        f"no {count} consecutive free ports on {host} outside {low}-{high} in {TRIES} tries"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """One free TCP port on ``host`` outside the ephemeral range (see the module's doc)."""
    return free_port_block(1, host)
