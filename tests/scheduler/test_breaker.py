"""The circuit breaker and the token bucket of the scheduler's reward client, on a clock the
test moves (no sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from deltarl.scheduler.breaker import BreakerState, CircuitBreaker
from deltarl.scheduler.rate_limit import TokenBucket
from tests.scheduler.helpers import Clock


def _breaker(clock: Clock, moves: list[tuple[str, str]]) -> CircuitBreaker:
    return CircuitBreaker(
        3, 5.0, clock=clock, on_transition=lambda old, new: moves.append((old, new))
    )


def test_breaker_opens_after_consecutive_failures_only() -> None:
    clock, moves = Clock(), []
    b = _breaker(clock, moves)
    b.failure()
    b.failure()
    b.success()  # the run of failures is broken
    b.failure()
    b.failure()
    assert b.state == BreakerState.CLOSED
    assert b.allow()
    b.failure()
    assert b.state == BreakerState.OPEN
    assert moves == [("closed", "open")]
    assert not b.allow()
    assert b.retry_in() == pytest.approx(5.0)


def test_breaker_half_open_lets_one_probe_and_closes_on_its_success() -> None:
    clock, moves = Clock(), []
    b = _breaker(clock, moves)
    for _ in range(3):
        b.failure()
    clock.advance(4.9)
    assert not b.allow()
    clock.advance(0.2)
    assert b.allow()  # the probe
    assert b.state == BreakerState.HALF_OPEN
    assert not b.allow()  # everyone else waits for the probe's outcome
    b.success()
    assert b.state == BreakerState.CLOSED
    assert b.allow()
    assert b.allow()
    assert moves == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
    assert b.transitions == 3


def test_breaker_probe_failure_opens_again_for_a_whole_cooldown() -> None:
    clock, moves = Clock(), []
    b = _breaker(clock, moves)
    for _ in range(3):
        b.failure()
    clock.advance(5.0)
    assert b.allow()
    b.failure()  # one failure is enough while half-open
    assert b.state == BreakerState.OPEN
    assert b.retry_in() == pytest.approx(5.0)
    clock.advance(5.0)
    assert b.allow()
    b.release()  # the probe was cancelled: no outcome, the next caller probes
    assert b.state == BreakerState.HALF_OPEN
    assert b.allow()


def test_bucket_allows_burst_then_the_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(2.0, burst=3, clock=clock)
    assert [bucket.try_take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.try_take() == pytest.approx(0.5)
    clock.advance(0.25)
    assert bucket.try_take() == pytest.approx(0.25)  # half a token so far
    clock.advance(0.25)
    assert bucket.try_take() == 0.0
    clock.advance(100.0)  # a quiet spell refills to the burst, no more
    assert [bucket.try_take() for _ in range(4)][-1] == pytest.approx(0.5)


def test_bucket_take_waits_for_its_token() -> None:
    clock = Clock()

    async def sleep_on_clock(seconds: float) -> None:
        clock.advance(seconds)

    bucket = TokenBucket(4.0, burst=1, clock=clock, sleep=sleep_on_clock)

    async def main() -> list[float]:
        return [await bucket.take() for _ in range(5)]

    waits = asyncio.run(main())
    assert waits[0] == 0.0
    assert waits[1:] == pytest.approx([0.25] * 4)
    assert clock.t - 1_700_000_000.0 == pytest.approx(1.0)  # 5 calls at 4/s after a burst of 1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CircuitBreaker(0, 1.0), "failures"),
        (lambda: CircuitBreaker(1, 0.0), "cooldown"),
        (lambda: TokenBucket(0.0), "rate"),
        (lambda: TokenBucket(1.0, burst=0), "burst"),
    ],
)
def test_bad_settings_are_refused(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
