"""sd_notify against a fake NOTIFY_SOCKET (a bound AF_UNIX datagram socket)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltarl.engine import loop
from deltarl.engine.notify import Notifier


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(2.0)
    yield path, sock
    sock.close()


def test_ready_status_stopping_reach_the_socket(notify_socket, monkeypatch) -> None:
    path, sock = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = Notifier.from_environ()
    assert "NOTIFY_SOCKET" not in os.environ  # children must not inherit it
    assert notifier.enabled
    notifier.ready("serving")
    notifier.status("refit 3 of 10")
    notifier.stopping()
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    assert sock.recv(4096) == b"STATUS=refit 3 of 10"
    assert sock.recv(4096) == b"STOPPING=1"
    notifier.close()


def test_abstract_namespace_address() -> None:
    name = f"deltarl-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        notifier.ready()
        assert sock.recv(4096) == b"READY=1"
        notifier.close()


def test_without_a_socket_every_call_is_a_no_op() -> None:
    env: dict[str, str] = {"WATCHDOG_USEC": "200000"}
    notifier = Notifier.from_environ(env)
    assert not notifier.enabled
    assert env == {}
    notifier.ready("x")
    notifier.status("x")
    notifier.watchdog()
    notifier.stopping()
    asyncio.run(asyncio.wait_for(notifier.watchdog_loop(), 1.0))  # returns at once


def test_a_lost_notification_is_logged_not_raised(tmp_path, caplog) -> None:
    notifier = Notifier(str(tmp_path / "nobody-listens"))
    with caplog.at_level(logging.WARNING):
        notifier.ready()
    notifier.close()
    assert "sd_notify" in caplog.text


def test_watchdog_is_meant_for_the_pid_systemd_named() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    ours = Notifier.from_environ(env)
    assert ours.watchdog_interval_s == pytest.approx(0.1)
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}
    theirs = Notifier.from_environ(env)
    assert theirs.watchdog_interval_s is None
    assert env == {}
    ours.close()
    theirs.close()


def test_watchdog_pings_come_from_the_loop_and_stop_while_it_is_blocked(notify_socket) -> None:
    path, sock = notify_socket
    pings: list[float] = []
    received: list[bytes] = []
    finished = threading.Event()

    def receive() -> None:  # a thread, so arrival times are real even while the loop is stuck
        sock.settimeout(0.05)
        while True:
            try:
                received.append(sock.recv(4096))
            except TimeoutError:
                if finished.is_set():
                    return
                continue
            pings.append(time.monotonic())

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    assert notifier.watchdog_interval_s == pytest.approx(0.1)  # half of WATCHDOG_USEC

    async def main() -> tuple[float, float]:
        task = asyncio.create_task(notifier.watchdog_loop())
        await asyncio.sleep(0.35)
        blocked_at = time.monotonic()
        time.sleep(0.5)  # noqa: ASYNC251 - the point: the loop is stuck, no ping may leave it
        unblocked_at = time.monotonic()
        await asyncio.sleep(0.25)
        task.cancel()
        return blocked_at, unblocked_at

    blocked_at, unblocked_at = loop.run(main())
    finished.set()
    receiver.join(timeout=5.0)
    assert set(received) == {b"WATCHDOG=1"}
    notifier.close()
    before = [t for t in pings if t < blocked_at]
    during = [t for t in pings if blocked_at + 0.05 < t < unblocked_at]
    after = [t for t in pings if t >= unblocked_at]
    assert len(before) >= 3
    assert during == []
    assert len(after) >= 2
