"""What a reward plugin is, and the plugins by name (``scorer = "..."`` in [daemons.reward]).

A plugin scores one group at a time: ``score_group(prompt, texts)`` returns one finite float
per text, in order, or raises ``ScoreError`` with the code the daemon answers (see
``deltarl.reward.protocol``). ``start`` runs before the daemon binds its socket (a judge
loads its model there, so a bad model directory is a configuration error, exit 78, not a
stream of failed calls); ``close`` runs once at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from deltarl.config.reward import RewardConfig
from deltarl.rl.task import Task


class ScoreError(Exception):
    """A group could not be scored; ``code`` is ``reward_error`` or ``reward_timeout``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class GroupScorer(Protocol):
    name: str

    async def start(self) -> None: ...

    async def score_group(self, prompt: str, texts: Sequence[str]) -> list[float]: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


Counter = Callable[[str], None]
ScorerFactory = Callable[[RewardConfig, Task, Counter], GroupScorer]


def _rule(config: RewardConfig, task: Task, count: Counter) -> GroupScorer:
    from deltarl.reward.rule import RuleScorer  # noqa: PLC0415 - each plugin's imports

    return RuleScorer(task, config.score_timeout_s, config.rule_workers, count)


def _judge(config: RewardConfig, task: Task, count: Counter) -> GroupScorer:
    del task  # the judge grades any prompt's answers
    from deltarl.reward.judge import JudgeScorer  # noqa: PLC0415 - vLLM only when used

    return JudgeScorer(config.judge, count)


SCORERS: dict[str, ScorerFactory] = {"rule": _rule, "judge": _judge}
"""Every plugin by name. A site's own plugin is one entry more (a program that adds it and
then runs ``deltarl.daemons.reward.main``; the tests' fault-injecting scorers do so)."""


def make_scorer(config: RewardConfig, task: Task, count: Counter) -> GroupScorer:
    try:
        factory = SCORERS[config.scorer]
    except KeyError:
        raise ValueError(f"unknown scorer {config.scorer!r}; known: {sorted(SCORERS)}") from None
    return factory(config, task, count)
