"""The refit pipeline the daemon tests share: a synthetic trainer, the export agent and one
or more apply agents as real processes (``deltarl.launch.DaemonGroup``), configured through
the project's one configuration writer (``deltarl.config.write_toml``).

``refit_tables`` builds the tables as Python values, so a test changes what it needs (a knob,
a link, relay children) instead of copying a TOML template.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from deltarl.config import write_toml
from deltarl.engine.weight_store import WeightStore
from deltarl.launch import DaemonDied, DaemonGroup, WaitTimeout
from deltarl.transport.control import request_sync
from deltarl.transport.messages import GetStatus, Ok, Pause, Status
from deltarl.transport.ports import free_port

PARAMS = 200_000


def shm_link(tmp: Path, name: str = "t") -> dict[str, Any]:
    return {"type": "shm", "name": name, "root": str(tmp)}


def stream_link(port: int, **knobs: Any) -> dict[str, Any]:
    return {"type": "stream", "host": "127.0.0.1", "port": port, **knobs}


def endpoint(tmp: Path, daemon: str, kind: str = "sock") -> str:
    return f"ipc://{tmp}/{daemon}.{kind}"


def apply_table(tmp: Path, name: str, link: dict[str, Any], store: str = "rollout") -> dict:
    return {
        "control": endpoint(tmp, name),
        "events": endpoint(tmp, name, "events"),
        "rollout_store": store,
        "store_root": str(tmp),
        "layout_store": "pub",
        "link": link,
    }


def refit_tables(
    tmp: Path,
    *,
    export_link: dict[str, Any],
    apply_link: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    export: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``[daemons.trainer]`` (synthetic), ``export`` and ``apply``; the apply agent receives
    on ``apply_link`` (default: ``export_link``, the same link). Knobs override the defaults."""
    return {
        "daemons": {
            "trainer": {
                "control": endpoint(tmp, "trainer"),
                "published_store": "pub",
                "store_root": str(tmp),
                "params": PARAMS,
                "interval_s": 0.3,
                **(trainer or {}),
            },
            "export": {
                "control": endpoint(tmp, "export"),
                "events": endpoint(tmp, "export", "events"),
                "published_store": "pub",
                "store_root": str(tmp),
                "manifest_store": str(tmp / "versions.sqlite"),
                "apply_control": endpoint(tmp, "apply"),
                "apply_events": endpoint(tmp, "apply", "events"),
                "full_resync_every": 4,
                "ack_timeout_s": 20.0,
                "poll_s": 0.02,
                **(export or {}),
                "link": export_link,
            },
            "apply": apply_table(tmp, "apply", apply_link or export_link),
        }
    }


def default_tables(tmp: Path, link: str) -> dict[str, Any]:
    chosen = shm_link(tmp) if link == "shm" else stream_link(free_port())
    return refit_tables(tmp, export_link=chosen)


class Pipeline(DaemonGroup):
    """The daemons of ``tables`` in ``tmp``; started one by one, stopped together."""

    def __init__(self, tmp: Path, tables: str | dict[str, Any] = "shm") -> None:
        self.tmp = tmp
        self.tables = default_tables(tmp, tables) if isinstance(tables, str) else tables
        config = write_toml(tmp / "deltarl.toml", self.tables)
        daemons = self.tables["daemons"]
        super().__init__(tmp, config, {n: t["control"] for n, t in daemons.items()})

    def endpoint(self, daemon: str) -> str:
        return self.endpoints[daemon]

    def start(self, daemon: str) -> None:  # type: ignore[override]
        if daemon == "trainer":
            super().start(daemon, args=["--synthetic"])
        elif daemon.startswith("apply"):
            super().start(daemon, daemon="apply")
        else:
            super().start(daemon)

    def status(self, daemon: str) -> dict[str, Any]:  # type: ignore[override]
        reply = request_sync(self.endpoint(daemon), GetStatus(), 2.0)
        assert isinstance(reply, Status), reply
        return reply.fields

    def wait(self, what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:  # type: ignore[override]
        try:
            super().wait(what, cond, timeout)
        except (DaemonDied, WaitTimeout) as e:
            raise AssertionError(f"{e}; logs:\n{self.logs(40)}") from None

    def quiesce(self, members: tuple[str, ...] = ("apply",)) -> int:
        """Pause the trainer; wait until its last version is active on every member."""
        assert request_sync(self.endpoint("trainer"), Pause(), 2.0) == Ok("paused")
        self.wait("the trainer's last step", lambda: not self.status("trainer")["stepping"])
        version = int(self.status("trainer")["version"])
        self.wait(
            f"version {version} active",
            lambda: (
                all(self.status(m)["active_version"] == version for m in members)
                and self.status("export")["reference_version"] == version
            ),
        )
        return version

    def stop_all(self) -> dict[str, int | None]:
        return self.stop(timeout_s=30)

    def kill_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)


def assert_bit_exact(tmp: Path, version: int, store: str = "rollout") -> None:
    with (
        WeightStore.open("pub", root=tmp, readonly=True) as pub,
        WeightStore.open(store, root=tmp, readonly=True) as out,
        pub.lease() as a,
        out.lease() as b,
    ):
        assert a.version == b.version == version
        assert np.array_equal(a.buffer, b.buffer)
