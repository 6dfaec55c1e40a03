"""The ``rule`` plugin: the task's own checker (``Task.reward``), as the scheduler ran it in
process, now behind the reward daemon. Each call runs in a thread of its own with a timeout
(``deltarl.scheduler.reward.RewardScorer``, without retries: the scheduler's client retries
whole groups, and a retry in both places would multiply)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deltarl.reward.scorer import Counter, ScoreError
from deltarl.rl.task import Task
from deltarl.scheduler.reward import RewardFailedError, RewardScorer


class RuleScorer:
    name = "rule"

    def __init__(self, task: Task, timeout_s: float, workers: int, count: Counter) -> None:
        self.task = task
        self.scorer = RewardScorer(
            task.reward, timeout_s=timeout_s, retries=0, workers=workers, count=count
        )

    async def start(self) -> None:
        """Nothing to load: the checker is code."""

    async def score_group(self, prompt: str, texts: Sequence[str]) -> list[float]:
        try:
            return await self.scorer.score_group(prompt, texts)
        except RewardFailedError as e:
            raise ScoreError(e.reason, str(e)) from None

    async def close(self) -> None:
        """Abandoned threads (``stuck``) end with the process: they are daemon threads."""

    def status(self) -> dict[str, Any]:
        return {"task": self.task.name, "stuck_calls": self.scorer.stuck}
