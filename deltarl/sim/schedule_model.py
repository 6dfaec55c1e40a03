"""A discrete-event model of RL rollout on many continuous-batching instances, and three ways
to dispatch it: what ``deltarl bench schedule`` replays a workload through.

The workload is prompt groups (n samples per prompt, each with its output length). An instance
decodes up to ``max_seqs`` sequences at once; one decode step advances every running sequence
by one token and costs ``decode_base_s + decode_per_seq_s * seqs + decode_per_kctx_s *
context_tokens / 1000`` (context: every running sequence's prompt and tokens so far); a
sequence admitted pays ``prefill_per_token_s`` per prompt token. Between two events (a
sequence finishing, one admitted) nothing changes but the context, which grows by ``seqs``
tokens a step, so the model jumps from event to event with the closed-form sum of the steps.

Policies (each a function of the same workload and cost model):

- ``sync``: the synchronous RL loop. Steps of ``groups_per_step`` groups, dealt round-robin to
  the instances; the step ends when the last sample of the step is done; then the trainer
  trains (``train_s``) and the new weights are loaded (``refit_s``) while every instance waits.
- ``least_requests``: asynchronous. The groups in dataset order; each goes to the instance with
  the fewest running sequences that has room; the trainer trains beside generation, on steps
  filled in completion order.
- ``deltarl``: asynchronous, seed 000's scheduler. Groups ordered longest predicted first
  (``predicted_tokens``: the workload's true mean per group times a log-normal prediction
  error), each to the instance with the least predicted wait (its predicted tokens queued or
  running over its throughput); steps are filled in completion order, and the trainer's
  micro-batches are length-sorted within a step.

Figures per policy: ``throughput_tok_s`` (generated tokens over the wall time), ``padding_ratio``
(1 - real / allocated token positions of the trainer's micro-batches), ``skewness`` (the busiest
instance's busy time over the mean), ``sorting_wait`` (the mean time a finished group waits for
its step to be complete, over the mean instance busy time).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("sync", "least_requests", "deltarl")


@dataclass(frozen=True)
class CostModel:
    """Seconds of one instance's work (defaults: a mid-size model on one modern GPU)."""

    decode_base_s: float = 0.012
    decode_per_seq_s: float = 0.00006
    decode_per_kctx_s: float = 0.0000012
    prefill_per_token_s: float = 0.00002
    max_seqs: int = 128

    def steps_time(self, k: int, seqs: int, ctx: float) -> float:
        """``k`` decode steps of ``seqs`` sequences, the context ``ctx`` at the first and
        growing by ``seqs`` a step."""
        mean_ctx = ctx + seqs * (k - 1) / 2
        per = self.decode_base_s + self.decode_per_seq_s * seqs
        return k * (per + self.decode_per_kctx_s * mean_ctx / 1000)


@dataclass(frozen=True)
class PromptGroup:
    prompt_tokens: int
    output_tokens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.output_tokens)


@dataclass(frozen=True)
class Workload:
    name: str
    groups: tuple[PromptGroup, ...]
    predicted_tokens: tuple[float, ...]
    """Per group: what the length predictor says its samples total (for ``deltarl`` only)."""


def long_tailed(
    prompts: int = 512,
    n: int = 8,
    seed: int = 0,
    median_tokens: float = 600.0,
    sigma_prompt: float = 0.9,
    sigma_sample: float = 0.5,
    max_tokens: int = 16384,
    prediction_sigma: float = 0.35,
) -> Workload:
    """Reasoning-trace-like lengths: each prompt's typical length is log-normal with a heavy
    tail, its samples log-normal around it; capped at ``max_tokens``. The predictor knows each
    prompt's typical length up to a log-normal error (``prediction_sigma``), as a predictor
    from a run's history or prompt statistics would."""
    rng = np.random.default_rng(seed)
    groups, predicted = [], []
    for _ in range(prompts):
        typical = median_tokens * math.exp(rng.normal(0, sigma_prompt))
        lengths = np.minimum(typical * np.exp(rng.normal(0, sigma_sample, n)), max_tokens)
        groups.append(PromptGroup(int(rng.integers(64, 512)), tuple(int(x) + 1 for x in lengths)))
        predicted.append(n * typical * math.exp(rng.normal(0, prediction_sigma)))
    name = f"long_tailed(prompts={prompts}, n={n}, median={median_tokens:g}, seed={seed})"
    return Workload(name, tuple(groups), tuple(predicted))


def from_trace(entries: Sequence[dict[str, object]], name: str) -> Workload:
    """A workload from ``[{"prompt_tokens": int, "output_tokens": [int, ...]}, ...]``; the
    predictor is then the mean length over the trace's groups of similar prompt length (the
    statistics a planner has without a model)."""
    groups = []
    for i, e in enumerate(entries):
        p, out = e.get("prompt_tokens"), e.get("output_tokens")
        if not isinstance(p, int) or not isinstance(out, list) or not out:
            raise ValueError(f"entry {i}: want prompt_tokens (int) and output_tokens (a list)")
        if not all(isinstance(x, int) and x > 0 for x in out):
            raise ValueError(f"entry {i}: output_tokens must be positive ints")
        groups.append(PromptGroup(p, tuple(out)))
    by_bucket: dict[int, list[float]] = {}
    for g in groups:
        by_bucket.setdefault(g.prompt_tokens.bit_length(), []).append(g.tokens)
    predicted = tuple(statistics.fmean(by_bucket[g.prompt_tokens.bit_length()]) for g in groups)
    return Workload(name, tuple(groups), predicted)


@dataclass
class _Seq:
    group: int
    remaining: int
    ctx: int


@dataclass
class _Instance:
    cost: CostModel
    now: float = 0.0
    busy: float = 0.0
    decoded: int = 0  # tokens decoded so far
    predicted: float = 0.0  # predicted tokens of the groups assigned so far (deltarl)
    running: list[_Seq] = field(default_factory=list)

    @property
    def ctx(self) -> int:
        return sum(s.ctx for s in self.running)

    def admit(self, group: int, g: PromptGroup) -> None:
        self.now += self.cost.prefill_per_token_s * g.prompt_tokens * len(g.output_tokens)
        self.busy += self.cost.prefill_per_token_s * g.prompt_tokens * len(g.output_tokens)
        self.running += [_Seq(group, t, g.prompt_tokens) for t in g.output_tokens]

    def advance(self) -> list[int]:
        """Decode until the next sequence finishes; the groups of the sequences finished."""
        k = min(s.remaining for s in self.running)
        dt = self.cost.steps_time(k, len(self.running), self.ctx)
        self.now += dt
        self.busy += dt
        self.decoded += k * len(self.running)
        done = []
        for s in self.running:
            s.remaining -= k
            s.ctx += k
            if s.remaining == 0:
                done.append(s.group)
        self.running = [s for s in self.running if s.remaining > 0]
        return done


@dataclass(frozen=True)
class Figures:
    throughput_tok_s: float
    padding_ratio: float
    skewness: float
    sorting_wait: float
    wall_s: float


def _generate(
    workload: Workload, cost: CostModel, queues: Sequence[Sequence[int]], start: float = 0.0
) -> tuple[dict[int, float], list[_Instance]]:
    """Each instance runs its queue of groups in order, admitting the next whole group when it
    has room (continuous batching, as a vLLM engine does with the requests it was sent).
    Instances share nothing, so each runs on its own clock. Each group's completion time."""
    finished: dict[int, float] = {}
    insts = []
    for queue in queues:
        inst = _Instance(cost, now=start)
        pending = list(queue)
        left = {g: len(workload.groups[g].output_tokens) for g in queue}
        while pending or inst.running:
            while pending:
                size = len(workload.groups[pending[0]].output_tokens)
                if inst.running and len(inst.running) + size > cost.max_seqs:
                    break
                group = pending.pop(0)
                inst.admit(group, workload.groups[group])
            for group in inst.advance():
                left[group] -= 1
                if left[group] == 0:
                    finished[group] = inst.now
        insts.append(inst)
    return finished, insts


def _padding(workload: Workload, steps: list[list[int]], micro: int, sort: bool) -> float:
    real = allocated = 0
    for step in steps:
        seqs = [
            workload.groups[g].prompt_tokens + t
            for g in step
            for t in workload.groups[g].output_tokens
        ]
        if sort:
            seqs.sort()
        for k in range(0, len(seqs), micro):
            chunk = seqs[k : k + micro]
            real += sum(chunk)
            allocated += max(chunk) * len(chunk)
    return 1.0 - real / allocated if allocated else 0.0


def _async_figures(
    workload: Workload,
    finished: dict[int, float],
    insts: list[_Instance],
    groups_per_step: int,
    train_s: float,
    micro: int,
    sort: bool,
) -> Figures:
    done = sorted(finished, key=lambda g: finished[g])
    steps = [done[k : k + groups_per_step] for k in range(0, len(done), groups_per_step)]
    waits = [finished[s[-1]] - finished[g] for s in steps for g in s]
    # The trainer takes each step when it is complete and its previous step is trained.
    trainer = 0.0
    for s in steps:
        trainer = max(trainer, finished[s[-1]]) + train_s
    wall = max(trainer, *(i.now for i in insts))
    return _figures(workload, insts, wall, waits, _padding(workload, steps, micro, sort))


def _figures(
    workload: Workload, insts: list[_Instance], wall: float, waits: list[float], padding: float
) -> Figures:
    busy = [i.busy for i in insts]
    mean_busy = statistics.fmean(busy)
    tokens = sum(g.tokens for g in workload.groups)
    return Figures(
        throughput_tok_s=tokens / wall,
        padding_ratio=padding,
        skewness=max(busy) / mean_busy,
        sorting_wait=statistics.fmean(waits) / mean_busy if waits else 0.0,
        wall_s=wall,
    )


def run_policy(
    policy: str,
    workload: Workload,
    cost: CostModel,
    instances: int,
    groups_per_step: int,
    train_s: float,
    refit_s: float,
    micro: int = 8,
) -> Figures:
    """One policy's figures on ``workload`` (the module docstring says what each does)."""
    order = list(range(len(workload.groups)))
    if policy == "sync":
        clock, waits, steps = 0.0, [], []
        busy = [0.0] * instances
        insts: list[_Instance] = []
        for k in range(0, len(order), groups_per_step):
            step = order[k : k + groups_per_step]
            queues = [step[i::instances] for i in range(instances)]  # round-robin
            finished, insts = _generate(workload, cost, queues, clock)
            end = max(finished.values())
            waits += [end - finished[g] for g in step]
            steps.append(step)
            busy = [b + i.busy for b, i in zip(busy, insts, strict=True)]
            clock = end + train_s + refit_s  # every instance waits for training and refit
        for i, b in zip(insts, busy, strict=True):
            i.busy = b
        return _figures(workload, insts, clock, waits, _padding(workload, steps, micro, False))
    queues: list[list[int]] = [[] for _ in range(instances)]
    if policy == "least_requests":
        # Each group to the instance holding the fewest requests: equal counts, whatever
        # their lengths.
        for g in order:
            min(queues, key=len).append(g)
        finished, insts = _generate(workload, cost, queues)
        return _async_figures(workload, finished, insts, groups_per_step, train_s, micro, False)
    if policy == "deltarl":
        pred = workload.predicted_tokens
        # Step by step (so the steps complete in order and training starts early), the
        # step's groups longest predicted first, each to the instance with the least
        # predicted work so far: long and short mixed on every instance, balanced.
        load = [0.0] * instances
        for k in range(0, len(order), groups_per_step):
            for g in sorted(order[k : k + groups_per_step], key=lambda g: -pred[g]):
                j = min(range(instances), key=load.__getitem__)
                queues[j].append(g)
                load[j] += pred[g]
        finished, insts = _generate(workload, cost, queues)
        return _async_figures(workload, finished, insts, groups_per_step, train_s, micro, True)
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
