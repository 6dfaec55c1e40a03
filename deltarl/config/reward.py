"""The reward service's tables: ``[daemons.reward]`` (the daemon, with its ``judge``) and
``[daemons.scheduler.reward]`` (the scheduler's client of it: timeout, retries, concurrency,
rate limit, circuit breaker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltarl.config.base import DaemonTable
from deltarl.config.checks import at_least, endpoints, non_negative, positive, within


@dataclass(frozen=True)
class JudgeConfig:
    """``[daemons.reward.judge]``: a vLLM engine serving a frozen copy of the policy grades
    each answer with a rubric prompt (self-feedback), for tasks without a rule checker."""

    model_dir: Path | None = None
    """A Hugging Face model directory (a frozen copy of the policy); None: the embedded tiny
    model (``deltarl.rl.tiny_model``), whose grades are noise: for tests and demos."""
    rubric: str = ""
    """The grading prompt, with ``{prompt}`` and ``{answer}``; empty: ``judge.DEFAULT_RUBRIC``.
    Rendered with the tokenizer's chat template when it has one; the reply must hold
    ``Score: N`` with N in [0, ``max_score``]."""
    max_score: int = 10
    """N / max_score is the reward, in [0, 1]."""
    max_tokens: int = 16
    """The longest reply the judge may give (greedy decoding)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Knobs of ``VllmEngineConfig`` (dtype, max_model_len, kv_cache_bytes, engine_args...)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "max_score", "max_tokens")
        if self.rubric and not ("{prompt}" in self.rubric and "{answer}" in self.rubric):
            raise ValueError("judge.rubric must name {prompt} and {answer}")


@dataclass(frozen=True)
class RewardConfig(DaemonTable):
    """``[daemons.reward]``: the reward daemon (``deltarl reward``)."""

    control: str
    """Its control endpoint: the scheduler's ``[daemons.scheduler.reward] endpoint``."""
    task: str = "default"
    """The task whose rule checker the ``rule`` scorer runs (``deltarl.rl.task.tasks()``);
    a ``ScoreGroup`` naming another task is refused (``wrong_task``)."""
    seed: int = 0
    scorer: str = "rule"
    """The plugin by name (``deltarl.reward.scorer.SCORERS``): ``rule``, the task's own
    checker; ``judge``, a model grades the answers."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    max_concurrency: int = 8
    """Groups scored at once; more wait (within their request's timeout)."""
    score_timeout_s: float = 30.0
    """A rule checker's call running longer is abandoned and the group answered
    ``reward_timeout`` (its thread is left behind: see ``deltarl.scheduler.reward``)."""
    rule_workers: int = 8
    """Rule-checker calls at once, over all groups."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "max_concurrency", "score_timeout_s", "rule_workers")


@dataclass(frozen=True)
class RewardClientConfig:
    """``[daemons.scheduler.reward]``: where the scheduler's rewards come from when set (else
    in-process, with ``reward_timeout_s``, ``reward_retries`` and ``reward_workers``)."""

    endpoint: str
    """The reward daemon's control endpoint."""
    timeout_s: float = 10.0
    """One call (a whole group) waits this long for its reply."""
    retries: int = 2
    """Calls tried again after a failure (timeout, error, bad reply)."""
    backoff_s: float = 0.2
    """The wait before the first retry; doubled at each further one, up to ``backoff_max_s``."""
    backoff_max_s: float = 2.0
    max_concurrency: int = 8
    """Calls in flight at once; more wait for a slot."""
    rate_per_s: float = 0.0
    """Calls started per second at most (a token bucket); 0: no limit."""
    burst: int = 1
    """Calls the bucket lets through at once after a quiet spell."""
    breaker_failures: int = 3
    """Consecutive failed calls that open the circuit breaker: submits are then answered
    ``reward_unavailable`` at once (the group stays issued, its rollout daemon submits it
    again), counted ``reward.circuit_open``."""
    breaker_cooldown_s: float = 5.0
    """How long the breaker stays open before one probe call may go (half-open); its success
    closes it, its failure opens it again."""

    def __post_init__(self) -> None:
        endpoints(self, "endpoint")
        positive(self, "timeout_s", "max_concurrency", "breaker_cooldown_s")
        non_negative(self, "retries", "backoff_s", "backoff_max_s", "rate_per_s")
        at_least(self, 1, "burst", "breaker_failures")
        within(self, "backoff_s", 0.0, self.backoff_max_s)
