"""``deltarl scheduler --config FILE``: prompts, dispatch, rewards, the sample pool, the lag bound.

A thin daemon around ``deltarl.scheduler.service.SchedulerService``: it binds the control
socket, answers the standard commands (status, pause, resume, shutdown) and every command of
``deltarl.rl.protocol`` (rollout daemons and the trainer are its clients), and checks
heartbeats and leases in the background. It also binds the samples socket
(``deltarl.transport.blobs.BlobServer`` on ``samples``, by default derived from ``control``):
rollout daemons put their encoded groups there and the trainer gets them, and every blob goes
into the same sqlite store as the groups. Its whole state is the sqlite store at ``db``, so a
restart, after ``kill -9`` too, continues where the last committed change left it.

``pause`` stops issuing work (instances are told to wait); pooled groups still ship to the
trainer, so a pause drains the pipeline rather than stalling training.
"""

from __future__ import annotations

import asyncio
import logging

from deltarl.config import ConfigError
from deltarl.config.rl import SchedulerConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.scheduler.rows import SchedulerStoreError
from deltarl.scheduler.service import SchedulerService
from deltarl.scheduler.store import SchedulerStore
from deltarl.transport.blobs import BlobServer

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
    blobs = BlobServer(cfg.samples_endpoint, store, max_frame_bytes=cfg.max_sample_bytes)
    try:
        blobs.bind()
    except OSError as e:
        store.close()
        raise ConfigError(f"scheduler: samples: {e}") from None
    serving = asyncio.create_task(blobs.serve(), name="scheduler:samples")

    async def close_blobs() -> None:  # before the store: closers run last added first
        blobs.stop()
        await serving

    context.on_close(close_blobs)
    logger.info(
        "scheduler: cursor %d, db %s, samples %s, task %s, lag bound %d (%s)",
        store.cursor,
        cfg.db,
        blobs.endpoint,
        cfg.task,
        cfg.max_policy_lag_steps,
        cfg.on_lag_exceeded,
    )
    return service


def main(argv: list[str]) -> int:
    return daemon_main("scheduler", SchedulerConfig, argv, _build, __doc__ or "")
