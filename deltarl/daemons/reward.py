"""``deltarl reward --config FILE``: scores groups of samples for the scheduler.

A thin daemon around ``deltarl.reward.service.RewardService``: it binds the control socket,
answers the standard commands and ``ScoreGroup`` (``deltarl.reward.protocol``), with one
scorer plugin (``scorer = "rule"``: the task's checker; ``"judge"``: a model grades the
answers; ``deltarl.reward.scorer.SCORERS``). The scheduler uses it when its
``[daemons.scheduler.reward] endpoint`` names this daemon's ``control``. It keeps no state: a
restart loses only the calls in flight, which the scheduler retries.
"""

from __future__ import annotations

import logging

from deltarl.config import ConfigError
from deltarl.config.reward import RewardConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.reward.service import RewardService
from deltarl.rl.task import make_task

logger = logging.getLogger(__name__)

__all__ = ["RewardConfig", "main"]


async def _build(cfg: RewardConfig, context: DaemonContext) -> RewardService:
    del context
    try:
        task = make_task(cfg.task, seed=cfg.seed)
    except ValueError as e:
        raise ConfigError(f"reward: {e}") from None
    try:
        service = RewardService(cfg, task)
        await service.scorer.start()
    except (ValueError, OSError) as e:  # an unknown scorer, an unusable model directory
        raise ConfigError(f"reward: {cfg.scorer}: {e}") from None
    logger.info(
        "reward: task %s, scorer %s, at most %d groups at once",
        task.name,
        service.scorer.name,
        cfg.max_concurrency,
    )
    return service


def main(argv: list[str]) -> int:
    return daemon_main("reward", RewardConfig, argv, _build, __doc__ or "")
