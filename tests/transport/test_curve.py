"""tcp:// control sockets with CURVE: an authorized client gets answers, a client without the
cluster's key or with an unlisted key gets nothing (a timeout), ipc:// is untouched, a broken key
directory is a configuration error (exit 78), and `deltarl keys` makes a usable directory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from deltarl.transport.control import ControlClient, ControlServer, ControlTimeoutError
from deltarl.transport.curve import CurveKeyError, CurveKeys, make_keys
from deltarl.transport.events import EventPublisher, EventSubscriber
from deltarl.transport.messages import GetStatus, Status, VersionApplied


async def _status(endpoint: str, curve: CurveKeys | None) -> Status | None:
    async with ControlClient(endpoint, curve=curve) as client:
        try:
            reply = await client.request(GetStatus(), 1.0)
        except ControlTimeoutError:
            return None
    assert isinstance(reply, Status)
    return reply


def _serve_and_ask(
    endpoint: str, server: CurveKeys | None, clients: list[CurveKeys | None]
) -> list[Status | None]:
    async def go() -> list[Status | None]:
        async def status(_: GetStatus) -> Status:
            return Status("probe", "running", {})

        async with ControlServer(endpoint, {GetStatus: status}, curve=server) as srv:
            return [await _status(srv.endpoint, c) for c in clients]

    return asyncio.run(go())


def test_only_authorized_clients_are_answered(tmp_path: Path) -> None:
    keys = CurveKeys.load(make_keys(tmp_path / "keys"))
    # a second cluster's client: a valid key pair, not listed in our authorized/
    other = CurveKeys.load(make_keys(tmp_path / "other"))
    stranger = CurveKeys(
        keys.directory,
        keys.server_public,
        keys.server_secret,
        other.client_public,
        other.client_secret,
    )
    got = _serve_and_ask("tcp://127.0.0.1:*", keys, [keys, None, stranger])
    assert got[0] is not None
    assert got[0].daemon == "probe"
    assert got[1] is None  # no CURVE at all: the handshake never completes
    assert got[2] is None  # CURVE, but a key the server does not know


def test_a_second_event_loop_serves_curve_too(tmp_path: Path) -> None:
    # A process may run several loops one after another (tests, tools): the ZAP handler
    # follows the loop, or every handshake after the first loop would hang.
    keys = CurveKeys.load(make_keys(tmp_path / "keys"))
    for _ in range(2):
        assert _serve_and_ask("tcp://127.0.0.1:*", keys, [keys])[0] is not None


def test_ipc_is_not_curve(tmp_path: Path) -> None:
    keys = CurveKeys.load(make_keys(tmp_path / "keys"))
    got = _serve_and_ask(f"ipc://{tmp_path}/c.sock", keys, [None])
    assert got[0] is not None


def test_bad_key_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(CurveKeyError, match="deltarl keys"):
        CurveKeys.load(tmp_path / "missing")
    d = make_keys(tmp_path / "keys")
    with pytest.raises(FileExistsError):
        make_keys(d)
    (d / "client.key_secret").unlink()
    zmq.auth.create_certificates(d, "client")
    (d / "client.key_secret").write_text((d / "client.key").read_text())  # public only
    with pytest.raises(CurveKeyError, match="no secret key"):
        CurveKeys.load(d)
    config = tmp_path / "deltarl.toml"
    config.write_text(f"""
[daemons.scheduler]
control = "tcp://127.0.0.1:0"
db = "{tmp_path}/s.sqlite"
""")
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "scheduler", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "DELTARL_CURVE_KEYS": str(d)},
    )
    assert proc.returncode == 78, proc.stderr
    assert "DELTARL_CURVE_KEYS" in proc.stderr


def test_deltarl_keys_command(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "keys", str(tmp_path / "k")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "DELTARL_CURVE_KEYS" in out.stdout
    assert oct((tmp_path / "k").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "k" / "server.key_secret").stat().st_mode & 0o777) == "0o600"
    CurveKeys.load(tmp_path / "k")


def test_events_over_tcp_reach_only_authorized_subscribers(tmp_path: Path) -> None:
    # The receiver state travels as events and moves the export agent's reference: a
    # subscriber without the cluster's key must not get them (nor could a stranger's PUB
    # feed an authorized SUB, since the SUB checks the server key).
    keys = CurveKeys.load(make_keys(tmp_path / "keys"))

    async def go() -> tuple[bool, bool]:
        publisher = EventPublisher("tcp://127.0.0.1:*", curve=keys)
        endpoint = publisher.bind()
        authorized = EventSubscriber(endpoint, curve=keys)
        anonymous = EventSubscriber(endpoint, curve=None)

        async def heard(sub: EventSubscriber) -> bool:
            try:
                await asyncio.wait_for(sub.receive(), 0.2)
            except TimeoutError:
                return False
            return True

        got = {"authorized": False, "anonymous": False}
        try:
            for _ in range(15):  # publish until the authorized one hears (joins are async)
                await publisher.publish(VersionApplied(1))
                got["authorized"] = got["authorized"] or await heard(authorized)
                got["anonymous"] = got["anonymous"] or await heard(anonymous)
        finally:
            authorized.close()
            anonymous.close()
            publisher.close()
        return got["authorized"], got["anonymous"]

    authorized, anonymous = asyncio.run(go())
    assert authorized
    assert not anonymous
