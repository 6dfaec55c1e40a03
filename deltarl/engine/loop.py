"""The event loop: which implementation runs it, and how late it wakes up.

uvloop is preferred and asyncio's own loop is the fallback; the choice is made here and only
here. uvloop is used through ``asyncio.Runner(loop_factory=uvloop.new_event_loop)``, never
``uvloop.install()`` (deprecated: it swaps the global policy under everyone's feet).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def loop_factory(prefer_uvloop: bool = True) -> tuple[str, LoopFactory]:
    """The loop implementation to use, as ``(name, factory)``: uvloop when importable."""
    if prefer_uvloop:
        try:
            import uvloop  # noqa: PLC0415 - optional: the fallback must work without it
        except ImportError:
            pass
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], *, prefer_uvloop: bool = True, debug: bool = False) -> T:
    """Run ``main`` to completion on a fresh loop of the preferred implementation."""
    _, factory = loop_factory(prefer_uvloop)
    with asyncio.Runner(loop_factory=factory, debug=debug) as runner:
        return runner.run(main)


@dataclass(frozen=True, slots=True)
class LoopLagStats:
    """How late the event loop woke up for the monitor's timer, in seconds."""

    interval_s: float  # how long the monitor asked to sleep each time
    samples: int
    last_s: float
    max_s: float
    mean_s: float


class LoopLagMonitor:
    """A task that sleeps ``interval_s`` at a time and records how late it wakes.

    Lag is time the loop spent on something other than this timer: a callback or a task
    step that blocked (CPU work, a blocking call). Timer granularity (1 ms on uvloop) shows
    up as a floor of noise.
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"lag monitor interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._samples = 0
        self._last = 0.0
        self._max = 0.0
        self._total = 0.0
        self._task: asyncio.Task[None] | None = None

    def stats(self) -> LoopLagStats:
        mean = self._total / self._samples if self._samples else 0.0
        return LoopLagStats(self.interval_s, self._samples, self._last, self._max, mean)

    def record(self, lag_s: float) -> None:
        self._samples += 1
        self._last = lag_s
        self._max = max(self._max, lag_s)
        self._total += lag_s

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            # time.monotonic, not loop.time(): uvloop's clock is cached per loop iteration
            # in whole milliseconds.
            asked_at = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, time.monotonic() - asked_at - self.interval_s))

    def start(self) -> asyncio.Task[None]:
        if self._task is not None:
            raise RuntimeError("the lag monitor is already running")
        self._task = asyncio.get_running_loop().create_task(self.run(), name="loop-lag-monitor")
        return self._task

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        # asyncio.wait, not ``await task`` under suppress(CancelledError): that would also
        # swallow a cancellation aimed at our caller.
        await asyncio.wait({self._task})
        self._task = None
