"""The arithmetic task: deterministic problems, exact answers, a held-out split training never
repeats, and a reward that pays the answer, a little for the form, nothing for noise."""

from __future__ import annotations

import pytest

from deltarl.rl.arithmetic import (
    EVAL,
    LEVELS,
    TRAIN,
    Arithmetic,
    answer,
    draw,
    parse,
    render,
    solve,
)
from deltarl.rl.task import Task, make_task


def test_problems_are_the_same_in_every_process_and_cover_every_level() -> None:
    task = make_task("arithmetic", seed=3)
    assert isinstance(task, Task)
    assert [task.prompt(i) for i in range(50)] == [Arithmetic(seed=3).prompt(i) for i in range(50)]
    assert task.prompt(0) != Arithmetic(seed=4).prompt(0)
    shapes = set()
    for i in range(2000):
        a, op, b = draw(3, TRAIN, i)
        shapes.add((len(str(a)), len(str(b)), op))
    for da, db, ops in LEVELS:
        for op in ops:
            assert (da, db, op) in shapes


def test_the_held_out_split_never_appears_in_training() -> None:
    task = Arithmetic(seed=0, eval_size=200)
    held = {draw(0, EVAL, i) for i in range(200)}
    assert len(held) > 150  # distinct enough to be an evaluation
    train = {task.problem(i) for i in range(20_000)}
    assert not train & held
    # the filter is doing something: the raw training stream does hit the split
    raw = {draw(0, TRAIN, i) for i in range(20_000)}
    assert raw & held
    assert parse(task.eval_prompt(5)) == draw(0, EVAL, 5)
    with pytest.raises(IndexError):
        task.eval_prompt(200)


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("47 + 385 = 432\nAnswer: 432", 1.0),
        ("Answer: 400\nWait, recheck.\nAnswer: 432", 1.0),  # the last answer counts
        ("Answer: 432\nno, Answer: 431", 0.1),  # the form, a wrong value
        ("Answer: **432**", 1.0),
        ("Answer: 1,432", 0.1),
        ("Answer: 432, since 47 + 385 = 432 (not 400)", 1.0),  # the form wins over later numbers
        ("47 + 385 = 432", 0.5),  # right, but not in the asked form: the last number
        ("The answer is 432.", 0.5),
        ("432 is wrong, it is 431", 0.0),
        ("Answer: none", 0.0),  # no number after it: not the form
        ("no number at all", 0.0),
        ("", 0.0),
    ],
)
def test_reward(completion: str, reward: float) -> None:
    prompt = render((47, "+", 385))
    assert Arithmetic().reward(prompt, completion) == reward


def test_parsing_and_solving() -> None:
    for p in [(12, "-", 345), (99, "*", 7), (1000, "+", 9999)]:
        assert parse(render(p)) == p
    assert solve((12, "-", 345)) == -333
    assert answer("Answer: -333") == -333
    assert answer("Answer: 1,234") == 1234
    with pytest.raises(ValueError, match="arithmetic"):
        Arithmetic().reward("Say a lot of a: ", "Answer: 1")
