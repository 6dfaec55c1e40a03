"""RL tasks: a prompt dataset indexed by an integer, and a verifiable reward on completion text.

A task works on text only: the rollout engine tokenizes each prompt with its model's own
tokenizer, so the same task runs on the embedded tiny model and on any Hugging Face model
directory named in the configuration. The scheduler picks the task by name (``task = "..."``
in its table) through ``make_task``.

The embedded default, ``RepeatLetter``, is chosen to be learnable by a tiny randomly
initialised byte-level-BPE model in a few dozen GRPO steps, and to be honest about it:

- prompt ``prompt_id`` is ``"Say a lot of X: "`` with X one of a few letters, drawn by a fixed
  integer hash of (seed, prompt_id), so every process agrees on the dataset without storing it;
- reward = (characters of the completion equal to X) / max(len(completion), MIN_CHARS), in
  [0, 1]. The floor MIN_CHARS makes a one-character "X" worth 1/MIN_CHARS, so the model cannot
  win by stopping at once; any other character dilutes the share. A random model scores about
  1/(vocabulary of characters it emits); rising reward means it learned to read X from the
  prompt and repeat it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

_MASK64 = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A fixed 64-bit hash of integers (splitmix64 steps): the same in every process and
    Python version, unlike ``hash`` of a tuple."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


@runtime_checkable
class Task(Protocol):
    """A prompt dataset and its reward. ``size`` 0 means infinite (any id >= 0 is a prompt)."""

    name: str
    size: int

    def prompt(self, prompt_id: int) -> str:
        """The prompt text of ``prompt_id``; the same text every time, in every process."""
        ...

    def reward(self, prompt: str, completion: str) -> float:
        """The reward of ``completion`` for ``prompt``, a finite float (here in [0, 1])."""
        ...


@runtime_checkable
class ShapedLengths(Protocol):
    """A task that fixes each sample's completion length instead of leaving it to the model
    (``deltarl.rl.long_tail``: a long-tailed length workload on real engines). The scheduler
    sends a group's lengths as ``sampling["lengths"]``; the rollout engine then generates
    exactly that many tokens per sample (EOS ignored)."""

    max_tokens: int
    """The longest length it forces (``deltarl up`` makes it the sampling's ``max_tokens``)."""

    def output_lengths(self, prompt_id: int, draw: int, n: int) -> list[int]:
        """The completion length of each of the ``n`` samples of one draw of ``prompt_id``
        (the group's sampling seed), each in [1, the task's max_tokens]; the same in every
        process."""
        ...


@dataclass(frozen=True)
class RepeatLetter:
    """The embedded default task (see the module docstring)."""

    seed: int = 0
    size: int = 0
    letters: str = "abcd"
    min_chars: int = 8
    name: str = "default"

    TEMPLATE = "Say a lot of {}: "

    def __post_init__(self) -> None:
        if not self.letters or len(set(self.letters)) != len(self.letters):
            raise ValueError(f"letters must be distinct and non-empty, got {self.letters!r}")
        if self.min_chars < 1 or self.size < 0:
            raise ValueError("min_chars must be >= 1 and size >= 0")

    def letter(self, prompt_id: int) -> str:
        return self.letters[mix64(self.seed, prompt_id) % len(self.letters)]

    def prompt(self, prompt_id: int) -> str:
        if prompt_id < 0 or (self.size and prompt_id >= self.size):
            raise IndexError(f"prompt id {prompt_id} is outside the dataset (size {self.size})")
        return self.TEMPLATE.format(self.letter(prompt_id))

    def reward(self, prompt: str, completion: str) -> float:
        head, _, tail = self.TEMPLATE.partition("{}")
        if not (prompt.startswith(head) and prompt.endswith(tail)):
            raise ValueError(f"not a prompt of this task: {prompt!r}")
        target = prompt[len(head) : len(prompt) - len(tail)]
        if len(target) != 1:
            raise ValueError(f"not a prompt of this task: {prompt!r}")
        hits = completion.count(target)
        return hits / max(len(completion), self.min_chars)


def tasks() -> dict[str, Callable[..., Task]]:
    """Every task by name (``task = "..."`` in the scheduler's table)."""
    from deltarl.rl.arithmetic import Arithmetic  # noqa: PLC0415 - it imports mix64 from here
    from deltarl.rl.long_tail import LongTail  # noqa: PLC0415 - the same

    return {"default": RepeatLetter, "arithmetic": Arithmetic, "long_tail": LongTail}


def make_task(name: str, *, seed: int = 0, size: int = 0) -> Task:
    """The task called ``name``; ValueError naming the known ones otherwise."""
    known = tasks()
    try:
        make = known[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(known)}") from None
    return make(seed=seed, size=size)
