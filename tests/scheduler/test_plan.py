"""The offline plan: length prediction, schedule groups, batches, statistics, validation, CLI."""

from __future__ import annotations

import dataclasses
import statistics

import orjson
import pytest

from deltarl.rl.arithmetic import Arithmetic
from deltarl.scheduler import plan_cli
from deltarl.scheduler.length_predictor import LengthPredictor, Record, prompt_key
from deltarl.scheduler.plan import (
    PlanError,
    bucket_of,
    build_plan,
    derive_boundaries,
    load_plan,
    plan_stats,
    validate,
    write_plan,
)

TASK = Arithmetic(seed=0, size=0)


def true_length(text: str) -> int:
    """A synthetic 'model': much longer answers for more digits (what a history would show)."""
    digits = sum(c.isdigit() for c in text)
    return 2 ** (digits + 2)


def history(ids: range) -> list[Record]:
    out = []
    for i in ids:
        text = TASK.prompt(i)
        out.append(Record("arithmetic", prompt_key(text), text, (true_length(text),) * 4))
    return out


def make(size: int = 96, **kw):
    predictor = LengthPredictor(history(range(1000, 1400)), "arithmetic", default_tokens=64)
    args = {
        "task": "arithmetic",
        "seed": 0,
        "size": size,
        "prompt": TASK.prompt,
        "predictor": predictor,
        "group_size": 4,
        "groups_per_step": 8,
        "instances": 2,
        "max_batch_tokens": 2048,
        "max_skew": 1.5,
    }
    args.update(kw)
    return build_plan(**args)


def test_the_predictor_tries_history_then_statistics_then_the_learned_model_then_a_default():
    seen = TASK.prompt(5)
    records = history(range(5, 6))
    assert LengthPredictor(records, "arithmetic", default_tokens=50).predict(seen).source == (
        "history"
    )
    assert LengthPredictor(records, "other", default_tokens=50).predict(seen).tokens == 50
    many = history(range(100, 140))
    p = LengthPredictor(many, "arithmetic", default_tokens=50, min_count=10**6)
    unseen = TASK.prompt(7)
    guess = p.predict(unseen)
    assert guess.source == "learned"
    # The learned model reads digits: its error is well under a constant guess's.
    test = [TASK.prompt(i) for i in range(2000, 2100)]
    mean = statistics.fmean(true_length(t) for t in many_texts(many))
    learned = statistics.fmean(abs(p.predict(t).tokens - true_length(t)) for t in test)
    constant = statistics.fmean(abs(mean - true_length(t)) for t in test)
    assert learned < 0.5 * constant
    stats = LengthPredictor(many, "arithmetic", default_tokens=50, min_count=2)
    assert stats.predict(unseen).source == "prompt_stats"


def many_texts(records: list[Record]) -> list[str]:
    return [r.text for r in records]


def test_each_schedule_group_is_one_step_of_the_same_length_mix():
    plan = make(size=96)
    assert sorted(plan.order) == list(range(96))
    sizes = [g.end - g.start for g in plan.schedule_groups]
    assert sizes == [8] * 12
    means = [statistics.fmean(plan.predicted_tokens[g.start : g.end]) for g in plan.schedule_groups]
    overall = statistics.fmean(plan.predicted_tokens)
    assert max(means) < 1.25 * overall
    assert min(means) > 0.75 * overall
    # The snake deals the longest prompts evenly: every group holds about as many of them.
    top = sorted(plan.predicted_tokens)[-24]
    per_group = [
        sum(1 for t in plan.predicted_tokens[g.start : g.end] if t >= top)
        for g in plan.schedule_groups
    ]
    assert max(per_group) - min(per_group) <= 2, per_group


def test_batches_are_length_homogeneous_and_within_the_token_budget():
    plan = make(size=64, max_batch_tokens=600)
    for b in plan.batches:
        ids = range(b.start, b.end)
        assert {bucket_of(plan.bucket_boundaries, plan.predicted_tokens[i]) for i in ids} == {
            b.bucket
        }
        assert b.allocated_tokens <= 600 or b.end - b.start == 1
    stats = plan_stats(plan)
    # Against one batch per schedule group (no buckets, no budget), padding falls.
    flat = make(size=64, max_batch_tokens=10**9, boundaries=None, buckets=1)
    assert stats["predicted_padding_ratio"] < plan_stats(flat)["predicted_padding_ratio"]


def test_boundaries_come_from_the_data():
    assert derive_boundaries([10.0] * 50 + [100.0] * 50, 2) == (16,)
    assert derive_boundaries([5.0, 6.0], 1) == ()
    with pytest.raises(PlanError):
        derive_boundaries([1.0], 0)


def test_a_plan_round_trips_and_validates(tmp_path):
    plan = make()
    path = tmp_path / "p.json"
    write_plan(plan, path)
    loaded, stats = load_plan(path)
    assert loaded.order == plan.order
    assert stats == validate(plan)
    assert not list(tmp_path.glob(".p.json.*"))  # the temporary file is gone


def test_a_plan_with_fractional_predictions_loads_as_written(tmp_path):
    """Predictions from history means are fractions; the file once rounded them to 3 decimals
    while the batches' totals kept full precision, and the scheduler refused the plan that
    ``deltarl plan`` had just written ("predicted tokens do not add up")."""
    plan = make()
    tokens = tuple(t + 1 / 3 + i / 7 for i, t in enumerate(plan.predicted_tokens))
    batches = tuple(
        dataclasses.replace(
            b, predicted_tokens=plan.group_size * sum(tokens[i] for i in range(b.start, b.end))
        )
        for b in plan.batches
    )
    fractional = dataclasses.replace(plan, predicted_tokens=tokens, batches=batches)
    validate(fractional)
    path = tmp_path / "p.json"
    write_plan(fractional, path)
    loaded, _ = load_plan(path)
    assert loaded.predicted_tokens == tokens


@pytest.mark.parametrize(
    "tamper",
    [
        lambda p: dataclasses.replace(p, order=(p.order[1], *p.order[1:])),
        lambda p: dataclasses.replace(
            p, batches=(dataclasses.replace(p.batches[0], predicted_tokens=1e9), *p.batches[1:])
        ),
        lambda p: dataclasses.replace(p, batches=p.batches[1:]),
        lambda p: dataclasses.replace(
            p,
            schedule_groups=(
                dataclasses.replace(p.schedule_groups[0], instance_s=(0.0, 99.0)),
                *p.schedule_groups[1:],
            ),
        ),
    ],
    ids=["order", "batch-tokens", "batch-missing", "instance-times"],
)
def test_a_plan_that_does_not_add_up_is_refused(tmp_path, tamper):
    bad = tamper(make())
    with pytest.raises(PlanError):
        validate(bad)


def test_a_plan_over_its_skew_bound_is_refused():
    plan = make(size=16, instances=4, max_batch_tokens=10**9, buckets=1, max_skew=1.05)
    with pytest.raises(PlanError, match="predicted skew"):
        validate(plan)


def test_a_malformed_plan_file_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(orjson.dumps({"format": "deltarl-plan/1", "dataset": {}}))
    with pytest.raises(PlanError, match="malformed"):
        load_plan(path)
    path.write_bytes(b"{")
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(path)


def test_the_cli_writes_a_plan_or_refuses_one_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["arithmetic", "--size", "64", "--instances", "2", "--out", str(out), "--json"]
    assert plan_cli.main([*args, "--max-skew", "5"]) == 0
    stats = orjson.loads(capsys.readouterr().out)
    assert stats["written"] == str(out)
    assert stats["sources"]["default"] == 64  # no history given
    assert {"predicted_padding_ratio", "predicted_skew", "histogram"} <= stats.keys()
    load_plan(out)
    out.unlink()
    assert plan_cli.main([*args, "--instances", "16", "--max-skew", "1.0001"]) == 3
    assert "refused" in capsys.readouterr().err
    assert not out.exists()
    assert plan_cli.main(["arithmetic", "--size", "0"]) == 2
