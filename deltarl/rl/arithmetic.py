"""The arithmetic task: procedurally generated problems with one exact answer, and a held-out
evaluation split no training prompt repeats.

A problem is ``a OP b`` with OP one of ``+ - *``, at one of ``LEVELS`` of difficulty (from one
digit each up to three-digit sums and two-digit products), drawn by a fixed hash of (seed,
split, id) so every process agrees on the dataset without storing it. The prompt asks for the
answer in one fixed form:

    What is 47 + 385? End your reply with "Answer: <number>".

The reward pays the answer in the asked form most, and the form a little:

    1.0   the number after the last ``Answer:`` is the true value
    0.5   no ``Answer:`` at all, but the completion's last number is the true value
    0.1   ``Answer: <number>`` with a wrong value (the form alone)
    0.0   anything else

Accuracy (the held-out evaluation's) is the share of samples with reward exactly 1.0: the
right value in the asked form. Measured on SmolLM2-135M-Instruct with the chat template,
greedy: the last number was right in about 23% of replies but the form was followed in only
10% (27% of samples at temperature 0.7). An exact-value reward that ignores the form
(how this task began) moved greedy held-out answers on 3 of 128 problems in 10 steps; the
tiers give GRPO an order among the wrong answers too, and what the policy learns first is
the instruction it was given.

The levels are weighted towards the easy ones, where a 135M model is right a third of the time
or more when greedy (and far less when sampling at temperature 1), so that groups carry signal
at once; the hard ones leave room to learn.

The evaluation split: ``eval_size`` problems drawn from their own hash stream; training
problems that coincide with one of them are skipped (the next draw is used), so accuracy on the
split measures generalisation, not memory. ``eval_prompt(i)`` gives them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from deltarl.rl.task import mix64

# (digits of a, digits of b, operators), easiest first. Drawn with the weights below: the
# easy levels let a 135M model earn rewards at once, the hard ones leave room to learn.
LEVELS: tuple[tuple[int, int, str], ...] = (
    (1, 1, "+-*"),
    (2, 1, "+-"),
    (2, 1, "*"),
    (2, 2, "+-"),
    (3, 3, "+-"),
    (2, 2, "*"),
)
WEIGHTS = (3, 3, 2, 2, 1, 1)
TRAIN, EVAL = 1, 2  # hash streams of the two splits
TEMPLATE = 'What is {a} {op} {b}? End your reply with "Answer: <number>".'
_PROMPT = re.compile(r"^What is (\d+) ([+\-*]) (\d+)\?")
_ANSWER = re.compile(r"Answer:\s*\**\s*(-?\d[\d,]*)")
_NUMBER = re.compile(r"-?\d[\d,]*")

Problem = tuple[int, str, int]


def solve(problem: Problem) -> int:
    a, op, b = problem
    return a + b if op == "+" else a - b if op == "-" else a * b


def _number(rng: int, digits: int) -> int:
    low = 10 ** (digits - 1) if digits > 1 else 0
    return low + rng % (10**digits - low)


def draw(seed: int, split: int, index: int) -> Problem:
    """The problem at ``index`` of a split's hash stream."""
    h = mix64(seed, split, index)
    pick = h % sum(WEIGHTS)
    level = 0
    while pick >= WEIGHTS[level]:
        pick -= WEIGHTS[level]
        level += 1
    da, db, ops = LEVELS[level]
    op = ops[mix64(h, 1) % len(ops)]
    return _number(mix64(h, 2), da), op, _number(mix64(h, 3), db)


@dataclass(frozen=True)
class Arithmetic:
    seed: int = 0
    size: int = 0  # 0: unbounded training prompts
    eval_size: int = 128
    name: str = "arithmetic"
    _held_out: frozenset[Problem] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.size < 0 or self.eval_size < 1:
            raise ValueError("size must be >= 0 and eval_size >= 1")
        held = frozenset(draw(self.seed, EVAL, i) for i in range(self.eval_size))
        object.__setattr__(self, "_held_out", held)

    def problem(self, prompt_id: int) -> Problem:
        """Training problem ``prompt_id``: the stream's draw, skipping held-out problems."""
        if prompt_id < 0 or (self.size and prompt_id >= self.size):
            raise IndexError(f"prompt id {prompt_id} is outside the dataset (size {self.size})")
        attempt = 0
        while True:
            p = draw(self.seed, TRAIN, mix64(prompt_id, attempt))
            if p not in self._held_out:
                return p
            attempt += 1

    def prompt(self, prompt_id: int) -> str:
        return render(self.problem(prompt_id))

    def eval_prompt(self, index: int) -> str:
        if not 0 <= index < self.eval_size:
            raise IndexError(f"eval index {index} is outside the split (size {self.eval_size})")
        return render(draw(self.seed, EVAL, index))

    def reward(self, prompt: str, completion: str) -> float:
        return score(parse(prompt), completion)


def render(problem: Problem) -> str:
    a, op, b = problem
    return TEMPLATE.format(a=a, op=op, b=b)


def parse(prompt: str) -> Problem:
    m = _PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not a prompt of the arithmetic task: {prompt[:80]!r}")
    return int(m.group(1)), m.group(2), int(m.group(3))


RIGHT, RIGHT_UNFORMED, FORM_ONLY = 1.0, 0.5, 0.1


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def answer(completion: str) -> int | None:
    """The number after the last ``Answer:`` in ``completion``, else its last number (commas
    as thousands separators allowed), or None."""
    found = _ANSWER.findall(completion) or _NUMBER.findall(completion)
    return _int(found[-1]) if found else None


def score(problem: Problem, completion: str) -> float:
    """The reward tiers of the module docstring."""
    value = solve(problem)
    stated = _ANSWER.findall(completion)
    if stated:
        return RIGHT if _int(stated[-1]) == value else FORM_ONLY
    numbers = _NUMBER.findall(completion)
    return RIGHT_UNFORMED if numbers and _int(numbers[-1]) == value else 0.0
