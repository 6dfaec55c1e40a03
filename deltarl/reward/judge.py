"""The ``judge`` plugin: a model grades each answer with a rubric prompt (self-feedback).

For tasks without a rule checker. A vLLM engine (``deltarl.rollout.engine.VllmEngine``, the
rollout daemon's) serves a frozen copy of the policy from a model directory; each answer is
put into the rubric, rendered with the tokenizer's chat template when it has one, and the
judge's reply is read as ``Score: N`` (N in [0, max_score]), the reward N / max_score.

- Greedy decoding: the same answer gets the same grade, so a retry of a group does not
  shop for a better one.
- The reply is prefilled with ``Score:`` (appended to the rendered prompt), so the model
  only has to say the number; the prefix is parsed as part of the reply.
- A reply without a score is an error (``reward_error``, counted ``judge.unparseable``),
  never a reward of 0: a 0 would train the policy against a grader that said nothing.

The engine is not thread-safe; every call to it runs on one thread of its own (an executor
of one), so the daemon's event loop keeps answering ``status`` while the judge generates.
Groups are graded one after the other, the answers of a group batched together.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

from deltarl.config.reward import JudgeConfig
from deltarl.reward.scorer import Counter, ScoreError
from deltarl.rollout.engine import VllmEngine, VllmEngineConfig

logger = logging.getLogger(__name__)

DEFAULT_RUBRIC = (
    "You are a strict grader. Read the question and the answer, then grade how correct "
    "and helpful the answer is, from 0 (wrong or empty) to {max_score} (fully correct).\n\n"
    "Question:\n{prompt}\n\nAnswer:\n{answer}\n\n"
    "Reply with one line of the form 'Score: N'."
)
PREFILL = "Score:"
_SCORE = re.compile(r"Score:\s*(\d+(?:\.\d+)?)")


def parse_score(reply: str, max_score: int) -> float:
    """The reward in [0, 1] that a judge's reply states; ValueError if it states none."""
    found = _SCORE.search(reply)
    if found is None:
        raise ValueError(f"no 'Score: N' in the judge's reply {reply[:80]!r}")
    value = float(found.group(1))
    if not 0 <= value <= max_score:
        raise ValueError(f"the judge's score {value:g} is outside [0, {max_score}]")
    return value / max_score


def engine_config(config: JudgeConfig, model: Path) -> VllmEngineConfig:
    """The judge's engine: ``config.engine`` over VllmEngineConfig's defaults."""
    known = {f.name for f in fields(VllmEngineConfig)} - {"model"}
    unknown = sorted(set(config.engine) - known)
    if unknown:
        raise ValueError(f"judge.engine: unknown keys {unknown}; known: {sorted(known)}")
    return VllmEngineConfig(model=model, **config.engine)


class JudgeScorer:
    name = "judge"

    def __init__(self, config: JudgeConfig, count: Counter) -> None:
        self.config = config
        self.count = count
        self.rubric = config.rubric or DEFAULT_RUBRIC
        self.model: Path | None = config.model_dir
        self.engine: VllmEngine | None = None
        self._template: Any = None  # the tokenizer, when it has a chat template
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge")
        self._ids = itertools.count()
        self.graded = 0
        self.unparseable = 0
        self.generate_s = 0.0

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._start)

    def _start(self) -> None:
        if self.model is None:
            from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415

            self.model = ensure_default_model()
        if not (self.model / "config.json").is_file():
            raise ValueError(f"judge.model_dir {self.model} holds no config.json")
        from transformers import AutoTokenizer  # noqa: PLC0415 - heavy

        tokenizer = AutoTokenizer.from_pretrained(str(self.model))
        self._template = tokenizer if getattr(tokenizer, "chat_template", None) else None
        self.engine = VllmEngine(engine_config(self.config, self.model))
        self.engine.start()

    def render(self, prompt: str, answer: str) -> str:
        """The judge's prompt for one answer, ending with the prefilled ``Score:``."""
        text = self.rubric.format(prompt=prompt, answer=answer, max_score=self.config.max_score)
        if self._template is not None:
            text = self._template.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        else:
            text += "\n"
        return text + PREFILL

    async def score_group(self, prompt: str, texts: Sequence[str]) -> list[float]:
        prompts = [self.render(prompt, t) for t in texts]
        loop = asyncio.get_running_loop()
        try:
            replies = await loop.run_in_executor(self._thread, self._generate, prompts)
        except ValueError as e:  # vLLM refuses a request (a prompt over max_model_len)
            raise ScoreError("reward_error", f"judge: {e}") from None
        rewards = []
        for reply in replies:
            try:
                rewards.append(parse_score(PREFILL + reply, self.config.max_score))
            except ValueError as e:
                self.unparseable += 1
                self.count("judge.unparseable")
                raise ScoreError("reward_error", f"judge: {e}") from None
        self.graded += len(rewards)
        return rewards

    def _generate(self, prompts: list[str]) -> list[str]:
        """Greedy replies to ``prompts``, batched; on the judge's thread."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("the judge's engine is not started")
        t0 = time.perf_counter()
        ids = [f"judge-{next(self._ids)}" for _ in prompts]
        sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": self.config.max_tokens}
        for gid, p in zip(ids, prompts, strict=True):
            engine.add_group(gid, p, 1, sampling)
        wanted, replies = set(ids), dict[str, str]()
        while len(replies) < len(ids):
            for done in engine.step():
                if done.group_id in wanted:  # not a request left by an earlier failed call
                    replies[done.group_id] = str(done.samples[0]["text"])
        self.generate_s += time.perf_counter() - t0
        return [replies[g] for g in ids]

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, engine.close)
        self._thread.shutdown(wait=False)

    def status(self) -> dict[str, Any]:
        return {
            "model": None if self.model is None else str(self.model),
            "graded": self.graded,
            "unparseable": self.unparseable,
            "generate_s": round(self.generate_s, 3),
        }
