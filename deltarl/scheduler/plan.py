"""The offline plan (seed 000, stage 1): prompt -> batch -> schedule group, with its statistics.

``deltarl plan TASK --size N`` builds it before a run, and the scheduler loads it (``plan =
PATH`` in its table; ``plan_view``). Three steps:

1. **Predict** each prompt's completion tokens per sample (``length_predictor``: the prompt's
   own history, statistics of its length class, a small learned model, or a default).
2. **Schedule groups.** One per training step (``groups_per_step`` prompts). Prompts are dealt
   to them longest predicted first, in a snake (1..G, G..1, ...), so each step holds the same
   mix of long and short ones: no step waits on all the long prompts at once.
3. **Batches.** Within a schedule group, prompts of one bucket (bucket boundaries: given, or
   the quantiles of the predicted lengths, as seed 000 warns against copied ones) are packed
   shortest first into batches under a token budget, ``max_batch_tokens`` >= group_size x
   prompts x the longest prediction in the batch (a static batch allocates its longest
   sequence for every one). The batches go to ``instances`` instances longest predicted time
   first, each to the least loaded (LPT), with a batch's time from the cost model
   (``CostModel``: decode steps of its longest sequence at its batch size, plus prefill).

Statistics: ``predicted_padding_ratio`` (1 - predicted tokens / allocated tokens over all
batches), ``predicted_skew`` (the busiest instance's predicted time over the mean, the largest
over the full schedule groups), a histogram of the predictions, and how many came from each
source. ``validate`` recomputes them from the plan's own batches and refuses a plan that does
not add up or whose predicted skew is over its bound (``max_skew``).

On disk: one JSON object (``FORMAT``), written atomically. Positions are the plan's order: the
scheduler's prompt id ``i`` is the task's prompt ``order[i]``, and each batch and schedule
group is a contiguous range of positions.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from deltarl.atomic_file import write_atomic
from deltarl.scheduler.length_predictor import SOURCES, LengthPredictor
from deltarl.sim.schedule_model import CostModel

FORMAT = "deltarl-plan/1"
DEFAULT_MAX_SKEW = 1.10
HISTOGRAM_BINS = 16


class PlanError(ValueError):
    """A plan that cannot be built, read or used."""


@dataclass(frozen=True)
class PlanBatch:
    start: int
    end: int
    """Positions ``[start, end)`` of the plan's order."""
    bucket: int
    schedule_group: int
    instance: int
    predicted_tokens: float
    """Predicted completion tokens of all its samples."""
    allocated_tokens: int
    predicted_s: float


@dataclass(frozen=True)
class ScheduleGroup:
    start: int
    end: int
    instance_s: tuple[float, ...]
    """Predicted busy seconds of each instance."""

    @property
    def skew(self) -> float:
        mean = statistics.fmean(self.instance_s)
        return max(self.instance_s) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Plan:
    task: str
    seed: int
    size: int
    group_size: int
    groups_per_step: int
    instances: int
    max_batch_tokens: int
    bucket_boundaries: tuple[int, ...]
    max_skew: float
    order: tuple[int, ...]
    """Position -> the task's prompt id."""
    predicted_tokens: tuple[float, ...]
    """Per position: predicted completion tokens per sample."""
    sources: tuple[str, ...]
    """Per position: which predictor source gave it."""
    batches: tuple[PlanBatch, ...]
    schedule_groups: tuple[ScheduleGroup, ...]
    cost: CostModel
    history_groups: int = 0
    created_at: float = 0.0

    def bucket_of(self, tokens: float) -> int:
        return bucket_of(self.bucket_boundaries, tokens)

    def stats(self) -> dict[str, Any]:
        return plan_stats(self)


def bucket_of(boundaries: Sequence[int], tokens: float) -> int:
    """Bucket ``k`` holds lengths in ``(boundaries[k-1], boundaries[k]]``; the last, the rest."""
    for k, b in enumerate(boundaries):
        if tokens <= b:
            return k
    return len(boundaries)


def derive_boundaries(predicted: Sequence[float], buckets: int) -> tuple[int, ...]:
    """Bucket boundaries at the quantiles of the predicted lengths (rounded up to a multiple
    of 8, repeats merged): from the data, not copied."""
    if buckets < 1:
        raise PlanError(f"buckets must be at least 1, got {buckets}")
    if buckets == 1 or not predicted:
        return ()
    # Quantiles that are data values (no interpolation into an empty gap between two modes).
    qs = np.quantile(
        np.asarray(predicted), [k / buckets for k in range(1, buckets)], method="inverted_cdf"
    )
    out = sorted({int(math.ceil(q / 8) * 8) for q in qs})
    return tuple(b for b in out if b < max(predicted))


def _deal(order: Sequence[int], predicted: Sequence[float], per_group: int) -> list[list[int]]:
    """Snake-deal positions, longest first, into schedule groups of ``per_group`` (the last
    one takes the remainder): each group gets the same mix of lengths."""
    n = len(order)
    count = max(1, math.ceil(n / per_group))
    caps = [per_group] * (count - 1) + [n - per_group * (count - 1)]
    groups: list[list[int]] = [[] for _ in range(count)]
    ranked = sorted(range(n), key=lambda i: (-predicted[i], i))
    lane, step = 0, 1
    for i in ranked:
        while len(groups[lane]) >= caps[lane]:  # full: move on along the snake
            lane, step = _next(lane, step, count)
        groups[lane].append(i)
        lane, step = _next(lane, step, count)
    return groups


def _next(lane: int, step: int, count: int) -> tuple[int, int]:
    if count == 1:
        return 0, 1
    if 0 <= lane + step < count:
        return lane + step, step
    return lane, -step  # turn: the end lane gets two in a row


def _pack(
    members: Sequence[int],
    predicted: Sequence[float],
    bounds: Sequence[int],
    group_size: int,
    max_batch_tokens: int,
    instances: int,
) -> list[tuple[int, list[int]]]:
    """One schedule group's prompts in length-homogeneous batches: by bucket, shortest first,
    a new batch when the next prompt would take the batch over its budget (every sample
    allocated the longest's length). The budget is also at most an instance's share of the
    group's tokens, so there are batches enough to go round the instances."""
    total = group_size * sum(math.ceil(predicted[i]) for i in members)
    budget = min(max_batch_tokens, max(1, math.ceil(total / instances)))
    by_bucket: dict[int, list[int]] = {}
    for i in members:
        by_bucket.setdefault(bucket_of(bounds, predicted[i]), []).append(i)
    packed: list[tuple[int, list[int]]] = []
    for b in sorted(by_bucket):
        current: list[int] = []
        for i in sorted(by_bucket[b], key=lambda i: (predicted[i], i)):
            longest = math.ceil(predicted[i])  # ascending: the newcomer is the longest
            if current and group_size * (len(current) + 1) * longest > budget:
                packed.append((b, current))
                current = []
            current.append(i)
        packed.append((b, current))
    return packed


def _balance(
    packed: list[tuple[int, list[int]]],
    timed: Callable[[list[int]], float],
    instances: int,
    max_skew: float,
) -> tuple[list[tuple[int, int, list[int], float]], list[float]]:
    """LPT: batches longest predicted time first, each to the least loaded instance. While the
    predicted skew is over ``max_skew``, the longest batch of the busiest instance that has two
    prompts or more is split in two and the whole is placed again (smaller batches balance
    better, at some padding). (instance, bucket, ids, predicted seconds) in placing order,
    and the loads. Each batch is timed once, when it is made."""
    batches = [(timed(ids), b, ids) for b, ids in packed]
    while True:
        batches.sort(key=lambda x: (-x[0], x[2][0]))
        load = [0.0] * instances
        placed: list[tuple[int, int, list[int], float]] = []
        for t, b, ids in batches:
            j = min(range(instances), key=lambda k: (load[k], k))
            load[j] += t
            placed.append((j, b, ids, t))
        mean = statistics.fmean(load)
        if mean <= 0 or max(load) / mean <= max_skew:
            return placed, load
        busiest = max(range(instances), key=lambda k: load[k])
        splittable = [k for k, (j, _, ids, _) in enumerate(placed) if j == busiest and len(ids) > 1]
        if not splittable:
            return placed, load  # as good as it gets: validate judges it
        _, b, ids = batches.pop(splittable[0])  # placed longest first: the longest of them
        half = len(ids) // 2
        batches += [(timed(ids[:half]), b, ids[:half]), (timed(ids[half:]), b, ids[half:])]


def _batch_time(cost: CostModel, seqs: int, longest: float, prompt_tokens: float) -> float:
    return cost.prefill_per_token_s * prompt_tokens * seqs + cost.steps_time(
        max(1, math.ceil(longest)), seqs, prompt_tokens * seqs
    )


def build_plan(
    *,
    task: str,
    seed: int,
    size: int,
    prompt: Callable[[int], str],
    predictor: LengthPredictor,
    group_size: int,
    groups_per_step: int,
    instances: int,
    max_batch_tokens: int,
    boundaries: Sequence[int] | None = None,
    buckets: int = 4,
    max_skew: float = DEFAULT_MAX_SKEW,
    cost: CostModel | None = None,
) -> Plan:
    """The plan of prompts ``0..size-1`` of a task (module docstring)."""
    if size < 1:
        raise PlanError(f"a plan needs a dataset of at least one prompt, got size {size}")
    for name, v in (
        ("group_size", group_size),
        ("groups_per_step", groups_per_step),
        ("instances", instances),
        ("max_batch_tokens", max_batch_tokens),
    ):
        if v < 1:
            raise PlanError(f"{name} must be at least 1, got {v}")
    cost = cost or CostModel()
    texts = [prompt(i) for i in range(size)]
    preds = [predictor.predict(t) for t in texts]
    predicted = [p.tokens for p in preds]
    bounds = tuple(sorted(boundaries)) if boundaries else derive_boundaries(predicted, buckets)
    prompt_tokens = [len(t) / 4 for t in texts]  # about 4 characters a token: only a cost term
    order: list[int] = []
    batches: list[PlanBatch] = []
    groups: list[ScheduleGroup] = []
    for sg, members in enumerate(_deal(range(size), predicted, groups_per_step)):
        packed = _pack(members, predicted, bounds, group_size, max_batch_tokens, instances)

        def timed(ids: list[int]) -> float:
            return _batch_time(
                cost,
                group_size * len(ids),
                max(predicted[i] for i in ids),
                statistics.fmean(prompt_tokens[i] for i in ids),
            )

        placed, load = _balance(packed, timed, instances, max_skew)
        start = len(order)
        for j, b, ids, seconds in placed:
            first = len(order)
            order.extend(ids)
            batches.append(
                PlanBatch(
                    first,
                    len(order),
                    b,
                    sg,
                    j,
                    group_size * sum(predicted[i] for i in ids),
                    group_size * len(ids) * math.ceil(max(predicted[i] for i in ids)),
                    seconds,
                )
            )
        groups.append(ScheduleGroup(start, len(order), tuple(load)))
    return Plan(
        task=task,
        seed=seed,
        size=size,
        group_size=group_size,
        groups_per_step=groups_per_step,
        instances=instances,
        max_batch_tokens=max_batch_tokens,
        bucket_boundaries=bounds,
        max_skew=max_skew,
        order=tuple(order),
        predicted_tokens=tuple(predicted[i] for i in order),
        sources=tuple(preds[i].source for i in order),
        batches=tuple(batches),
        schedule_groups=tuple(groups),
        cost=cost,
        history_groups=predictor.records,
        created_at=time.time(),
    )


def plan_stats(plan: Plan) -> dict[str, Any]:
    """The plan's statistics, from its batches (what ``validate`` recomputes)."""
    allocated = sum(b.allocated_tokens for b in plan.batches)
    tokens = sum(b.predicted_tokens for b in plan.batches)
    full = [g for g in plan.schedule_groups if g.end - g.start == plan.groups_per_step]
    skews = [g.skew for g in (full or plan.schedule_groups)]
    preds = np.asarray(plan.predicted_tokens)
    edges = np.unique(np.geomspace(max(preds.min(), 1.0), max(preds.max(), 2.0), HISTOGRAM_BINS))
    counts, edges = np.histogram(preds, bins=edges)
    return {
        "prompts": plan.size,
        "batches": len(plan.batches),
        "schedule_groups": len(plan.schedule_groups),
        "predicted_padding_ratio": 1.0 - tokens / allocated if allocated else 0.0,
        "predicted_skew": max(skews),
        "predicted_skew_mean": statistics.fmean(skews),
        "over_budget_batches": sum(
            1 for b in plan.batches if b.allocated_tokens > plan.max_batch_tokens
        ),
        "predicted_tokens_mean": float(preds.mean()),
        "sources": {s: plan.sources.count(s) for s in SOURCES},
        "histogram": {
            "edges": [round(float(e), 1) for e in edges],
            "counts": [int(c) for c in counts],
        },
    }


def validate(plan: Plan) -> dict[str, Any]:
    """The plan's statistics, if it is whole and consistent and its predicted skew is within
    ``max_skew``; PlanError saying what is wrong otherwise."""
    n = plan.size
    if sorted(plan.order) != list(range(n)):
        raise PlanError("the plan's order is not a permutation of the dataset's prompts")
    if len(plan.predicted_tokens) != n or len(plan.sources) != n:
        raise PlanError("the plan's per-prompt columns do not match its size")
    at = 0
    for b in plan.batches:
        if b.start != at or b.end <= b.start:
            raise PlanError(f"batch at position {b.start} does not follow the previous one")
        ids = range(b.start, b.end)
        expected = plan.group_size * sum(plan.predicted_tokens[i] for i in ids)
        if not math.isclose(b.predicted_tokens, expected, rel_tol=1e-6):
            raise PlanError(f"batch at position {b.start}: predicted tokens do not add up")
        if any(
            bucket_of(plan.bucket_boundaries, plan.predicted_tokens[i]) != b.bucket for i in ids
        ):
            raise PlanError(f"batch at position {b.start} mixes buckets")
        at = b.end
    if at != n:
        raise PlanError(f"the batches cover {at} of {n} positions")
    at = 0
    for k, g in enumerate(plan.schedule_groups):
        if g.start != at or len(g.instance_s) != plan.instances:
            raise PlanError(f"schedule group {k} is not contiguous or not over every instance")
        load = [0.0] * plan.instances
        for b in plan.batches:
            if b.schedule_group == k:
                if not g.start <= b.start < b.end <= g.end:
                    raise PlanError(f"batch at position {b.start} is outside schedule group {k}")
                load[b.instance] += b.predicted_s
        if not all(
            math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)
            for x, y in zip(load, g.instance_s, strict=True)
        ):
            raise PlanError(f"schedule group {k}: instance times do not add up")
        at = g.end
    if at != n:
        raise PlanError(f"the schedule groups cover {at} of {n} positions")
    stats = plan_stats(plan)
    if stats["predicted_skew"] > plan.max_skew:
        raise PlanError(
            f"predicted skew {stats['predicted_skew']:.3f} is over the bound {plan.max_skew:g}: "
            "lower max_batch_tokens (smaller batches balance better), plan for fewer "
            "instances, or raise --max-skew"
        )
    return stats


def to_json(plan: Plan) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "created_at": plan.created_at,
        "dataset": {"task": plan.task, "seed": plan.seed, "size": plan.size},
        "group_size": plan.group_size,
        "groups_per_step": plan.groups_per_step,
        "instances": plan.instances,
        "max_batch_tokens": plan.max_batch_tokens,
        "bucket_boundaries": list(plan.bucket_boundaries),
        "max_skew": plan.max_skew,
        "history_groups": plan.history_groups,
        "cost_model": asdict(plan.cost),
        "order": list(plan.order),
        # Unrounded: the batches' totals are sums of these, and a loader checks them (a plan
        # rounded to 3 decimals was refused by the scheduler that was to load it).
        "predicted_tokens": list(plan.predicted_tokens),
        "sources": list(plan.sources),
        "batches": [asdict(b) for b in plan.batches],
        "schedule_groups": [
            {"start": g.start, "end": g.end, "instance_s": list(g.instance_s), "skew": g.skew}
            for g in plan.schedule_groups
        ],
        "stats": plan_stats(plan),
    }


def from_json(data: dict[str, Any]) -> Plan:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(f"not a deltarl plan (want format {FORMAT!r})")
    try:
        ds = data["dataset"]
        return Plan(
            task=str(ds["task"]),
            seed=int(ds["seed"]),
            size=int(ds["size"]),
            group_size=int(data["group_size"]),
            groups_per_step=int(data["groups_per_step"]),
            instances=int(data["instances"]),
            max_batch_tokens=int(data["max_batch_tokens"]),
            bucket_boundaries=tuple(int(b) for b in data["bucket_boundaries"]),
            max_skew=float(data["max_skew"]),
            order=tuple(int(i) for i in data["order"]),
            predicted_tokens=tuple(float(x) for x in data["predicted_tokens"]),
            sources=tuple(str(s) for s in data["sources"]),
            batches=tuple(PlanBatch(**b) for b in data["batches"]),
            schedule_groups=tuple(
                ScheduleGroup(int(g["start"]), int(g["end"]), tuple(g["instance_s"]))
                for g in data["schedule_groups"]
            ),
            cost=CostModel(**data["cost_model"]),
            history_groups=int(data.get("history_groups", 0)),
            created_at=float(data.get("created_at", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"a malformed plan: {e!r}") from e


def write_plan(plan: Plan, path: Path) -> None:
    """Atomically: a reader sees the old file or the whole new one."""
    write_atomic(path, orjson.dumps(to_json(plan)))


def load_plan(path: Path) -> tuple[Plan, dict[str, Any]]:
    """A plan from disk, validated (its statistics with it); PlanError if it is not usable."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read a plan: {e}") from e
    plan = from_json(data)
    try:
        return plan, validate(plan)
    except PlanError as e:
        raise PlanError(f"{path}: {e}") from e
