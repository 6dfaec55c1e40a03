"""The scheduler's client of the reward daemon (``deltarl reward``): one call per group.

Used instead of the in-process ``RewardScorer`` when ``[daemons.scheduler.reward] endpoint``
is set; the same ``score_group`` contract: every sample's reward in order, or
``RewardFailedError`` (the group failed: dropped and counted as today), or
``RewardUnavailableError`` (the service is out: the group is kept, see below).

One group's scoring:

    for each attempt (1 + ``retries``), after a backoff (``backoff_s``, doubled each time):
        breaker open?           -> RewardUnavailableError at once      (reward.circuit_open)
        a rate-limit token      (waits: a token bucket of ``rate_per_s``, ``burst``)
        a concurrency slot      (waits: at most ``max_concurrency`` calls in flight)
        ScoreGroup, ``timeout_s``
            Scores, one finite reward per text    -> the rewards; the breaker closes
            Error reward_error / reward_timeout   -> the scorer failed on this group; the
                                                     service is well (reward.errors or
                                                     reward.timeouts); retried
            no reply in time                      -> reward.timeouts } a failure of the
            a reply that is not one reward each   -> reward.bad_replies } service: counts
            any other Error (busy, stopping, ...) -> reward.errors  } against the breaker
    all attempts failed: breaker closed -> RewardFailedError (the group is dropped, its
                         prompt queued again, as with in-process scoring)
                         breaker not closed -> RewardUnavailableError (an outage, not a bad
                         group: nothing is dropped, no prompt edges towards abandonment)

What an open breaker means for the scheduler (``SchedulerService.submit_group``): a submit is
answered ``Error("reward_unavailable")`` at once, the group stays issued to its instance (its
lease still runs), its samples stay on the samples endpoint, and the rollout daemon submits it
again after a pause. So an outage shorter than a lease loses no sample and no prompt; a
longer one lets the lease requeue the prompt (generated again, counted ``requeued.lease``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from deltarl.config.reward import RewardClientConfig
from deltarl.reward.protocol import (
    REPLIES,
    REWARD_ERROR,
    REWARD_TIMEOUT,
    ScoreGroup,
    Scores,
)
from deltarl.scheduler.breaker import BreakerState, CircuitBreaker
from deltarl.scheduler.rate_limit import TokenBucket
from deltarl.scheduler.reward import RewardFailedError, RewardUnavailableError
from deltarl.transport.control import ControlClient, ControlTimeoutError
from deltarl.transport.messages import Error, Reply

logger = logging.getLogger(__name__)

Counter = Callable[[str], None]
Request = Callable[[ScoreGroup, float], Any]
"""``ControlClient.request``-like: (command, timeout) -> awaitable Reply."""


class _FailedError(Exception):
    """One attempt failed; ``service``: the service's fault (counts against the breaker)."""

    def __init__(self, reason: str, message: str, *, service: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.service = service


def _ignore(name: str) -> None:
    del name


class RemoteRewardScorer:
    def __init__(
        self,
        config: RewardClientConfig,
        task: str,
        count: Counter = _ignore,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.task = task
        self.count = count
        self.client = ControlClient(config.endpoint, replies=REPLIES)
        self.breaker = CircuitBreaker(
            config.breaker_failures,
            config.breaker_cooldown_s,
            clock=clock,
            on_transition=self._transition,
        )
        self.bucket = (
            TokenBucket(config.rate_per_s, config.burst, clock=clock)
            if config.rate_per_s > 0
            else None
        )
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self.in_flight = 0
        self.peak_in_flight = 0
        self.rate_waited_s = 0.0
        self.stuck = 0  # as RewardScorer's: a remote call leaves no thread behind

    def _transition(self, old: BreakerState, new: BreakerState) -> None:
        # Logged and counted once per transition, not once per refused group.
        self.count(f"reward.breaker.{new.value}")
        if new == BreakerState.OPEN:
            logger.warning(
                "reward service %s: circuit breaker open (%s -> open after %d consecutive "
                "failures); submits are answered reward_unavailable, a probe in %.1f s",
                self.config.endpoint,
                old.value,
                self.breaker.consecutive_failures,
                self.config.breaker_cooldown_s,
            )
        elif new == BreakerState.HALF_OPEN:
            logger.info("reward service %s: breaker half-open, probing", self.config.endpoint)
        else:
            logger.warning(
                "reward service %s: breaker closed, scoring resumes", self.config.endpoint
            )

    def _unavailable(self) -> RewardUnavailableError:
        return RewardUnavailableError(
            f"the reward service {self.config.endpoint} is unavailable (circuit breaker "
            f"{self.breaker.state.value}, next probe in {self.breaker.retry_in():.1f} s); "
            "the group stays issued to you: submit it again later"
        )

    async def score_group(self, prompt: str, texts: Sequence[str]) -> list[float]:
        cfg = self.config
        last = _FailedError(REWARD_ERROR, "not tried", service=False)
        for attempt in range(cfg.retries + 1):
            if attempt:
                self.count("reward.retries")
                await asyncio.sleep(min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1)))
            if not self.breaker.allow():
                self.count("reward.circuit_open")
                raise self._unavailable()
            try:
                rewards = await self._call(prompt, texts)
            except _FailedError as e:
                last = e
                if e.service:
                    self.breaker.failure()
                else:
                    self.breaker.success()  # it answered: the service itself is well
                continue
            except BaseException:
                self.breaker.release()  # cancelled: no outcome to judge the service by
                raise
            self.breaker.success()
            return rewards
        if self.breaker.state != BreakerState.CLOSED:
            raise self._unavailable()
        logger.warning("reward failed after %d tries: %s", cfg.retries + 1, last)
        raise RewardFailedError(last.reason, str(last))

    async def _call(self, prompt: str, texts: Sequence[str]) -> list[float]:
        if self.bucket is not None:
            waited = await self.bucket.take()
            if waited:
                self.count("reward.rate_limited")
                self.rate_waited_s += waited
        async with self.slots:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self.count("reward.calls")
            try:
                reply = await self.client.request(
                    ScoreGroup(prompt, list(texts), self.task), timeout=self.config.timeout_s
                )
            except ControlTimeoutError:
                self.count("reward.timeouts")
                raise _FailedError(
                    REWARD_TIMEOUT, f"no reply within {self.config.timeout_s:g} s", service=True
                ) from None
            except ConnectionError as e:
                self.count("reward.errors")
                raise _FailedError(REWARD_ERROR, f"{type(e).__name__}: {e}", service=True) from None
            finally:
                self.in_flight -= 1
        return self._rewards(reply, len(texts))

    def _rewards(self, reply: Reply, n: int) -> list[float]:
        if isinstance(reply, Error):
            if reply.code == REWARD_TIMEOUT:
                self.count("reward.timeouts")
            else:
                self.count("reward.errors")
            scorer_failed = reply.code in (REWARD_ERROR, REWARD_TIMEOUT)
            reason = reply.code if scorer_failed else REWARD_ERROR
            text = f"reward service: {reply.code}: {reply.message}"
            raise _FailedError(reason, text, service=not scorer_failed)
        if isinstance(reply, Scores):
            rewards = reply.rewards
            if len(rewards) == n and all(_finite(r) for r in rewards):
                return [float(r) for r in rewards]
            problem = f"{len(rewards)} rewards for {n} samples: {str(rewards)[:120]}"
        else:
            problem = f"a {type(reply).__name__} reply"
        self.count("reward.bad_replies")
        raise _FailedError(REWARD_ERROR, f"reward service: bad reply: {problem}", service=True)

    def status(self) -> dict[str, Any]:
        b = self.breaker
        return {
            "service": self.config.endpoint,
            "breaker": b.state.value,
            "consecutive_failures": b.consecutive_failures,
            "probe_in_s": round(b.retry_in(), 3),
            "breaker_transitions": b.transitions,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "max_concurrency": self.config.max_concurrency,
            "rate_per_s": self.config.rate_per_s,
            "rate_waited_s": round(self.rate_waited_s, 3),
        }

    async def close(self) -> None:
        await self.client.close()


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
