"""A scheduler without a plan predicts lengths from its own run (run_lengths.py), and sends the
lengths a task forces."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deltarl.config.rl import Sampling
from deltarl.rl.long_tail import LongTail
from deltarl.rl.protocol import GetWork, Heartbeat, TakeBatch, Work
from deltarl.rl.task import RepeatLetter
from deltarl.scheduler.length_predictor import (
    MIN_FIT_ROWS,
    RIDGE,
    LengthPredictor,
    Record,
    features,
    prompt_key,
)
from deltarl.scheduler.plan import build_plan
from deltarl.scheduler.plan_view import PlannedTask
from deltarl.scheduler.run_lengths import DISPATCHED_KEPT, RunLengths, forced_lengths
from tests.scheduler.helpers import LETTER_LENGTHS, generate_letters, letter_of, make_service

TASK = RepeatLetter()


def test_the_incremental_predictor_fits_what_a_batch_ridge_fits():
    """``add`` one group at a time reaches the ridge solved on every row at once."""
    texts = [f"#{i} " + "please " * (i % 7) + "Say a lot of a: " for i in range(40)]
    means = [5.0 + 3.0 * (i % 7) + (i % 3) for i in range(40)]
    records = [Record("t", prompt_key(t), t, (int(m),)) for t, m in zip(texts, means, strict=True)]
    grown = LengthPredictor([], "t", default_tokens=1.0)
    for i, r in enumerate(records):
        assert grown.fitted == (i >= MIN_FIT_ROWS)
        assert grown.add(r)
    assert not grown.add(Record("other task", 1, "x", (3,)))  # not learned
    assert not grown.add(Record("t", 1, "x", ()))
    x = np.stack([features(t) for t in texts])
    y = np.log([float(int(m)) for m in means])
    a = x.T @ x + RIDGE * np.eye(x.shape[1])
    a[0, 0] -= RIDGE
    assert grown.weights == pytest.approx(np.linalg.solve(a, x.T @ y))
    assert grown.records == 40
    batch = LengthPredictor(records, "t", default_tokens=1.0, min_count=10**6)
    assert batch.weights == pytest.approx(grown.weights)
    # With no class statistics (min_count unreachable), a new prompt is the fit's.
    new = "#99 please please Say a lot of a: "
    assert batch.predict(new).source == "learned"
    assert batch.predict(new).tokens == pytest.approx(
        math.exp(float(features(new) @ grown.weights))
    )


def test_without_a_plan_deltarl_predicts_from_the_runs_own_lengths(tmp_path: Path) -> None:
    """Nothing is predicted until the fit answers (16 groups); then each prompt is predicted
    from its history, the longest goes first, what was predicted at dispatch is measured
    against what came back, and a restarted scheduler predicts the same."""

    async def go() -> None:
        svc, store, _ = make_service(tmp_path, policy="deltarl", pool_capacity=64, lookahead=8)
        assert svc.run_lengths is not None
        for _ in range(MIN_FIT_ROWS // 4):
            assert svc.predicted_tokens(store.cursor) is None
            await generate_letters(svc, "a", 4)
        prompts = {p: TASK.prompt(p) for p in range(store.cursor, store.cursor + 8)}
        for p, text in prompts.items():
            assert svc.predicted_tokens(p) == pytest.approx(4 * LETTER_LENGTHS[letter_of(text)])
        # Of the window, the asker gets the longest predicted first.
        (first,) = await generate_letters(svc, "a", 1)
        longest = max(LETTER_LENGTHS[letter_of(t)] for t in prompts.values())
        assert LETTER_LENGTHS[letter_of(first["prompt"])] == longest
        # The groups issued after the fit carry their prediction into their step's error.
        await generate_letters(svc, "a", 3)
        for step in range(1, 11):  # 20 groups pooled, in pool order
            await svc.take_batch(TakeBatch(step, 2, trainer_version=0))
        rows = store.history()
        assert [r["predicted_groups"] for r in rows] == [0] * 8 + [2, 2]
        assert [r["length_error"] for r in rows[8:]] == [pytest.approx(0.0)] * 2
        store.close()
        again, store2, _ = make_service(tmp_path, policy="deltarl", pool_capacity=64)
        assert again.run_lengths is not None
        assert again.run_lengths.predictor.records == MIN_FIT_ROWS + 4
        first_prompt = TASK.prompt(0)
        assert again.predicted_tokens(0) == pytest.approx(
            4 * LETTER_LENGTHS[letter_of(first_prompt)]
        )
        store2.close()

    asyncio.run(go())


def test_with_a_plan_the_run_does_not_predict_for_itself(tmp_path: Path) -> None:
    from tests.scheduler.test_dispatch_policies import write_a_plan  # noqa: PLC0415

    plan = write_a_plan(tmp_path / "plan.json")
    svc, store, _ = make_service(tmp_path, plan=plan, policy="deltarl")
    assert svc.run_lengths is None
    assert svc.predicted_tokens(0) == pytest.approx(4 * svc.plan.predicted(0))
    store.close()


def test_the_dispatched_predictions_are_bounded() -> None:
    class _Store:
        def length_records(self) -> list[Any]:
            return []

    lengths = RunLengths(_Store(), TASK, 4)  # type: ignore[arg-type]

    class _G:
        def __init__(self, p: int) -> None:
            self.prompt_id, self.group_id = p, f"{p}.0"

    ids = range(DISPATCHED_KEPT + 5)
    lengths.dispatched([_G(p) for p in ids], dict.fromkeys(ids, 8.0))  # type: ignore[misc]
    assert lengths.take_dispatched("0.0") is None  # the oldest went first
    assert lengths.take_dispatched(f"{DISPATCHED_KEPT + 4}.0") == 2.0  # per sample
    assert lengths.take_dispatched(f"{DISPATCHED_KEPT + 4}.0") is None  # taken once


def test_a_task_that_forces_lengths_has_them_sent_capped_at_max_tokens(tmp_path: Path) -> None:
    task = LongTail(seed=3, max_tokens=256)
    assert forced_lengths(RepeatLetter(), 0, 1, 4, 64) is None
    capped = forced_lengths(task, 5, 11, 8, 16)
    assert capped == [min(x, 16) for x in task.output_lengths(5, 11, 8)]
    # Under a plan, position i is the task's prompt order[i].
    plan = build_plan(
        task="long_tail",
        seed=3,
        size=8,
        prompt=task.prompt,
        predictor=LengthPredictor([], "long_tail", default_tokens=24),
        group_size=4,
        groups_per_step=2,
        instances=2,
        max_batch_tokens=4096,
        max_skew=10.0,
    )
    planned = PlannedTask(task, plan)
    for i in range(8):
        assert forced_lengths(planned, i, 7, 4, 256) == task.output_lengths(plan.order[i], 7, 4)

    async def go() -> None:
        svc, store, _ = make_service(
            tmp_path, task="long_tail", seed=3, sampling=Sampling(max_tokens=40)
        )
        await svc.heartbeat(Heartbeat("a", "s", weight_version=0))
        reply = await svc.get_work(GetWork("a", "s", max_groups=2, weight_version=0))
        assert isinstance(reply, Work)
        for g in reply.groups:
            s = g["sampling"]
            want = [min(x, 40) for x in task.output_lengths(g["prompt_id"], s["seed"], 4)]
            assert s["lengths"] == want
        store.close()

    asyncio.run(go())
