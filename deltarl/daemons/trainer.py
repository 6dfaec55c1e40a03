"""``deltarl trainer --config FILE``: GRPO on the scheduler's sample pool; bf16 versions out.

The process around ``deltarl.trainer.service.TrainerService`` (its loop, resume and stop
rules are described there): the scheduler's control client, the daemon runtime
(deltarl/engine/daemon.py), and the ``[daemons.trainer]`` table. Control: ``status`` (step,
version, checkpoint step, last metrics, activity), ``pause`` (after the step in flight),
``resume``, ``drain`` (SIGTERM: finish the step in flight, checkpoint, exit), ``shutdown``.
"""

from __future__ import annotations

from deltarl.config.rl import RLTrainerConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.rl.protocol import REPLIES
from deltarl.trainer.service import TrainerService
from deltarl.transport.blobs import BlobClient
from deltarl.transport.control import ControlClient


async def _build(cfg: RLTrainerConfig, context: DaemonContext) -> TrainerService:
    scheduler = ControlClient(cfg.scheduler, replies=REPLIES)
    samples = BlobClient(cfg.samples_endpoint)
    context.on_close(scheduler.close)
    context.on_close(samples.close)
    return TrainerService(cfg, scheduler.request, samples.get)


def main(argv: list[str]) -> int:
    return daemon_main("trainer", RLTrainerConfig, argv, _build, __doc__ or "deltarl trainer")
