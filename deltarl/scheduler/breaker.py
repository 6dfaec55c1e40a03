"""A circuit breaker for calls to a remote service (the reward daemon).

    CLOSED --``failures`` consecutive failed calls--> OPEN --``cooldown_s`` later, at the next
      ^                                                 ^      ``allow``--> HALF_OPEN
      |                                                 |                     | one probe call
      +------------- the probe succeeds ----------------+---- it fails -------+

Why: a reward service that is down would otherwise cost every submitted group its whole
timeout times its retries, and count it as a failed group (its prompt abandoned after
``max_reward_failures``) for what is an outage, not a bad group. Open, the caller refuses at
once and says so; after the cooldown one probe finds out whether the service is back, so a
recovered service is in use again within ``cooldown_s`` without a flood of calls hitting a
service that is still down.

Not thread-safe: one event loop calls it. The clock is a parameter, so tests step it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


def _ignore(old: BreakerState, new: BreakerState) -> None:
    del old, new


class CircuitBreaker:
    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[BreakerState, BreakerState], None] = _ignore,
    ) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("failures >= 1 and cooldown_s > 0 are required")
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.on_transition = on_transition
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.transitions = 0
        self._probing = False

    def _move(self, new: BreakerState) -> None:
        old, self.state = self.state, new
        if old != new:
            self.transitions += 1
            self.on_transition(old, new)

    def retry_in(self) -> float:
        """Seconds until an open breaker lets a probe through; 0 otherwise."""
        if self.state != BreakerState.OPEN or self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.cooldown_s - self.clock())

    def allow(self) -> bool:
        """Whether a call may go now. After the cooldown the first caller becomes the probe
        (half-open); everyone else is refused until the probe's outcome is known."""
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN:
            if self.retry_in() > 0:
                return False
            self._move(BreakerState.HALF_OPEN)
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self.consecutive_failures = 0
        self._probing = False
        self.opened_at = None
        self._move(BreakerState.CLOSED)

    def failure(self) -> None:
        self.consecutive_failures += 1
        probe_failed = self.state == BreakerState.HALF_OPEN
        self._probing = False
        if probe_failed or (
            self.state == BreakerState.CLOSED and self.consecutive_failures >= self.threshold
        ):
            self.opened_at = self.clock()
            self._move(BreakerState.OPEN)

    def release(self) -> None:
        """A call that was allowed ended without an outcome (cancelled): a half-open breaker
        lets the next caller probe instead of waiting for an answer that never comes."""
        self._probing = False
