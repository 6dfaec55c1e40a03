"""``deltarl rollout --config FILE [--name rollout-N]``: generate with vLLM, refit between steps.

The process around ``deltarl.rollout.service.RolloutService`` (the loop, its invariants and
its drain are described there): the scheduler's control client, the daemon runtime
(deltarl/engine/daemon.py), the scheduler's samples socket (finished groups are put there,
then submitted by reference), and ``[daemons.NAME]`` of the configuration. The weights come
from the apply agent's store, with the digest each version was verified against.
"""

from __future__ import annotations

from deltarl.config.rl import RolloutConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.rl.protocol import REPLIES
from deltarl.rollout.service import RolloutService
from deltarl.transport.blobs import BlobClient
from deltarl.transport.control import ControlClient


async def _build(cfg: RolloutConfig, context: DaemonContext) -> RolloutService:
    scheduler = ControlClient(cfg.scheduler, replies=REPLIES)
    samples = BlobClient(cfg.samples_endpoint)
    context.on_close(scheduler.close)
    context.on_close(samples.close)
    return RolloutService(cfg, scheduler.request, context, samples.put)


def main(argv: list[str]) -> int:
    return daemon_main("rollout", RolloutConfig, argv, _build, __doc__ or "")
