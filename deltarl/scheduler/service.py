"""The scheduler's logic, one method per command of ``deltarl.rl.protocol``; no sockets here.

Two clocks take back issued work. Heartbeats keep an *instance*: one silent for
``heartbeat_timeout_s`` is removed and everything it holds is queued again, and a new session
of an instance requeues what its old sessions held. A *group* has a lease of ``lease_s`` from
its issue, which heartbeats do not renew: an instance that lost the ``Work`` reply (a timeout,
a scheduler restart) keeps heartbeating but never submits those groups. An instance whose
heartbeats report what it holds (``Heartbeat.reports_held`` and ``held``) gets such groups
requeued at its next heartbeat once they are ``not_held_grace_s`` old (``requeued.not_held``;
a group being scored is never taken back); for one that does not, only the lease brings them
back. Leases are wall-clock and durable, so they also requeue the work of an instance that
died while the scheduler was down.

Samples arrive on their own socket (``deltarl.transport.blobs``, bound by the daemon on the
``samples`` endpoint, stored in the same sqlite store): ``SubmitGroup.samples_ref`` names the
blob. It is decoded once here (``deltarl.rl.samples.decode_group``: that is the validation),
scored from its texts, and pooled as a reference and rewards; a ``Batch`` ships the references
and the trainer gets the same bytes from the samples socket.

Every state change goes through ``SchedulerStore`` in one transaction before the reply is
sent, so whatever the reply was, the store already holds it: a client that lost the reply and
asks again gets the same answer (a duplicate submit is ``Ok``; a retried submit of a refused
attempt, dropped or stale, gets the recorded Error and is not counted again; the same step is
the same batch). See the store's docstring for a prompt's life and why none is trained twice
or skipped.

The lag bound (``max_policy_lag_steps``, measured at ship time: trainer version minus the
group's oldest token version, time in the pool included; its newest under ``lag_rule =
"partial"``, where groups go on under new weights: ``token_lag``) is hard under every policy:
a pooled group over it is dropped and its prompt queued again
(``dropped_groups.lag_exceeded``), never shipped. ``on_lag_exceeded`` says what the
scheduler does *before* that, at ``GetWork``:

- ``throttle``: issue nothing that is predicted to arrive over the bound. The prediction: the
  k-th group issued now (from 0) lands in the batch (pooled + issued + k) // groups_per_step
  steps after the next one, the trainer will hold its current version plus those steps (plus
  one if a shipped step is still training), and the group's tokens will be the asking
  instance's version. A GetWork gets only the groups predicted within the bound; none:
  ``Work([], reason="throttle: ...")``, counted ``lag.throttled``. Generation waits for the
  trainer; little is wasted (``token_waste`` measures it). Under ``lag_rule = "partial"``
  (no cap on token age) a policy that ``forecasts_landing`` counts each issued group where it
  is forecast to land instead (``landing``): a long group that goes on under new weights then
  holds no place in the next step.
- ``sync``: an instance whose weights are more than the bound behind the trainer gets
  ``sync_to`` = the trainer's version and no work until it has refitted (``lag.sync``):
  asynchrony degrades to synchronous steps for the instances that fall behind.
- ``drop``: no gate; generation runs ahead freely and whatever goes stale is dropped at ship
  time. Most throughput, most waste.

Failed groups: a group is scored whole (GRPO normalises within the group). A sample whose
reward still fails after the retries drops the whole group (``dropped_groups.reward_timeout``
or ``.reward_error``, its samples in ``dropped_samples.*``) and queues the prompt again; so
does a group whose samples are malformed (``bad_samples``: its blob is missing, does not
decode, names another group or holds other than ``group_size`` samples; checked before
scoring, so nothing the trainer cannot build a batch from is ever pooled). Either way the submit is
answered with an Error of that reason. After ``max_reward_failures`` failed groups the prompt
is abandoned (``abandoned_prompts``), so a prompt that can never be scored or sampled cleanly
cannot stall the run, and is never lost silently either. A reward *service* that is out
(``[daemons.scheduler.reward]``, its circuit breaker open: ``reward_client``) is no failure of
the group: the submit is answered ``reward_unavailable``, nothing is dropped or counted against
the prompt, and the group stays issued for its instance to submit again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from deltarl.config.rl import SchedulerConfig
from deltarl.engine.daemon import DaemonCore, PauseGate
from deltarl.reward.protocol import REWARD_UNAVAILABLE
from deltarl.rl.protocol import (
    RL_COMMANDS,
    Batch,
    Beat,
    Checkpointed,
    GetHistory,
    GetWork,
    Heartbeat,
    History,
    StepDone,
    SubmitGroup,
    TakeBatch,
    Work,
)
from deltarl.rl.samples import Group as SampleGroup
from deltarl.rl.samples import SampleError, decode_group, sample_count
from deltarl.rl.task import Task, make_task, mix64
from deltarl.scheduler import token_lag
from deltarl.scheduler.evaluation import Evaluation, is_eval_group
from deltarl.scheduler.landing import InFlight, LandingForecast
from deltarl.scheduler.length_log import LengthNote
from deltarl.scheduler.length_predictor import prompt_key
from deltarl.scheduler.plan import PlanError, load_plan
from deltarl.scheduler.plan_view import PlannedTask, PlanView, check_fits, identity
from deltarl.scheduler.policy import (
    Candidates,
    DispatchPolicy,
    InstanceLoad,
    WorkRequest,
    make_policy,
)
from deltarl.scheduler.restore import RestoreError
from deltarl.scheduler.reward import RewardFailedError, RewardUnavailableError
from deltarl.scheduler.reward_scorers import make_reward_scorer
from deltarl.scheduler.reward_stats import RewardWindow
from deltarl.scheduler.rows import Group, PromptState, parse_group_id
from deltarl.scheduler.run_lengths import RunLengths, forced_lengths
from deltarl.scheduler.step_metrics import SchedulerMetrics
from deltarl.scheduler.store import SchedulerStore
from deltarl.scheduler.stragglers import StragglerJudge
from deltarl.transport.control import Handler
from deltarl.transport.messages import Command, Error, Ok, Reply, RestoreTo

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 60.0


@dataclass
class Instance:
    """A live rollout instance, as its heartbeats and requests describe it (memory only: after
    a restart the durable leases stand in until it is heard from again)."""

    name: str
    session: str
    last_seen: float  # monotonic
    last_seen_wall: float
    weight_version: int | None = None
    running_groups: int = 0
    queue_depth: int = 0
    tokens_per_s: float = 0.0
    busy_s: float = 0.0
    progress: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Group id -> (oldest token version, tokens so far), from its last heartbeat
    (``Heartbeat.progress``; malformed entries left out)."""


class SchedulerService(DaemonCore):
    daemon: ClassVar[str] = "scheduler"
    pause_text: ClassVar[str] = "paused: no new work is issued"

    def __init__(
        self,
        config: SchedulerConfig,
        store: SchedulerStore,
        *,
        task: Task | None = None,
        policy: DispatchPolicy | None = None,
        monotonic: Any = time.monotonic,  # noqa: ANN401 - a clock: () -> float
    ) -> None:
        self.config = config
        self.store = store
        base = task or make_task(config.task, seed=config.seed, size=config.dataset_size)
        self.plan = self._load_plan(config, store)
        self.task: Task = base if self.plan is None else PlannedTask(base, self.plan.plan)
        self.dataset_size = config.dataset_size or (self.plan.plan.size if self.plan else 0)
        # Without a plan the dispatch predicts from this run's own lengths (run_lengths.py).
        self.run_lengths = (
            RunLengths(store, self.task, config.group_size) if self.plan is None else None
        )
        self.policy = policy or make_policy(config.policy, config.lookahead)
        self.stragglers = StragglerJudge(
            config.straggler_ratio, config.straggler_window_s, config.straggler_cooldown_s
        )
        self.reward_window = RewardWindow()
        self.metrics = SchedulerMetrics(config.max_policy_lag_steps)
        self.scorer = make_reward_scorer(config, self.task, self._count_reward)
        self.monotonic = monotonic
        self.gate = PauseGate()
        self.instances: dict[str, Instance] = {}
        self._scoring: dict[str, asyncio.Future[Reply]] = {}
        self._pooled_at: deque[tuple[float, int]] = deque()  # (monotonic, samples): throughput
        self.landing = LandingForecast()  # the throttle's count under ``partial``
        version = store.meta("trainer_version")
        self.trainer_version: int | None = None if version is None else int(version)
        store.record_run(config.as_record())
        self.evals = Evaluation(config, store, self.task, self.scorer)  # held-out rounds
        self.evals.start(self.trainer_version)
        # Instances that held work when the scheduler stopped get one heartbeat timeout from
        # now to be heard from, as if they had just been seen: they could not reach us.
        now, wall = monotonic(), store.clock()
        for g in store.groups(PromptState.ISSUED):
            if g.instance is not None and g.session is not None:
                self.instances.setdefault(
                    g.instance, Instance(g.instance, g.session, now, wall, g.weight_version)
                )

    @staticmethod
    def _load_plan(config: SchedulerConfig, store: SchedulerStore) -> PlanView | None:
        """The plan of ``config.plan``, checked against the config and the store (PlanError,
        a ValueError, otherwise: ``plan_view``'s docstring says why ids bind a store to it)."""
        recorded = store.meta("plan")
        if config.plan is None:
            if recorded is not None:
                raise PlanError(
                    f"the store's prompt ids are positions of the plan {recorded}: "
                    "name that plan in `plan`, or start on a new store"
                )
            return None
        plan, stats = load_plan(config.plan)
        check_fits(plan, config)
        mine = identity(plan)
        if recorded is None and store.cursor > 0:
            raise PlanError(
                f"the store issued {store.cursor} prompts in dataset order, without a plan; "
                "a plan renumbers them: start it on a new store"
            )
        if recorded is not None and recorded != mine:
            raise PlanError(f"the store was started on the plan {recorded}, not {mine}")
        if recorded is None:
            store.set_meta("plan", mine)
        view = PlanView(plan)
        view.replay(store.planned_lengths())
        logger.info(
            "plan %s: %d prompts, %d batches, predicted skew %.3f, padding %.3f",
            config.plan,
            plan.size,
            stats["batches"],
            stats["predicted_skew"],
            stats["predicted_padding_ratio"],
        )
        return view

    def predicted_tokens(self, prompt_id: int) -> float | None:
        """A group's predicted completion tokens (all samples): the plan's, or without one the
        run's own history's once it predicts every prompt; else None (the dispatch counts
        groups)."""
        if self.run_lengths is not None:
            return self.run_lengths.predicted_tokens(prompt_id)
        if self.plan is None or not self.plan.covers(prompt_id):
            return None
        return self.plan.predicted(prompt_id) * self.config.group_size

    def _count_reward(self, name: str) -> None:
        self.store.bump(name)
        self.reward_window.note(name)

    @property
    def paused(self) -> bool:
        return self.gate.paused

    def handlers(self) -> Mapping[type[Command], Handler]:
        return {RestoreTo: self.on_restore}

    async def on_restore(self, cmd: RestoreTo) -> Reply:
        """Forget the steps after ``cmd.step`` (deltarl/scheduler/restore.py). Stop the trainer
        first; ``deltarl trainer-restore --step S`` then makes that checkpoint its newest."""
        try:
            done = self.store.restore_to(cmd.step)
        except RestoreError as e:
            return Error("cannot_restore", str(e))
        return Ok(
            f"restored to step {done.step}: {done.steps_forgotten} steps forgotten, "
            f"{done.requeued} prompts queued again; now run deltarl trainer-restore "
            f"--step {done.step}, then start the trainer"
        )

    def concurrent_handlers(self) -> Mapping[type[Command], Handler]:
        """Every command of the RL protocol, concurrently: rollout daemons and the trainer
        must not wait behind each other's submits (which await reward scoring), and every
        handler keeps the state consistent in its own store transactions."""
        handlers: dict[str, Handler] = {
            "rl.heartbeat": self.heartbeat,
            "rl.get_work": self.get_work,
            "rl.submit_group": self.submit_group,
            "rl.take_batch": self.take_batch,
            "rl.step_done": self.step_done,
            "rl.checkpointed": self.checkpointed,
            "rl.history": self.history,
        }
        missing = set(RL_COMMANDS) - set(handlers)
        if missing:  # the protocol grew a command this service does not answer yet
            raise RuntimeError(f"scheduler: no handler for {sorted(missing)}")
        return {RL_COMMANDS[tag]: handler for tag, handler in handlers.items()}

    # -- instances and leases -------------------------------------------------------------

    def _see(self, instance: str, session: str, weight_version: int | None = None) -> Instance:
        """Note that ``instance`` is alive; a new session requeues what older ones held."""
        known = self.instances.get(instance)
        if known is None or known.session != session:
            n = self.store.requeue_instance(instance, "session_changed", keep_session=session)
            n += self.evals.requeue_instance(instance, "session_changed", keep_session=session)
            if n:
                logger.info("instance %s: new session %s, %d groups requeued", instance, session, n)
            known = Instance(instance, session, 0.0, 0.0)
            self.instances[instance] = known
        known.last_seen, known.last_seen_wall = self.monotonic(), self.store.clock()
        if weight_version is not None:
            known.weight_version = weight_version
        return known

    def expire(self) -> None:
        """Remove instances that missed their heartbeats (requeueing their groups), then
        requeue groups whose durable lease ran out."""
        now = self.monotonic()
        for name, inst in list(self.instances.items()):
            if now - inst.last_seen > self.config.heartbeat_timeout_s:
                del self.instances[name]
                self.stragglers.forget(name)
                self.metrics.instance_removed(name)
                n = self.store.requeue_instance(name, "heartbeat_missed")
                n += self.evals.requeue_instance(name, "heartbeat_missed")
                logger.warning(
                    "instance %s missed its heartbeats: removed, %d groups requeued", name, n
                )
        self.evals.requeue_expired()
        expired = self.store.requeue_expired()
        if expired:
            logger.warning("%d leases expired: prompts %s requeued", len(expired), expired[:8])

    async def run(self) -> None:
        """The daemon's background work: check heartbeats and leases every ``tick_s``, remove
        the blobs no submit referred to within ``samples_grace_s``, and apply retention."""
        while True:
            self.expire()
            swept = self.store.sweep_blobs(self.config.samples_grace_s)
            if swept:
                logger.info("%d unreferenced sample blobs removed", swept)
            self.retain()
            await asyncio.sleep(self.config.tick_s)

    def retain(self) -> None:
        """One bounded batch of retention (``keep_steps``) and one bounded reclaim of file
        space per tick: each holds the write lock for a few milliseconds, and a batch of steps
        per tick outpaces any trainer."""
        try:
            self.store.prune_steps(self.config.keep_steps)
            self.store.reclaim()
        except sqlite3.OperationalError as e:  # busy, or a full disk: the next tick tries again
            logger.warning("scheduler store retention: %s", e)

    # -- rollout instances -----------------------------------------------------------------

    async def heartbeat(self, cmd: Heartbeat) -> Reply:
        inst = self._see(cmd.instance, cmd.session, cmd.weight_version)
        inst.running_groups, inst.queue_depth = cmd.running_groups, cmd.queue_depth
        inst.tokens_per_s, inst.busy_s = cmd.tokens_per_s, cmd.busy_s
        inst.progress = {
            str(g): (f[0], f[1])
            for g, f in (cmd.progress.items() if isinstance(cmd.progress, dict) else ())
            if isinstance(f, list) and len(f) == 2 and all(isinstance(x, int) for x in f)
        }
        benched = bool(self.stragglers.benched_for(inst.name, self.monotonic()))
        self.metrics.instance_seen(inst.name, inst.weight_version, not benched)
        if cmd.reports_held and isinstance(cmd.held, list):
            self._requeue_not_held(cmd.instance, cmd.session, cmd.held)
        self._judge(inst)
        doomed = self._doomed(inst)
        if doomed:
            aborted = self.store.requeue_doomed(cmd.instance, cmd.session, doomed)
            if aborted:
                logger.info(
                    "%s: %d groups can no longer ship within lag bound %d: requeued, aborted",
                    cmd.instance,
                    len(aborted),
                    self.config.max_policy_lag_steps,
                )
                return Beat(abort=aborted)
        return Ok()

    def _doomed(self, inst: Instance) -> dict[str, int]:
        """Held groups (its heartbeat's ``progress``) whose oldest token is already over the
        lag bound behind the trainer: group id -> tokens so far. Their lag only grows until
        they ship, where they would be dropped; stopping them now saves what they would still
        generate."""
        tv, bound = self.trainer_version, self.config.max_policy_lag_steps
        if self.config.lag_rule == "partial":
            # A group goes on under the new weights (its newest token is current), unless its
            # oldest token is already past the cap on token age: it would be dropped at ship.
            if self.config.max_token_lag_steps is None:
                return {}
            bound = self.config.max_token_lag_steps
        if tv is None:
            return {}
        # Eval groups are never trained: no lag bound applies to them.
        return {
            gid: tokens
            for gid, (oldest, tokens) in inst.progress.items()
            if not is_eval_group(gid) and tv - oldest > bound
        }

    def _judge(self, inst: Instance) -> None:
        """Bench ``inst`` if it straggles (deltarl/scheduler/stragglers.py)."""
        rates = {
            i.name: i.tokens_per_s / i.running_groups
            for i in self.instances.values()
            if i.running_groups > 0 and i.tokens_per_s > 0
        }
        if not self.stragglers.observe(inst.name, rates, self.monotonic()):
            return
        n = self.store.requeue_instance(inst.name, "straggler")
        n += self.evals.requeue_instance(inst.name, "straggler")
        self.store.bump("stragglers.benched")
        self.metrics.instance_removed(inst.name)
        logger.warning(
            "instance %s straggles (%.1f tokens/s per running group, below %.0f%% of its "
            "peers' median for %.0f s): benched for %.0f s, %d groups requeued",
            inst.name,
            rates.get(inst.name, 0.0),
            100 * self.config.straggler_ratio,
            self.config.straggler_window_s,
            self.config.straggler_cooldown_s,
            n,
        )

    def _requeue_not_held(self, instance: str, session: str, held: list[Any]) -> None:
        """Requeue what this session was issued, does not hold, and had time to receive.

        A group being scored is held by the scheduler itself (its submit is answered only
        after scoring), so it is never taken back here.
        """
        keep = {h for h in held if isinstance(h, str)} | set(self._scoring)
        before = self.store.clock() - self.config.not_held_grace_s
        self.evals.requeue_not_held(instance, session, keep, before)
        lost = self.store.requeue_not_held(instance, session, keep, before)
        if lost:
            logger.warning(
                "instance %s does not hold %d issued groups (Work reply lost?): "
                "prompts %s requeued",
                instance,
                len(lost),
                lost[:8],
            )

    def _wait(self, reason: str, sync_to: int | None = None) -> Work:
        return Work([], wait_s=self.config.wait_s, reason=reason, sync_to=sync_to)

    def _steps_in_training(self) -> int:
        last = self.store.history(last=1)
        return 1 if last and last[0]["done_at"] is None else 0

    def _lag_gate(self, version: int | None) -> Work | int | None:
        """The ``on_lag_exceeded`` gate at GetWork (module docstring): a Work to wait, None to
        go ahead, or (throttle) how many groups at most may be issued now.

        The k-th group issued now (from 0) lands ``(pooled + issued + k) // groups_per_step``
        steps after the next one, so its predicted lag grows with k: a GetWork for many
        groups gets only those predicted within the bound. (Checking the first alone let one
        GetWork issue a whole further step's groups over the bound: measured on the tiny
        model, 23% of generated tokens were then dropped stale, a full step of groups in
        every third step.)"""
        cfg, tv = self.config, self.trainer_version
        forced = self.policy.max_lag  # the sync baseline: throttle at lag 0, whatever the config
        action = cfg.on_lag_exceeded if forced is None else "throttle"
        if forced is not None and tv is None:
            tv = version  # the trainer not heard from yet: it holds the weights being served
        if tv is None or version is None or action == "drop":
            return None
        bound = (
            cfg.max_policy_lag_steps if forced is None else min(forced, cfg.max_policy_lag_steps)
        )
        if action == "sync":
            if tv - version > bound:
                self.store.bump("lag.sync")
                return self._wait(f"sync: weights {version}, trainer {tv}, bound {bound}", tv)
            return None
        counts = self.store.state_counts()
        behind = tv + self._steps_in_training() - version  # the lag of a group landing next
        waiting = counts["pooled"] + counts["issued"]
        # Groups landing within ``bound - behind`` steps after the next are within the bound.
        allowed = (bound - behind + 1) * cfg.groups_per_step - waiting
        if (
            cfg.lag_rule == "partial"
            and cfg.max_token_lag_steps is None
            and self.policy.forecasts_landing
        ):
            # Groups that go on under new weights add no lag to those issued now unless they
            # land ahead of them: when they are forecast to land counts (landing.py). Not
            # under a cap on token age, which would stop the long groups it lets run.
            allowed = self.landing.room(
                self._in_flight(), counts["pooled"], bound - behind + 1, cfg.groups_per_step
            )
        if allowed <= 0:
            predicted = behind + waiting // cfg.groups_per_step
            self.store.bump("lag.throttled")
            return self._wait(f"throttle: predicted lag {predicted} > bound {bound}")
        return allowed

    def _in_flight(self) -> list[InFlight]:
        """The issued groups, with their predictions, progress and instances' rates."""
        out = []
        for g in self.store.groups(PromptState.ISSUED):
            inst = self.instances.get(g.instance or "")
            rate = (
                inst.tokens_per_s / inst.running_groups
                if inst is not None and inst.running_groups > 0
                else 0.0
            )
            done = inst.progress.get(g.group_id, (0, 0))[1] if inst is not None else 0
            out.append(InFlight(self.predicted_tokens(g.prompt_id), done, rate))
        return out

    async def get_work(self, cmd: GetWork) -> Reply:
        inst = self._see(cmd.instance, cmd.session, cmd.weight_version)
        self.expire()
        if self.paused:
            return self._wait("paused")
        # Eval groups first (a share of the slots: deltarl.scheduler.evaluation), training
        # groups in the rest, and eval again in what training leaves; the eval ones pass no
        # pool or lag gate, as nothing trains on them.
        version, share = inst.weight_version, self.evals.share(cmd.max_groups)
        evals = self.evals.work(cmd.instance, cmd.session, version, share)
        reply = self._training_work(cmd, inst, cmd.max_groups - len(evals))
        if not evals:
            return reply
        spare = cmd.max_groups - len(evals) - len(reply.groups)  # what training left unused
        evals += self.evals.work(cmd.instance, cmd.session, version, spare)
        return Work([*evals, *reply.groups], reason=reply.reason, sync_to=reply.sync_to)

    def _training_work(self, cmd: GetWork, inst: Instance, max_groups: int) -> Work:
        cfg = self.config
        now = self.monotonic()
        benched = self.stragglers.benched_for(inst.name, now)
        if benched is not None:
            return self._wait(f"straggler: benched, back in {benched:.0f} s")
        gate = self._lag_gate(inst.weight_version)
        if isinstance(gate, Work):
            return gate
        counts = self.store.state_counts()
        room = cfg.pool_capacity - counts["pooled"] - counts["issued"]
        if room <= 0:
            return self._wait(f"pool full ({cfg.pool_capacity} groups pooled or issued)")
        if gate is not None:
            room = min(room, gate)  # throttle: no more than land within the lag bound
        want = min(room, max(max_groups, 0))
        cursor, size = self.store.cursor, self.dataset_size
        ahead = want + (self.policy.lookahead if want else 0)
        end = cursor + ahead if not size else min(cursor + ahead, size)
        queued = self.store.queued(max(want, ahead))
        predicted = {
            p: t for p in [*queued, *range(cursor, end)] if (t := self.predicted_tokens(p))
        }
        candidates = Candidates(
            queued, range(cursor, end), predicted or None, self.store.prefix_homes(queued)
        )
        if not candidates.queued and not candidates.fresh:
            return self._wait("dataset exhausted" if want else "asked for no groups")
        held: dict[str, int] = dict.fromkeys(self.instances, 0)
        held_tokens: dict[str, float] = dict.fromkeys(self.instances, 0.0)
        for g in self.store.groups(PromptState.ISSUED):
            if g.instance in held:
                held[g.instance] += 1
                # No prediction: one, as the policy counts a candidate without one.
                held_tokens[g.instance] += self.predicted_tokens(g.prompt_id) or 1.0
        loads = [
            InstanceLoad(
                i.name,
                held[i.name],
                i.running_groups,
                i.queue_depth,
                i.tokens_per_s,
                i.weight_version,
                held_tokens[i.name],
            )
            for i in self.instances.values()
            # A benched straggler takes no work: counted as a peer with nothing to do, it would
            # draw the longest prompts in the policy's share-out (and their prefix homes) and
            # leave them unissued until it came back.
            if i.name == cmd.instance or self.stragglers.benched_for(i.name, now) is None
        ]
        chosen = self.policy.choose(WorkRequest(cmd.instance, max_groups, room), loads, candidates)
        if not chosen:
            return self._wait(f"the {self.policy.name} policy gives {cmd.instance} nothing now")
        groups = self.store.issue(
            chosen[:room],
            instance=cmd.instance,
            session=cmd.session,
            weight_version=inst.weight_version,
            lease_s=cfg.lease_s,
            dataset_size=self.dataset_size,
        )
        if self.run_lengths is not None:
            self.run_lengths.dispatched(groups, predicted)
        return Work([self._work_item(g) for g in groups])

    def _work_item(self, g: Group) -> dict[str, Any]:
        s = self.config.sampling_params
        seed = mix64(self.config.seed, g.prompt_id, g.attempt) >> 33
        n = self.config.group_size
        sampling: dict[str, Any] = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens,
            "seed": seed,
        }
        lengths = forced_lengths(self.task, g.prompt_id, seed, n, s.max_tokens)
        if lengths is not None:
            sampling["lengths"] = lengths
        return {
            "group_id": g.group_id,
            "prompt_id": g.prompt_id,
            "prompt": self.task.prompt(g.prompt_id),
            "n": n,
            "sampling": sampling,
        }

    async def submit_group(self, cmd: SubmitGroup) -> Reply:
        self._see(cmd.instance, cmd.session)
        if is_eval_group(cmd.group_id):  # scored and recorded apart, never pooled
            return await self.evals.submit(cmd)
        running = self._scoring.get(cmd.group_id)
        if running is not None:  # the same group again while it is being scored
            self.store.bump("submit.duplicate")
            return await asyncio.shield(running)
        blob = self.store.get_blob(cmd.samples_ref)
        answer = self._answer_without_scoring(cmd, blob)
        if not isinstance(answer, tuple):
            return answer
        # Scoring outlives a cancelled request (the server's timeout): its result is recorded
        # either way, and a retried submit finds it pooled (or its recorded refusal).
        group, samples = answer
        assert blob is not None  # decoded from it
        future = asyncio.ensure_future(
            self._score_and_pool(group, samples, (cmd.samples_ref, blob))
        )
        self._scoring[cmd.group_id] = future
        future.add_done_callback(lambda _: self._scoring.pop(cmd.group_id, None))
        return await asyncio.shield(future)

    def _answer_without_scoring(
        self, cmd: SubmitGroup, blob: bytes | None
    ) -> Reply | tuple[Group, SampleGroup]:
        """The reply to a submit that is not scored (unknown, duplicate, stale, bad samples),
        or the issued group to score and its decoded samples."""
        n = 0 if blob is None else sample_count(blob)
        ids = parse_group_id(cmd.group_id)
        group = None if ids is None else self.store.group(ids[0])
        if ids is None or group is None or ids[1] > group.attempt:
            self._count_drop("unknown_group", n)
            return Error("unknown_group", f"no group {cmd.group_id!r} was issued")
        prompt_id, attempt = ids
        if group.attempt == attempt and group.state in (
            PromptState.POOLED,
            PromptState.SHIPPED,
            PromptState.TRAINED,
        ):
            self.store.bump("submit.duplicate")
            return Ok(f"duplicate: group {cmd.group_id} is {group.state} already")
        stale = (
            f"group {cmd.group_id} is not held by {cmd.instance}/{cmd.session} any more "
            f"(prompt {prompt_id}: {group.state}, attempt {group.attempt}); not accepted"
        )
        if group.attempt != attempt:
            # A past attempt: dropped (a retry after a lost reply gets the recorded answer,
            # counted once), or requeued before this submit came (counted now, once).
            return self._refuse_stale(group, attempt, n, stale)
        holder = (group.instance, group.session)
        if group.state != PromptState.ISSUED or holder != (cmd.instance, cmd.session):
            # The live attempt, held by someone else: not recorded, the holder may submit.
            self._count_drop("stale_submit", n)
            return Error("stale_group", stale)
        try:
            samples = self._decode(cmd, prompt_id, blob)
        except SampleError as e:
            problem = f"group {cmd.group_id}: {e}"
            return self._drop_failed(group, "bad_samples", n, problem, blob=cmd.samples_ref)
        return group, samples

    def _decode(self, cmd: SubmitGroup, prompt_id: int, blob: bytes | None) -> SampleGroup:
        """The submitted samples, decoded once (``decode_group`` validates every value);
        SampleError if there are none, they do not decode, or are not this group's."""
        if blob is None:
            raise SampleError(
                f"no samples blob {cmd.samples_ref[:64]!r} (put it on the scheduler's samples "
                f"endpoint {self.config.samples_endpoint} first; unreferenced blobs are kept "
                f"{self.config.samples_grace_s:g} s)"
            )
        samples = decode_group(blob, max_bytes=self.config.max_sample_bytes)
        if (samples.group_id, samples.prompt_id) != (cmd.group_id, prompt_id):
            raise SampleError(
                f"the blob holds the samples of group {samples.group_id!r} "
                f"(prompt {samples.prompt_id})"
            )
        if len(samples.samples) != self.config.group_size:
            raise SampleError(
                f"expected {self.config.group_size} samples, got {len(samples.samples)}"
            )
        return samples

    def _refuse_stale(self, group: Group, attempt: int, n: int, message: str) -> Error:
        """Refuse a submission of a past attempt: the recorded answer if it was refused (or
        dropped) before, else stale, counted and recorded, so retries count nothing."""
        (code, text), first = self.store.refuse_stale(
            group.prompt_id, attempt, n, "stale_group", message
        )
        if not first:
            self.store.bump("submit.duplicate")
        return Error(code, text)

    def _drop_failed(
        self, group: Group, reason: str, n: int, problem: str, blob: str | None = None
    ) -> Reply:
        """Drop a submitted group that failed (``bad_samples``, ``reward_*``): counted, its
        prompt queued again or, at ``max_reward_failures``, abandoned, its ``blob`` removed;
        the Error is recorded as the answer to any retry of this submission."""
        abandon = self.config.max_reward_failures
        fate = "abandoned" if abandon and group.reward_failures + 1 >= abandon else "queued again"
        message = f"dropped: {reason}: {problem}; prompt {group.prompt_id} {fate}"
        state = self.store.drop(
            group.prompt_id,
            group.attempt,
            reason,
            n,
            failure=True,
            max_failures=abandon,
            refusal=(reason, message),
            blob=blob,
        )
        if state is None:  # requeued meanwhile (while it was being scored)
            stale = f"group {group.group_id} was requeued while it was scored; not accepted"
            return self._refuse_stale(group, group.attempt, n, stale)
        return Error(reason, message)

    def _count_drop(self, reason: str, samples: int) -> None:
        self.store.bump(f"dropped_groups.{reason}")
        self.store.bump(f"dropped_samples.{reason}", samples)

    async def _score_and_pool(
        self, group: Group, samples: SampleGroup, blob: tuple[str, bytes]
    ) -> Reply:
        prompt = self.task.prompt(group.prompt_id)
        n = len(samples.samples)
        started = self.monotonic()
        try:
            rewards = await self.scorer.score_group(prompt, [s.text for s in samples.samples])
        except RewardFailedError as e:
            self.metrics.reward_failed()
            return self._drop_failed(group, e.reason, n, str(e), blob=blob[0])
        except RewardUnavailableError as e:  # an outage: nothing dropped, nothing counted
            self.metrics.reward_failed()  # against the group, but an operator sees it
            return Error(REWARD_UNAVAILABLE, str(e))  # against the group (reward_client.py)
        scored_s = self.monotonic() - started
        self.reward_window.observe(scored_s)
        self.metrics.reward_scored(scored_s)
        oldest = samples.oldest_version()
        if oldest is None:
            oldest = group.weight_version
        if oldest is None:
            oldest = self.trainer_version
        tokens = sum(len(s.token_ids) for s in samples.samples)
        lengths = self._length_note(group, prompt, samples)
        versions = token_lag.versions_of(samples.samples)
        if not self.store.pool(
            group.prompt_id, group.attempt, blob, rewards, oldest, tokens, lengths, versions
        ):
            # Requeued while it was being scored (its lease ran out): the new attempt will be
            # pooled instead, so these samples are counted as dropped, not pooled twice.
            stale = f"group {group.group_id} was requeued while it was scored; not accepted"
            return self._refuse_stale(group, group.attempt, n, stale)
        if self.run_lengths is not None:
            self.run_lengths.learn(lengths)  # as the store now holds it
        self._pooled_at.append((self.monotonic(), n))
        return Ok("pooled")

    def _length_note(self, group: Group, prompt: str, samples: SampleGroup) -> LengthNote:
        """The group's lengths for the history, with what was predicted for it; the plan's
        correction learns from them (after the prediction is noted: it is what was used)."""
        outputs = tuple(len(s.token_ids) for s in samples.samples)
        first = samples.samples[0] if samples.samples else None
        note = LengthNote(
            task=self.task.name,
            prompt_key=prompt_key(prompt),
            prompt_text=prompt,
            prompt_tokens=len(first.prompt_token_ids) if first is not None else 0,
            outputs=outputs,
            instance=group.instance,
        )
        if self.run_lengths is not None:  # no plan: what the run's own history predicted
            predicted = self.run_lengths.take_dispatched(group.group_id)
            return note if predicted is None else dataclasses.replace(note, predicted=predicted)
        view = self.plan
        if view is None or not view.covers(group.prompt_id) or not outputs:
            return note
        bucket, planned = view.bucket(group.prompt_id), view.planned(group.prompt_id)
        note = dataclasses.replace(
            note, predicted=view.predicted(group.prompt_id), planned=planned, bucket=bucket
        )
        view.observe(bucket, planned, sum(outputs) / len(outputs))
        return note

    # -- trainer --------------------------------------------------------------------------

    async def take_batch(self, cmd: TakeBatch) -> Reply:
        cfg = self.config
        if cmd.groups != cfg.groups_per_step:
            return Error(
                "bad_request",
                f"the trainer asks for {cmd.groups} groups a step, the scheduler is configured "
                f"for groups_per_step = {cfg.groups_per_step}",
            )
        if self.trainer_version is None or cmd.trainer_version > self.trainer_version:
            self.trainer_version = cmd.trainer_version
        self.metrics.trainer_version(self.trainer_version)
        result = self.store.ship(
            cmd.step,
            cmd.groups,
            cmd.trainer_version,
            cfg.max_policy_lag_steps,
            reward=self.reward_window.figures(),
            throughput={i.name: i.tokens_per_s for i in self.instances.values()},
            lag_rule=cfg.lag_rule,
            max_token_lag=cfg.max_token_lag_steps,
            busy={i.name: i.busy_s for i in self.instances.values()},
        )
        if result.groups and not result.replayed:  # recorded with this new step
            self.reward_window.reset()
            self.landing.shipped(self.monotonic())
            recorded = self.store.history(last=1)
            if recorded:
                self.metrics.step_shipped(recorded[-1])
        if result.pruned:
            return Error(
                "checkpointed",
                f"step {cmd.step} is in a checkpoint already and its records were pruned "
                f"(keep_steps = {cfg.keep_steps}); its samples are not kept",
            )
        if result.dropped_for_lag:
            logger.info(
                "step %d: %d pooled groups over the lag bound dropped",
                cmd.step,
                len(result.dropped_for_lag),
            )
        if not result.groups:
            counts = self.store.state_counts()
            return Batch(
                cmd.step,
                [],
                wait_s=cfg.wait_s,
                reason=f"{counts['pooled']} of {cmd.groups} groups pooled",
            )
        if any(g.state == PromptState.TRAINED for g in result.groups):
            return Error(
                "checkpointed",
                f"step {cmd.step} is in a checkpoint already; its samples are not kept",
            )
        return Batch(
            cmd.step,
            [self._batch_item(g) for g in result.groups],
            temperature=cfg.sampling_params.temperature,
        )

    def _batch_item(self, g: Group) -> dict[str, Any]:
        return {
            "group_id": g.group_id,
            "prompt_id": g.prompt_id,
            "prompt": self.task.prompt(g.prompt_id),
            "samples_ref": g.samples_ref,
            "rewards": g.rewards or [],
            "lag": g.lag,
        }

    async def step_done(self, cmd: StepDone) -> Reply:
        if not self.store.step_done(cmd.step, cmd.version, dict(cmd.metrics)):
            return Error("unknown_step", f"step {cmd.step} was never shipped")
        if self.trainer_version is None or cmd.version > self.trainer_version:
            self.trainer_version = cmd.version
        self.metrics.step_trained(self.trainer_version, cmd.metrics)
        self.evals.step_done(cmd.step, cmd.version)
        return Ok()

    async def checkpointed(self, cmd: Checkpointed) -> Reply:
        n = self.store.checkpoint(cmd.step)
        return Ok(f"{n} groups trained for good")

    async def history(self, cmd: GetHistory) -> Reply:
        steps = self.evals.annotate(self.store.history(cmd.last))
        return History(
            self.store.run_config(), steps, self.counters(), evals=self.store.eval_rounds()
        )

    # -- status ---------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        return {**self.store.counters(), "reward.stuck": self.scorer.stuck}

    def throughput(self) -> float:
        """Samples pooled per second over the last minute."""
        now = self.monotonic()
        while self._pooled_at and now - self._pooled_at[0][0] > THROUGHPUT_WINDOW_S:
            self._pooled_at.popleft()
        return sum(n for _, n in self._pooled_at) / THROUGHPUT_WINDOW_S

    def status_fields(self) -> dict[str, Any]:
        counts = self.store.state_counts()
        now = self.monotonic()
        return {
            "cursor": self.store.cursor,
            "dataset_size": self.dataset_size,
            "policy": self.policy.name,
            "plan": None
            if self.plan is None
            else {
                "path": str(self.config.plan),
                "identity": identity(self.plan.plan),
                "corrections": [round(f, 4) for f in self.plan.factors],
                "observed": list(self.plan.observed),
            },
            "pool": {
                "pooled": counts["pooled"],
                "issued": counts["issued"],
                "capacity": self.config.pool_capacity,
            },
            "queue_depth": counts["queued"],
            "groups": counts,
            "trainer_version": self.trainer_version,
            "checkpointed_step": self.store.meta("checkpointed"),
            "on_lag_exceeded": self.config.on_lag_exceeded,
            "max_policy_lag_steps": self.config.max_policy_lag_steps,
            "throughput_samples_per_s": round(self.throughput(), 3),
            "samples": {"endpoint": self.config.samples_endpoint, **self.store.blob_stats()},
            "instances": {
                i.name: {
                    "session": i.session,
                    "last_heartbeat_s_ago": round(now - i.last_seen, 3),
                    "last_heartbeat": i.last_seen_wall,
                    "weight_version": i.weight_version,
                    "running_groups": i.running_groups,
                    "queue_depth": i.queue_depth,
                    "tokens_per_s": i.tokens_per_s,
                    "benched_s": self.stragglers.benched_for(i.name, now),
                }
                for i in self.instances.values()
            },
            "counters": self.counters(),
            "reward": {**self.scorer.status(), **self.reward_window.figures()},
            "eval": self.evals.status(),
            "paused": self.paused,
        }

    async def close(self) -> None:
        """Let running scorings finish recording (bounded by their own timeouts)."""
        pending = list(self._scoring.values())
        if pending:
            with contextlib.suppress(Exception):
                await asyncio.wait(pending, timeout=self.config.reward_timeout_s)
        await self.scorer.close()
        await self.evals.close()
