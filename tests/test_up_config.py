"""What ``deltarl up`` writes for its daemons, without starting any: one table per rollout
daemon, each its own instance reading the one store, and ``--engine-arg`` in every engine."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from deltarl import up
from deltarl.ops.placement import parse_cpu_list
from deltarl.rl.long_tail import LongTail


def _tables(tmp_path: Path, argv: list[str]) -> dict:
    args = up._parse(argv)
    run = up.Run(tmp_path, tmp_path / "shm", args.steps, up.PROFILES[args.model], args.rollouts)
    up.write_config(run, tmp_path / "model", args)
    return tomllib.loads(run.config.read_text())["daemons"]


def test_several_rollout_daemons_are_instances_of_one_store(tmp_path: Path) -> None:
    argv = ["--rollouts", "3", "--engine-arg", "gpu_memory_utilization=0.3"]
    daemons = _tables(tmp_path, [*argv, "--engine-arg", "swap_space=0"])
    names = ["rollout", "rollout-2", "rollout-3"]
    assert [d for d in daemons if d.startswith("rollout")] == names
    rollouts = [daemons[n] for n in names]
    assert [r["instance"] for r in rollouts] == names
    assert len({r["control"] for r in rollouts}) == 3  # each answers on its own socket
    assert {r["rollout_store"] for r in rollouts} == {daemons["apply"]["rollout_store"]}
    for r in rollouts:
        assert r["engine"]["engine_args"] == {"gpu_memory_utilization": 0.3, "swap_space": 0}
    assert daemons["trainer"]["ranks"] == 1


def test_trainer_ranks_share_the_trainer_threads(tmp_path: Path) -> None:
    daemons = _tables(tmp_path, ["--trainer-ranks", "2", "--model", "smollm2-135m"])
    assert daemons["trainer"]["ranks"] == 2
    assert daemons["trainer"]["threads"] >= 1


def test_the_trainers_threads_are_counted_from_its_cpus(tmp_path: Path) -> None:
    """Not from the host's CPU count: a trainer pinned to 3 CPUs runs 3 threads, split among
    its ranks; unpinned, half of the CPUs this process may use. (The SmolLM2 profile: the
    tiny model's trainer keeps torch's own count, which pinning sets.)"""
    smollm2 = ["--model", "smollm2-135m"]
    for sub, argv, threads in [
        ("three", ["--cpus", "trainer=0-2"], 3),
        ("ranks", ["--cpus", "trainer=0-2", "--trainer-ranks", "2"], 1),
        ("one", ["--cpus", "trainer=0"], 1),
        ("none", ["--cpus", "none"], max(1, len(os.sched_getaffinity(0)) // 2)),
    ]:
        (tmp_path / sub).mkdir()
        assert _tables(tmp_path / sub, [*smollm2, *argv])["trainer"]["threads"] == threads, sub
    (tmp_path / "auto").mkdir()
    trainer = _tables(tmp_path / "auto", smollm2)["trainer"]
    assert trainer["threads"] == len(parse_cpu_list(trainer["cpus"]))


def test_a_task_that_forces_lengths_gets_room_for_them_and_unknown_tasks_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert up._parse([]).max_tokens == up.PROFILES["tiny"].max_tokens
    assert up._parse(["--task", "long_tail"]).max_tokens == LongTail().max_tokens
    assert up._parse(["--task", "long_tail", "--max-tokens", "64"]).max_tokens == 64
    with pytest.raises(SystemExit):
        up._parse(["--task", "nope"])
    assert "--task: unknown task 'nope'; known:" in capsys.readouterr().err


def test_the_dispatch_window_reaches_the_scheduler(tmp_path: Path) -> None:
    daemons = _tables(tmp_path, ["--policy", "deltarl", "--lookahead", "1024"])
    assert (daemons["scheduler"]["policy"], daemons["scheduler"]["lookahead"]) == ("deltarl", 1024)
    (tmp_path / "default").mkdir()
    assert "lookahead" not in _tables(tmp_path / "default", [])["scheduler"]  # its default


def test_cpus_reach_each_daemon_and_rollout_means_every_rollout(tmp_path: Path) -> None:
    cpus_args = ["--cpus", "trainer=1", "--cpus", "rollout=0", "--cpus", "rollout-3=0-1"]
    daemons = _tables(tmp_path, ["--rollouts", "3", *cpus_args])
    cpus = {name: table.get("cpus") for name, table in daemons.items()}
    assert cpus == {
        "scheduler": None,
        "trainer": "1",
        "export": None,
        "apply": None,
        "rollout": "0",
        "rollout-2": "0",
        "rollout-3": "0-1",  # a later item for one daemon wins
    }
    for bad in ["trainer", "nobody=0", "trainer=1-0", "rollout-2=0"]:  # one rollout only
        with pytest.raises(SystemExit):
            up._parse(["--cpus", bad])


def test_by_default_generation_and_training_get_half_the_cpus_each(tmp_path: Path) -> None:
    assert up.auto_cpus({0, 1}, ["rollout"]) == {"trainer": "1", "rollout": "0"}
    assert up.auto_cpus(range(7), ["rollout", "rollout-2"]) == {
        "trainer": "4-6",
        "rollout": "0-3",  # the larger half: generation is most of a step
        "rollout-2": "0-3",
    }
    assert up.auto_cpus({0, 2, 4, 6}, ["rollout"]) == {"trainer": "4,6", "rollout": "0,2"}
    assert up.auto_cpus({3}, ["rollout"]) == {}  # one CPU: nothing to split
    daemons = _tables(tmp_path, [])
    expected = up.auto_cpus(os.sched_getaffinity(0), ["rollout"])
    assert {n: t["cpus"] for n, t in daemons.items() if "cpus" in t} == expected
    (tmp_path / "none").mkdir()
    assert not any("cpus" in t for t in _tables(tmp_path / "none", ["--cpus", "none"]).values())
    with pytest.raises(SystemExit):
        up._parse(["--cpus", "none", "--cpus", "trainer=0"])


def test_one_rollout_by_default_and_bad_counts_are_refused(tmp_path: Path) -> None:
    daemons = _tables(tmp_path, [])
    assert [d for d in daemons if d.startswith("rollout")] == ["rollout"]
    with pytest.raises(SystemExit):
        up._parse(["--rollouts", "0"])
    with pytest.raises(SystemExit):
        up._parse(["--engine-arg", "no-equals-sign"])
    with pytest.raises(SystemExit):
        up._parse(["--trainer-ranks", "0"])
