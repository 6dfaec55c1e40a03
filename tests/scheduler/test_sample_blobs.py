"""Sample blobs in the scheduler's store: kept while a group refers to them, released with the
drop or the checkpoint that unreferences them, swept after the grace when no submit came, and
never lost by a sweep that races a submit being scored."""

from __future__ import annotations

import asyncio
from pathlib import Path

from deltarl.rl.protocol import Checkpointed, TakeBatch
from deltarl.scheduler.store import SchedulerStore
from deltarl.transport.blobs import blob_digest
from deltarl.transport.messages import Ok
from tests.scheduler.helpers import encoded, make_service, samples, submission, submit_all, work


def test_blobs_live_as_long_as_their_groups(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, clock = make_service(tmp_path, samples_grace_s=60.0)
        w = await work(svc, n=2)
        assert all(isinstance(r, Ok) for r in await submit_all(svc, w))
        assert store.blob_stats()["blobs"] == 2
        assert store.blob_stats()["unreferenced"] == 0
        loose = encoded("5.0", samples(w.groups[0], 4))
        store.put_blob(blob_digest(loose), loose)  # a put whose submit never comes
        clock.advance(30.0)
        assert store.sweep_blobs(60.0) == 0  # within the grace
        clock.advance(31.0)
        assert store.sweep_blobs(60.0) == 1  # past it; pooled groups' blobs stay
        assert store.blob_stats()["blobs"] == 2
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        refs = [g["samples_ref"] for g in batch.groups]
        assert all(store.get_blob(r) is not None for r in refs)
        await svc.checkpointed(Checkpointed(1))  # trained for good: released
        assert store.blob_stats() == {"blobs": 0, "bytes": 0, "unreferenced": 0}

    asyncio.run(go())


def test_a_group_dropped_for_lag_releases_its_blob(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path, max_policy_lag_steps=1)
        w = await work(svc, n=2)
        await submit_all(svc, w, version=0)
        assert store.blob_stats()["blobs"] == 2
        await svc.take_batch(TakeBatch(step=5, groups=2, trainer_version=5))
        assert store.counters()["dropped_groups.lag_exceeded"] == 2
        assert store.blob_stats()["blobs"] == 0

    asyncio.run(go())


def test_a_blob_swept_while_its_group_is_scored_is_kept_by_the_pool(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path)
        (g,) = (await work(svc, n=1)).groups
        cmd = submission(svc, "a", "s1", g["group_id"], samples(g, 4))
        data = store.get_blob(cmd.samples_ref)
        original = svc.scorer.score_group

        async def score_after_a_sweep(prompt: str, texts: list[str]) -> list[float]:
            store.sweep_blobs(-1.0)  # the grace ran out while the reward was computed
            assert store.get_blob(cmd.samples_ref) is None
            return await original(prompt, texts)

        svc.scorer.score_group = score_after_a_sweep  # type: ignore[method-assign]
        assert isinstance(await svc.submit_group(cmd), Ok)
        assert store.get_blob(cmd.samples_ref) == data
        assert store.group(0).samples_ref == cmd.samples_ref

    asyncio.run(go())


def test_blobs_survive_a_restart(tmp_path: Path) -> None:
    store = SchedulerStore(tmp_path / "s.sqlite")
    store.put_blob("d" * 32, b"bytes")
    store.close()
    again = SchedulerStore(tmp_path / "s.sqlite")
    assert again.get_blob("d" * 32) == b"bytes"
    again.close()
