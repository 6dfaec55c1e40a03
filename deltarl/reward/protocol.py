"""The reward service's control messages: the scheduler asks ``deltarl reward`` to score.

    ScoreGroup(prompt, texts, task, group_id)  ->  Scores(rewards, seconds)
                                               |   Error(code, message)

``rewards`` holds one finite float per text, in order; ``seconds`` is how long the scoring
took inside the daemon (the scheduler measures the whole call itself). A group is scored whole
or not at all (GRPO normalises within the group), so any failure is an Error for the group:

- ``reward_error``: the scorer failed on this group (the checker raised or returned no
  finite number; the judge's reply held no score). Retried by the client, then the group is
  dropped as today's in-process failures are.
- ``reward_timeout``: a checker's call ran past the daemon's ``score_timeout_s``.
- ``wrong_task``: the daemon scores another task than the one named; a configuration error
  the client does not retry.

The standard errors of every control socket (``busy``, ``timeout``, ``stopping``,
``handler_failed``) say the service itself is not well: they count against the scheduler's
circuit breaker, as do calls that get no reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from deltarl.transport.messages import REPLIES as BASE_REPLIES
from deltarl.transport.messages import Command, Reply, decode_table

REWARD_ERROR = "reward_error"
REWARD_TIMEOUT = "reward_timeout"
WRONG_TASK = "wrong_task"
REWARD_UNAVAILABLE = "reward_unavailable"
"""The scheduler's answer to a submit while its reward service is unavailable (circuit
breaker open): the group stays issued to its instance, which submits it again later."""


@dataclass(frozen=True)
class ScoreGroup(Command):
    """Score every text of one group for ``prompt``. Answered ``Scores`` or ``Error``."""

    TAG: ClassVar[str] = "reward.score"
    prompt: str
    texts: list[Any]
    task: str | None = None
    """The task the scheduler runs; the daemon refuses one that is not its own."""
    group_id: str = ""
    """For the daemon's log only."""


@dataclass(frozen=True)
class Scores(Reply):
    TAG: ClassVar[str] = "reward.scores"
    rewards: list[Any]
    seconds: float = 0.0


REWARD_COMMANDS = decode_table(ScoreGroup)
REPLIES = {**BASE_REPLIES, **decode_table(Scores)}
"""What a client of the reward daemon decodes: ``ControlClient(endpoint, replies=REPLIES)``."""
