"""The schedule model's cost model, measured on the real rollout engine of this machine.

``deltarl bench schedule --calibrate FILE`` starts a ``VllmEngine`` (the embedded tiny model,
or ``--model-dir``), and times it:

- decode: groups of 1 to 48 sequences decoding side by side; every engine step that admits
  nothing is one point (running sequences, their total context, seconds), and a least-squares
  fit of ``seconds = base + per_seq * seqs + per_kctx * context / 1000`` gives the three decode
  terms of ``CostModel`` (a term the fit makes negative is 0);
- prefill: one sequence with prompts of growing length; the first step's time less the decode
  time the fit predicts for it, over the prompt's tokens, is ``prefill_per_token_s`` (the
  median of the prompt lengths);
- ``max_seqs`` is the engine's ``max_num_seqs``.

The fit's R^2 and point count come with it. The JSON written is the ``CostModel`` fields, what
``--cost FILE`` reads.

The engine is measured where the model's instances will run (``calibrate_placed``): in a
process of its own, pinned to the CPUs of the real runs' engines (``--real-cpus``, or
``deltarl up``'s own placement) when ``--real`` comes with ``--calibrate``, and its costs
multiplied by the number of engines pinned to those same CPUs, which time-share them
(``CostModel.time_shared``). Measured on one engine over every CPU, the model took each of
the real runs' two engines (one CPU between them) to be several times as fast as it was:
its throughput error was 209%.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from deltarl.ops.placement import format_cpu_list
from deltarl.sim.schedule_model import CostModel

BATCHES = (1, 4, 16, 48)
DECODE_TOKENS = 48
PROMPTS = (64, 256, 768)
WORD = "count the apples and the pears in the basket "  # about 10 tokens for most tokenizers


def _prompt(tokens: int) -> str:
    return WORD * max(1, tokens // 10)


@contextlib.contextmanager
def _stdout_on_stderr() -> Iterator[None]:
    """File descriptor 1 onto 2 meanwhile: vLLM logs to stdout, where the bench's one JSON
    object must stand alone (its handler holds the stream, so swapping sys.stdout is not
    enough)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def calibrate_placed(
    model_dir: Path | None, cpus: str | None, engines: int = 1
) -> tuple[CostModel, dict[str, Any]]:
    """Measure the engine in a process of its own pinned to ``cpus`` (None: unpinned), then
    take its costs as ``engines`` time-sharing those CPUs (module docstring). RuntimeError
    with the end of its log if the measuring process fails."""
    cmd = [sys.executable, "-m", "deltarl.bench.schedule_calibrate"]
    cmd += ["--cpus", cpus] if cpus else []
    cmd += ["--model-dir", str(model_dir)] if model_dir else []
    proc = subprocess.run(  # noqa: S603 - our own module
        cmd, capture_output=True, text=True, timeout=1800, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"calibration failed:\n{proc.stderr[-4000:]}")
    measured = orjson.loads(proc.stdout.strip().splitlines()[-1])
    cost = CostModel(**measured["cost"]).time_shared(engines)
    info: dict[str, Any] = measured["calibration"]
    info["placement"] = {"cpus": cpus, "engines_sharing": engines}
    info["measured"] = measured["cost"]  # one engine alone on those CPUs
    return cost, info


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deltarl.bench.schedule_calibrate [--cpus LIST] [--model-dir DIR]``: one
    JSON object on stdout, ``{"cost": CostModel fields, "calibration": the fit's figures}``."""
    ap = argparse.ArgumentParser(prog="python -m deltarl.bench.schedule_calibrate")
    ap.add_argument("--cpus", help="pin this process to these CPUs first (a cpu list)")
    ap.add_argument("--model-dir", type=Path)
    args = ap.parse_args(argv)
    if args.cpus:
        from deltarl.ops.placement import pin_at_start  # noqa: PLC0415

        pin_at_start(args.cpus)  # executes this process again, pinned, before vLLM loads
    cost, info = calibrate(args.model_dir)
    info["ran_on"] = format_cpu_list(os.sched_getaffinity(0))
    sys.stdout.write(
        orjson.dumps({"cost": dataclasses.asdict(cost), "calibration": info}).decode() + "\n"
    )
    return 0


def calibrate(model_dir: Path | None = None) -> tuple[CostModel, dict[str, Any]]:
    """Measure the engine (module docstring); the cost model and how well it fits."""
    with _stdout_on_stderr():
        return _calibrate(model_dir)


def _calibrate(model_dir: Path | None) -> tuple[CostModel, dict[str, Any]]:
    from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415 - heavy
    from deltarl.rollout.engine import VllmEngine, VllmEngineConfig  # noqa: PLC0415 - heavy

    config = VllmEngineConfig(
        model=model_dir or ensure_default_model(), max_model_len=2048, max_num_seqs=max(BATCHES)
    )
    points: list[tuple[int, float, float]] = []  # (seqs, context tokens, seconds)
    firsts: list[tuple[int, float]] = []  # (prompt tokens, first step seconds)
    with VllmEngine(config) as engine:
        sampling = {"temperature": 1.0, "max_tokens": DECODE_TOKENS, "seed": 0}
        engine.add_group("warm-up", _prompt(32), 2, sampling)
        while engine.has_work():
            engine.step()
        for k, n in enumerate(BATCHES):
            engine.add_group(f"decode-{k}", _prompt(32), n, sampling)
            engine.step()  # prefill and the first token of every sequence
            while engine.has_work():
                seqs, ctx = engine.occupancy()
                started = time.perf_counter()
                engine.step()
                points.append((seqs, float(ctx), time.perf_counter() - started))
        for k, tokens in enumerate(PROMPTS):
            engine.add_group(f"prefill-{k}", _prompt(tokens), 1, {**sampling, "max_tokens": 1})
            started = time.perf_counter()
            done = engine.step()
            seconds = time.perf_counter() - started
            while engine.has_work():
                done += engine.step()
            prompt = len(done[0].samples[0]["prompt_token_ids"]) if done else tokens
            firsts.append((prompt, seconds))
    x = np.array([[1.0, s, c / 1000] for s, c, _ in points])
    y = np.array([t for _, _, t in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    base, per_seq, per_kctx = (max(float(v), 0.0) for v in coef)
    fitted = x @ np.array([base, per_seq, per_kctx])
    r2 = 1.0 - float(((y - fitted) ** 2).sum()) / float(((y - y.mean()) ** 2).sum() or 1.0)
    prefill = statistics.median(
        max(t - (base + per_seq + per_kctx * p / 1000), 0.0) / p for p, t in firsts
    )
    cost = CostModel(
        decode_base_s=base,
        decode_per_seq_s=per_seq,
        decode_per_kctx_s=per_kctx,
        prefill_per_token_s=prefill,
        max_seqs=config.max_num_seqs,
    )
    return cost, {"decode_points": len(points), "decode_r2": r2, "prefill_points": firsts}


if __name__ == "__main__":
    sys.exit(main())
