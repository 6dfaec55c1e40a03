"""The trainer core: GRPO on the scheduler's sample pool; bf16 versions out.

The logic of ``deltarl trainer`` with no socket (deltarl/daemons/trainer.py gives it the
scheduler as an ``Ask`` and runs it on the daemon runtime). It owns a Hugging Face causal LM in
fp32 (the master weights) and AdamW. Its loop:

    TakeBatch(step, groups_per_step, version) --empty--> wait ``wait_s`` (or what it says)
        v groups (references)
    their samples from the scheduler's samples endpoint, checked and decoded
        (deltarl.trainer.shipped; silent endpoint: ask again after ``wait_s``)
    GRPO step (deltarl.trainer.grpo), in the training thread
    publish the bf16 weights as the next version: ``step``, or above it after a restore
    (deltarl.trainer.publisher; deltarl/scheduler/restore.py)
    StepDone(step, version, metrics)
    every ``checkpoint_every`` steps: checkpoint, then Checkpointed(step)

Torch work runs in one dedicated thread, so the event loop keeps answering control and
pinging the watchdog; being a single thread it also orders the work: a checkpoint asked for at
shutdown runs after the step in flight, never beside it.

Resume (docs/architecture.md, "nothing lost"): the newest sound checkpoint holds the model,
optimizer, RNG, step s, its version (s, or above after an operator's restore: ``deltarl
trainer-restore``) and the data cursor (s + 1). A restarted trainer loads it, republishes its
weights as that version if the store's active version is another one (a crash after s left
later versions there), tells the scheduler Checkpointed(s) again (idempotent: the crash may
have come between the file and the message) and asks for step s + 1. The scheduler returns the
same groups for a step asked again, so steps s + 1 ... retrain bit-identically: no sample is
skipped and none is trained twice into the weights that survive. A checkpoint is written only
for a step whose StepDone the scheduler acknowledged, so every checkpointed step is in the run
record.

Stopping: ``pause`` holds after the step in flight; ``drain`` (SIGTERM) takes no new batch and
lets the step in flight finish; then, and on ``shutdown`` too, ``close`` reports and
checkpoints the last step before the process exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import nn

from deltarl.config import ConfigError
from deltarl.engine.daemon import DaemonCore, PauseGate
from deltarl.engine.weight_store import SegmentFormatError
from deltarl.ops import metrics as metrics_out
from deltarl.rl.protocol import Batch, Checkpointed, StepDone, TakeBatch
from deltarl.trainer.checkpoint import Checkpoint, Checkpointer
from deltarl.trainer.grpo import BatchError, GRPOConfig, ScoredGroup, build_batch, train_step
from deltarl.trainer.publisher import Publisher
from deltarl.trainer.ranks import Workers, check_same_start, train_share
from deltarl.trainer.shipped import FetchBlobs, ShippedItem, fetch_groups, parse_items
from deltarl.transport.messages import Command, Error, Ok, Reply

if TYPE_CHECKING:
    from deltarl.config.rl import RLTrainerConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

Ask = Callable[[Command, float], Awaitable[Reply]]
"""A request to the scheduler with a timeout in seconds: its reply, or TimeoutError or
ConnectionError (ControlClient.request is one)."""

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
FINISH_TIMEOUT_S = 5.0
"""How long each message at shutdown may wait for the scheduler (it may be gone already)."""


def load_model(model_dir: Path) -> nn.Module:
    """The causal LM in ``model_dir`` in fp32, in eval mode (no dropout: see grpo.py).

    Seed the RNGs first: a directory without weights is initialised from its config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 - heavy import

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model_dir {model_dir} holds no config.json (a Hugging Face model)")
    if any((model_dir / name).is_file() for name in WEIGHT_FILES):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model  # type: ignore[no-any-return]


@dataclass
class Built:
    """What a trainer rank starts from: the model, its optimizer, the KL reference, the
    checkpoints and the one it restored (None: a fresh start at step 0)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    reference: nn.Module | None
    checkpointer: Checkpointer
    found: Checkpoint | None

    @property
    def step(self) -> int:
        return 0 if self.found is None else self.found.step


def train_device(cfg: RLTrainerConfig, rank: int = 0) -> torch.device:
    """Where rank ``rank`` trains: its GPU (rank modulo the GPUs torch sees) or the CPU."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError('device = "cuda" but torch sees no GPU here')
    return torch.device("cuda", rank % torch.cuda.device_count())


def build_model(cfg: RLTrainerConfig, rank: int = 0) -> Built:
    """The model, optimizer and reference of every rank, restored from the newest sound
    checkpoint: one code path for rank 0 and the workers, so that they start equal (R1 in
    deltarl/trainer/ranks.py). The model is on the rank's ``train_device`` before the
    optimizer is made (its state follows the parameters) and before the restore."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)  # a library may draw from numpy's global generator
    device = train_device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load_model(cfg.model_dir).to(device)
    # The reference is the initial model; a restart rebuilds it the same way.
    reference = copy.deepcopy(model).requires_grad_(False) if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    checkpointer = Checkpointer(cfg.checkpoint_dir, keep=cfg.keep_checkpoints)
    found = checkpointer.restore(model, optimizer)
    if found is not None:
        for group in optimizer.param_groups:
            # The configuration may have been changed on purpose before this restart.
            group["lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
    return Built(model, optimizer, reference, checkpointer, found)


def grpo_config(cfg: RLTrainerConfig, temperature: float) -> GRPOConfig:
    """The GRPO settings of a step sampled at ``temperature``, the same on every rank."""
    return GRPOConfig(
        cfg.clip_eps,
        cfg.kl_coef,
        cfg.max_grad_norm,
        cfg.micro_batch,
        temperature,
        bf16=computes_bf16(cfg.compute_dtype, train_device(cfg)),
        behaviour_weight_cap=cfg.behaviour_weight_cap if cfg.objective == "decoupled" else 0.0,
        published_forward=cfg.forward_weights == "published",
    )


def computes_bf16(compute_dtype: str, device: torch.device) -> bool:
    """Whether ``compute_dtype`` means bf16 autocast on ``device`` ("auto": where the device
    has bf16 arithmetic; emulated, bf16 is slower than float32)."""
    if compute_dtype != "auto":
        return compute_dtype == "bfloat16"
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


class TrainerService(DaemonCore):
    """The training loop and its state; the process module adds the sockets."""

    daemon: ClassVar[str] = "trainer"
    pause_text: ClassVar[str] = "paused (after the step in flight)"

    def __init__(self, config: RLTrainerConfig, scheduler: Ask, fetch: FetchBlobs) -> None:
        self.config = config
        self.scheduler = scheduler
        self.fetch = fetch
        self.activity = "starting"
        self.gate = PauseGate()
        self.draining = False
        self.step = 0
        self.version = 0
        self.checkpoint_step: int | None = None
        self.reported_step = 0
        """The last step whose StepDone the scheduler acknowledged."""
        self.metrics: dict[str, Any] = {}
        self.error: str | None = None
        self.wait_reason = ""
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")
        self._inflight: concurrent.futures.Future[Any] | None = None
        self.model: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.publisher: Publisher | None = None
        self.checkpointer: Checkpointer | None = None
        self._restored = False
        self.workers: Workers | None = None

    # -- the torch side (runs in the training thread) -------------------------------------

    def _setup(self) -> None:
        cfg = self.config
        built = build_model(cfg)
        found = built.found
        if found is not None:
            self.step, self.version = found.step, found.version
            self.checkpoint_step = self.reported_step = found.step
            self._restored = True
        model = built.model
        self.model, self.optimizer, self.reference = model, built.optimizer, built.reference
        self.checkpointer = built.checkpointer
        if cfg.ranks > 1:
            self.workers = Workers(cfg)
            self.workers.start(next(model.parameters()).device)
            check_same_start(model, self.step)
        try:
            self.publisher = Publisher(model, cfg.published_store, root=cfg.store_root)
        except SegmentFormatError as e:
            raise ConfigError(f"published_store {cfg.published_store!r}: {e}") from None
        if self.publisher.active_version != self.version:
            # Later versions in the store came from steps after the checkpoint; they will be
            # retrained identically, and until then the store must show what the model is.
            self.publisher.publish(self.version, allow_older=True)
            what = "the checkpoint's weights" if self._restored else "the initial weights"
            logger.info("published version %d (%s)", self.version, what)

    def _train_and_publish(
        self,
        step: int,
        items: list[ShippedItem],
        groups: list[ScoredGroup],
        temperature: float = 1.0,
    ) -> dict[str, Any]:
        if self.model is None or self.optimizer is None or self.publisher is None:
            raise RuntimeError("the trainer is not set up")
        cfg = self.config
        if not (math.isfinite(temperature) and temperature > 0):
            # Training at it would divide the logits by zero or worse: stall, loudly.
            raise BatchError(f"the batch's temperature {temperature!r} is not positive")
        t0 = time.perf_counter()
        batch = build_batch(groups, pad_id=cfg.pad_token_id)  # BatchError: nothing changed
        grpo = grpo_config(cfg, temperature)
        if self.workers is None:
            stats = train_step(self.model, self.optimizer, batch, grpo, self.reference)
        else:
            # A lost rank fails the collective here: the step is not taken, and the error
            # ends the daemon (R3 in deltarl/trainer/ranks.py).
            self.workers.step(step, batch, temperature)
            stats = train_share(
                self.model, self.optimizer, batch, grpo, self.reference, 0, cfg.ranks
            )
        t1 = time.perf_counter()
        # One above the last: equal to the step in a run never restored, above it after an
        # operator's restore (deltarl/trainer/checkpoint.py: restore_to).
        version = self.version + 1
        self.publisher.publish(version)
        t2 = time.perf_counter()
        lags = [item.lag for item in items if item.lag is not None]
        metrics: dict[str, Any] = {
            **asdict(stats),
            # Which groups this step trained (id -> samples): lets the run record prove that no
            # sample was trained in two steps, a replayed step replacing its own row.
            "groups": {g.group.group_id: len(g.group.samples) for g in groups},
            "temperature": temperature,
            "step_s": t1 - t0,
            "publish_s": t2 - t1,
            "lag_max": max(lags) if lags else None,
        }
        metrics_out.TRAIN_STEP_SECONDS.observe(t1 - t0)
        metrics_out.TRAIN_LOSS.set(stats.loss)
        metrics_out.TRAIN_GRAD_NORM.set(stats.grad_norm)
        metrics_out.TRAIN_CLIP_FRACTION.set(stats.clip_frac)
        metrics_out.TRAIN_CAP_FRACTION.set(stats.cap_frac)
        # Set here, not by the awaiting task: a shutdown may cancel it while this runs on.
        self.step, self.version = step, version
        self.metrics = metrics
        return metrics

    def _save_checkpoint(self) -> None:
        if self.model is None or self.optimizer is None or self.checkpointer is None:
            raise RuntimeError("the trainer is not set up")
        self.checkpointer.save(
            step=self.step,
            version=self.version,
            model=self.model,
            optimizer=self.optimizer,
            extra={"metrics": self.metrics, "model_dir": str(self.config.model_dir)},
        )
        self.checkpoint_step = self.step

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:  # noqa: ANN401
        future = self._executor.submit(fn, *args)
        self._inflight = future
        return await asyncio.wrap_future(future)

    # -- talking to the scheduler ---------------------------------------------------------

    async def _ask(
        self,
        command: Command,
        *,
        retry: bool,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's own, sent with it
    ) -> Reply | None:
        """The scheduler's reply; while it does not answer, retry every ``wait_s`` (or, with
        ``retry`` False, give up: None). Every message here is safe to repeat."""
        while True:
            try:
                reply = await self.scheduler(command, timeout or self.config.request_timeout_s)
            except (TimeoutError, ConnectionError) as e:
                self.error = f"scheduler: {e}"
                logger.warning("%s: %s", command.TAG, e)
                if not retry:
                    return None
                await asyncio.sleep(self.config.wait_s)
                continue
            if isinstance(reply, Error):
                self.error = f"scheduler refused {command.TAG}: {reply.code}: {reply.message}"
                logger.error("%s", self.error)
            return reply

    async def _report_step(self, *, retry: bool, timeout: float | None = None) -> None:  # noqa: ASYNC109
        reply = await self._ask(
            StepDone(self.step, self.version, self.metrics), retry=retry, timeout=timeout
        )
        if isinstance(reply, Ok):
            self.reported_step = self.step

    async def _checkpoint(self, *, retry: bool, timeout: float | None = None) -> None:  # noqa: ASYNC109
        self.activity = "checkpointing"
        await self._in_thread(self._save_checkpoint)
        await self._ask(Checkpointed(self.step), retry=retry, timeout=timeout)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.config
        self.activity = "loading"
        await self._in_thread(self._setup)
        if self._restored:
            await self._ask(Checkpointed(self.step), retry=True)
        while True:
            if cfg.max_steps and self.step >= cfg.max_steps:
                if self.checkpoint_step != self.step:
                    await self._checkpoint(retry=True)
                self.activity = "finished"
                await asyncio.Event().wait()  # keep serving control until shutdown
            if self.gate.paused or self.draining:
                self.activity = "drained" if self.draining else "paused"
                await (asyncio.Event().wait() if self.draining else self.gate.resumed())
                continue
            step = self.step + 1
            self.activity = "waiting for a batch"
            reply = await self._ask(TakeBatch(step, cfg.groups_per_step, self.version), retry=True)
            if not isinstance(reply, Batch) or reply.step != step:
                if not isinstance(reply, Error):
                    self.error = f"scheduler answered TakeBatch({step}) with {reply!r}"
                    logger.error("%s", self.error)
                await asyncio.sleep(cfg.wait_s)
                continue
            if not reply.groups:
                self.wait_reason = reply.reason
                await asyncio.sleep(reply.wait_s if reply.wait_s > 0 else cfg.wait_s)
                continue
            self.activity, self.wait_reason = "fetching samples", ""
            try:
                items = parse_items(reply.groups)
                groups = await fetch_groups(items, self.fetch, cfg.request_timeout_s)
                self.activity = "training"
                await self._in_thread(
                    self._train_and_publish, step, items, groups, reply.temperature
                )
            except (TimeoutError, ConnectionError) as e:
                self.error = f"samples endpoint: {e}"
                logger.warning("step %d: samples not fetched: %s", step, e)
                await asyncio.sleep(cfg.wait_s)
                continue
            except BatchError as e:
                # Skipping the batch would lose its samples, and a crash would come back to it:
                # stall where status shows why, and ask again (the scheduler may fix it).
                self.activity, self.error = "stalled", f"step {step}: {e}"
                logger.error("cannot train step %d: %s", step, e)  # noqa: TRY400 - expected
                await asyncio.sleep(cfg.wait_s * 10)
                continue
            self.error = None
            logger.info(
                "step %d: loss %.4f, reward %.3f, %d tokens, %.2f s",
                step,
                self.metrics["loss"],
                self.metrics["reward_mean"],
                self.metrics["tokens"],
                self.metrics["step_s"],
                extra={"step": step, "version": self.version},
            )
            await self._report_step(retry=True)
            if step % cfg.checkpoint_every == 0 and self.reported_step == step:
                await self._checkpoint(retry=True)

    async def drain(self) -> None:
        """No new batch; the step in flight finishes (``close`` then checkpoints it)."""
        self.draining = True
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([asyncio.wrap_future(self._inflight)])

    async def close(self) -> None:
        """After the loop stopped: let the step in flight end, checkpoint it, close."""
        if self._inflight is not None and not self._inflight.done():
            self.activity = "finishing the step in flight"
            await asyncio.wait([asyncio.wrap_future(self._inflight)])
        try:
            ready = self.model is not None and self.checkpointer is not None
            if ready and self.step != (self.checkpoint_step or 0):
                if self.reported_step != self.step:
                    await self._report_step(retry=False, timeout=FINISH_TIMEOUT_S)
                if self.reported_step == self.step:
                    await self._checkpoint(retry=False, timeout=FINISH_TIMEOUT_S)
                else:
                    logger.warning(
                        "step %d is not in the scheduler's record, so it is not checkpointed; "
                        "a restart retrains it from step %s",
                        self.step,
                        self.checkpoint_step,
                    )
        finally:
            if self.workers is not None:
                # On the training thread, after its last collective: the workers exit.
                await asyncio.wrap_future(self._executor.submit(self.workers.stop))
            self._executor.shutdown(wait=True)
            if self.publisher is not None:
                self.publisher.close()

    # -- what the runtime asks ---------------------------------------------------------------

    def state(self) -> str:
        return "paused" if self.gate.paused else self.activity

    def status_fields(self) -> dict[str, Any]:
        publisher = self.publisher
        return {
            "step": self.step,
            "version": self.version,
            "published_version": None if publisher is None else publisher.active_version,
            "checkpoint_step": self.checkpoint_step,
            "reported_step": self.reported_step,
            "ranks": self.config.ranks,
            "ranks_alive": 1 if self.workers is None else self.workers.alive(),
            "metrics": self.metrics,
            "activity": self.activity,
            "wait_reason": self.wait_reason,
            "error": self.error,
            "store": self.config.published_store,
            "scheduler": self.config.scheduler,
            "scheduler_samples": self.config.samples_endpoint,
            "max_steps": self.config.max_steps,
        }
