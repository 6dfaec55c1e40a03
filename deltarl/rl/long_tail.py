"""The long-tail task: the repeat-letter reward on prompts whose completion lengths follow a
long-tailed distribution, as reasoning traces do.

Why it exists: the real-engine benchmark has to show what length-aware scheduling buys, and
that needs a workload where a few groups run many times longer than the median. The embedded
tiny model cannot produce one by itself: its completions all run to ``max_tokens``. So the
lengths here are *forced*, not learned: the task fixes each sample's completion length
(``output_lengths``), the scheduler sends them with the group (``sampling["lengths"]``) and
the rollout engine generates exactly that many tokens (``max_tokens`` per sample, EOS
ignored; ``deltarl.rollout.engine`` says why not ``min_tokens``). The reward is
``RepeatLetter``'s letter share, so the task still trains.

The lengths, all drawn from a fixed integer hash (``mix64``) so every process agrees without
storing anything:

- each prompt has a *typical* length ``median_tokens * exp(N(0, sigma_prompt))``: log-normal
  across prompts, the heavy tail;
- each sample of a draw (a group, keyed by its sampling seed) runs ``typical * exp(N(0,
  sigma_sample))`` tokens, rounded and clipped to ``[1, max_tokens]``.

The prompt carries the signal a length predictor can use, by construction: it holds a filler
of about ``typical * exp(N(0, prediction_sigma)) / 8`` words, so a longer prompt means a longer
completion, as harder problems in real reasoning datasets do, and a predictor that reads the
prompt's length (``deltarl.scheduler.length_predictor``: statistics by character-length class,
a ridge regression on the text's features) knows a prompt's typical length up to about that
log-normal noise, the error the discrete-event model assumes (``prediction_sigma`` of
``deltarl.sim.schedule_model.long_tailed``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from deltarl.rl.task import RepeatLetter, mix64

# Hash streams: the same (seed, prompt_id) must give independent normals for the typical
# length, the prompt's filler and the samples' lengths, so each draw carries its own tag.
TYPICAL_TAG = 0x7479_7069  # "typi"
FILLER_TAG = 0x6669_6C6C  # "fill"
SAMPLE_TAG = 0x7361_6D70  # "samp"

FILLER_WORD = "please "
WORDS_PER_TOKEN = 1 / 8
"""Filler words per typical completion token: a 24-token median gives 3 words."""
MAX_FILLER_WORDS = 64
"""The filler's cap: the tiny model's context holds the prompt and 256 completion tokens."""

_PROMPT = re.compile(r"^#(\d+) (?:please )*Say a lot of (.): \Z", re.DOTALL)


def _uniform53(h: int) -> float:
    """A uniform in [0, 1) from the top 53 bits of a 64-bit hash: exact in a float."""
    return (h >> 11) / (1 << 53)


def normal(*key: int) -> float:
    """A standard normal drawn from ``mix64(*key)`` by Box-Muller: the same in every process,
    with no generator state to share."""
    h = mix64(*key)
    u1 = 1.0 - _uniform53(mix64(h, 1))  # in (0, 1]: the logarithm stays finite
    u2 = _uniform53(mix64(h, 2))
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _exp(x: float) -> float:
    """``exp`` that answers inf past the float range instead of raising: a far tail under
    large sigmas is clipped by the caller, not an error."""
    return math.exp(x) if x < 709.0 else math.inf


@dataclass(frozen=True)
class LongTail:
    """The long-tail task (see the module docstring)."""

    seed: int = 0
    size: int = 0
    median_tokens: float = 24.0
    sigma_prompt: float = 0.9
    sigma_sample: float = 0.5
    max_tokens: int = 256
    prediction_sigma: float = 0.35
    letters: str = "abcd"
    min_chars: int = 8
    name: str = "long_tail"
    _letters: RepeatLetter = field(init=False, repr=False, compare=False)

    TEMPLATE = "#{id} {filler}Say a lot of {letter}: "

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median_tokens) and self.median_tokens > 0):
            raise ValueError(f"median_tokens must be positive, got {self.median_tokens!r}")
        for knob in ("sigma_prompt", "sigma_sample", "prediction_sigma"):
            value = getattr(self, knob)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{knob} must be a finite number >= 0, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.size < 0:
            raise ValueError(f"size must be >= 0 (0: infinite), got {self.size!r}")
        # The letters and the reward are RepeatLetter's, which checks its own knobs.
        base = RepeatLetter(self.seed, self.size, self.letters, self.min_chars)
        object.__setattr__(self, "_letters", base)  # frozen: set once, here

    def _check(self, prompt_id: int) -> None:
        if prompt_id < 0 or (self.size and prompt_id >= self.size):
            raise IndexError(f"prompt id {prompt_id} is outside the dataset (size {self.size})")

    def letter(self, prompt_id: int) -> str:
        return self._letters.letter(prompt_id)

    def _log_typical(self, prompt_id: int) -> float:
        z = normal(self.seed, prompt_id, TYPICAL_TAG)
        return math.log(self.median_tokens) + self.sigma_prompt * z

    def typical_tokens(self, prompt_id: int) -> float:
        """The prompt's typical completion length, unclipped: the median of its samples'."""
        return _exp(self._log_typical(prompt_id))

    def filler_words(self, prompt_id: int) -> int:
        """Words of filler in the prompt: its typical length, seen through log-normal noise."""
        z = normal(self.seed, prompt_id, FILLER_TAG)
        seen = _exp(self._log_typical(prompt_id) + self.prediction_sigma * z)
        return min(MAX_FILLER_WORDS, max(0, round(min(seen, 2.0**60) * WORDS_PER_TOKEN)))

    def prompt(self, prompt_id: int) -> str:
        self._check(prompt_id)
        # The id makes every prompt's text distinct: the predictor's history is keyed by text.
        return self.TEMPLATE.format(
            id=prompt_id,
            filler=FILLER_WORD * self.filler_words(prompt_id),
            letter=self.letter(prompt_id),
        )

    def reward(self, prompt: str, completion: str) -> float:
        match = _PROMPT.match(prompt)
        if match is None:
            raise ValueError(f"not a prompt of this task: {prompt!r}")
        return self._letters.reward(RepeatLetter.TEMPLATE.format(match.group(2)), completion)

    def output_lengths(self, prompt_id: int, draw: int, n: int) -> list[int]:
        """The forced completion length of each of the ``n`` samples of one draw of
        ``prompt_id`` (the scheduler passes the group's sampling seed as ``draw``)."""
        self._check(prompt_id)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        log_typical = self._log_typical(prompt_id)
        out = []
        for i in range(n):
            z = normal(self.seed, prompt_id, draw, i, SAMPLE_TAG)
            # Clipped before rounding: a far tail (large sigmas) is inf, which round refuses.
            length = min(float(self.max_tokens), _exp(log_typical + self.sigma_sample * z))
            out.append(max(1, round(length)))
        return out
