"""The RL loop's control messages: rollout daemons and the trainer talk to the scheduler.

The scheduler is the only server here; rollout daemons and the trainer are its clients, over
the same ZeroMQ control sockets and tagged orjson messages as every other command
(``deltarl.transport.messages``). Samples do not travel inside these messages: a group of 16
completions of 8k tokens is megabytes, over ``MAX_MESSAGE_BYTES``. They take the scheduler's
samples socket (``deltarl.transport.blobs``, the ``samples`` endpoint) as one encoded group
(``deltarl.rl.samples``), and the messages name the blob by its digest (``samples_ref``).

A group's life in the scheduler (kept in its sqlite store, so a crash of any daemon loses
nothing and trains nothing twice):

    prompt cursor --GetWork--> ISSUED to an instance (a lease from issue; heartbeats: alive)
        | lease ran out, instance missed its heartbeats, its session changed, or its heartbeat
        | reports it does not hold the group (Heartbeat.held) -> back to the queue
        v SubmitGroup (idempotent by group_id)
    reward scoring (timeout, retries) -> POOLED (capacity bound; full: GetWork waits)
        | TakeBatch(step): lag = trainer_version - oldest token version, checked here
        |   over the bound: throttle | drop | sync (each counted; a dropped group's prompt
        |   is queued again, so no prompt is skipped)
        v
    SHIPPED to step s (the same step asked again gets the same groups: exact replay)
        | Checkpointed(step >= s)
        v
    TRAINED (final)

Samples (``deltarl.rl.samples.Sample``, a blob of one ``Group`` named by
``SubmitGroup.samples_ref`` and ``Batch.groups[i]["samples_ref"]``) carry:
``prompt_token_ids`` (int32), ``token_ids`` (int32, the completion), ``logprobs`` (float32, the
engine's log-probability of each sampled token: finite, <= 0), ``token_versions`` (int32, the
weight version that produced each token: >= 0), one of each per token, ``text: str`` and
``finish_reason: str``. Their rewards travel beside the reference: ``Batch.groups[i]["rewards"]``,
one float per sample, in the blob's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from deltarl.transport.messages import REPLIES as BASE_REPLIES
from deltarl.transport.messages import Command, Reply, decode_table

# -- rollout daemon -> scheduler --------------------------------------------------------------


@dataclass(frozen=True)
class Heartbeat(Command):
    """A rollout instance is alive; its health figures. Answered ``Ok``, or ``Beat`` when some
    of the groups it holds can no longer ship (see ``progress``).

    ``session`` is new at every start of the instance: a new session means the old one's
    in-flight groups are lost and are queued again.

    ``held`` and ``reports_held``: with ``reports_held=True``, ``held`` is the complete list of
    the group ids (``Work.groups[i]["group_id"]``) this instance and session hold now: every
    group received in a ``Work`` reply whose ``SubmitGroup`` has not been answered yet (keep a
    group listed while its submit is in flight or being retried). The scheduler then requeues
    every group it issued to this instance and session that is not listed and was issued more
    than ``not_held_grace_s`` ago (a Work reply still on its way is not raced), counted
    ``requeued.not_held``: a Work reply the instance never got frees its pool slots within a
    heartbeat instead of a lease. A later submit of such a group is refused as stale. An
    instance that does not set ``reports_held`` (the default, and every older client) keeps the
    old behaviour: ``held`` is ignored and only leases and missed heartbeats requeue.
    """

    TAG: ClassVar[str] = "rl.heartbeat"
    instance: str
    session: str
    weight_version: int | None = None
    running_groups: int = 0
    queue_depth: int = 0
    tokens_per_s: float = 0.0
    held: list[Any] = field(default_factory=list)
    """Group ids this instance and session are generating or submitting (see above)."""
    reports_held: bool = False
    """``held`` is complete: groups issued to this session and missing from it are requeued."""
    progress: dict[str, Any] = field(default_factory=dict)
    """Group id -> ``[oldest token version, tokens so far]`` of held groups that have tokens.
    A group whose oldest token is already more than ``max_policy_lag_steps`` behind the
    trainer can only get staler: it would be dropped when shipped. The scheduler requeues it
    now (``requeued.doomed``; its tokens are counted wasted) and names it in ``Beat.abort``,
    so the instance stops generating it instead of finishing work that cannot be trained."""
    busy_s: float = 0.0
    """Seconds the instance's engine has spent in engine steps since it started: the
    scheduler's per-step skewness (busiest instance's busy time over the mean)."""


@dataclass(frozen=True)
class GetWork(Command):
    """Ask for up to ``max_groups`` prompt groups to generate. Answered ``Work``."""

    TAG: ClassVar[str] = "rl.get_work"
    instance: str
    session: str
    max_groups: int = 1
    weight_version: int | None = None


@dataclass(frozen=True)
class SubmitGroup(Command):
    """The completions of one issued group, put first on the scheduler's samples endpoint:
    ``samples_ref`` is the digest it answered. Answered ``Ok`` (pooled; also for a duplicate)
    or ``Error`` (not accepted: ``stale_group``, the lease was lost and the group requeued;
    ``bad_samples``, the blob is missing, does not decode, or is not this group's
    ``group_size`` samples; ``reward_timeout`` or ``reward_error``, it could not be scored; or
    ``unknown_group``). A retried submit of a refused attempt gets the same Error again and
    is counted once."""

    TAG: ClassVar[str] = "rl.submit_group"
    instance: str
    session: str
    group_id: str
    samples_ref: str
    """The xxh3-128 hex digest of the encoded group (``deltarl.transport.blobs.blob_digest``)."""


# -- trainer -> scheduler ---------------------------------------------------------------------


@dataclass(frozen=True)
class TakeBatch(Command):
    """The groups for optimizer step ``step``. Answered ``Batch`` (maybe empty: wait)."""

    TAG: ClassVar[str] = "rl.take_batch"
    step: int
    groups: int
    trainer_version: int


@dataclass(frozen=True)
class StepDone(Command):
    """Step ``step`` is trained and published as ``version``; ``metrics`` (loss, timings)
    go to the run metadata. Answered ``Ok``."""

    TAG: ClassVar[str] = "rl.step_done"
    step: int
    version: int
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpointed(Command):
    """A checkpoint holding every step up to ``step`` is durable: those groups are trained
    for good. Answered ``Ok``."""

    TAG: ClassVar[str] = "rl.checkpointed"
    step: int


@dataclass(frozen=True)
class GetHistory(Command):
    """The run metadata: configuration and per-step records. Answered ``History``."""

    TAG: ClassVar[str] = "rl.history"
    last: int = 0
    """Only the last ``last`` steps; 0: all."""


# -- replies ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work(Reply):
    """Groups to generate. Each: ``group_id``, ``prompt_id``, ``prompt`` (text), ``n``
    (samples), ``sampling`` (temperature, top_p, max_tokens, seed, and optionally ``lengths``:
    n ints in [1, max_tokens], the exact completion length of each sample, for a task that
    fixes them, ``deltarl.rl.task.ShapedLengths``), and ``eval``: true for a held-out
    evaluation group (``deltarl.scheduler.evaluation``: one sample, decoded greedily, submitted
    like any group and never trained on; its ``prompt_id`` is the index in the eval split, its
    id ``e<step>.<index>.<attempt>``). Empty ``groups`` with ``wait_s``: nothing now (pool
    full, throttled, or dataset exhausted: ``reason`` says). ``sync_to``: generate nothing
    until the engine holds this weight version or newer."""

    TAG: ClassVar[str] = "rl.work"
    groups: list[Any]
    wait_s: float = 0.0
    reason: str = ""
    sync_to: int | None = None


@dataclass(frozen=True)
class Beat(Reply):
    """A heartbeat's answer when there is something to do: ``abort``, the held groups that can
    no longer ship (``Heartbeat.progress``), already requeued; stop generating them. A submit
    of one that raced the abort is refused as stale."""

    TAG: ClassVar[str] = "rl.beat"
    abort: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Batch(Reply):
    """The groups of step ``step`` (each: ``group_id``, ``prompt_id``, ``prompt``,
    ``samples_ref``: the digest of its samples on the scheduler's samples endpoint,
    ``rewards``: one per sample, and ``lag``). Empty with ``wait_s``: not enough pooled groups
    yet. ``temperature``: what the groups were sampled at (the scheduler's sampling table);
    the trainer's log-probabilities must be of that distribution for the importance ratio."""

    TAG: ClassVar[str] = "rl.batch"
    step: int
    groups: list[Any]
    wait_s: float = 0.0
    reason: str = ""
    temperature: float = 1.0


@dataclass(frozen=True)
class History(Reply):
    """The run metadata. Each of ``steps`` (oldest first) carries the step's batch figures and,
    from held-out evaluation, ``eval_accuracy``, ``eval_reward_mean``, ``eval_samples``,
    ``eval_version_min``, ``eval_version_max``, ``eval_partial`` (None and 0 where no round of
    that step finished). ``evals``: every eval round, the step-0 baseline included (step,
    target_version, size, samples, failed, accuracy, reward_mean, version_min, version_max,
    finished, partial, started_at, finished_at)."""

    TAG: ClassVar[str] = "rl.history"
    config: dict[str, Any]
    steps: list[Any]
    counters: dict[str, Any] = field(default_factory=dict)
    evals: list[Any] = field(default_factory=list)


RL_COMMANDS = decode_table(
    Heartbeat, GetWork, SubmitGroup, TakeBatch, StepDone, Checkpointed, GetHistory
)
REPLIES = {**BASE_REPLIES, **decode_table(Work, Batch, History, Beat)}
"""What a client of the scheduler decodes: ``ControlClient(endpoint, replies=REPLIES)``."""
