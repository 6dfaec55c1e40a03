"""Reward scoring with a timeout and retries.

Each sample's reward is one call of the task's ``reward(prompt, text)`` in a thread of its own,
awaited with ``timeout_s``; a call that raises, returns something that is not a finite number,
or runs past the timeout is tried again, up to ``retries`` more times. The samples of a group
are scored concurrently, at most ``workers`` calls at a time.

Why a thread per call rather than a pool: a call that hangs cannot be killed from Python, and
in a fixed pool a few hung calls would occupy every worker and time out all later scoring. A
thread of its own is simply abandoned at its timeout (``stuck`` counts the ones still running,
reported in the scheduler's status), so a hung reward service costs one thread, not the loop.

What a failure means is the service's decision (see ``SchedulerService.submit_group``): a group
is scored whole or not at all, because GRPO normalises rewards within the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]


class RewardFailedError(Exception):
    """A sample's reward could not be had within the retries; ``reason`` is
    ``reward_timeout`` or ``reward_error``, and the message says what happened last."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RewardUnavailableError(Exception):
    """The reward service cannot score now (its circuit breaker is open): not the group's
    fault, so the group is neither dropped nor counted as a failure; it is refused as
    ``reward_unavailable`` and submitted again later (``deltarl.scheduler.reward_client``)."""


def _checked(value: object) -> float:
    """A reward as a float, or why it is not one (it is then retried like an exception)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward is {type(value).__name__}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"reward is {value}")
    return float(value)


def _ignore(name: str) -> None:
    del name


@dataclass
class RewardScorer:
    fn: RewardFn
    timeout_s: float = 10.0
    retries: int = 2
    workers: int = 8
    count: Callable[[str], None] = _ignore
    """Called with ``reward.calls``, ``reward.retries``, ``reward.timeouts``, ``reward.errors``
    as they happen (the service persists them in its store)."""
    stuck: int = field(default=0, init=False)
    """Timed-out calls whose thread has not returned yet."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.retries < 0 or self.workers < 1:
            raise ValueError("timeout_s > 0, retries >= 0 and workers >= 1 are required")
        self._slots = asyncio.Semaphore(self.workers)
        self._lock = threading.Lock()

    async def score_group(self, prompt: str, texts: Sequence[str]) -> list[float]:
        """Every sample's reward, in order; RewardFailedError if any one fails for good."""
        tasks = [asyncio.ensure_future(self.score(prompt, t)) for t in texts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # one failed: the others' results are of no use any more
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        """The scheduler's status of its rewards: scored in this process."""
        return {"service": "in_process", "workers": self.workers, "stuck": self.stuck}

    async def close(self) -> None:
        """Nothing to release: abandoned threads are daemon threads."""

    async def score(self, prompt: str, text: str) -> float:
        last = RewardFailedError("reward_error", "not tried")
        for attempt in range(self.retries + 1):
            if attempt:
                self.count("reward.retries")
            try:
                async with self._slots:
                    value = await asyncio.wait_for(self._call(prompt, text), self.timeout_s)
            except TimeoutError:
                self.count("reward.timeouts")
                last = RewardFailedError("reward_timeout", f"no reward within {self.timeout_s:g} s")
                continue
            except Exception as e:  # noqa: BLE001 - any failure of the task's code is retried
                self.count("reward.errors")
                last = RewardFailedError("reward_error", f"{type(e).__name__}: {e}")
                continue
            return value
        logger.warning("reward failed after %d tries: %s", self.retries + 1, last)
        raise last

    async def _call(self, prompt: str, text: str) -> float:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[float] = loop.create_future()
        self.count("reward.calls")

        def deliver(value: float | None, error: BaseException | None) -> None:
            if done.done():  # timed out and abandoned meanwhile
                return
            if error is not None:
                done.set_exception(error)
            else:
                assert value is not None
                done.set_result(value)

        def run() -> None:
            try:
                result: tuple[float | None, BaseException | None] = (
                    _checked(self.fn(prompt, text)),
                    None,
                )
            except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                result = (None, e)
            finally:
                with self._lock:
                    fate["finished"] = True
                    if fate["abandoned"]:
                        self.stuck -= 1
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(deliver, *result)

        fate = {"finished": False, "abandoned": False}
        threading.Thread(target=run, name="reward", daemon=True).start()
        try:
            return await done
        except asyncio.CancelledError:
            with self._lock:
                if not fate["finished"]:
                    fate["abandoned"] = True
                    self.stuck += 1
            raise
