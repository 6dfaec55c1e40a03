"""The scheduler's ``[daemons.scheduler]`` table (loaded by ``deltarl.daemons.config.load``).

Example::

    [daemons.scheduler]
    control = "ipc:///run/deltarl/scheduler.sock"
    db = "/var/lib/deltarl/scheduler.sqlite"
    group_size = 8
    groups_per_step = 16
    max_policy_lag_steps = 2
    on_lag_exceeded = "throttle"

    [daemons.scheduler.sampling]
    max_tokens = 16     # temperature and top_p may only be 1.0 (see Sampling)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deltarl.transport.blobs import DEFAULT_MAX_FRAME_BYTES, samples_endpoint
from deltarl.transport.control import check_endpoint

LagAction = Literal["throttle", "drop", "sync"]


@dataclass(frozen=True)
class Sampling:
    """What every group is generated with (``Work.groups[i]["sampling"]``, plus a seed).

    ``temperature`` and ``top_p`` must be 1.0: anything else is refused (a configuration
    error, so the daemon exits 78). The GRPO importance ratio divides the trainer's
    log-probability of each token by the engine's, and the two must be of the same
    distribution. The trainer computes the plain ``log_softmax`` of the logits
    (``deltarl.trainer.grpo``), while vLLM records "processed" log-probabilities, after
    temperature scaling and top-p truncation; with any other value the ratio would be off
    by a per-token factor nobody sees, and training would silently go wrong.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16

    def __post_init__(self) -> None:
        for key in ("temperature", "top_p"):
            value = getattr(self, key)
            if value != 1.0:
                raise ValueError(
                    f"sampling: {key} must be 1.0, got {value}: the trainer computes plain "
                    "log_softmax(logits) while the engine records log-probabilities after "
                    "temperature and top-p, so any other value silently breaks the GRPO "
                    "importance ratio"
                )
        if self.max_tokens < 1:
            raise ValueError(f"sampling: max_tokens >= 1 is required, got {self.max_tokens}")

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> Sampling:
        """A ``[daemons.scheduler.sampling]`` table; ValueError naming a bad key or value."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - names)
        if unknown:
            raise ValueError(f"sampling: unknown key(s) {unknown}; known: {sorted(names)}")
        values: dict[str, Any] = {}
        for key, value in table.items():
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if key == "max_tokens":
                ok = ok and isinstance(value, int)
            if not ok:
                raise ValueError(f"sampling: {key} must be a number, got {value!r}")
            values[key] = value if key == "max_tokens" else float(value)
        return cls(**values)


@dataclass(frozen=True)
class SchedulerConfig:
    control: str
    """The scheduler's control endpoint: rollout daemons, the trainer and ``ctl`` talk to it."""
    db: Path
    """The sqlite store (deltarl.scheduler.store): cursor, groups, counters, run metadata."""
    samples: str | None = None
    """The samples endpoint (deltarl.transport.blobs), where rollout daemons put and the
    trainer gets encoded groups; None: derived from ``control`` (``samples_endpoint``)."""
    samples_grace_s: float = 600.0
    """A blob put on the samples endpoint that no submit has referred to for this long is
    removed (its submit never came, or was refused)."""
    max_sample_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """The largest encoded group the samples endpoint takes; bigger is refused (too_large)."""
    task: str = "default"
    """The task by name (deltarl.rl.task.TASKS): prompts and reward."""
    policy: str = "fifo"
    """The dispatch policy by name (deltarl.scheduler.policy.POLICIES)."""
    group_size: int = 8
    """Samples per prompt (GRPO's group)."""
    groups_per_step: int = 8
    """Groups per optimizer step; a TakeBatch asking for another number is refused."""
    pool_capacity: int = 64
    """Groups the pool holds, counting the ones issued and not yet submitted (their slots are
    reserved at issue, so a submission never finds the pool full)."""
    max_policy_lag_steps: int = 2
    """A hard bound: no batch holds a group whose oldest token is more versions behind the
    trainer than this, measured when the batch is shipped."""
    on_lag_exceeded: LagAction = "throttle"
    """What keeps the lag in bound besides dropping stale groups at ship time (service docs)."""
    heartbeat_timeout_s: float = 15.0
    """An instance silent this long is removed and its groups are queued again."""
    not_held_grace_s: float = 5.0
    """A heartbeat that reports what its instance holds (``Heartbeat.reports_held``) requeues
    the groups issued to that instance and session that it does not hold, if they were issued
    more than this long ago (younger ones: their Work reply may still be on its way)."""
    lease_s: float = 300.0
    """An issued group not submitted this long after its issue is queued again (heartbeats
    do not renew it: see the service's docstring). Durable across scheduler restarts."""
    reward_timeout_s: float = 10.0
    reward_retries: int = 2
    reward_workers: int = 8
    max_reward_failures: int = 3
    """A prompt whose group failed this often is abandoned (counted ``abandoned_prompts``);
    0: never. A failure: its reward could not be had (``reward_*``), or its samples were
    malformed (``bad_samples``), so a prompt that can never be trained cannot stall the run."""
    sampling: Sampling | Mapping[str, Any] = field(default_factory=Sampling)
    """``[daemons.scheduler.sampling]``: temperature, top_p (both 1.0 only), max_tokens."""
    dataset_size: int = 0
    """Prompts in the dataset; 0: infinite."""
    seed: int = 0
    """The dataset's and the sampling seeds' root."""
    tick_s: float = 0.5
    """How often heartbeats and leases are checked."""
    wait_s: float = 0.2
    """The back-off suggested in an empty Work or Batch."""

    def __post_init__(self) -> None:
        # The shared loader hands a nested table over as it is (a union of two non-None types
        # is left to the class); it becomes a Sampling here, so a bad key names ``sampling``.
        if not isinstance(self.sampling, Sampling):
            if not isinstance(self.sampling, Mapping):
                raise TypeError(f"sampling must be a table, got {self.sampling!r}")
            object.__setattr__(self, "sampling", Sampling.from_table(self.sampling))
        positive = ("group_size", "groups_per_step", "pool_capacity", "reward_workers")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")
        samples_endpoint(self.control) if self.samples is None else check_endpoint(self.samples)
        if self.max_sample_bytes < 1:
            raise ValueError(f"max_sample_bytes must be positive, got {self.max_sample_bytes}")
        for key in (
            "heartbeat_timeout_s",
            "lease_s",
            "reward_timeout_s",
            "tick_s",
            "wait_s",
            "samples_grace_s",
        ):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")
        for key in ("max_policy_lag_steps", "reward_retries", "max_reward_failures",
                    "dataset_size", "not_held_grace_s"):  # fmt: skip
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must not be negative, got {getattr(self, key)}")
        if self.pool_capacity < self.groups_per_step:
            raise ValueError(
                f"pool_capacity ({self.pool_capacity}) must hold at least groups_per_step "
                f"({self.groups_per_step}), or no step could ever be filled"
            )

    @property
    def samples_endpoint(self) -> str:
        """Where the samples socket is bound: ``samples``, or the one derived from ``control``."""
        return samples_endpoint(self.control) if self.samples is None else self.samples

    @property
    def sampling_params(self) -> Sampling:
        assert isinstance(self.sampling, Sampling)  # __post_init__ made it one
        return self.sampling

    def as_record(self) -> dict[str, Any]:
        """The configuration as plain JSON values (the run metadata)."""
        record = dataclasses.asdict(self)
        record["db"] = str(self.db)
        record["sampling"] = dataclasses.asdict(self.sampling_params)
        return record
