"""``deltarl rollout --config FILE [--name rollout-N]``: generate with vLLM, refit between steps.

The process around ``deltarl.rollout.service.RolloutService`` (the loop, its invariants and
its drain are described there): the scheduler's and the apply agent's control clients, the
daemon runtime (deltarl/engine/daemon.py), and ``[daemons.NAME]`` of the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.rl.protocol import REPLIES
from deltarl.rollout.service import RolloutService
from deltarl.transport.blobs import BlobClient, samples_endpoint
from deltarl.transport.control import ControlClient, check_endpoint
from deltarl.transport.messages import GetStatus


@dataclass(frozen=True)
class RolloutConfig:
    control: str
    scheduler: str
    """The scheduler's control endpoint (work, submits, heartbeats)."""
    rollout_store: str
    """The apply agent's store: the weights this engine serves."""
    apply_control: str | None = None
    """The apply agent's control endpoint: its ``status`` reports each version's model digest,
    which the engine's own digest must equal. None: nothing to check against, so every load is
    unverified and the daemon generates nothing (see ``_refit``)."""
    store_root: Path | None = None
    model_dir: Path | None = None
    """A Hugging Face model directory (config, tokenizer); None: the embedded default model."""
    instance: str = "rollout"
    """This engine's name at the scheduler (unique per engine)."""
    max_running_groups: int = 8
    heartbeat_s: float = 1.0
    idle_s: float = 0.05
    """How long to wait when there is nothing to generate."""
    store_wait_s: float = 600.0
    """How long to wait for the apply agent's store to hold a first version."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Knobs of ``VllmEngineConfig`` (max_model_len, kv_cache_gb, seed, ...)."""
    scheduler_samples: str | None = None
    """The scheduler's samples endpoint, where finished groups are put before their submit;
    None: derived from ``scheduler`` as the scheduler derives it (``samples_endpoint``)."""

    def __post_init__(self) -> None:
        # ValueError here becomes a ConfigError naming the file and table (config._build).
        self.samples_endpoint  # noqa: B018 - derived (or checked) now, not at the first put

    @property
    def samples_endpoint(self) -> str:
        if self.scheduler_samples is not None:
            return check_endpoint(self.scheduler_samples)
        return samples_endpoint(self.scheduler)


async def _build(cfg: RolloutConfig, context: DaemonContext) -> RolloutService:
    scheduler = ControlClient(cfg.scheduler, replies=REPLIES)
    samples = BlobClient(cfg.samples_endpoint)
    apply = None if cfg.apply_control is None else ControlClient(cfg.apply_control)
    context.on_close(scheduler.close)
    context.on_close(samples.close)
    if apply is not None:
        context.on_close(apply.close)
    status = None if apply is None else partial(apply.request, GetStatus())
    return RolloutService(cfg, scheduler.request, context, status, samples.put)


def main(argv: list[str]) -> int:
    return daemon_main("rollout", RolloutConfig, argv, _build, __doc__ or "")
