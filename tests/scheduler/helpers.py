"""Building a SchedulerService on a real store in a temporary directory, with a clock the test
moves, and playing a rollout instance against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltarl.config.rl import SchedulerConfig
from deltarl.rl.protocol import GetWork, Heartbeat, SubmitGroup, Work
from deltarl.rl.samples import Group, Sample, encode_group
from deltarl.rl.task import RepeatLetter
from deltarl.scheduler.rows import parse_group_id
from deltarl.scheduler.service import SchedulerService
from deltarl.scheduler.store import SchedulerStore
from deltarl.transport.blobs import blob_digest


class Clock:
    """Wall and monotonic time in one: starts at a fixed epoch, moves only when told."""

    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def make_service(tmp: Path, **overrides: Any) -> tuple[SchedulerService, SchedulerStore, Clock]:
    values: dict[str, Any] = {
        "control": f"ipc://{tmp}/sched.sock",
        "db": tmp / "sched.sqlite",
        "group_size": 4,
        "groups_per_step": 2,
        "pool_capacity": 8,
        "max_policy_lag_steps": 2,
        "heartbeat_timeout_s": 10.0,
        "lease_s": 100.0,
        "reward_timeout_s": 2.0,
        "reward_retries": 1,
    }
    values.update(overrides)
    clock = Clock()
    store = SchedulerStore(values["db"], clock=clock)
    service = SchedulerService(SchedulerConfig(**values), store, monotonic=clock)
    return service, store, clock


def samples(item: dict[str, Any], n: int, version: int = 0, good: bool = True) -> list[Any]:
    """``n`` completions of a Work item: all its letter (reward 1) or all ``z`` (reward 0)."""
    letter = item["prompt"].removeprefix("Say a lot of ")[0] if good else "z"
    text = letter * 8
    return [
        {
            "prompt_token_ids": [1, 2, 3],
            "token_ids": list(range(8)),
            "logprobs": [-1.0] * 8,
            "token_versions": [version] * 8,
            "text": text,
            "finish_reason": "length",
        }
        for _ in range(n)
    ]


def encoded(group_id: str, samples: list[dict[str, Any]]) -> bytes:
    """Sample dicts (``samples``) as a rollout daemon puts them: one encoded group."""
    ids = parse_group_id(group_id)
    return encode_group(Group(group_id, ids[0] if ids else 0, tuple(Sample(**s) for s in samples)))


def submission(
    svc: SchedulerService, instance: str, session: str, group_id: str, samples: list[Any]
) -> SubmitGroup:
    """The submit of ``samples`` after their put on the samples socket (here: the store)."""
    data = encoded(group_id, samples)
    digest = blob_digest(data)
    svc.store.put_blob(digest, data)
    return SubmitGroup(instance, session, group_id, digest)


async def work(
    svc: SchedulerService, instance: str = "a", session: str = "s1", n: int = 2, version: int = 0
) -> Work:
    await svc.heartbeat(Heartbeat(instance, session, weight_version=version))
    reply = await svc.get_work(GetWork(instance, session, max_groups=n, weight_version=version))
    assert isinstance(reply, Work), reply
    return reply


async def submit_all(
    svc: SchedulerService, w: Work, instance: str = "a", session: str = "s1", version: int = 0
) -> list[Any]:
    return [
        await svc.submit_group(
            submission(svc, instance, session, g["group_id"], samples(g, g["n"], version))
        )
        for g in w.groups
    ]


LETTER_LENGTHS = {"a": 100, "b": 10, "c": 50, "d": 20}
"""Completion tokens of every sample of each letter's prompt (``RepeatLetter``), as
``generate_letters`` submits them."""


def letter_of(prompt: str) -> str:
    """The letter a ``RepeatLetter`` prompt asks for."""
    return prompt.removeprefix(RepeatLetter.TEMPLATE.partition("{}")[0])[0]


def samples_of_length(item: dict[str, Any], tokens: int) -> list[dict[str, Any]]:
    """A Work item's samples, each ``tokens`` long."""
    return [
        {
            "prompt_token_ids": [1, 2, 3],
            "token_ids": [5] * tokens,
            "logprobs": [-1.0] * tokens,
            "token_versions": [0] * tokens,
            "text": "x" * tokens,
            "finish_reason": "length",
        }
        for _ in range(item["n"])
    ]


async def generate_letters(
    svc: SchedulerService, instance: str, groups: int
) -> list[dict[str, Any]]:
    """One GetWork of ``groups`` from ``instance``, each submitted at its letter's length
    (``LETTER_LENGTHS``)."""
    await svc.heartbeat(Heartbeat(instance, "s", weight_version=0, tokens_per_s=10.0))
    reply = await svc.get_work(GetWork(instance, "s", max_groups=groups, weight_version=0))
    assert isinstance(reply, Work), reply
    for g in reply.groups:
        tokens = LETTER_LENGTHS[letter_of(g["prompt"])]
        await svc.submit_group(
            submission(svc, instance, "s", g["group_id"], samples_of_length(g, tokens))
        )
    return list(reply.groups)
