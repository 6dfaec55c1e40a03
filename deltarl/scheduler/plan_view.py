"""A loaded plan as the scheduler runs it: the dataset in plan order, and its length predictions
refreshed online.

**Positions are prompt ids.** With ``plan = PATH``, the scheduler's prompt id ``i`` is the
plan's position ``i``: the task's prompt ``order[i]`` (``PlannedTask``). The store's cursor,
its exactly-once rules and replay are then unchanged, and prompts are issued schedule group
by schedule group, batch by batch, as planned. Because ids change meaning with the plan, the
store records the plan's identity (``identity``: a digest of its dataset and order) at the
first start, and a scheduler started on that store with another plan, or none, is refused; as
is a plan made for another task, seed, group size or step size than the scheduler's.

**Online refresh.** Every pooled group's real lengths correct the predictions of the prompts
not yet generated: one multiplicative factor per bucket, a geometric moving average of actual
/ planned (``ALPHA``), so the first finished groups of a bucket move the rest of it. The
factors are memory only; at a start they are rebuilt from the store's ``length_history``
(each row keeps its bucket and planned figure), so a restart forgets nothing it learned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from deltarl.config.rl import SchedulerConfig
from deltarl.rl.task import Task
from deltarl.scheduler.plan import Plan, PlanError

ALPHA = 0.2
"""Weight of each new group in its bucket's correction (a geometric moving average)."""


def identity(plan: Plan) -> str:
    """What a store records of the plan its prompt ids refer to."""
    h = xxhash.xxh64()
    h.update(f"{plan.task}/{plan.seed}/{plan.size}/".encode())
    h.update(",".join(map(str, plan.order)).encode())
    return f"{plan.task}/{plan.seed}/{plan.size}/{h.hexdigest()}"


def check_fits(plan: Plan, config: SchedulerConfig) -> None:
    """PlanError unless the plan was made for this scheduler's dataset and step shape."""
    wrong = [
        f"{name} {mine!r} (the plan's: {theirs!r})"
        for name, mine, theirs in (
            ("task", config.task, plan.task),
            ("seed", config.seed, plan.seed),
            ("group_size", config.group_size, plan.group_size),
            ("groups_per_step", config.groups_per_step, plan.groups_per_step),
        )
        if mine != theirs
    ]
    if config.dataset_size not in (0, plan.size):
        wrong.append(f"dataset_size {config.dataset_size} (the plan's: {plan.size})")
    if wrong:
        raise PlanError("the plan does not fit this scheduler: " + ", ".join(wrong))


@dataclass
class PlannedTask:
    """The task with its prompts in plan order (module docstring); eval passes through."""

    task: Task
    plan: Plan

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def size(self) -> int:
        return self.plan.size

    def prompt(self, prompt_id: int) -> str:
        if not 0 <= prompt_id < self.plan.size:
            raise IndexError(f"prompt id {prompt_id} is outside the plan (size {self.plan.size})")
        return self.task.prompt(self.plan.order[prompt_id])

    def reward(self, prompt: str, completion: str) -> float:
        return self.task.reward(prompt, completion)

    @property
    def eval_size(self) -> int:
        return int(getattr(self.task, "eval_size", 0))

    def eval_prompt(self, index: int) -> str:
        return str(self.task.eval_prompt(index))  # type: ignore[attr-defined]


class PlanView:
    """Predictions for a plan's positions, corrected by what was generated (module docstring)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.factors = [1.0] * (len(plan.bucket_boundaries) + 1)
        self.observed = [0] * len(self.factors)

    def covers(self, prompt_id: int) -> bool:
        """Whether the scheduler's ``prompt_id`` is a position of this plan."""
        return 0 <= prompt_id < self.plan.size

    def bucket(self, position: int) -> int:
        return self.plan.bucket_of(self.plan.predicted_tokens[position])

    def planned(self, position: int) -> float:
        """The plan's own prediction: completion tokens per sample."""
        return self.plan.predicted_tokens[position]

    def predicted(self, position: int) -> float:
        """The prediction as corrected so far, per sample."""
        return self.planned(position) * self.factors[self.bucket(position)]

    def observe(self, bucket: int, planned: float, actual: float) -> None:
        """A group of ``bucket`` planned at ``planned`` tokens per sample came out at
        ``actual``."""
        if not 0 <= bucket < len(self.factors) or planned <= 0:
            return
        ratio = max(actual, 1.0) / planned
        self.factors[bucket] = math.exp(
            (1 - ALPHA) * math.log(self.factors[bucket]) + ALPHA * math.log(ratio)
        )
        self.observed[bucket] += 1

    def replay(self, rows: Iterable[tuple[int, float, float]]) -> None:
        """Rebuild the corrections from recorded (bucket, planned, actual) rows, oldest first."""
        for bucket, planned, actual in rows:
            self.observe(bucket, planned, actual)
