"""The agents' kernel warm-up (codecs/kernel_warmth.py): what it reports and how it waits.

The counts come from numba's own per-dispatcher statistics; they are checked here on a real
cached kernel in a fresh cache directory, compiled by one process and loaded by the next."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import orjson
import pytest

from deltarl.codecs import conditioned, kernels
from deltarl.codecs.kernel_warmth import dispatchers, start_warming

KERNEL = """
from numba import njit


@njit(cache=True)
def squares(n):
    s = 0
    for i in range(n):
        s += i * i
    return s
"""

RUN = """
import sys
import orjson
sys.path.insert(0, sys.argv[1])
import tiny
from deltarl.codecs.kernel_warmth import start_warming

warmth, thread = start_warming("test", lambda: tiny.squares(10), [tiny.squares])
thread.join()
print(orjson.dumps(warmth.fields()).decode())
"""


def _warm_in_a_fresh_process(module_dir: Path, cache: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(module_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "NUMBA_CACHE_DIR": str(cache)},
    )
    return orjson.loads(out.stdout)


def test_compiled_into_a_cold_cache_then_loaded_from_it(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tiny.py").write_text(textwrap.dedent(KERNEL))
    cache = tmp_path / "cache"
    first = _warm_in_a_fresh_process(tmp_path / "src", cache)
    assert first["state"] == "ready"
    assert (first["compiled"], first["loaded"]) == (1, 0)
    assert first["cache"] is not None
    assert first["cache"].startswith(str(cache))
    assert first["error"] is None
    second = _warm_in_a_fresh_process(tmp_path / "src", cache)
    assert (second["state"], second["compiled"], second["loaded"]) == ("ready", 0, 1)


def test_a_failed_warm_up_is_reported_and_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("no threading layer could be loaded")

    with caplog.at_level(logging.ERROR):
        warmth, thread = start_warming("apply", broken, [kernels.encode_sparse])
        thread.join(30)
    asyncio.run(asyncio.wait_for(warmth.wait(), 5))
    fields = warmth.fields()
    assert fields["state"] == "failed"
    assert fields["error"] == "RuntimeError: no threading layer could be loaded"
    assert "apply: the codec kernels' warm-up failed" in caplog.text
    assert "no threading layer could be loaded" in caplog.text  # the traceback


def test_a_version_waits_for_the_warm_up() -> None:
    """``wait`` returns only once the warm-up has ended; meanwhile the status says warming."""
    release = threading.Event()
    warmth, thread = start_warming("export", release.wait, [kernels.encode_sparse])

    async def scenario() -> None:
        waiting = asyncio.create_task(warmth.wait())
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert warmth.fields()["state"] == "warming"
        assert warmth.fields()["seconds"] >= 0.3
        release.set()
        await asyncio.wait_for(waiting, 10)

    asyncio.run(scenario())
    thread.join(10)
    assert warmth.fields()["state"] == "ready"


def test_every_kernel_is_watched() -> None:
    """The counts cover the codec's kernels, not a hand-kept list of them."""
    watched = {d.py_func.__name__ for d in dispatchers([kernels, conditioned])}
    assert {"encode_sparse", "decode_sparse", "scatter_sparse", "undo_sparse"} <= watched
    assert len(watched) >= 10
