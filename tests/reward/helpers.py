"""Reward daemons as processes for the tests: configured, started, waited for, killed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deltarl.transport.control import ControlClient, ControlProtocolError, ControlTimeoutError
from deltarl.transport.messages import GetStatus, Status

ROOT = Path(__file__).resolve().parents[2]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


class RewardDaemon:
    """``deltarl reward`` (or, with ``delays``, the ``slow`` scorer of tests.reward.faulty)."""

    def __init__(self, tmp: Path, delays: str | None = None, **keys: Any) -> None:
        self.endpoint = f"ipc://{tmp}/reward.sock"
        table = {"control": self.endpoint, **keys}
        if delays is not None:
            table["scorer"] = "slow"
        self.config = tmp / "reward.toml"
        lines = [f"{k} = {toml_value(v)}" for k, v in table.items()]
        self.config.write_text("[daemons.reward]\n" + "\n".join(lines) + "\n")
        self.delays = delays
        self.log_path = tmp / "reward.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if self.delays is None:
            cmd = [sys.executable, "-m", "deltarl.cli", "reward", "--config", str(self.config)]
        else:
            env["DELTARL_TEST_REWARD_DELAYS"] = self.delays
            cmd = [sys.executable, "-m", "tests.reward.faulty", "--config", str(self.config)]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def status(self, timeout: float = 30.0) -> Status:  # noqa: ASYNC109
        """Its status, once it answers (it has just been started, maybe)."""
        deadline = time.monotonic() + timeout
        async with ControlClient(self.endpoint) as client:
            while time.monotonic() < deadline:
                assert self.proc is None or self.proc.poll() is None, self.log()
                try:
                    reply = await client.request(GetStatus(), timeout=1.0)
                except (ControlTimeoutError, ControlProtocolError):
                    await asyncio.sleep(0.05)
                    continue
                assert isinstance(reply, Status), reply
                return reply
        raise AssertionError(f"the reward daemon did not answer in {timeout} s:\n{self.log()}")
