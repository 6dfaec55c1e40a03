"""Under ``lag_rule = "partial"`` the deltarl policy's throttle counts only the issued groups
forecast to land within its window (deltarl/scheduler/landing.py)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from deltarl.rl.protocol import GetWork, Heartbeat, StepDone, TakeBatch, Work
from deltarl.scheduler.landing import EARLY, InFlight, LandingForecast
from deltarl.scheduler.length_predictor import MIN_FIT_ROWS
from tests.scheduler.helpers import generate_letters, make_service


def _forecast(*ships: float) -> LandingForecast:
    f = LandingForecast()
    for t in ships:
        f.shipped(t)
    return f


def test_the_step_time_is_the_longest_recent_ship_interval() -> None:
    """The longest: steps of long groups train longest, just when long groups land."""
    assert _forecast().step_s() is None
    assert _forecast(5.0).step_s() is None
    assert _forecast(0.0, 1.0, 2.0, 10.0).step_s() == 8.0
    f = _forecast(0.0, 50.0, *[float(t) for t in range(100, 110)])
    assert len(f.ships) == 9  # the recent intervals only: the 50 s ones are forgotten
    assert f.step_s() == 1.0


def test_groups_take_places_where_they_are_forecast_to_land() -> None:
    """Two groups a step, a window of two steps (four places), 2 s a step."""
    f = _forecast(0.0, 2.0, 4.0)

    def due_in(seconds: float) -> InFlight:  # 10 tokens/s, 1000 predicted
        return InFlight(1000.0, round(1000 - seconds * 10 / EARLY), 10.0)

    long, near = due_in(39.0), due_in(1.5)

    def room(groups: list[InFlight], pooled: int = 0, window: int = 2) -> int:
        return f.room(groups, pooled, window, 2)

    assert room([]) == 4
    assert room([long] * 4) == 4  # 39 s left each: they land when steps have shipped
    assert room([near]) == 3  # 1.5 s left: it takes a place of the next step
    assert room([near], pooled=2) == 1
    assert room([due_in(2.5)]) == 4  # lands after one ship
    # Six landing together in the third interval find 8 places by then, less what they
    # leave: two more may go now; ten would leave none.
    assert room([due_in(5.0)] * 6) == 2
    assert room([due_in(5.0)] * 10) == -2
    # A group is taken to land early: 100 tokens left at 10 a second land at face value
    # after 10 s, taken as EARLY * 10 s, in that interval of 2 s.
    j = math.ceil(EARLY * 10.0 / 2.0)
    assert f.room([InFlight(400.0, 300, 10.0)] * 3, 0, 1, 2) == min(2, 2 * j - 3)
    # What the forecast cannot tell lands now, as the throttle counted it before.
    assert room([InFlight(None, 0, 10.0)]) == 3  # no prediction
    assert room([InFlight(400.0, 10, 0.0)]) == 3  # no measured rate
    assert room([InFlight(400.0, 900, 10.0)]) == 3  # outran its prediction: due now
    # No window (already over the bound) or no step time yet: the throttle's own rule.
    assert room([long], window=0) == -1
    assert _forecast(0.0).room([long], 0, 2, 2) == 3


@pytest.mark.parametrize(
    ("policy", "lag_rule", "cap", "second"),
    [
        ("deltarl", "partial", None, 4),  # the long groups in flight leave their places free
        ("deltarl", "oldest_token", None, 0),  # their first tokens fix their lag: they count
        ("least_requests", "partial", None, 0),  # no forecast: every issued group counts
        ("deltarl", "partial", 2, 0),  # a cap on token age would stop the long ones
    ],
)
def test_long_groups_in_flight_hold_no_places_under_partial(
    tmp_path: Path, policy: str, lag_rule: str, cap: int | None, second: int
) -> None:
    """Bound 1, two groups a step: an instance at the trainer's version may have four groups
    pooled or issued. With four long ones generating, a second GetWork gets four more under
    ``partial`` with the deltarl policy (they will go on under new weights and land after
    the window), and none otherwise; once they near their end they count again."""

    async def go() -> None:
        svc, store, clock = make_service(
            tmp_path,
            policy=policy,
            lag_rule=lag_rule,
            max_token_lag_steps=cap,
            on_lag_exceeded="throttle",
            max_policy_lag_steps=1,
            pool_capacity=64,
            lookahead=8,
        )
        for _ in range(MIN_FIT_ROWS // 4):  # the run's own lengths: the fit predicts
            await generate_letters(svc, "a", 4)
        for step in range(1, MIN_FIT_ROWS // 2 + 1):  # one step a second
            clock.advance(1.0)
            assert len((await svc.take_batch(TakeBatch(step, 2, trainer_version=0))).groups) == 2
            await svc.step_done(StepDone(step, 0))
        first = await svc.get_work(GetWork("a", "s", max_groups=8, weight_version=0))
        assert isinstance(first, Work)
        assert len(first.groups) == 4

        async def beat(fraction_left: float) -> None:
            progress = {}
            for g in first.groups:
                predicted = svc.predicted_tokens(g["prompt_id"])
                total = 40.0 if predicted is None else predicted
                progress[g["group_id"]] = [0, int(total * (1 - fraction_left))]
            await svc.heartbeat(
                Heartbeat(
                    "a", "s", weight_version=0, running_groups=4, tokens_per_s=8.0,
                    progress=progress,
                )
            )  # fmt: skip

        await beat(0.9)  # 2 tokens/s a group: every group has at least 4 s left, window 2 s
        second_reply = await svc.get_work(GetWork("a", "s", max_groups=8, weight_version=0))
        assert isinstance(second_reply, Work)
        assert len(second_reply.groups) == second
        if second:
            await beat(0.0)  # all due now: the eight issued fill the window and more
            third = await svc.get_work(GetWork("a", "s", max_groups=8, weight_version=0))
            assert isinstance(third, Work)
            assert third.groups == []
            assert third.reason.startswith("throttle")
        store.close()

    asyncio.run(go())
