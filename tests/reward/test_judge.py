"""The judge plugin: its score parsing, and a real vLLM engine on the embedded tiny model
grading answers. The tiny model's grades are noise, so the engine test checks the plumbing:
each group comes back as one reward per answer in [0, 1], or as a counted ``reward_error``
for a reply without a score, never as a silent 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deltarl.config.reward import JudgeConfig, RewardConfig
from deltarl.reward.judge import PREFILL, JudgeScorer, parse_score
from deltarl.reward.protocol import ScoreGroup, Scores
from deltarl.reward.service import RewardService
from deltarl.rl.task import make_task
from deltarl.transport.messages import Error

# float32: bf16 is about 4x slower on CPU (the engine turns chunked prefill off there itself).
CPU_ENGINE = {"dtype": "float32", "max_model_len": 512}


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("Score: 7", 0.7),
        ("Score:10 because", 1.0),
        ("I think... Score: 0", 0.0),
        ("Score: 2.5", 0.25),
    ],
)
def test_parse_score(reply: str, reward: float) -> None:
    assert parse_score(reply, 10) == pytest.approx(reward)


@pytest.mark.parametrize("reply", ["", "Score:", "seven", "Score: 11", "Score: -1"])
def test_a_reply_without_a_score_in_range_is_an_error_not_zero(reply: str) -> None:
    with pytest.raises(ValueError, match="judge"):
        parse_score(reply, 10)


def test_rubric_must_name_prompt_and_answer() -> None:
    with pytest.raises(ValueError, match="rubric"):
        JudgeConfig(rubric="Grade this: {answer}")


def test_judge_grades_with_a_real_engine(tmp_path: Path) -> None:
    config = RewardConfig(
        control=f"ipc://{tmp_path}/reward.sock",
        scorer="judge",
        judge=JudgeConfig(max_tokens=4, engine=CPU_ENGINE),
    )
    service = RewardService(config, make_task("default"))
    judge = service.scorer
    assert isinstance(judge, JudgeScorer)

    async def main() -> list[object]:
        await judge.start()
        try:
            rendered = judge.render("Say a lot of a: ", "aaaa")
            assert rendered.endswith(PREFILL)
            assert "Say a lot of a: " in rendered
            assert "aaaa" in rendered
            groups = (["aaaa", "bbbb"], ["a"], ["aaaaaaaa", "zz", "abab"])
            replies = [await service.score(ScoreGroup("Say a lot of a: ", a)) for a in groups]
            # Greedy: the same answers get the same grades, or the same failure.
            replies.append(await service.score(ScoreGroup("Say a lot of a: ", ["a"])))
            return replies
        finally:
            await service.close()

    replies = asyncio.run(main())
    print("judge replies:", replies, judge.status())  # what the tiny model made of it
    sizes = [2, 1, 3, 1]
    for reply, n in zip(replies, sizes, strict=True):
        if isinstance(reply, Scores):
            assert len(reply.rewards) == n
            assert all(0.0 <= r <= 1.0 for r in reply.rewards)
        else:
            assert isinstance(reply, Error), reply
            assert reply.code == "reward_error"
            assert "Score: N" in reply.message
    assert replies[1] == replies[3] or (
        isinstance(replies[1], Scores)
        and isinstance(replies[3], Scores)
        and replies[1].rewards == replies[3].rewards
    )
    failed = sum(isinstance(r, Error) for r in replies)
    assert service.counters["judge.unparseable"] == failed
    assert service.counters["failed.reward_error"] == failed
    assert judge.status()["graded"] == sum(
        n for r, n in zip(replies, sizes, strict=True) if isinstance(r, Scores)
    )
