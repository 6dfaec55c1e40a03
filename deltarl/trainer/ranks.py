"""Data-parallel trainer ranks on ``torch.distributed``: ``ranks = N`` in ``[daemons.trainer]``,
or ``deltarl trainer --nproc N``.

Rank 0 is the trainer daemon: it talks to the scheduler, fetches the samples, publishes every
version and writes every checkpoint. Ranks 1 .. N-1 are processes it starts itself
(``python -m deltarl.trainer.ranks SPEC RANK``), each with the same model, optimizer and
checkpoint as rank 0 (``deltarl.trainer.service.build_model``, the same code). They join one
process group (gloo on CPU, over TCP on 127.0.0.1) and then, per step:

    rank 0      broadcast a header (what to do, the step, the batch's shape, its temperature),
                then the batch's tensors
    every rank  its contiguous share of the rows (``share``), micro-batched; the loss of each is
                divided by the whole step's completion tokens, so the ranks' gradients add up
                to the whole batch's
                all_reduce(SUM) of the gradients, flattened into one buffer in parameter order,
                and of the loss sums
                the same clip and the same AdamW step on every rank

Invariants:
- R1: after every step every rank holds the same weights and optimizer state. The reduced
  gradients are the same bits on every rank (one all_reduce hands each rank the same result),
  and clip and AdamW are deterministic functions of them. Checked when the group forms: each
  worker's digest of its weights and step must equal rank 0's, or the worker refuses to start.
- R2: only rank 0 writes (versions, checkpoints); a worker never touches a store or a file.
- R3: one rank lost loses the whole group. A worker that dies (or is killed) makes rank 0's next
  collective fail; rank 0 then raises, the trainer daemon exits 1 and its supervisor (systemd,
  a test) starts it again: it starts a fresh set of workers, every rank restores the newest
  checkpoint, and the scheduler replays the steps after it, which retrain bit-identically for
  the same N (the all_reduce of a given world size sums in a fixed order). Rank 0 dying takes
  its workers with it: they are in its process group, and the kernel signals them when it dies
  (``PR_SET_PDEATHSIG``), besides their collectives failing.

Whether rank 0 publishes the whole version or each rank its shard: with data parallelism every
rank holds the whole model, so rank 0 publishing it costs no transfer between ranks at all; a
sharded (FSDP) trainer would need a gather first or shard-wise publishing.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import torch
import torch.distributed as dist
import xxhash
from torch import nn

from deltarl.ops.parent_death import signal_on_parent_death
from deltarl.trainer.grpo import GRPOBatch, GRPOConfig, StepStats, train_step
from deltarl.transport.ports import free_port

if TYPE_CHECKING:
    from deltarl.config.rl import RLTrainerConfig

logger = logging.getLogger(__name__)

OP_STOP, OP_STEP = 0, 1
SPEC_NAME = "ranks.json"
"""The spec rank 0 writes into its checkpoint directory for the workers it starts."""


def share(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a step's ``rows`` that ``rank`` of ``world`` trains."""
    return rows * rank // world, rows * (rank + 1) // world


def weights_digest(model: nn.Module) -> str:
    """xxh3-128 of every parameter's bytes, in order: equal on two ranks iff their weights are."""
    h = xxhash.xxh3_128()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def reduce_gradients(params: list[nn.Parameter], sums: dict[str, float]) -> None:
    """``GradReduce`` over the default process group: SUM of every gradient (a rank that had no
    token gives zeros) and of the loss sums, in place."""
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
    keys = sorted(sums)
    totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=flat.device)
    dist.all_reduce(totals)
    sums.update(zip(keys, totals.tolist(), strict=True))


def _header(
    op: int, step: int = 0, batch: GRPOBatch | None = None, temp: float = 1.0
) -> torch.Tensor:
    """What to do next: op, step, the batch's rows and columns, its temperature."""
    rows, cols = (0, 0) if batch is None else tuple(batch.input_ids.shape)
    return torch.tensor([op, step, rows, cols, temp], dtype=torch.float64, device=comm_device())


def train_share(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: GRPOBatch,
    config: GRPOConfig,
    reference: nn.Module | None,
    rank: int,
    world: int,
) -> StepStats:
    """One data-parallel step of ``rank``: its share of the whole step's ``batch``, the loss
    normalised by the whole batch's tokens, gradients and loss sums reduced over the group.
    Every rank calls it with the same batch; the figures returned are the whole step's."""
    start, stop = share(batch.size, rank, world)
    stats = train_step(
        model,
        optimizer,
        batch.rows(start, stop),
        config,
        reference,
        total_tokens=batch.tokens,
        reduce=reduce_gradients,
    )
    return dataclasses.replace(
        stats, samples=batch.size, reward_mean=float(batch.rewards.mean().item())
    )


def broadcast_batch(batch: GRPOBatch) -> None:
    """Rank 0's half of ``receive_batch``: the tensors, in a fixed order."""
    for t in (
        batch.input_ids,
        batch.attention_mask,
        batch.loss_mask,
        batch.behaviour_logprobs,
        batch.advantages,
        batch.rewards,
    ):
        dist.broadcast(t.contiguous().to(comm_device()), src=0)


def receive_batch(rows: int, cols: int) -> GRPOBatch:
    def get(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=comm_device())
        dist.broadcast(t, src=0)
        return t.cpu()  # as rank 0 holds its batch; train_step moves micro-batches over

    return GRPOBatch(
        input_ids=get((rows, cols), torch.int64),
        attention_mask=get((rows, cols), torch.int64),
        loss_mask=get((rows, cols - 1), torch.float32),
        behaviour_logprobs=get((rows, cols - 1), torch.float32),
        advantages=get((rows,), torch.float32),
        rewards=get((rows,), torch.float32),
    )


def comm_device() -> torch.device:
    """Where this rank's collective tensors live: NCCL moves GPU tensors only, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join(rank: int, world: int, address: str, timeout_s: float, device: torch.device) -> None:
    """Join the ranks' group: NCCL when the ranks train on GPUs (``build_model`` has set this
    rank's GPU), gloo on the CPU."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def check_same_start(model: nn.Module, step: int) -> None:
    """R1 at the start: every rank's weights and step equal rank 0's, or this rank raises."""
    mine = orjson.dumps([weights_digest(model), step])
    dev = comm_device()
    sizes = torch.tensor([len(mine)], dtype=torch.int64, device=dev)
    dist.broadcast(sizes, src=0)
    buf = torch.zeros(int(sizes.item()), dtype=torch.uint8, device=dev)
    if dist.get_rank() == 0:
        buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(dev)
    dist.broadcast(buf, src=0)
    theirs = bytes(buf.cpu().numpy())
    if theirs != mine:
        raise RuntimeError(
            f"rank {dist.get_rank()} starts from other weights or another step than rank 0 "
            f"(rank 0: {theirs.decode()}, here: {mine.decode()})"
        )


class Workers:
    """Rank 0's handle on ranks 1 .. N-1: starts them, forms the group, drives each step."""

    def __init__(self, config: RLTrainerConfig) -> None:
        self.config = config
        self.world = config.ranks
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, device: torch.device) -> None:
        """Start the workers and join the group with them (rank 0, training on ``device``).
        Call before anything else touches torch.distributed in this process."""
        cfg = self.config
        address = f"127.0.0.1:{free_port()}"
        cfg.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        spec = cfg.checkpoint_dir / SPEC_NAME
        record = dataclasses.asdict(cfg)
        tmp = spec.with_suffix(".tmp")
        tmp.write_bytes(
            orjson.dumps({"config": record, "world": self.world, "address": address}, default=str)
        )
        tmp.replace(spec)
        for rank in range(1, self.world):
            log = cfg.checkpoint_dir / f"rank{rank}.log"
            with log.open("ab") as out:
                self.procs.append(
                    subprocess.Popen(  # noqa: S603 - our own module
                        [sys.executable, "-m", "deltarl.trainer.ranks", str(spec), str(rank)],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        join(0, self.world, address, cfg.rank_timeout_s, device)
        logger.info(
            "trainer ranks: %d processes in one %s group at %s",
            self.world,
            dist.get_backend(),
            address,
        )

    def alive(self) -> int:
        """Ranks running now, rank 0 included."""
        return 1 + sum(p.poll() is None for p in self.procs)

    def step(self, step: int, batch: GRPOBatch, temperature: float) -> None:
        """Hand ``batch`` to every worker (rank 0 then trains its own share: ``train_share``)."""
        dist.broadcast(_header(OP_STEP, step, batch, temperature), src=0)
        broadcast_batch(batch)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the workers to exit and wait for them; kill what does not."""
        told = False
        try:
            if dist.is_initialized() and self.alive() == self.world:
                dist.broadcast(_header(OP_STOP), src=0)
                told = True
        except (RuntimeError, ValueError) as e:  # a worker is gone already
            logger.warning("trainer ranks: could not tell the workers to stop: %s", e)
        for p in self.procs:
            try:
                # The group is broken when one was lost: the others would wait in a
                # collective that never completes, so they are killed at once.
                p.wait(timeout_s if told else 0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def worker(spec_path: Path, rank: int) -> int:
    """Rank ``rank``: build the model as rank 0 does, join, then follow rank 0's steps."""
    from deltarl.config.rl import RLTrainerConfig  # noqa: PLC0415 - only workers need these
    from deltarl.config.tables import build  # noqa: PLC0415
    from deltarl.trainer.service import build_model, grpo_config  # noqa: PLC0415 - it imports this module

    signal_on_parent_death(signal.SIGKILL)  # rank 0 dying takes its workers (R3)
    spec = orjson.loads(spec_path.read_bytes())
    record = {k: v for k, v in spec["config"].items() if v is not None}
    cfg = build(RLTrainerConfig, "[daemons.trainer] of rank 0", record)
    built = build_model(cfg, rank)
    device = next(built.model.parameters()).device
    join(rank, int(spec["world"]), str(spec["address"]), cfg.rank_timeout_s, device)
    check_same_start(built.model, built.step)
    logger.info("rank %d of %d: at step %d", rank, spec["world"], built.step)
    while True:
        header = _header(OP_STOP)
        dist.broadcast(header, src=0)
        op, step, rows, cols, temperature = header.tolist()
        if int(op) == OP_STOP:
            dist.destroy_process_group()
            return 0
        batch = receive_batch(int(rows), int(cols))
        train_share(
            built.model,
            built.optimizer,
            batch,
            grpo_config(cfg, temperature),
            built.reference,
            rank,
            int(spec["world"]),
        )
        logger.info("rank %d: step %d", rank, int(step))


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s trainer-rank{sys.argv[2]} %(levelname)s %(message)s",
    )
    sys.exit(worker(Path(sys.argv[1]), int(sys.argv[2])))
