"""Which scorer the scheduler uses: the reward daemon when ``[daemons.scheduler.reward]`` is
set (``RemoteRewardScorer``), else the task's checker in this process (``RewardScorer``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from deltarl.config.rl import SchedulerConfig
from deltarl.rl.task import Task
from deltarl.scheduler.reward import RewardScorer
from deltarl.scheduler.reward_client import RemoteRewardScorer


class GroupRewards(Protocol):
    stuck: int

    async def score_group(self, prompt: str, texts: Sequence[str]) -> list[float]: ...

    def status(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def make_reward_scorer(
    config: SchedulerConfig, task: Task, count: Callable[[str], None]
) -> GroupRewards:
    if config.reward is not None:
        return RemoteRewardScorer(config.reward, task.name, count)
    return RewardScorer(
        task.reward,
        timeout_s=config.reward_timeout_s,
        retries=config.reward_retries,
        workers=config.reward_workers,
        count=count,
    )
