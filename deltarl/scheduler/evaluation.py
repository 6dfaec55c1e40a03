"""Held-out evaluation: every ``eval_every`` steps, the current policy on the task's eval split.

The scheduler opens a round when the trainer reports step ``s`` done (``StepDone``, at
``s % eval_every == 0``) with the version ``v`` it published, and one at step 0 (version 0,
or the trainer's) when the store holds no round yet: the baseline before training. A round is
``task.eval_size`` groups of one sample each, ``task.eval_prompt(i)``, decoded greedily
(temperature 0) with the training ``max_tokens``. They go out in ``Work`` replies like
training groups, marked ``"eval": true`` with ids ``e<step>.<i>.<attempt>``
(``deltarl.scheduler.eval_store``), so that:

- the rollout daemon decodes them greedily, and submits them like any group;
- the scheduler routes their ``SubmitGroup`` here: scored with the task's reward and recorded
  in the round, never pooled, shipped, trained, or counted in any training counter (their own
  are ``eval.*``), and their samples' blob is released at once;
- training is held up by at most a share of the engines' slots: an instance gets eval groups
  only once it holds weights at or past the round's version, at most ``eval_share`` of the
  groups it asks for (half by default; one sample each, against ``group_size`` for a
  training group) plus the slots training work leaves unused (pool full, throttled), and eval
  groups take no pool capacity and do not enter the lag gate. ``eval_share = 1`` gives a
  round every slot until it is issued: it then finishes in about one decoding batch, on one
  version, where a half share spreads it over the next versions on a slow engine.

Greedy is allowed here and nowhere in training: the training ``Sampling`` refuses it, because
the GRPO ratio needs the engine's log-probabilities of the sampled distribution; nothing
trains on an eval sample, so its log-probabilities are unused.

A round measures the weights its samples were generated with: ``version_min`` and
``version_max`` of their tokens (equal unless an engine refitted during the round). A new
round is not opened while one is unfinished (counted ``eval.skipped_busy``): every recorded
round is whole. Crash safety is the training groups': an eval group lost to a rollout restart,
a missed heartbeat, a lost Work reply or a lease running out (which also covers a scheduler
restart) is queued again as a new attempt and re-issued; one that cannot be scored fails and
its round is recorded ``partial``, accuracy over the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection
from typing import Any

from deltarl.config.rl import SchedulerConfig
from deltarl.rl.protocol import SubmitGroup
from deltarl.rl.samples import Group as SampleGroup
from deltarl.rl.samples import SampleError, decode_group
from deltarl.rl.task import Task
from deltarl.scheduler.eval_store import EvalGroup, parse_eval_group_id
from deltarl.scheduler.reward import RewardFailedError, RewardScorer
from deltarl.scheduler.store import SchedulerStore
from deltarl.transport.messages import Error, Ok, Reply

logger = logging.getLogger(__name__)

CORRECT = 1.0
"""The reward of a correct answer: accuracy is the share of samples scored exactly this."""

STEP_FIELDS = (
    "eval_accuracy",
    "eval_reward_mean",
    "eval_samples",
    "eval_version_min",
    "eval_version_max",
    "eval_partial",
)
"""What a round adds to the run history's row of the step it was triggered at."""


def is_eval_group(group_id: str) -> bool:
    return parse_eval_group_id(group_id) is not None


class Evaluation:
    """The scheduler's eval rounds (module docstring); the service calls in at its hooks."""

    def __init__(
        self, config: SchedulerConfig, store: SchedulerStore, task: Task, scorer: RewardScorer
    ) -> None:
        self.config = config
        self.store = store
        self.task = task
        self.scorer = scorer
        split = int(getattr(task, "eval_size", 0)) if hasattr(task, "eval_prompt") else 0
        self.size = min(split, config.eval_prompts) if config.eval_prompts else split
        self.enabled = config.eval_every > 0 and self.size > 0
        if config.eval_every > 0 and not self.size:
            logger.warning(
                "eval_every = %d, but the task %r has no held-out split: no evaluation",
                config.eval_every,
                task.name,
            )
        self.scoring: dict[str, asyncio.Future[Reply]] = {}

    # -- rounds ---------------------------------------------------------------------------

    def start(self, trainer_version: int | None) -> None:
        """The baseline round (step 0), unless the store holds a round already."""
        if self.enabled and not self.store.eval_rounds():
            self._open(0, trainer_version or 0)

    def step_done(self, step: int, version: int) -> None:
        """Open the round of ``step`` if it is one (a replayed step opens nothing new)."""
        if not self.enabled or step % self.config.eval_every:
            return
        busy = self.store.eval_open()
        if busy is not None and busy.step != step:
            self.store.bump("eval.skipped_busy")
            logger.warning(
                "eval at step %d skipped: the round of step %d is unfinished", step, busy.step
            )
            return
        self._open(step, version)

    def _open(self, step: int, version: int) -> None:
        if self.store.open_eval_round(step, version, self.size):
            logger.info(
                "eval round at step %d: %d held-out prompts, on version %d or newer",
                step,
                self.size,
                version,
            )

    # -- work -----------------------------------------------------------------------------

    def share(self, max_groups: int) -> int:
        """The eval groups an instance asking for ``max_groups`` gets before training work:
        ``eval_share`` of them (at least one). Eval groups are one sample each, so half of
        the groups is far less than half of the engine's sequences."""
        return min(max_groups, max(1, int(max_groups * self.config.eval_share)))

    def work(
        self, instance: str, session: str, version: int | None, limit: int
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` groups of the open round; none unless the instance holds the
        round's version or a newer one."""
        if not self.enabled or limit < 1 or version is None:
            return []
        current = self.store.eval_open()
        if current is None or version < current.target_version:
            return []
        issued = self.store.issue_eval(
            current.step,
            limit,
            instance=instance,
            session=session,
            weight_version=version,
            lease_s=self.config.lease_s,
        )
        return [self._item(g) for g in issued]

    def _item(self, g: EvalGroup) -> dict[str, Any]:
        return {
            "group_id": g.group_id,
            "prompt_id": g.idx,
            "prompt": self.task.eval_prompt(g.idx),  # type: ignore[attr-defined]
            "n": 1,
            "eval": True,
            "sampling": {
                "temperature": 0.0,  # greedy: the policy's own answer, not a draw
                "top_p": 1.0,
                "max_tokens": self.config.sampling_params.max_tokens,
                "seed": 0,
            },
        }

    # -- submits --------------------------------------------------------------------------

    async def submit(self, cmd: SubmitGroup) -> Reply:
        running = self.scoring.get(cmd.group_id)
        if running is not None:
            self.store.bump("eval.duplicate")
            return await asyncio.shield(running)
        ids = parse_eval_group_id(cmd.group_id)
        group = None if ids is None else self.store.eval_group(ids[0], ids[1])
        if ids is None or group is None or ids[2] > group.attempt:
            self.store.bump("eval.unknown")
            self.store.release_blob(cmd.samples_ref)
            return Error("unknown_group", f"no eval group {cmd.group_id!r} was issued")
        if ids[2] == group.attempt and group.state in ("done", "failed"):
            self.store.bump("eval.duplicate")
            self.store.release_blob(cmd.samples_ref)  # recorded already: the copy is not kept
            return Ok(f"duplicate: eval group {cmd.group_id} is {group.state} already")
        if (
            ids[2] != group.attempt
            or group.state != "issued"
            or (group.instance, group.session) != (cmd.instance, cmd.session)
        ):
            self.store.bump("eval.stale")
            self.store.release_blob(cmd.samples_ref)
            return Error(
                "stale_group",
                f"eval group {cmd.group_id} is not held by {cmd.instance}/{cmd.session} any "
                f"more ({group.state}, attempt {group.attempt}); not accepted",
            )
        future = asyncio.ensure_future(self._score(group, cmd.samples_ref))
        self.scoring[cmd.group_id] = future
        future.add_done_callback(lambda _: self.scoring.pop(cmd.group_id, None))
        return await asyncio.shield(future)

    async def _score(self, group: EvalGroup, ref: str) -> Reply:
        try:
            sample = self._decode(group, ref).samples[0]
        except SampleError as e:
            return self._fail(group, ref, "bad_samples", str(e))
        try:
            (reward,) = await self.scorer.score_group(
                self.task.eval_prompt(group.idx),  # type: ignore[attr-defined]
                [sample.text],
            )
        except RewardFailedError as e:
            return self._fail(group, ref, e.reason, str(e))
        versions = [int(v) for v in sample.token_versions]
        span = (min(versions), max(versions)) if versions else (group.weight_version,) * 2
        recorded, finished = self.store.finish_eval(
            group, reward=float(reward), versions=span, blob=ref
        )
        if not recorded:
            return self._requeued_meanwhile(group)
        if finished:
            self._log_round(group.step)
        return Ok("eval sample recorded")

    def _decode(self, group: EvalGroup, ref: str) -> SampleGroup:
        blob = self.store.get_blob(ref)
        if blob is None:
            raise SampleError(f"no samples blob {ref[:64]!r}")
        samples = decode_group(blob, max_bytes=self.config.max_sample_bytes)
        if samples.group_id != group.group_id or len(samples.samples) != 1:
            raise SampleError(
                f"the blob holds {len(samples.samples)} samples of group {samples.group_id!r}, "
                f"not the one sample of {group.group_id}"
            )
        return samples

    def _fail(self, group: EvalGroup, ref: str, reason: str, problem: str) -> Reply:
        recorded, finished = self.store.finish_eval(
            group, reward=None, versions=(None, None), failure=f"{reason}: {problem}", blob=ref
        )
        if not recorded:
            return self._requeued_meanwhile(group)
        logger.warning("eval group %s failed (%s): %s", group.group_id, reason, problem)
        if finished:
            self._log_round(group.step)
        return Error(reason, f"eval group {group.group_id}: {problem}")

    def _requeued_meanwhile(self, group: EvalGroup) -> Reply:
        self.store.bump("eval.stale")
        return Error("stale_group", f"eval group {group.group_id} was requeued while it was scored")

    def _log_round(self, step: int) -> None:
        for r in self.store.eval_rounds():
            if r["step"] == step:
                logger.info(
                    "eval at step %d: accuracy %s over %d samples (%d failed), versions %s..%s",
                    step,
                    r["accuracy"],
                    r["samples"],
                    r["failed"],
                    r["version_min"],
                    r["version_max"],
                )

    # -- lost groups ----------------------------------------------------------------------

    def requeue_instance(
        self, instance: str, reason: str, *, keep_session: str | None = None
    ) -> int:
        return self.store.requeue_eval_instance(instance, reason, keep_session=keep_session)

    def requeue_not_held(
        self, instance: str, session: str, held: Collection[str], issued_before: float
    ) -> int:
        # A group being scored is the scheduler's own: never taken back.
        keep = set(held) | set(self.scoring)
        return self.store.requeue_eval_not_held(instance, session, keep, issued_before)

    def requeue_expired(self) -> int:
        return self.store.requeue_eval_expired()

    # -- what is read ---------------------------------------------------------------------

    def annotate(self, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The run history's step rows with the measurement of the round of each step
        (``STEP_FIELDS``; None where the step had no round, or it is unfinished)."""
        rounds = {r["step"]: r for r in self.store.eval_rounds() if r["finished"]}
        for row in steps:
            r = rounds.get(int(row["step"]))
            row["eval_accuracy"] = None if r is None else r["accuracy"]
            row["eval_reward_mean"] = None if r is None else r["reward_mean"]
            row["eval_samples"] = 0 if r is None else r["samples"]
            row["eval_version_min"] = None if r is None else r["version_min"]
            row["eval_version_max"] = None if r is None else r["version_max"]
            row["eval_partial"] = None if r is None else r["partial"]
        return steps

    def status(self) -> dict[str, Any]:
        current = self.store.eval_open()
        return {
            "enabled": self.enabled,
            "every": self.config.eval_every,
            "size": self.size,
            "open_round": None if current is None else current.step,
            "scoring": len(self.scoring),
        }

    async def close(self) -> None:
        pending = list(self.scoring.values())
        if pending:
            with contextlib.suppress(Exception):
                await asyncio.wait(pending, timeout=self.config.reward_timeout_s)
