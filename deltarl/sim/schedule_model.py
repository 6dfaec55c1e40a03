"""A discrete-event model of asynchronous RL rollout on many continuous-batching instances, with
the scheduler's lag gate and a trainer: what ``deltarl bench schedule`` replays a workload
through, one dispatch policy at a time.

The workload is prompt groups (n samples per prompt, each with its output length). An instance
decodes up to ``max_seqs`` sequences at once; one decode step advances every running sequence
by one token and costs ``decode_base_s + decode_per_seq_s * seqs + decode_per_kctx_s *
context_tokens / 1000`` (context: every running sequence's prompt and tokens so far); a group
admitted pays ``prefill_per_token_s`` per prompt token of each sample first. Between two
events nothing changes but the context, so each instance jumps from event to event with the
closed form of the steps (fractional steps when another instance's event comes first).

What every policy shares, as the scheduler does (``deltarl/scheduler/service.py``):

- pull dispatch: an instance gets a group only when it has room for all its samples;
- the throttle gate at lag bound L: an instance ``behind`` versions behind the trainer (plus
  one while a step trains) gets work only while fewer than ``(L - behind + 1) *
  groups_per_step`` groups are running or pooled; under ``partial`` the ``deltarl`` policy
  counts its running groups where they are forecast to land instead
  (``deltarl/scheduler/landing.py``: predicted remaining tokens at the instance's rate per
  group, in ship intervals), as the scheduler does;
- the trainer takes the first ``groups_per_step`` pooled groups (completion order) when it is
  idle, trains ``train_s``, publishes a version; every instance then stalls ``refit_s`` for
  the refit (between two engine steps: running sequences continue, a partial rollout);
- the hard lag rule: a group whose oldest token is more than L versions behind the trainer
  when shipped is dropped and its prompt queued again (``MAX_ATTEMPTS`` at most); a running
  group already past that is stopped at the refit and requeued (the scheduler's
  ``requeued.doomed``: ``Heartbeat.progress``). Every token of a dropped or stopped group is
  wasted.
- the lag rule (``lag_rule``, the scheduler's): ``oldest_token`` measures a group's lag from its
  oldest token, so every trained token is within L of the trainer (what the previous
  paragraph describes); ``partial`` lets a group that lives through a refit continue under the
  new weights (a partial rollout, each token keeping the version that sampled it, which the
  trainer's per-token importance ratio is taken against) and measures its lag from its newest
  token, so nothing in flight is doomed: only a group whose instance fell behind is dropped.
  Its cost is the age of the old tokens it trains on, reported as ``token_lag_mean`` and
  ``over_bound_token_ratio`` (the trained tokens more than L behind the trainer).

The policies:

- ``sync``: lag bound 0: one step of groups is generated to the last sample, trained and
  refitted while the instances wait. The synchronous RL loop.
- ``least_requests``: the next group in dataset order to the instance with the fewest running
  requests: the common asynchronous dispatch.
- ``deltarl``: seed 000's dispatch: of the next ``lookahead`` groups (requeued ones first),
  the longest predicted (``predicted_tokens``: the workload's true mean per group times a
  log-normal error) to the instance with the least predicted wait (predicted tokens of its
  running groups over its decode rate at its occupancy); the trainer's micro-batches are
  length-sorted.

Figures per policy: ``throughput_tok_s`` (trained completion tokens over the wall time: wasted
tokens are not throughput), ``padding_ratio`` (1 - real / allocated token positions of the
trainer's micro-batches), ``skewness`` (the busiest instance's busy time over the mean),
``sorting_wait`` (the mean time a finished group waits in the pool for its step, over the mean
time groups take to generate: what the scheduler records per step), ``wasted_tokens_ratio``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from deltarl.scheduler.landing import InFlight, LandingForecast
from deltarl.scheduler.step_busy import skewness

POLICIES = ("sync", "least_requests", "deltarl")
LAG_RULES = ("oldest_token", "partial")
MAX_ATTEMPTS = 3
"""A prompt dropped stale this often is given up (as the scheduler abandons failing ones)."""
DEFAULT_LOOKAHEAD = 64
"""The ``deltarl`` policy's window, as the scheduler's ``lookahead`` default."""
DONE_EPS = 1e-6
"""Tokens left under which a sequence is done (fractional steps round off)."""


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

    def steps_s(self, count: int, seqs: int, context_tokens: int) -> float:
        """``count`` decode steps that ran ``seqs`` sequences over ``context_tokens`` of
        context in all (sums over the steps: the cost is linear in both)."""
        per_seq = self.decode_per_seq_s * seqs
        return count * self.decode_base_s + per_seq + self.decode_per_kctx_s * context_tokens / 1000

    def scaled(self, factor: float) -> CostModel:
        """Every cost ``factor`` times as long."""
        return dataclasses.replace(
            self,
            decode_base_s=self.decode_base_s * factor,
            decode_per_seq_s=self.decode_per_seq_s * factor,
            decode_per_kctx_s=self.decode_per_kctx_s * factor,
            prefill_per_token_s=self.prefill_per_token_s * factor,
        )

    def time_shared(self, engines: int) -> CostModel:
        """This engine's costs when ``engines`` as busy share its CPUs: each step takes that
        many times as long (the real runs of ``bench schedule --real`` pin every engine to
        the same CPUs)."""
        return self.scaled(engines)


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
    remaining: float
    ctx: float
    length: int
    marked: float = 0.0
    """Tokens generated by the last version mark (``_Run._mark``)."""


@dataclass
class _Instance:
    index: int
    cost: CostModel
    now: float = 0.0
    stall_until: float = 0.0
    """No decoding before this (a prefill or a refit in progress)."""
    busy: float = 0.0
    version: int = 0
    running: list[_Seq] = field(default_factory=list)
    groups: dict[int, int] = field(default_factory=dict)
    """Group -> its samples still running here."""
    predicted: float = 0.0
    """Predicted tokens of the groups running here (deltarl's wait)."""
    epoch: int = 0
    """Bumped when the running set changes: older heap entries are stale."""

    def room(self, size: int) -> bool:
        return not self.running or len(self.running) + size <= self.cost.max_seqs

    def advance(self, t: float) -> None:
        """Decode until ``t`` (fractional steps between events: the context grows by the
        running sequences each step, so the time of k steps is quadratic in k)."""
        start = max(self.now, self.stall_until)
        dt = t - start
        self.now = max(self.now, t)
        if dt <= 0 or not self.running:
            return
        seqs = len(self.running)
        ctx = sum(x.ctx for x in self.running)
        c = self.cost.decode_per_kctx_s / 1000
        a = c * seqs / 2
        b = self.cost.decode_base_s + self.cost.decode_per_seq_s * seqs + c * ctx - a
        k = 2 * dt / (b + math.sqrt(b * b + 4 * a * dt))  # the root, without cancellation
        for x in self.running:
            x.remaining -= k
            x.ctx += k
        self.busy += dt

    def next_finish(self) -> float | None:
        if not self.running:
            return None
        k = max(min(x.remaining for x in self.running), 0.0)
        ctx = sum(x.ctx for x in self.running)
        return max(self.now, self.stall_until) + self.cost.steps_time(k, len(self.running), ctx)

    def stall(self, seconds: float, busy: bool) -> None:
        self.stall_until = max(self.stall_until, self.now) + seconds
        if busy:
            self.busy += seconds


@dataclass(frozen=True)
class Figures:
    throughput_tok_s: float
    """Trained completion tokens per second of wall time (dropped ones are not throughput)."""
    padding_ratio: float
    skewness: float
    sorting_wait: float
    wall_s: float
    wasted_tokens_ratio: float = 0.0
    steps: int = 0
    token_lag_mean: float = 0.0
    """Trained tokens' mean lag: the trainer's version at ship minus the token's."""
    over_bound_token_ratio: float = 0.0
    """Trained tokens more than the lag bound behind (0 under ``oldest_token``)."""
    step_skewness: float = 1.0
    """The median over steps of each step's skewness, as the scheduler records it: the
    busiest instance's busy time since the previous step over the mean."""
    step_tokens_min: float = 1.0
    step_tokens_max: float = 1.0
    """The smallest and largest step's mean completion tokens per group, over the workload's
    mean: how far dispatch by length skews what each step trains on (1 and 1: every step the
    workload's mix)."""
    tail_s: float = 0.0
    """Wall seconds after the last group was issued: the finite workload's drain, when there
    is nothing left to give an idle instance (what ``skewness`` over the run mostly measures
    on a short workload)."""


@dataclass
class _Group:
    index: int
    attempt: int = 0
    start_version: int = 0
    admitted_at: float = 0.0
    finished_at: float = 0.0
    instance: int = -1


class _Run:
    """One policy's run of a workload: instances, the lag gate, the trainer (module docstring)."""

    def __init__(
        self,
        policy: str,
        workload: Workload,
        cost: CostModel,
        instances: int,
        groups_per_step: int,
        train_s: float,
        refit_s: float,
        lag: int,
        micro: int,
        lookahead: int,
        lag_rule: str = "oldest_token",
        token_cap: int | None = None,
    ) -> None:
        self.policy = policy
        self.lag_rule = lag_rule
        # the scheduler's max_token_lag_steps: under partial, the oldest token's cap
        self.token_cap = token_cap if lag_rule == "partial" else None
        self.w = workload
        self.cost = cost
        self.gps = groups_per_step
        self.train_s = train_s
        self.refit_s = refit_s
        self.lag = 0 if policy == "sync" else lag
        self.micro = micro
        self.lookahead = lookahead
        # sync never crosses a version; under ``partial`` nothing in flight is doomed unless
        # a cap on the oldest token's age makes it so
        self.abort_doomed = policy != "sync" and (
            lag_rule == "oldest_token" or self.token_cap is not None
        )
        # how far behind a group's oldest token may fall before it is doomed
        self.oldest_bound = self.lag if self.token_cap is None else self.token_cap
        self.insts = [_Instance(i, cost) for i in range(instances)]
        self.heap: list[tuple[float, int, int]] = []
        self.fresh = 0  # the dataset's cursor
        self.queue: list[int] = []  # requeued prompts, oldest first
        self.attempts = [0] * len(workload.groups)
        self.issued = 0  # groups running on an instance
        self.pooled: list[_Group] = []
        self.version = 0  # the trainer's
        self.training_until: float | None = None
        self.steps: list[list[_Group]] = []
        self.shipped_at: list[float] = []
        self.wasted = 0
        self.trained = 0
        self.now = 0.0
        self.record: dict[int, _Group] = {}  # each group's latest attempt
        self.by_version: dict[int, dict[int, float]] = {}  # group -> version -> tokens
        self.lag_tokens = 0.0  # trained tokens times their lag
        self.busy_at_ship: list[list[float]] = []  # each instance's busy seconds at each step
        self.last_issue = 0.0  # when the last group was issued
        self.over_bound = 0.0  # trained tokens more than the bound behind
        # Under ``partial`` the deltarl policy's throttle counts issued groups where they are
        # forecast to land (deltarl/scheduler/landing.py), as the scheduler's does.
        self.forecast = (
            LandingForecast()
            if policy == "deltarl" and lag_rule == "partial" and self.token_cap is None
            else None
        )
        self.rooms: dict[int, int] = {}  # window -> the forecast's room at this dispatch
        self.admitted = 0  # groups admitted in this dispatch

    # -- dispatch -----------------------------------------------------------------------

    def _allowed(self, inst: _Instance) -> int:
        """The throttle gate (the scheduler's): groups landing within the lag bound."""
        behind = self.version + (1 if self.training_until is not None else 0) - inst.version
        window = self.lag - behind + 1
        if self.forecast is None:
            return window * self.gps - (self.issued + len(self.pooled))
        if window not in self.rooms:
            self.rooms[window] = self.forecast.room(
                self._in_flight(), len(self.pooled), window, self.gps
            )
        return self.rooms[window] - self.admitted  # those admitted since count as landing now

    def _in_flight(self) -> list[InFlight]:
        """The running groups as the scheduler's forecast sees them: predicted tokens, tokens
        generated so far (the heartbeat's progress), the instance's rate per group."""
        out = []
        for inst in self.insts:
            inst.advance(self.now)
            if not inst.groups:
                continue
            rate = self._throughput(inst) / len(inst.groups)
            left: dict[int, float] = {}
            for x in inst.running:
                left[x.group] = left.get(x.group, 0.0) + max(x.remaining, 0.0)
            for g in inst.groups:
                generated = self.w.groups[g].tokens - left.get(g, 0.0)
                out.append(InFlight(self.w.predicted_tokens[g], int(generated), rate))
        return out

    def _candidates(self) -> list[int]:
        n = len(self.w.groups)
        # one at a time: a window of 0 past it is the next one alone, in order
        ahead = max(self.lookahead, 1) if self.policy == "deltarl" else 1
        return self.queue[:ahead] + list(range(self.fresh, min(self.fresh + ahead, n)))

    def _take(self, g: int) -> None:
        if self.queue and g in self.queue:
            self.queue.remove(g)
        else:  # a fresh prompt: those passed over before it are queued (as the store does)
            self.queue += list(range(self.fresh, g))
            self.fresh = g + 1

    def _throughput(self, inst: _Instance) -> float:
        seqs = max(len(inst.running), 1)
        per = self.cost.decode_base_s + self.cost.decode_per_seq_s * seqs
        return seqs / per

    def dispatch(self) -> None:
        self.rooms, self.admitted = {}, 0
        while True:
            cands = self._candidates()
            if not cands:
                return
            if self.policy == "deltarl":
                pred = self.w.predicted_tokens
                g = max(cands, key=lambda p: (pred[p], -p))  # longest predicted first
                size = len(self.w.groups[g].output_tokens)
                ok = [i for i in self.insts if i.room(size) and self._allowed(i) > 0]
                if not ok:
                    return
                inst = min(ok, key=lambda i: (i.predicted / self._throughput(i), i.index))
            else:
                g = cands[0]
                size = len(self.w.groups[g].output_tokens)
                ok = [i for i in self.insts if i.room(size) and self._allowed(i) > 0]
                if not ok:
                    return
                inst = min(ok, key=lambda i: (len(i.running), i.index))  # fewest requests
            self._take(g)
            self._admit(inst, g)

    def _admit(self, inst: _Instance, g: int) -> None:
        inst.advance(self.now)
        group = self.w.groups[g]
        inst.stall(
            self.cost.prefill_per_token_s * group.prompt_tokens * len(group.output_tokens), True
        )
        inst.running += [
            _Seq(g, float(t), float(group.prompt_tokens), t) for t in group.output_tokens
        ]
        inst.groups[g] = len(group.output_tokens)
        inst.predicted += self.w.predicted_tokens[g]
        self.by_version[g] = {}
        self.record[g] = _Group(g, self.attempts[g], inst.version, self.now, 0.0, inst.index)
        self.issued += 1
        self.admitted += 1
        self.last_issue = self.now
        self._schedule(inst)

    def _schedule(self, inst: _Instance) -> None:
        inst.epoch += 1
        t = inst.next_finish()
        if t is not None:
            heapq.heappush(self.heap, (t, inst.index, inst.epoch))

    # -- events -------------------------------------------------------------------------

    def _finish(self, inst: _Instance) -> None:
        inst.advance(self.now)
        done = [x for x in inst.running if x.remaining <= DONE_EPS]
        inst.running = [x for x in inst.running if x.remaining > DONE_EPS]
        for x in done:
            self._credit(inst, x, float(x.length))
            inst.groups[x.group] -= 1
            if inst.groups[x.group] == 0:
                del inst.groups[x.group]
                inst.predicted -= self.w.predicted_tokens[x.group]
                rec = self.record[x.group]
                rec.finished_at = self.now
                self.issued -= 1
                self.pooled.append(rec)
        self._schedule(inst)

    def _credit(self, inst: _Instance, x: _Seq, generated: float) -> None:
        """The tokens ``x`` generated since its last mark were sampled by ``inst.version``."""
        seen = self.by_version[x.group]
        seen[inst.version] = seen.get(inst.version, 0.0) + generated - x.marked
        x.marked = generated

    def _group_lag(self, rec: _Group) -> int:
        if self.lag_rule == "partial":
            return self.version - max(self.by_version[rec.index], default=rec.start_version)
        return self.version - rec.start_version  # its oldest token: sampled at admission

    def _ship(self) -> None:
        if self.training_until is not None:
            return
        fresh = []
        for rec in self.pooled:
            capped = (
                self.token_cap is not None and self.version - rec.start_version > self.token_cap
            )
            if self._group_lag(rec) > self.lag or capped:  # over the bound: dropped
                self.wasted += self.w.groups[rec.index].tokens
                self.attempts[rec.index] += 1
                if self.attempts[rec.index] < MAX_ATTEMPTS:
                    self.queue.append(rec.index)
            else:
                fresh.append(rec)
        self.pooled = fresh
        if len(fresh) < self.gps:
            return
        step, self.pooled = fresh[: self.gps], fresh[self.gps :]
        self.steps.append(step)
        self.shipped_at.append(self.now)
        if self.forecast is not None:
            self.forecast.shipped(self.now)
        for i in self.insts:  # busy up to now, as each engine's heartbeat would report it
            i.advance(self.now)
        self.busy_at_ship.append([i.busy for i in self.insts])
        self.trained += sum(self.w.groups[r.index].tokens for r in step)
        for r in step:
            for v, n in self.by_version[r.index].items():
                self.lag_tokens += (self.version - v) * n
                self.over_bound += n if self.version - v > self.lag else 0.0
        self.training_until = self.now + self.train_s

    def _publish(self) -> None:
        self.training_until = None
        self.version += 1
        for inst in self.insts:  # every engine loads the new weights between two steps
            inst.advance(self.now)
            for x in inst.running:  # what they generated so far was the old version's
                self._credit(inst, x, x.length - x.remaining)
            if self.abort_doomed:
                self._abort_doomed(inst)
            inst.stall(self.refit_s, False)
            inst.version = self.version
            self._schedule(inst)

    def _abort_doomed(self, inst: _Instance) -> None:
        """Groups whose lag can only grow past the bound before they ship are stopped now and
        their prompts queued again: what they would still generate is saved (what they did
        generate is wasted all the same)."""
        doomed = {
            g
            for g in inst.groups
            if self.version - self.record[g].start_version > self.oldest_bound
        }
        if not doomed:
            return
        for g in doomed:
            finished = self.w.groups[g].tokens - sum(
                x.length for x in inst.running if x.group == g
            )  # samples of it that are done
            self.wasted += finished + sum(
                x.length - x.remaining for x in inst.running if x.group == g
            )
            self.attempts[g] += 1
            if self.attempts[g] < MAX_ATTEMPTS:
                self.queue.append(g)
            del inst.groups[g]
            inst.predicted -= self.w.predicted_tokens[g]
            self.issued -= 1
        inst.running = [x for x in inst.running if x.group not in doomed]

    def run(self) -> Figures:
        target = len(self.w.groups) // self.gps
        while len(self.steps) < target:
            self.dispatch()
            self._ship()
            nxt = self.heap[0][0] if self.heap else math.inf
            if self.training_until is not None and self.training_until <= nxt:
                self.now = self.training_until
                self._publish()
                continue
            if not self.heap:
                break  # nothing running, nothing to train: the dataset is used up
            t, i, epoch = heapq.heappop(self.heap)
            if epoch != self.insts[i].epoch:
                continue
            self.now = t
            self._finish(self.insts[i])
        if self.training_until is not None:
            self.now = self.training_until
        return self._figures()

    def _figures(self) -> Figures:
        busy = [i.busy for i in self.insts]
        mean_busy = statistics.fmean(busy)
        waits = [
            at - r.finished_at for s, at in zip(self.steps, self.shipped_at, strict=True) for r in s
        ]
        gen = [r.finished_at - r.admitted_at for s in self.steps for r in s]
        mean_gen = statistics.fmean(gen) if gen else 0.0
        steps = [[r.index for r in s] for s in self.steps]
        made = self.trained + self.wasted
        mean_tokens = statistics.fmean(g.tokens for g in self.w.groups)
        per_step = [
            statistics.fmean(self.w.groups[r.index].tokens for r in s) / mean_tokens
            for s in self.steps
        ] or [1.0]
        # each step's figure by the scheduler's own arithmetic (step_busy.skewness)
        zero = [0.0] * len(self.insts)
        snapshots = [{str(i): b for i, b in enumerate(at)} for at in [zero, *self.busy_at_ship]]
        step_skew = [
            s
            for before, after in itertools.pairwise(snapshots)
            if (s := skewness(before, after)) is not None
        ]
        return Figures(
            throughput_tok_s=self.trained / self.now if self.now > 0 else 0.0,
            padding_ratio=_padding(self.w, steps, self.micro, self.policy == "deltarl"),
            skewness=max(busy) / mean_busy if mean_busy > 0 else 1.0,
            sorting_wait=statistics.fmean(waits) / mean_gen if mean_gen > 0 else 0.0,
            wall_s=self.now,
            wasted_tokens_ratio=self.wasted / made if made else 0.0,
            steps=len(self.steps),
            token_lag_mean=self.lag_tokens / self.trained if self.trained else 0.0,
            over_bound_token_ratio=self.over_bound / self.trained if self.trained else 0.0,
            step_skewness=statistics.median(step_skew) if step_skew else 1.0,
            step_tokens_min=min(per_step),
            step_tokens_max=max(per_step),
            tail_s=max(self.now - self.last_issue, 0.0),
        )


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


def run_policy(
    policy: str,
    workload: Workload,
    cost: CostModel,
    instances: int,
    groups_per_step: int,
    train_s: float,
    refit_s: float,
    micro: int = 8,
    lag: int = 1,
    lookahead: int = DEFAULT_LOOKAHEAD,
    lag_rule: str = "oldest_token",
    token_cap: int | None = None,
) -> Figures:
    """One policy's figures on ``workload`` (the module docstring says what each does)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if lag_rule not in LAG_RULES:
        raise ValueError(f"unknown lag rule {lag_rule!r}; known: {', '.join(LAG_RULES)}")
    return _Run(
        policy,
        workload,
        cost,
        instances,
        groups_per_step,
        train_s,
        refit_s,
        lag,
        micro,
        lookahead,
        lag_rule,
        token_cap,
    ).run()
