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

from deltarl.daemons.config import ConfigError, DaemonShell, daemon_main
from deltarl.rl.protocol import RL_COMMANDS
from deltarl.scheduler.config import SchedulerConfig
from deltarl.scheduler.service import SchedulerService
from deltarl.scheduler.store import SchedulerStore, SchedulerStoreError
from deltarl.transport.messages import GetStatus, Ok, Pause, Resume, Shutdown, Status

logger = logging.getLogger(__name__)

__all__ = ["SchedulerConfig", "main"]


async def _amain(cfg: SchedulerConfig) -> None:
    try:
        store = SchedulerStore(cfg.db)
    except SchedulerStoreError as e:
        raise ConfigError(f"scheduler: db: {e}") from None
    try:
        service = SchedulerService(cfg, store)
    except ValueError as e:  # an unknown task or policy name
        store.close()
        raise ConfigError(f"scheduler: {e}") from None
    shell = DaemonShell("scheduler", cfg.control, {})

    async def on_status(_: GetStatus) -> Status:
        return Status("scheduler", "paused" if service.paused else "running",
                      service.status_fields())  # fmt: skip

    async def on_pause(_: Pause) -> Ok:
        was, service.paused = service.paused, True
        return Ok("already paused" if was else "paused: no new work is issued")

    async def on_resume(_: Resume) -> Ok:
        was, service.paused = service.paused, False
        return Ok("resumed" if was else "was not paused")

    async def on_shutdown(_: Shutdown) -> Ok:
        shell.stop.set()
        return Ok("stopping")

    handlers = {
        "rl.heartbeat": service.heartbeat,
        "rl.get_work": service.get_work,
        "rl.submit_group": service.submit_group,
        "rl.take_batch": service.take_batch,
        "rl.step_done": service.step_done,
        "rl.checkpointed": service.checkpointed,
        "rl.history": service.history,
    }
    missing = set(RL_COMMANDS) - set(handlers)
    if missing:  # the protocol grew a command this daemon does not answer yet
        raise RuntimeError(f"scheduler: no handler for {sorted(missing)}")
    shell.handlers.update({RL_COMMANDS[tag]: handler for tag, handler in handlers.items()})
    shell.handlers.update({
        GetStatus: on_status,
        Pause: on_pause,
        Resume: on_resume,
        Shutdown: on_shutdown,
    })  # fmt: skip
    logger.info("scheduler: cursor %d, db %s, task %s, lag bound %d (%s)", store.cursor, cfg.db,
                cfg.task, cfg.max_policy_lag_steps, cfg.on_lag_exceeded)  # fmt: skip
    try:
        await shell.run(service.run())
    finally:
        await service.close()
        store.close()


def main(argv: list[str]) -> int:
    return daemon_main("scheduler", SchedulerConfig, argv, _amain, __doc__ or "")
