"""``deltarl trainer --config FILE [--nproc N]``: GRPO on the sample pool; bf16 versions out.

``--nproc N`` overrides the table's ``ranks``: N data-parallel ranks, this process rank 0
(deltarl/trainer/ranks.py).

The process around ``deltarl.trainer.service.TrainerService`` (its loop, resume and stop
rules are described there): the scheduler's control client, the daemon runtime
(deltarl/engine/daemon.py), and the ``[daemons.trainer]`` table. Control: ``status`` (step,
version, checkpoint step, last metrics, activity), ``pause`` (after the step in flight),
``resume``, ``drain`` (SIGTERM: finish the step in flight, checkpoint, exit), ``shutdown``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

from deltarl.config import EX_CONFIG
from deltarl.config.rl import RLTrainerConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.rl.protocol import REPLIES
from deltarl.trainer.service import TrainerService
from deltarl.transport.blobs import BlobClient
from deltarl.transport.control import ControlClient


async def _build(
    cfg: RLTrainerConfig, context: DaemonContext, nproc: int | None = None
) -> TrainerService:
    if nproc is not None:
        cfg = dataclasses.replace(cfg, ranks=nproc)
    scheduler = ControlClient(cfg.scheduler, replies=REPLIES)
    samples = BlobClient(cfg.samples_endpoint)
    context.on_close(scheduler.close)
    context.on_close(samples.close)
    return TrainerService(cfg, scheduler.request, samples.get)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--nproc", type=int)
    known, rest = ap.parse_known_args(argv)
    if known.nproc is not None and known.nproc < 1:
        print(f"deltarl trainer: --nproc must be at least 1, got {known.nproc}", file=sys.stderr)
        return EX_CONFIG
    build = functools.partial(_build, nproc=known.nproc)
    return daemon_main("trainer", RLTrainerConfig, rest, build, __doc__ or "deltarl trainer")
