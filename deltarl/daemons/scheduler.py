"""``deltarl scheduler --config FILE``: prompts, dispatch, rewards, the sample pool, the lag bound.

A thin daemon around ``deltarl.scheduler.service.SchedulerService``: it binds the control
socket, answers the standard commands (status, pause, resume, shutdown) and every command of
``deltarl.rl.protocol`` (rollout daemons and the trainer are its clients), and checks
heartbeats and leases in the background. Its whole state is the sqlite store at ``db``, so a
restart, after ``kill -9`` too, continues where the last committed change left it.

``pause`` stops issuing work (instances are told to wait); pooled groups still ship to the
trainer, so a pause drains the pipeline rather than stalling training.
"""

from __future__ import annotations

import logging

from deltarl.config import ConfigError
from deltarl.config.rl import SchedulerConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.scheduler.service import SchedulerService
from deltarl.scheduler.store import SchedulerStore, SchedulerStoreError

logger = logging.getLogger(__name__)

__all__ = ["SchedulerConfig", "main"]


async def _build(cfg: SchedulerConfig, context: DaemonContext) -> SchedulerService:
    try:
        store = SchedulerStore(cfg.db)
    except SchedulerStoreError as e:
        raise ConfigError(f"scheduler: db: {e}") from None
    try:
        service = SchedulerService(cfg, store)
    except ValueError as e:  # an unknown task or policy name
        store.close()
        raise ConfigError(f"scheduler: {e}") from None

    async def close_store() -> None:
        store.close()

    context.on_close(close_store)
    logger.info(
        "scheduler: cursor %d, db %s, task %s, lag bound %d (%s)",
        store.cursor,
        cfg.db,
        cfg.task,
        cfg.max_policy_lag_steps,
        cfg.on_lag_exceeded,
    )
    return service


def main(argv: list[str]) -> int:
    return daemon_main("scheduler", SchedulerConfig, argv, _build, __doc__ or "")
