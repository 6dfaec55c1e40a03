"""``deltarl trainer --synthetic``: a stand-in trainer that publishes realistic bf16 versions.

It owns a small model and AdamW at an RL learning rate (``sim.RealisticDeltas``), so the
versions it publishes change about as sparsely as a real trainer's. It creates the published
WeightStore and, every ``interval_s``, takes one optimizer step and commits the new bf16
weights as the next version: the store's active version is the version counter the export
agent watches. Control: ``status``, ``pause``, ``resume``, ``drain``, ``shutdown``.

Invariant: the published store's active version always equals ``RealisticDeltas.version``
of the weights in it (one commit per step, with that step's number).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, ClassVar

from deltarl.config import EX_CONFIG, ConfigError, load
from deltarl.config.refit import TrainerConfig
from deltarl.daemons.process import CONFIG_ERRORS, run
from deltarl.engine.daemon import DaemonContext, DaemonCore, PauseGate

logger = logging.getLogger(__name__)


class SyntheticTrainer(DaemonCore):
    """The publishing loop; knows nothing about sockets (the daemon runtime adds them)."""

    daemon: ClassVar[str] = "trainer"

    def __init__(self, config: TrainerConfig) -> None:
        from deltarl.engine.weight_store import WeightStore  # noqa: PLC0415 - with torch below
        from deltarl.sim.realistic_deltas import RealisticDeltas  # noqa: PLC0415 - torch

        self.config = config
        self.gate = PauseGate()
        self.stepping = False
        self.loss: float | None = None
        self.gen = RealisticDeltas(config.params, seed=config.seed)
        self.store = WeightStore.create(
            config.published_store, self.gen.layout, root=config.store_root
        )
        self._publish()  # version 0: the initial weights, before any step

    def _publish(self) -> None:
        with self.store.begin_write() as txn:
            digests: list[str] | None = [] if self.config.tensor_digests else None
            self.gen.publish(out=txn.buffer, digests=digests)
            txn.commit(self.gen.version, tensor_digests=digests)

    @property
    def version(self) -> int:
        return self.gen.version

    async def run(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.interval_s)
            if self.gate.paused or (cfg.steps and self.gen.version >= cfg.steps):
                continue
            # A step is CPU work; off the loop so control and the watchdog stay live. A step
            # in flight when ``pause`` arrives still publishes: ``stepping`` tells when it is done.
            self.stepping = True
            try:
                self.loss = await asyncio.to_thread(self.gen.step)
                await asyncio.to_thread(self._publish)
            finally:
                self.stepping = False
            logger.debug("published version %d (loss %.4f)", self.version, self.loss)

    async def close(self) -> None:
        # The segment is the trainer's: remove its name so a restart can create it again
        # (an export agent still attached keeps its mapping until it lets go).
        self.store.unlink()
        self.store.close()

    def status_fields(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "stepping": self.stepping,
            "store": self.config.published_store,
            "params": self.gen.param_count,
            "loss": self.loss,
            "steps_left": max(0, self.config.steps - self.version) if self.config.steps else None,
        }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deltarl trainer", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--synthetic",
        action="store_true",
        required=True,
        help="publish a simulated policy instead of training a model",
    )
    ap.add_argument("--config", help="the deltarl TOML; reads [daemons.trainer]")
    ap.add_argument("--params", type=int, help="model parameters (overrides the config)")
    ap.add_argument("--store", help="published store name (overrides the config)")
    ap.add_argument("--store-root", help="directory of the weight stores (default /dev/shm)")
    ap.add_argument("--interval", type=float, help="seconds between steps")
    ap.add_argument("--steps", type=int, help="stop stepping after K steps (0: never)")
    ap.add_argument("--control", help="control endpoint (overrides the config)")
    return ap


def _config(args: argparse.Namespace) -> TrainerConfig:
    if args.config:
        cfg = load(TrainerConfig, "trainer", args.config)
    else:
        if not (args.store and args.control):
            raise ConfigError("without --config, --store and --control are required")
        cfg = TrainerConfig(control=args.control, published_store=args.store)
    overrides = {
        "params": args.params,
        "published_store": args.store,
        "interval_s": args.interval,
        "steps": args.steps,
        "control": args.control,
        "store_root": None if args.store_root is None else Path(args.store_root),
    }
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


async def _build(cfg: TrainerConfig, _: DaemonContext) -> SyntheticTrainer:
    return SyntheticTrainer(cfg)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    try:
        return run("trainer", _config(args), _build)
    except CONFIG_ERRORS as e:
        print(f"deltarl trainer: {e}", file=sys.stderr)
        return EX_CONFIG
