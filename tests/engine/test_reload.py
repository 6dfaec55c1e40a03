"""``systemctl reload`` (SIGHUP) on a real export daemon: the keys that may change live do,
the others are reported as needing a restart, a table that no longer loads changes nothing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from deltarl.config import load_config, write_toml
from deltarl.transport.control import request_sync
from deltarl.transport.messages import Resync
from tests.daemons.pipeline import Pipeline


def _wait_log(log: Path, text: str, timeout_s: float = 30) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        content = log.read_text() if log.exists() else ""
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {log}:\n{log.read_text()[-3000:]}")


def test_sighup_reloads_what_can_change_live(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    try:
        pipe.start("export")
        pipe.wait("the export agent up", lambda: pipe.status("export") is not None)
        before = pipe.status("export")
        config = tmp_path / "deltarl.toml"
        tables = load_config(config)
        export = tables["daemons"]["export"]
        export["full_resync_every"] = before["full_resync_every"] + 7
        assert before["delta_coding"] == "rice"
        export["delta_coding"] = "conditioned"
        export["chunk_bytes"] = 1 << 22  # used when the encoder is made: restart only
        audit = tmp_path / "audit.jsonl"
        export["audit_log"] = str(audit)
        write_toml(config, tables)
        pid = pipe.status("export")["runtime"]["pid"]
        os.kill(pid, signal.SIGHUP)
        log = pipe.log("export")
        _wait_log(log, "export: reloaded: ")
        after = pipe.status("export")
        assert after["full_resync_every"] == before["full_resync_every"] + 7
        assert after["delta_coding"] == "conditioned"
        assert after["runtime"]["pid"] == pid  # the same process: reloaded, not restarted
        text = log.read_text()
        assert (
            "reloaded: full_resync_every, delta_coding, audit_log; needs a restart: chunk_bytes"
            in text
        )
        # The audit log named in the reload is written from now on.
        request_sync(pipe.endpoint("export"), Resync(), 2.0)
        _wait_log(audit, '"command":"resync"')

        # A table that does not load: nothing changes, and the log says why.
        export["full_resync_every"] = "often"
        write_toml(config, tables)
        os.kill(pid, signal.SIGHUP)
        _wait_log(log, "reload refused, the configuration is unchanged")
        assert pipe.status("export")["full_resync_every"] == before["full_resync_every"] + 7
    finally:
        pipe.kill_all()
