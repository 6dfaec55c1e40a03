"""A token bucket: at most ``rate_per_s`` calls a second on average, ``burst`` at once.

Why waiting rather than refusing: the reward service's rate limit protects it (a judge model
has a fixed throughput, a hosted checker a quota); a submit that waits a little for its turn
loses nothing, one refused would have to be generated again. Waiting is bounded by the
caller's own timeouts (the submit's request timeout), so a bucket far too small shows up as
timeouts, counted, not as a hang.

Not thread-safe: one event loop uses it. The clock and the sleep are parameters, so
tests step them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class TokenBucket:
    def __init__(
        self,
        rate_per_s: float,
        burst: int = 1,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s > 0 and burst >= 1 are required")
        self.rate = rate_per_s
        self.burst = float(burst)
        self.clock = clock
        self.sleep = sleep
        self.tokens = float(burst)
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def try_take(self) -> float:
        """Take a token if there is one: 0.0. Else take nothing and return how many seconds
        until there will be one."""
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    async def take(self) -> float:
        """Wait for a token and take it; the seconds waited."""
        waited = 0.0
        while (wait := self.try_take()) > 0:
            await self.sleep(wait)
            waited += wait
        return waited
