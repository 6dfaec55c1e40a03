"""Free ports outside the ephemeral range: bindable, never handed out twice, taken ones skipped."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deltarl.transport import ports
from deltarl.transport.ports import NoFreePortError, ephemeral_range, free_port, free_port_block

HOST = "127.0.0.1"


@contextmanager
def held(port: int) -> Iterator[None]:
    """A listener on ``port``, as another process's would be."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen()
        yield


def test_ports_lie_outside_the_ephemeral_range_and_can_be_listened_on() -> None:
    low, high = ephemeral_range()
    picked = [free_port() for _ in range(40)]
    assert len(set(picked)) == len(picked)
    for port in picked:
        assert not low <= port <= high, (port, low, high)
        assert ports.LOWEST <= port <= ports.HIGHEST
        with held(port):
            pass


def test_a_block_is_consecutive_and_never_straddles_the_range() -> None:
    ephemeral = (20000, 60000)
    for _ in range(30):
        first = free_port_block(5, ephemeral=ephemeral)
        block = range(first, first + 5)
        assert all(not 20000 <= p <= 60000 for p in block), first
        assert block[-1] <= ports.HIGHEST


def test_a_port_another_process_holds_is_skipped() -> None:
    ephemeral = ephemeral_range()
    # The port a generator seeded alike would draw first, taken before the draw.
    first_choice = free_port_block(1, ephemeral=ephemeral, draw=random.Random(7))
    ports._handed_out.discard(first_choice)
    with held(first_choice):
        got = free_port_block(1, ephemeral=ephemeral, draw=random.Random(7))
        assert got != first_choice
        with held(got):
            pass


def test_ports_handed_out_are_not_drawn_again_before_they_are_bound() -> None:
    # A generator that keeps drawing the same first port: the second pick must move on.
    class Stuck(random.Random):
        calls = 0

        def randrange(self, *args: int) -> int:  # type: ignore[override]
            self.calls += 1
            return 0 if self.calls < 3 else 1

        def choices(self, population, weights=None, **kw):  # type: ignore[no-untyped-def,override]
            return [population[0]]

    ephemeral = (ports.LOWEST + 100, 60999)
    first = free_port_block(1, ephemeral=ephemeral, draw=Stuck())
    if first != ports.LOWEST:
        pytest.skip(f"port {ports.LOWEST} is in use on this host")
    second = free_port_block(1, ephemeral=ephemeral, draw=Stuck())
    assert second == ports.LOWEST + 1


def test_every_candidate_taken_is_a_clear_error() -> None:
    # Ranges that leave only ports LOWEST and HIGHEST, both held.
    ephemeral = (ports.LOWEST + 1, ports.HIGHEST - 1)
    with (
        held(ports.LOWEST),
        held(ports.HIGHEST),
        pytest.raises(NoFreePortError, match="no 1 consecutive free ports"),
    ):
        free_port_block(1, ephemeral=ephemeral)


def test_a_range_below_the_lowest_leaves_the_ports_above_it() -> None:
    for _ in range(20):
        assert ports.LOWEST <= free_port_block(1, ephemeral=(1024, 5000)) <= ports.HIGHEST


def test_a_range_covering_every_port_is_refused_with_the_setting_named() -> None:
    with pytest.raises(NoFreePortError, match="ip_local_port_range"):
        free_port_block(1, ephemeral=(1024, 65535))
    with pytest.raises(ValueError, match="at least 1"):
        free_port_block(0)


def test_the_range_is_read_from_the_kernel_and_defaults_when_unreadable(tmp_path: Path) -> None:
    given = tmp_path / "range"
    given.write_text("40000\t50000\n")
    assert ephemeral_range(given) == (40000, 50000)
    assert ephemeral_range(tmp_path / "absent") == ports.DEFAULT_EPHEMERAL
    given.write_text("garbage")
    assert ephemeral_range(given) == ports.DEFAULT_EPHEMERAL
