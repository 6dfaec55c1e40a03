"""Dispatch policies: which prompts an asking rollout instance gets, and how many.

Dispatch is pull-based: an instance sends ``GetWork`` when it has room, and the policy answers
for that one request, seeing every live instance's load. A policy only *chooses*; the service
enforces everything that must hold whatever the policy does (pool capacity, the lag gates, the
dataset's end), and the store makes the choice durable. A policy may pick fresh prompts out of
order (say, by predicted length): the store queues the ones it passed over, so none is skipped.

Policies, chosen by name (``policy = "..."`` in the scheduler's table, ``make_policy``):

- ``fifo`` / ``least_requests``: queued prompts first, then fresh ones in order, no instance
  holding more than its share of groups: the common asynchronous dispatch, which balances
  request counts whatever their lengths.
- ``sync``: the same dealing, with the lag gate forced to 0 (``max_lag``): one step of groups
  is issued, generated to the last sample, trained and refitted before the next is issued.
  The synchronous RL loop, as a baseline in the same code.
- ``deltarl``: seed 000's queue-aware dispatch. Each instance's predicted wait is the
  predicted tokens of the groups it holds over its measured throughput; the candidates (a
  look-ahead window of the dataset, in plan order when a plan is loaded) go longest predicted
  first, as many as may be issued now, each to the instance whose wait is least (LPT), and
  the asking instance gets the ones that fall to it. The predictions are a plan's, or
  without one the run's own history's (``run_lengths``). Without predictions (a run's first
  groups) every group counts one, so the split follows measured throughput alone. Long and
  short prompts mix on every instance, and a slower instance gets less. All samples of a
  prompt are one group, issued to one instance in one request, so they share its prefix
  cache within a weight version by construction. A requeued prompt goes back to the
  instance that prefilled it (its home, ``prefix_home``) while that instance holds the same
  weight version and its predicted wait exceeds the least by no more than
  ``AFFINITY_SLACK`` times the prompt's own predicted time there: prefix affinity, unless
  the wait is too long. Under ``lag_rule = "partial"`` its predictions also serve the
  throttle gate, which then counts only the issued groups forecast to land within its window
  (``forecasts_landing``, ``deltarl.scheduler.landing``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

AFFINITY_SLACK = 1.0
"""How much longer than the least predicted wait a requeued prompt may wait for its home
instance, in units of its own predicted time there (1: going home may at most double the time
until it is done)."""


@dataclass(frozen=True)
class InstanceLoad:
    """What the scheduler knows of one live rollout instance."""

    name: str
    held: int
    """Groups issued to it and not yet submitted."""
    running_groups: int = 0
    queue_depth: int = 0
    tokens_per_s: float = 0.0
    weight_version: int | None = None
    predicted_tokens: float = 0.0
    """Predicted completion tokens of the groups it holds (all their samples)."""


@dataclass(frozen=True)
class WorkRequest:
    instance: str
    max_groups: int
    room: int
    """How many groups the service allows now (pool capacity and gates): the policy's cap."""


@dataclass(frozen=True)
class Candidates:
    """Prompts that may be issued: queued ones (oldest first), then fresh ones from the cursor."""

    queued: Sequence[int]
    fresh: Sequence[int]
    predicted: Mapping[int, float] | None = None
    """Predicted completion tokens of each candidate group; None: no prediction."""
    homes: Mapping[int, tuple[str, int]] | None = None
    """Queued prompt -> (instance, weight version) that prefilled it before (``prefix_home``)."""


class DispatchPolicy(Protocol):
    name: str

    @property
    def lookahead(self) -> int:
        """Fresh prompts the service offers beyond what may be issued now (0: just those)."""
        ...

    @property
    def max_lag(self) -> int | None:
        """A lag bound the policy imposes on the throttle gate (None: the configured one)."""
        ...

    @property
    def forecasts_landing(self) -> bool:
        """Under ``lag_rule = "partial"``, the throttle counts only the issued groups forecast
        to land within its window (``deltarl.scheduler.landing``), not all of them."""
        ...

    def choose(
        self, request: WorkRequest, instances: Sequence[InstanceLoad], candidates: Candidates
    ) -> list[int]:
        """The prompt ids to issue to ``request.instance`` (at most ``request.room``), taken
        from ``candidates``; an empty list means "nothing for you now"."""
        ...


@dataclass(frozen=True)
class FifoLeastLoaded:
    """Queued prompts first, then fresh ones in order; no instance holds more than its share.

    The share is the room and the groups already held, spread evenly over the live instances
    (rounded up): an instance that asks first cannot take everything while another one that is
    idle has yet to ask. The least-loaded instances therefore get work first.
    """

    name: str = "fifo"
    lookahead: int = 0
    max_lag: int | None = None
    forecasts_landing: bool = False

    def choose(
        self, request: WorkRequest, instances: Sequence[InstanceLoad], candidates: Candidates
    ) -> list[int]:
        held = {i.name: i.held for i in instances}
        mine = held.get(request.instance, 0)
        live = max(len(held), 1)
        share = math.ceil((sum(held.values()) + request.room) / live)
        n = max(0, min(request.max_groups, request.room, share - mine))
        return [*candidates.queued, *candidates.fresh][:n]


@dataclass(frozen=True)
class PredictedWait:
    """Seed 000's dispatch: longest predicted first, to the least predicted wait (module
    docstring). ``lookahead``: how far past the cursor it may pick."""

    name: str = "deltarl"
    lookahead: int = 64
    max_lag: int | None = None
    forecasts_landing: bool = True

    def choose(
        self, request: WorkRequest, instances: Sequence[InstanceLoad], candidates: Candidates
    ) -> list[int]:
        cap = max(0, min(request.max_groups, request.room))
        if cap == 0:
            return []
        rates = {i.name: i.tokens_per_s for i in instances if i.tokens_per_s > 0}
        known = sum(rates.values()) / len(rates) if rates else 1.0  # unmeasured: the peers' mean
        wait: dict[str, float] = {}
        rate: dict[str, float] = {}
        for i in [*instances, InstanceLoad(request.instance, 0)]:
            if i.name not in wait:
                rate[i.name] = rates.get(i.name, known)
                wait[i.name] = i.predicted_tokens / rate[i.name]
        predicted = candidates.predicted or {}
        queued = set(candidates.queued)
        versions = {i.name: i.weight_version for i in instances}
        homes = {
            p: name
            for p, (name, version) in (candidates.homes or {}).items()
            if name in wait and version is not None and versions.get(name) == version
        }  # still holding the version its prefix was cached under

        def longest_first(p: int) -> tuple[float, int]:
            return -predicted.get(p, 1.0), p

        # Queued prompts were passed over or taken back: they go before fresh ones, longest
        # first among them, so none waits behind the window for ever.
        ranked = sorted(queued, key=longest_first) + sorted(
            (p for p in candidates.fresh if p not in queued), key=longest_first
        )
        chosen: list[int] = []
        # What may be issued now (the room) is shared out, not the whole look-ahead: the asker
        # gets the part of it that falls to it; the look-ahead only chooses which prompts.
        for p in ranked[: request.room]:
            # The least wait; on a tie the asking instance, which has room now.
            j = min(wait, key=lambda n: (wait[n], n != request.instance, n))
            home = homes.get(p)
            if home is not None and wait[home] - wait[j] <= (
                AFFINITY_SLACK * predicted.get(p, 1.0) / rate[home]
            ):
                j = home
            wait[j] += predicted.get(p, 1.0) / rate[j]
            if j == request.instance:
                chosen.append(p)
                if len(chosen) == cap:
                    break
        return chosen


@dataclass(frozen=True)
class Synchronous(FifoLeastLoaded):
    """The synchronous baseline: FIFO dealing, lag gate 0 (module docstring)."""

    name: str = "sync"
    max_lag: int | None = 0


POLICIES: dict[str, Callable[[], DispatchPolicy]] = {
    "fifo": FifoLeastLoaded,
    "least_requests": lambda: FifoLeastLoaded(name="least_requests"),
    "sync": Synchronous,
    "deltarl": PredictedWait,
}


def make_policy(name: str, lookahead: int | None = None) -> DispatchPolicy:
    """The policy called ``name``; ``lookahead`` (``deltarl`` only): its window, else the
    default."""
    try:
        policy = POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; known: {sorted(POLICIES)}") from None
    if lookahead is not None and isinstance(policy, PredictedWait):
        policy = PredictedWait(policy.name, lookahead, policy.max_lag)
    return policy
