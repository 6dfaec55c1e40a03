"""Dispatch policies: which prompts an asking rollout instance gets, and how many.

Dispatch is pull-based: an instance sends ``GetWork`` when it has room, and the policy answers
for that one request, seeing every live instance's load. A policy only *chooses*; the service
enforces everything that must hold whatever the policy does (pool capacity, the lag gates, the
dataset's end), and the store makes the choice durable. A policy may pick fresh prompts out of
order (say, by predicted length): the store queues the ones it passed over, so none is skipped.

``FifoLeastLoaded`` is the default. The length-aware policies of the next issue (predicted
output length, length-homogeneous batches, long/short-mixed groups) implement the same
``DispatchPolicy`` and are chosen by name with ``make_policy``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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


class DispatchPolicy(Protocol):
    name: str

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

    def choose(
        self, request: WorkRequest, instances: Sequence[InstanceLoad], candidates: Candidates
    ) -> list[int]:
        held = {i.name: i.held for i in instances}
        mine = held.get(request.instance, 0)
        live = max(len(held), 1)
        share = math.ceil((sum(held.values()) + request.room) / live)
        n = max(0, min(request.max_groups, request.room, share - mine))
        return [*candidates.queued, *candidates.fresh][:n]


POLICIES: dict[str, type[FifoLeastLoaded]] = {"fifo": FifoLeastLoaded}


def make_policy(name: str) -> DispatchPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; known: {sorted(POLICIES)}") from None
