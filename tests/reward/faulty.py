"""The real reward daemon with a fault-injecting scorer added to its plugins, for the tests:

    python -m tests.reward.faulty --config FILE       ([daemons.reward] scorer = "slow")

``slow``: the task's rule checker after a delay; the delays (seconds) cycle through the
comma-separated ``DELTARL_TEST_REWARD_DELAYS`` (``"1.0,0"``: every other call is slow, so a
retry of a timed-out call succeeds). Everything else is ``deltarl reward`` as shipped.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any

from deltarl.config.reward import RewardConfig
from deltarl.daemons import reward
from deltarl.reward.rule import RuleScorer
from deltarl.reward.scorer import SCORERS, Counter
from deltarl.rl.task import Task


class SlowRule:
    name = "slow"

    def __init__(self, config: RewardConfig, task: Task, count: Counter) -> None:
        self.rule = RuleScorer(task, config.score_timeout_s, config.rule_workers, count)
        text = os.environ.get("DELTARL_TEST_REWARD_DELAYS", "0")
        self.delays = itertools.cycle(float(d) for d in text.split(","))
        self.calls = 0

    async def start(self) -> None:
        await self.rule.start()

    async def score_group(self, prompt: str, texts: Sequence[str]) -> list[float]:
        self.calls += 1
        await asyncio.sleep(next(self.delays))
        return await self.rule.score_group(prompt, texts)

    async def close(self) -> None:
        await self.rule.close()

    def status(self) -> dict[str, Any]:
        return {"calls": self.calls, **self.rule.status()}


if __name__ == "__main__":
    SCORERS["slow"] = SlowRule
    sys.exit(reward.main(sys.argv[1:]))
