"""Authenticated, encrypted control sockets across hosts: ZeroMQ CURVE with one key directory.

A ``tcp://`` control socket would otherwise take ``shutdown`` or ``rollback`` from anyone who
can reach the port. With ``DELTARL_CURVE_KEYS=DIR`` in the environment (the units read it from
``/etc/deltarl/deltarl.env``), every ``tcp://`` control server and client of the process speaks
CURVE: the server proves it holds the cluster's server key, the client proves it holds a key
listed in ``DIR/authorized``, and the traffic is encrypted. ``ipc://`` sockets are left alone:
their protection is the runtime directory's mode.

    deltarl keys DIR        makes DIR/server.key(_secret), DIR/client.key(_secret) and
                            DIR/authorized/client.key, and the data plane's keys beside them
                            (data.key, tls/: deltarl/transport/data_keys.py); run on an older
                            directory, it adds only what is missing. Copy DIR to every host
                            (mode 0700)

Without the variable, a ``tcp://`` server still works and logs a warning once; with it, a
client that has no authorized key gets no reply at all (ZeroMQ drops the handshake), which
``ControlClient`` reports as a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from deltarl.transport.data_keys import make_data_keys

logger = logging.getLogger(__name__)

KEYS_ENV = "DELTARL_CURVE_KEYS"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)


class CurveKeyError(ValueError):
    """The key directory is missing a file or holds an unreadable key."""


@dataclass(frozen=True)
class CurveKeys:
    directory: Path
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def authorized(self) -> Path:
        return self.directory / "authorized"

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        d = Path(directory)
        try:
            server_public, server_secret = zmq.auth.load_certificate(d / "server.key_secret")
            client_public, client_secret = zmq.auth.load_certificate(d / "client.key_secret")
        except (OSError, ValueError) as e:
            raise CurveKeyError(
                f"{KEYS_ENV}={d}: {e} (make the directory with `deltarl keys DIR`)"
            ) from None
        if server_secret is None or client_secret is None:
            raise CurveKeyError(f"{KEYS_ENV}={d}: a *.key_secret file holds no secret key")
        if not (d / "authorized").is_dir():
            raise CurveKeyError(f"{KEYS_ENV}={d}: no authorized/ directory of client keys")
        return cls(d, server_public, server_secret, client_public, client_secret)

    @classmethod
    def from_env(cls) -> CurveKeys | None:
        value = os.environ.get(KEYS_ENV)
        return cls.load(value) if value else None


def make_keys(directory: str | Path) -> Path:
    """Create a cluster key directory, or add what an older one lacks (the data plane's
    keys); never overwrite a key. The directory; FileExistsError if it was complete."""
    d = Path(directory)
    written: list[Path] = []
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    if not (d / "server.key_secret").exists():
        zmq.auth.create_certificates(d, "server")
        zmq.auth.create_certificates(d, "client")
        (d / "authorized").mkdir(exist_ok=True, mode=0o700)
        shutil.copy(d / "client.key", d / "authorized" / "client.key")
        for secret in d.glob("*.key_secret"):
            os.chmod(secret, 0o600)
        written += sorted(d.glob("*.key*"))
    written += make_data_keys(d)
    if not written:
        raise FileExistsError(f"{d} already holds every key; remove it first to make new ones")
    return d


_authenticators: dict[int, tuple[AsyncioAuthenticator, asyncio.AbstractEventLoop]] = {}
_warned = False


def secure_server(sock: zmq.asyncio.Socket, endpoint: str, keys: CurveKeys | None) -> None:
    """Make ``sock`` (about to bind ``endpoint``) a CURVE server when it is ``tcp://``."""
    global _warned  # noqa: PLW0603 - one warning per process
    if not endpoint.startswith("tcp://"):
        return
    if keys is None:
        if not _warned:
            _warned = True
            logger.warning(
                "control socket %s is not authenticated: set %s to a key directory "
                "(deltarl keys DIR)",
                endpoint,
                KEYS_ENV,
            )
        return
    context = sock.context
    loop = asyncio.get_running_loop()
    held = _authenticators.get(id(context))
    if held is None or held[1] is not loop:
        # One ZAP handler per context (it binds a fixed inproc address), serving on the
        # running loop; one left by an earlier loop of this process is stopped first.
        if held is not None:
            old = held[0]
            # close() releases the inproc address only later, in libzmq's reaper: unbind now.
            with contextlib.suppress(zmq.ZMQError):
                old.zap_socket.unbind(ZAP_ENDPOINT)
            old.stop()
        auth = AsyncioAuthenticator(context)  # type: ignore[arg-type]
        auth.start()
        auth.configure_curve(domain="*", location=str(keys.authorized))
        _authenticators[id(context)] = (auth, loop)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.asyncio.Socket, endpoint: str, keys: CurveKeys | None) -> None:
    """Make ``sock`` (about to connect to ``endpoint``) a CURVE client when it is ``tcp://``."""
    if keys is None or not endpoint.startswith("tcp://"):
        return
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


def main(argv: list[str]) -> int:
    """``deltarl keys DIR``: make a cluster key directory."""
    import argparse  # noqa: PLC0415 - only for the command line

    ap = argparse.ArgumentParser(
        prog="deltarl keys",
        description="make the cluster's keys: CURVE for the control sockets, a MAC key and a "
        "TLS identity for the data plane (an existing directory gets what it lacks)",
    )
    ap.add_argument("directory", type=Path)
    args = ap.parse_args(argv)
    try:
        d = make_keys(args.directory)
    except FileExistsError as e:
        print(f"deltarl keys: {e}")
        return 1
    print(f"keys in {d}; copy the directory to every host (mode 0700) and set {KEYS_ENV}={d}")
    return 0
