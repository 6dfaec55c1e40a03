"""Which issued groups will land in the pool soon: what the throttle counts under ``partial``.

The throttle gate (``service``'s docstring) lets an instance have work only while the groups
pooled and issued fill fewer than ``(bound - behind + 1) * groups_per_step`` places: every
issued group is counted as if it landed in the next step's batch. Under ``lag_rule =
"oldest_token"`` that is what it must assume, since a group's lag is fixed by its first token.
Under ``"partial"`` it is not: a group that lives through a refit goes on under the new
weights, and its lag at ship is measured from its newest token. A long group still generating
therefore adds nothing to the lag of the groups issued after it; only the groups pooled ahead
of them do. Counting it anyway keeps its place empty for as long as it runs, and on a
long-tailed workload the engines wait: on the tiny model's ``long_tail`` task at lag bound 1,
two engines were idle about a quarter of the run, and ``lag.throttled`` counted thousands of
refusals.

So a policy that predicts lengths (``DispatchPolicy.forecasts_landing``) may have the gate,
under ``partial``, count each issued group where it is forecast to land (``room``): its
predicted remaining tokens (predicted tokens less those generated so far, from the instance's
heartbeat ``progress``) at its instance's measured tokens per second per running group, in
ship intervals (the longest of the recent ones: a step of long groups trains longest, just when
long groups land, so the pool drains slowest then). The forecast errs towards landing early: a
group with no prediction or no measured rate lands now, as does one that has outrun its
prediction; and the groups issued now are counted as landing at once. Before two steps have
shipped there is no interval, and the throttle's own rule holds. Under a cap on token age
(``max_token_lag_steps``) the throttle's own rule holds too: the long groups the forecast lets
run are the ones the cap would stop.

A wrong forecast costs lag, not correctness: a group that lands earlier than forecast joins
the pool ahead of others, whose lag at ship may then exceed the bound; the hard rule still
drops those at ship, and ``token_waste`` counts them.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

SHIP_INTERVALS = 8
"""How many recent ship intervals the step time is the longest of."""
EARLY = 0.35
"""A group is taken to land once this share of its predicted remaining tokens is generated.
Landing early costs lag (a place taken that was counted free), landing late only an idle
place, and the run's own length predictions are off by about 45% (median, the tiny model's
``long_tail`` task). Measured there at lag bound 1, 40 steps, wasted share of generated
tokens: at face value (1.0) 8-10%; at 0.5, 1.5-7.7% over five runs (0.5 with the longest
interval, 3.0-6.2%); at 0.35 with the longest interval, 2.2-3.8% over three."""


@dataclass(frozen=True)
class InFlight:
    """One issued group, as the forecast sees it."""

    predicted_tokens: float | None
    """All its samples' predicted completion tokens; None: no prediction."""
    generated: int
    """Tokens generated so far (the instance's last heartbeat ``progress``; 0 if none)."""
    tokens_per_s: float
    """Its instance's measured tokens per second per running group; 0: not measured."""


@dataclass
class LandingForecast:
    """Ship times, and the count of issued groups forecast to land within a window."""

    ships: deque[float] = field(default_factory=lambda: deque(maxlen=SHIP_INTERVALS + 1))

    def shipped(self, now: float) -> None:
        """A step was shipped at ``now`` (monotonic seconds)."""
        self.ships.append(now)

    def step_s(self) -> float | None:
        """The longest of the recent ship intervals; None before two ships."""
        if len(self.ships) < 2:
            return None
        return max(b - a for a, b in itertools.pairwise(self.ships))

    def room(self, groups: Sequence[InFlight], pooled: int, window: int, per_step: int) -> int:
        """How many more groups may be issued now (<= 0: none), ``window`` steps' places
        (``bound - behind + 1``) of ``per_step`` groups being free of lag.

        A group that lands when ``P`` groups are pooled ahead of it ships ``P // per_step``
        steps later, so every landing must find fewer than ``window * per_step`` ahead. By
        ``j`` ship intervals from now, ``j`` steps will have shipped, so for every ``j >= 1``:
        ``pooled + landed within j intervals + issued now <= (window + j - 1) * per_step``,
        the groups issued now counted as landing at once. ``j = 1`` is the throttle's own
        rule, with only the groups forecast to land by then counted; the later ``j`` keep the
        long groups from all landing in one step later on."""
        step = self.step_s()
        if step is None or step <= 0 or window <= 0:
            return window * per_step - pooled - len(groups)  # the throttle's rule
        due = sorted(_time_left(g) for g in groups)
        # Between two landings the places grow and the landed stay: the least room is at j = 1
        # or at the interval of a landing.
        room = window * per_step - pooled - bisect.bisect_right(due, step)
        for j in {math.ceil(t / step) for t in due if t > step}:
            landed = bisect.bisect_right(due, j * step)
            room = min(room, (window + j - 1) * per_step - pooled - landed)
        return room


def _time_left(g: InFlight) -> float:
    """Seconds until ``g`` is forecast to land; 0 where that cannot be told."""
    if g.predicted_tokens is None or g.tokens_per_s <= 0:
        return 0.0
    return EARLY * max(g.predicted_tokens - g.generated, 0.0) / g.tokens_per_s
