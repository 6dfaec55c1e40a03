"""The scheduler's Prometheus figures (deltarl/ops/metrics.py), from what it records anyway.

A step's figures are exported from the row the store just wrote (``SchedulerStore.history``),
so Prometheus and ``deltarl ctl scheduler history`` can never disagree: the tokens trained and
wasted, samples, reward, lag and the bubbles (the step's skewness from the instances' busy
seconds recorded with it: ``step_busy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deltarl.ops import metrics


class SchedulerMetrics:
    def __init__(self, lag_bound: int) -> None:
        metrics.POLICY_LAG_BOUND.set(lag_bound)

    @staticmethod
    def instance_seen(name: str, version: int | None, healthy: bool) -> None:
        if version is not None:
            metrics.INSTANCE_VERSION.labels(name).set(version)
        metrics.INSTANCE_HEALTHY.labels(name).set(1 if healthy else 0)

    @staticmethod
    def instance_removed(name: str) -> None:
        """Silent past its heartbeats, or benched as a straggler."""
        metrics.INSTANCE_HEALTHY.labels(name).set(0)
        metrics.INSTANCES_REMOVED.inc()

    @staticmethod
    def reward_scored(seconds: float) -> None:
        metrics.REWARD_SECONDS.observe(seconds)

    @staticmethod
    def reward_failed() -> None:
        metrics.REWARD_ERRORS.inc()

    @staticmethod
    def trainer_version(version: int | None) -> None:
        if version is not None:
            metrics.TRAINER_VERSION.set(version)

    @staticmethod
    def step_shipped(row: Mapping[str, Any]) -> None:
        """A new step was recorded as ``row``."""
        metrics.STEPS_FINALISED.inc()
        metrics.SAMPLES.inc(int(row.get("samples") or 0))
        metrics.TOKENS.labels("trained").inc(int(row.get("trained_tokens") or 0))
        metrics.TOKENS.labels("wasted").inc(int(row.get("wasted_tokens") or 0))
        for gauge, key in (
            (metrics.REWARD_MEAN, "reward_mean"),
            (metrics.POLICY_LAG, "lag_max"),
            (metrics.SORTING_WAIT, "sorting_wait"),
            (metrics.LENGTH_ERROR, "length_error"),
            (metrics.TOKEN_LAG, "token_lag_mean"),
            (metrics.OVER_BOUND_TOKENS, "over_bound_token_ratio"),
            (metrics.SKEWNESS, "skewness"),
        ):
            value = row.get(key)
            if value is not None:
                gauge.set(float(value))

    @staticmethod
    def step_trained(version: int, figures: Mapping[str, Any]) -> None:
        """The trainer reported a step done: its padding (the trainer's micro-batches)."""
        metrics.TRAINER_VERSION.set(version)
        padding = figures.get("padding_ratio")
        if isinstance(padding, int | float):
            metrics.PADDING_RATIO.set(float(padding))
