"""Event-loop selection and the lag monitor."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import uvloop

from deltarl.engine import loop
from deltarl.engine.loop import LoopLagMonitor, LoopLagStats


def test_uvloop_is_chosen_when_importable() -> None:
    name, factory = loop.loop_factory()
    assert name == "uvloop"
    assert factory is uvloop.new_event_loop

    async def which() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(loop.run(which()), uvloop.Loop)
    assert not issubclass(loop.run(which(), prefer_uvloop=False), uvloop.Loop)


def test_asyncio_is_the_fallback_without_uvloop(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes `import uvloop` raise ImportError
    name, factory = loop.loop_factory()
    assert name == "asyncio"
    assert factory is asyncio.new_event_loop
    assert loop.run(asyncio.sleep(0, result=7)) == 7


def test_lag_statistics_from_recorded_samples() -> None:
    monitor = LoopLagMonitor(interval_s=0.5)
    assert monitor.stats() == LoopLagStats(0.5, 0, 0.0, 0.0, 0.0)
    for lag in (0.1, 0.4, 0.1):
        monitor.record(lag)
    stats = monitor.stats()
    assert (stats.samples, stats.last_s, stats.max_s) == (3, 0.1, 0.4)
    assert stats.mean_s == pytest.approx(0.2)
    with pytest.raises(ValueError, match="must be positive"):
        LoopLagMonitor(interval_s=0)


@pytest.mark.parametrize("prefer_uvloop", [True, False], ids=["uvloop", "asyncio"])
def test_a_blocked_loop_shows_up_as_lag(prefer_uvloop) -> None:
    async def main() -> LoopLagStats:
        monitor = LoopLagMonitor(interval_s=0.02)
        monitor.start()
        await asyncio.sleep(0.1)
        asyncio.get_running_loop().call_soon(time.sleep, 0.25)  # a callback that blocks
        await asyncio.sleep(0.1)
        await monitor.stop()
        return monitor.stats()

    stats = loop.run(main(), prefer_uvloop=prefer_uvloop)
    assert stats.samples >= 3
    assert stats.max_s >= 0.2
    assert stats.mean_s < stats.max_s
