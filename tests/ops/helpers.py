"""What the ops tests share: ``deltarl ctl ... --json`` in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
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
