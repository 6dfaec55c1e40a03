"""Completion lengths within one run: predicted from the run's own history where no plan is
loaded, and forced where the task fixes them.

**Predicting without a plan.** The ``deltarl`` dispatch balances instances by predicted
tokens. A plan (``plan_view``) carries predictions made offline; without one, the scheduler
used to have none and counted groups, which is ``least_requests`` by another name. Now every
pooled group teaches a ``LengthPredictor`` (its sources in order: this prompt's own history,
its length class's mean, a ridge fit on the prompt text), rebuilt at a start from the store's
``length_history``, so a restart forgets nothing. Predictions are given only once the fit
answers (``LengthPredictor.fitted``, 16 groups): from then on every prompt has one of its
own; before, some prompts would carry tokens and others the policy's count of one, and the
dispatch would compare the two.

What the dispatch predicted for each group it issued is kept until the group pools, and goes
into its ``length_history`` row (``predicted``), so each step's prediction error is measured
as without a plan as with one (``step_lengths``). Memory only: a group issued before a
restart pools without it.

**Forced lengths.** A task that fixes each sample's completion length (``ShapedLengths``: a
long-tailed workload replayed on real engines) has them sent with the work, capped at the
sampling's ``max_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from deltarl.rl.task import ShapedLengths, Task
from deltarl.scheduler.length_log import LengthNote
from deltarl.scheduler.length_predictor import LengthPredictor, Record, store_records
from deltarl.scheduler.plan_view import PlannedTask
from deltarl.scheduler.rows import Group
from deltarl.scheduler.store import SchedulerStore

DISPATCHED_KEPT = 1 << 16
"""At most this many issued groups' predictions are held (a group aborted and never pooled
would otherwise hold its entry for ever); the oldest go first."""


class RunLengths:
    """The run's own length predictions (module docstring), for a scheduler without a plan."""

    def __init__(self, store: SchedulerStore, task: Task, group_size: int) -> None:
        self.task = task
        self.group_size = group_size
        # default_tokens is never given out: predictions start once the fit answers.
        self.predictor = LengthPredictor(store_records(store), task.name, default_tokens=1.0)
        self._dispatched: OrderedDict[str, float] = OrderedDict()

    def predicted_tokens(self, prompt_id: int) -> float | None:
        """The group's predicted completion tokens (all samples); None until the predictor
        can predict every prompt."""
        if not self.predictor.fitted:
            return None
        return self.predictor.predict(self.task.prompt(prompt_id)).tokens * self.group_size

    def dispatched(self, groups: Iterable[Group], predicted: Mapping[int, float]) -> None:
        """Keep what was predicted for each of these issued groups (per sample)."""
        for g in groups:
            tokens = predicted.get(g.prompt_id)
            if tokens is not None:
                self._dispatched[g.group_id] = tokens / self.group_size
                self._dispatched.move_to_end(g.group_id)
        while len(self._dispatched) > DISPATCHED_KEPT:
            self._dispatched.popitem(last=False)

    def take_dispatched(self, group_id: str) -> float | None:
        """What was predicted per sample for this group when it was issued (then forgotten)."""
        return self._dispatched.pop(group_id, None)

    def learn(self, note: LengthNote) -> None:
        """One pooled group's lengths, as its history row holds them (a group without
        samples teaches nothing: ``LengthPredictor.add``)."""
        self.predictor.add(Record(note.task, note.prompt_key, note.prompt_text, note.outputs))


def forced_lengths(
    task: Task, prompt_id: int, draw: int, n: int, max_tokens: int
) -> list[int] | None:
    """Each sample's completion length where the task fixes it (capped at ``max_tokens``),
    else None. ``draw``: the group's sampling seed, so each draw of a prompt differs."""
    if isinstance(task, PlannedTask):  # plan positions name the task's prompts in plan order
        task, prompt_id = task.task, task.plan.order[prompt_id]
    if not isinstance(task, ShapedLengths):
        return None
    return [min(length, max_tokens) for length in task.output_lengths(prompt_id, draw, n)]
