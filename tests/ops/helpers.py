"""What the ops tests share: ``deltarl ctl ... --json`` in a process of its own, and a daemon
started and waited for."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen
from typing import Any

import orjson


def ctl_json(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """(exit status, the one JSON object printed) of ``deltarl ctl --config CONFIG ARGS
    --json``."""
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "ctl", "--config", str(config), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout, proc.stderr
    return proc.returncode, dict(orjson.loads(proc.stdout))


def start_daemon(config: Path, daemon: str, env: dict[str, str] | None = None) -> Popen[str]:
    """``deltarl DAEMON --config CONFIG`` in a process of its own, its stderr piped."""
    return Popen(
        [sys.executable, "-m", "deltarl.cli", daemon, "--config", str(config)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def running_daemon(
    config: Path, daemon: str, env: dict[str, str] | None = None
) -> Iterator[Popen[str]]:
    """``start_daemon``, once it answers ``status`` (within 60 s, or it exited: the test
    fails with its stderr); killed on the way out if it still runs."""
    proc = start_daemon(config, daemon, env)
    try:
        end = time.monotonic() + 60
        while not ctl_json(config, daemon, "status")[1].get("ok"):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < end, f"the {daemon} daemon never answered"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
