"""The reward daemon's logic: score groups for the scheduler with one plugin; no sockets here.

``ScoreGroup`` is served concurrently (bypassing the core's mailbox), at most
``max_concurrency`` groups at once; more wait for a slot within their request's timeout.
What the scheduler needs to judge the service's health it measures itself (timeouts,
retries, its circuit breaker); this side reports what only it can see: groups in flight and
the most at once, and why groups failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, ClassVar

from deltarl.config.reward import RewardConfig
from deltarl.engine.daemon import DaemonCore
from deltarl.reward.protocol import REWARD_ERROR, WRONG_TASK, ScoreGroup, Scores
from deltarl.reward.scorer import GroupScorer, ScoreError, ScorerFactory, make_scorer
from deltarl.rl.task import Task
from deltarl.transport.control import Handler
from deltarl.transport.messages import Command, Error, Reply

logger = logging.getLogger(__name__)


class RewardService(DaemonCore):
    daemon: ClassVar[str] = "reward"

    def __init__(self, config: RewardConfig, task: Task, make: ScorerFactory = make_scorer) -> None:
        self.config = config
        self.task = task.name
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self.in_flight = 0
        self.peak_in_flight = 0
        self.counters: Counter[str] = Counter()
        self.scorer: GroupScorer = make(config, task, self.count)

    def count(self, name: str) -> None:
        self.counters[name] += 1

    def concurrent_handlers(self) -> Mapping[type[Command], Handler]:
        """Concurrent: a slow group must not hold up the others behind the mailbox; the
        semaphore is the bound instead."""
        return {ScoreGroup: self.score}

    async def score(self, cmd: ScoreGroup) -> Reply:
        if cmd.task is not None and cmd.task != self.task:
            self.count("refused.wrong_task")
            return Error(
                WRONG_TASK, f"this reward daemon scores task {self.task!r}, not {cmd.task!r}"
            )
        texts = [t for t in cmd.texts if isinstance(t, str)]
        if len(texts) != len(cmd.texts):
            self.count("refused.bad_request")
            return Error("bad_request", "texts must all be strings")
        async with self.slots:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            t0 = time.perf_counter()
            try:
                rewards = await self.scorer.score_group(cmd.prompt, texts)
            except ScoreError as e:
                self.count(f"failed.{e.code}")
                logger.info("group %s not scored: %s", cmd.group_id or "?", e)
                return Error(e.code, str(e))
            finally:
                self.in_flight -= 1
        bad = [r for r in rewards if not math.isfinite(r)]
        if len(rewards) != len(texts) or bad:  # a plugin's bug: never pass it on as rewards
            self.count(f"failed.{REWARD_ERROR}")
            return Error(REWARD_ERROR, f"the {self.scorer.name} scorer gave {rewards!r}")
        self.count("scored_groups")
        self.counters["scored_samples"] += len(rewards)
        return Scores(rewards, round(time.perf_counter() - t0, 6))

    def status_fields(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "scorer": self.scorer.name,
            "max_concurrency": self.config.max_concurrency,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "counters": dict(self.counters),
            self.scorer.name: self.scorer.status(),
        }

    async def close(self) -> None:
        await self.scorer.close()
