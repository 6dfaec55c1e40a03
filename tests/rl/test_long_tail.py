"""The long-tail task: deterministic long-tailed lengths, prompts whose length predicts them up
to the stated noise, forced sample lengths clipped to the budget, and the letter-share reward."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from deltarl.rl.long_tail import MAX_FILLER_WORDS, LongTail, normal
from deltarl.rl.task import RepeatLetter, ShapedLengths, Task, make_task

PROMPTS = 4000


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation with tied values sharing their mean rank (many prompts have the same
    filler, hence the same length)."""

    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=float)
        order = np.argsort(a, kind="stable")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=float)
        for value in np.unique(a):
            tied = a == value
            r[tied] = r[tied].mean()
        return r

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def test_two_instances_agree_and_the_seed_changes_the_dataset() -> None:
    a, b = LongTail(seed=3), LongTail(seed=3)
    assert [a.prompt(i) for i in range(200)] == [b.prompt(i) for i in range(200)]
    assert [a.output_lengths(i, 7, 8) for i in range(200)] == [
        b.output_lengths(i, 7, 8) for i in range(200)
    ]
    other = LongTail(seed=4)
    assert [a.typical_tokens(i) for i in range(50)] != [other.typical_tokens(i) for i in range(50)]
    # Another draw of the same prompt is drawn anew; the samples of one draw differ.
    assert a.output_lengths(5, 7, 8) != a.output_lengths(5, 8, 8)
    assert len(set(a.output_lengths(5, 7, 8))) > 1


def test_the_normals_are_standard() -> None:
    zs = [normal(0, i, 99) for i in range(20_000)]
    assert abs(statistics.fmean(zs)) < 0.03
    assert abs(statistics.pstdev(zs) - 1) < 0.03
    assert abs(sum(abs(z) < 1 for z in zs) / len(zs) - 0.6827) < 0.015


def test_prompts_are_distinct_and_end_in_the_repeat_letter_form() -> None:
    task = LongTail(seed=1)
    prompts = [task.prompt(i) for i in range(PROMPTS)]
    assert len(set(prompts)) == PROMPTS
    for i, p in enumerate(prompts[:100]):
        assert p.startswith(f"#{i} ")
        assert p.endswith(f"Say a lot of {task.letter(i)}: ")
    assert {task.letter(i) for i in range(100)} == set("abcd")
    assert max(task.filler_words(i) for i in range(PROMPTS)) <= MAX_FILLER_WORDS


def test_the_dataset_is_bounded_by_its_size() -> None:
    task = LongTail(size=10)
    task.prompt(9)
    for bad in (-1, 10):
        with pytest.raises(IndexError, match="outside the dataset"):
            task.prompt(bad)
        with pytest.raises(IndexError, match="outside the dataset"):
            task.output_lengths(bad, 0, 2)
    LongTail().prompt(10**9)  # size 0: infinite


def test_reward_is_the_share_of_the_prompts_letter() -> None:
    task = LongTail()
    i = next(i for i in range(100) if task.letter(i) == "b")
    p = task.prompt(i)
    assert task.reward(p, "bbbbbbbb") == 1.0
    assert task.reward(p, "bbbbaaaa") == 0.5
    assert task.reward(p, "b") == 1 / 8  # the floor: stopping at once does not win
    assert task.reward(p, "") == 0.0
    assert task.reward(p, "a" * 20) == 0.0
    # The same reward as the default task's on the same letter.
    assert task.reward(p, "bxbxbbbbbbq") == RepeatLetter().reward("Say a lot of b: ", "bxbxbbbbbbq")
    for bad in ("Say a lot of b: ", "#3 Say a lot of bb: ", "#3 hello Say a lot of b: ", "x"):
        with pytest.raises(ValueError, match="not a prompt of this task"):
            task.reward(bad, "b")


def test_typical_lengths_are_log_normal_around_the_median_with_a_heavy_tail() -> None:
    task = LongTail(seed=2)
    typical = [task.typical_tokens(i) for i in range(PROMPTS)]
    assert abs(statistics.median(typical) / 24.0 - 1) < 0.1
    p50, p99 = np.percentile(typical, [50, 99])
    assert p99 / p50 > 5  # exp(2.33 * 0.9) = 8.1 for the default sigma
    logs = [math.log(t) for t in typical]
    assert abs(statistics.pstdev(logs) - 0.9) < 0.05


def test_sample_lengths_spread_around_the_typical_and_are_clipped() -> None:
    unclipped = LongTail(seed=2, max_tokens=10**9)
    lengths = [x for i in range(PROMPTS) for x in unclipped.output_lengths(i, 1, 2)]
    p50, p99 = np.percentile(lengths, [50, 99])
    assert abs(p50 / 24.0 - 1) < 0.1
    assert p99 / p50 > 5
    ratio = [
        math.log(unclipped.output_lengths(i, 1, 1)[0] / unclipped.typical_tokens(i))
        for i in range(PROMPTS)
    ]
    assert abs(statistics.pstdev(ratio) - 0.5) < 0.05  # sigma_sample, rounding aside

    clipped = LongTail(seed=2, max_tokens=64)
    capped = [x for i in range(PROMPTS) for x in clipped.output_lengths(i, 1, 2)]
    assert capped == [min(x, 64) for x in lengths]
    assert max(capped) == 64
    tiny = LongTail(median_tokens=0.5, sigma_prompt=2.0)
    short = [x for i in range(500) for x in tiny.output_lengths(i, 0, 4)]
    assert min(short) == 1  # never zero tokens
    # Sigmas far past the float range clip instead of overflowing.
    wild = LongTail(sigma_prompt=500.0, sigma_sample=500.0)
    seen = {x for i in range(200) for x in wild.output_lengths(i, 0, 4)}
    assert {1, 256} <= seen
    assert all(1 <= x <= 256 for x in seen)
    assert all(0 <= wild.filler_words(i) <= MAX_FILLER_WORDS for i in range(200))
    assert LongTail().output_lengths(0, 0, 0) == []


def test_a_longer_prompt_predicts_a_longer_completion() -> None:
    task = LongTail(seed=5)
    typical = [task.typical_tokens(i) for i in range(PROMPTS)]
    chars = [float(len(task.prompt(i))) for i in range(PROMPTS)]
    assert spearman(chars, typical) > 0.8
    # ...but only up to the prediction noise: exact knowledge would leave no error at all.
    exact = LongTail(seed=5, prediction_sigma=0.0)
    exact_chars = [float(len(exact.prompt(i))) for i in range(PROMPTS)]
    assert spearman(exact_chars, typical) > spearman(chars, typical)
    # The filler tracks typical / 8 through log-normal noise of prediction_sigma.
    noise = [
        math.log(task.filler_words(i) * 8 / t)
        for i, t in enumerate(typical)
        if task.filler_words(i) >= 8  # rounding is small against the noise there
    ]
    assert abs(statistics.pstdev(noise) - 0.35) < 0.07


def test_make_task_and_the_shaped_lengths_protocol() -> None:
    task = make_task("long_tail", seed=3, size=100)
    assert isinstance(task, LongTail)
    assert (task.seed, task.size, task.name) == (3, 100, "long_tail")
    assert isinstance(task, Task)
    assert isinstance(task, ShapedLengths)
    assert not isinstance(RepeatLetter(), ShapedLengths)
    assert not isinstance(make_task("arithmetic"), ShapedLengths)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"median_tokens": 0.0}, "median_tokens must be positive"),
        ({"median_tokens": math.nan}, "median_tokens must be positive"),
        ({"sigma_prompt": -0.1}, "sigma_prompt must be"),
        ({"sigma_sample": -1.0}, "sigma_sample must be"),
        ({"prediction_sigma": math.inf}, "prediction_sigma must be"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"size": -1}, "size must be >= 0"),
        ({"min_chars": 0}, "min_chars must be >= 1"),
        ({"letters": "aa"}, "letters must be distinct"),
    ],
)
def test_bad_knobs_are_refused(knobs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LongTail(**knobs)  # type: ignore[arg-type]
