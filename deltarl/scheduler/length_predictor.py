"""Predicting a prompt's output length before it is generated: what the plan and the ``deltarl``
dispatch policy balance instances by.

Three sources, tried in this order for each prompt (seed 000's "history statistics or a light
model"); each prediction says which one gave it:

``history``
    This very prompt was generated before (the same text, by its ``prompt_key``): the mean
    completion tokens per sample of its recorded groups.
``prompt_stats``
    Prompts of the same task and length class (characters, by powers of two) were: their
    mean, once at least ``min_count`` groups are on record in the class.
``learned``
    A ridge regression of log(mean tokens per sample) on a few features of the prompt text
    (its length, digits, words, operators), fitted on every recorded group of the task. It
    needs at least ``MIN_FIT_ROWS`` groups.
``default``
    Nothing on record: ``default_tokens`` for every prompt. Balancing then only counts
    prompts; the scheduler's online correction (``deltarl.scheduler.plan_view``) learns from
    the first groups that finish.

The history is ``length_log``'s table in a run's scheduler store (``load_history``), so a
second run of a task plans from the first one's lengths.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from deltarl.scheduler.store import SchedulerStore

SOURCES = ("history", "prompt_stats", "learned", "default")
MIN_FIT_ROWS = 16
"""The learned predictor is fitted only on at least this many recorded groups."""
RIDGE = 0.05
"""Ridge strength: just enough to keep the fit defined when features repeat."""
_DIGITS = re.compile(r"\d")


def prompt_key(text: str) -> int:
    """A prompt's identity across runs and plans: xxh64 of its text, as a signed 64-bit int
    (what sqlite stores)."""
    v = xxhash.xxh64_intdigest(text.encode())
    return v - (1 << 64) if v >= 1 << 63 else v


def length_class(chars: int) -> int:
    """The prompt-length class of the statistics: characters by powers of two."""
    return max(chars, 1).bit_length()


def features(text: str) -> np.ndarray:
    """The learned predictor's inputs: a bias, log length, digits, words and arithmetic
    operators, each scaled to about one."""
    return np.array(
        [
            1.0,
            math.log1p(len(text)) / 5,
            len(_DIGITS.findall(text)) / 10,
            len(text.split()) / 20,
            sum(text.count(op) for op in "+-*/=") / 4,
        ]
    )


@dataclass(frozen=True)
class Record:
    """One generated group, as the history holds it."""

    task: str
    key: int
    text: str
    outputs: tuple[int, ...]
    """Completion tokens of each sample."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.outputs) if self.outputs else 0.0


@dataclass(frozen=True)
class Prediction:
    tokens: float
    """Predicted completion tokens per sample."""
    source: str


class LengthPredictor:
    """Predicts completion tokens per sample for one task's prompts (module docstring).

    It learns incrementally: ``add`` folds in one more group, so a scheduler without a plan
    predicts from its own run's history as groups pool (``deltarl.scheduler.service``), and
    ``deltarl plan`` builds one from every recorded group. Each source keeps sums, not rows:
    a mean per prompt key and per length class, and the ridge's normal equations.
    """

    def __init__(
        self,
        records: Iterable[Record],
        task: str,
        *,
        default_tokens: float,
        min_count: int = 4,
    ) -> None:
        if default_tokens <= 0:
            raise ValueError(f"default_tokens must be positive, got {default_tokens}")
        self.task = task
        self.default_tokens = float(default_tokens)
        self.min_count = min_count
        self._by_key: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])  # [sum, count]
        self._by_class: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
        width = features("").shape[0]
        self._xtx = np.zeros((width, width))
        self._xty = np.zeros(width)
        self._weights: np.ndarray | None = None
        self._stale = False  # the weights lag the normal equations
        self.records = 0
        for r in records:
            self.add(r)

    def add(self, record: Record) -> bool:
        """Learn one more group; False (and nothing learned) for another task's or an empty
        one."""
        if record.task != self.task or not record.outputs:
            return False
        mean = record.mean
        for table, k in (
            (self._by_key, record.key),
            (self._by_class, length_class(len(record.text))),
        ):
            table[k][0] += mean
            table[k][1] += 1
        x = features(record.text)
        self._xtx += np.outer(x, x)
        self._xty += x * math.log(max(mean, 1.0))
        self.records += 1
        self._stale = True
        return True

    @property
    def fitted(self) -> bool:
        """Whether the learned source answers: then every prompt gets a prediction of its own."""
        return self.records >= MIN_FIT_ROWS

    @property
    def weights(self) -> np.ndarray | None:
        """The ridge's weights over ``features`` (None below ``MIN_FIT_ROWS`` groups)."""
        if not self.fitted:
            return None
        if self._stale or self._weights is None:
            a = self._xtx + RIDGE * np.eye(self._xtx.shape[0])
            a[0, 0] -= RIDGE  # the bias is not shrunk
            self._weights = np.linalg.solve(a, self._xty)
            self._stale = False
        return self._weights

    def predict(self, text: str) -> Prediction:
        found = self._by_key.get(prompt_key(text))
        if found is not None:
            return Prediction(max(found[0] / found[1], 1.0), "history")
        found = self._by_class.get(length_class(len(text)))
        if found is not None and found[1] >= self.min_count:
            return Prediction(max(found[0] / found[1], 1.0), "prompt_stats")
        weights = self.weights
        if weights is not None:
            return Prediction(max(math.exp(float(features(text) @ weights)), 1.0), "learned")
        return Prediction(self.default_tokens, "default")


def load_history(paths: Sequence[Path]) -> list[Record]:
    """Every recorded group in these scheduler stores (sqlite files, or run directories holding
    one at ``scheduler.sqlite``), opened read-only. A store from before ``length_log`` has
    none."""
    out: list[Record] = []
    for path in paths:
        db = path / "scheduler.sqlite" if path.is_dir() else path
        if not db.is_file():
            raise FileNotFoundError(f"{path}: no scheduler store there")
        with SchedulerStore(db, readonly=True) as store:
            out += store_records(store)
    return out


def store_records(store: SchedulerStore) -> list[Record]:
    """Every group recorded in one open scheduler store's ``length_history``."""
    return [Record(t, k, x, tuple(o)) for t, k, x, _, o in store.length_records()]
