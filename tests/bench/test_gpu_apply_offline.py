"""scripts/gpu-apply-offline.sh: `bench gpu-apply` from an uninstalled checkout, on a machine
whose python has torch and numpy but no index to install deltarl's other needs from. Run here
on the CPU (``--device cpu``); the same script runs the bench on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-apply-offline.sh"


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), **env},
    )


def _hiding(tmp_path: Path, module: str) -> str:
    """A PYTHONPATH under which ``module`` cannot be imported, as on a machine without it."""
    shadow = tmp_path / f"no-{module}"
    shadow.mkdir()
    (shadow / f"{module}.py").write_text(f"raise ImportError('{module} is not here')\n")
    return str(shadow)


def test_it_runs_the_bench_from_the_checkout(tmp_path: Path) -> None:
    out = _run(tmp_path, "--device", "cpu", "--params", "300000", "--repeat", "1")
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "out" / "gpu_apply.json").read_text())
    (size,) = result["sizes"]
    assert size["bit_exact"]
    assert size["checksums_match"]
    assert result["device"] == "cpu"
    assert f"worker_ext should take: {result['worker_ext_path']}" in out.stdout


def test_it_says_which_wheel_is_missing(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    out = _run(
        tmp_path, "--device", "cpu", PYTHONPATH=_hiding(tmp_path, "orjson"), WHEELS=str(wheels)
    )
    assert out.returncode == 3
    assert "no orjson wheel" in out.stderr
    assert "--fetch" in out.stderr  # and how to get one
    assert not (tmp_path / "out" / "gpu_apply.json").exists()


def test_it_needs_torch_and_says_so(tmp_path: Path) -> None:
    out = _run(tmp_path, "--device", "cpu", PYTHONPATH=_hiding(tmp_path, "torch"))
    assert out.returncode == 2
    assert "cannot import numpy and torch" in out.stderr
