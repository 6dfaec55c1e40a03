"""The `deltarl bench refit --json` contract: one JSON object with exactly these keys and types,
every refit bit-exact; with ``--rate-mbit`` the network namespaces are gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import orjson
import pytest
from deltarl.bench import netns
from deltarl.bench.refit_report import render

from deltarl.ops.placement import halves, parse_cpu_list

TOP_KEYS = {
    "link",
    "rate_mbit",
    "params",
    "full",
    "refits",
    "delta_total_s_median",
    "speedup",
    "delta_total_s_p95",
    "speedup_min",
    "apply_s_median",
    "cpus",
}
REFIT_KEYS = {
    "version": int,
    "kind": str,
    "changed_ratio": float,
    "wire_bytes": int,
    "encode_s": float,
    "transfer_s": float,
    "link_s": float,
    "apply_s": float,
    "activate_s": float,
    "total_s": float,
    "bit_exact": bool,
    "opened_by": str,
}


def _bench(*args: str) -> tuple[dict[str, Any], int]:
    """The bench's JSON object, and the pid of the process that ran it."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltarl.cli",
            "bench",
            "refit",
            "--params",
            "200000",
            "--refits",
            "2",
            "--json",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, stderr[-4000:]
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return orjson.loads(lines[0]), proc.pid


def _check_shape(
    result: dict[str, Any], link: str, rate: float | None, *, split: bool = True
) -> None:
    assert set(result) == TOP_KEYS
    # each agent's CPUs, read back from its process: with --cpus split (the default) the
    # halves of ours, as on two hosts; shared, all of ours each
    ours = os.sched_getaffinity(0)
    assert set(result["cpus"]) == {"export", "apply"}
    got = {name: parse_cpu_list(result["cpus"][name]) for name in ("export", "apply")}
    if split and len(ours) >= 2:
        assert got["export"] | got["apply"] == ours
        assert not got["export"] & got["apply"]
        assert max(got["export"]) < min(got["apply"])
    else:
        assert got["export"] == got["apply"] == ours
    assert result["link"] == link
    assert result["rate_mbit"] == rate
    if rate is not None:
        assert isinstance(result["rate_mbit"], float)
    assert isinstance(result["params"], int)
    assert result["params"] > 100_000
    assert set(result["full"]) == {"total_s", "wire_bytes"}
    assert isinstance(result["full"]["total_s"], float)
    assert isinstance(result["full"]["wire_bytes"], int)
    assert result["full"]["total_s"] > 0
    # a full version carries every bf16 value (before link compression)
    assert result["full"]["wire_bytes"] > result["params"]
    assert len(result["refits"]) == 2
    versions = [r["version"] for r in result["refits"]]
    assert versions == sorted(versions)
    assert len(set(versions)) == 2
    for r in result["refits"]:
        assert set(r) == set(REFIT_KEYS)
        for key, kind in REFIT_KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["kind"] in ("delta", "full")
        assert r["bit_exact"] is True
        assert 0 < r["changed_ratio"] < 1
        assert r["total_s"] > 0
        # the shaped link's least time for the bytes; an unshaped link has no rate to price
        want = r["wire_bytes"] * 8 / (rate * 1e6) if rate is not None else 0.0
        assert r["link_s"] == pytest.approx(want)
    # realistic deltas: the delta is much smaller than the full version
    assert all(r["wire_bytes"] < result["full"]["wire_bytes"] / 4 for r in result["refits"])
    assert isinstance(result["delta_total_s_median"], float)
    assert isinstance(result["speedup"], float)
    assert result["speedup"] > 0


def test_bench_refit_shm_json_shape_and_bit_exactness() -> None:
    _check_shape(_bench("--link", "shm")[0], "shm", None)


def test_bench_refit_cpus_shared_leaves_both_agents_on_every_cpu() -> None:
    _check_shape(_bench("--link", "shm", "--cpus", "shared")[0], "shm", None, split=False)


def test_split_cpus_halves_and_refuses_one() -> None:
    # as `bench refit --cpus split` splits them: the export agent's half first
    assert halves({0, 1}, lower_larger=False) == ("0", "1")
    assert halves({0, 1, 2, 3, 5}, lower_larger=False) == ("0-1", "2-3,5")
    assert halves({7}, lower_larger=False) is None


_STAGES = ("encode_s", "transfer_s", "apply_s", "wire_bytes")
COMPARED_KEYS = {
    "delta_total_s_median",
    "delta_total_s_p95",
    "speedup",
    "speedup_min",
    "delta_ratio",
    "bit_exact",
    *(f"{s}_median" for s in _STAGES),
    *(f"{s}_ratio" for s in _STAGES),
}
"""The keys of another run's figures beside the first (``conditioned_cost``)."""


def test_bench_refit_compare_copy_measures_the_catch_up_side_by_side() -> None:
    # and (in the same bench run, to spare the test a third one) the export agent hashing
    result, _ = _bench("--link", "shm", "--compare-copy", "--compare-export-hash")
    assert "the export agent hashing the model itself" in render(result)
    hashed = result.pop("export_hash")
    assert set(hashed) == COMPARED_KEYS
    assert hashed["bit_exact"] is True
    # the same deltas either way: only who hashes differs
    assert 0.99 < hashed["wire_bytes_ratio"] < 1.01
    copied = result.pop("copy")
    _check_shape(result, "shm", None)
    assert set(copied) == {
        "delta_total_s_median",
        "delta_total_s_p95",
        "apply_s_median",
        "speedup",
        "speedup_min",
        "delta_ratio",
        "apply_ratio",
        "bit_exact",
        "opened_by",
    }
    assert copied["bit_exact"] is True
    # the warm-up delta copies (the other buffer was empty); from then on the other buffer
    # is settled at the active version after each commit, unless the agent is told to copy
    assert {r["opened_by"] for r in result["refits"]} == {"settled"}
    assert copied["opened_by"] == ["copy"]
    assert result["speedup_min"] <= result["speedup"]
    assert result["delta_total_s_p95"] >= result["delta_total_s_median"]


def test_bench_refit_compare_conditioned_measures_the_coding_side_by_side() -> None:
    codings = ("conditioned", "conditioned_rice", "conditioned_huffman")
    result, _ = _bench("--link", "shm", *(f"--compare-{c.replace('_', '-')}" for c in codings))
    text = render(result)
    for coding in codings:
        assert f"deltas coded against the reference (delta_coding = '{coding}')" in text
    both = [result.pop(coding) for coding in codings]
    _check_shape(result, "shm", None)
    for coded in both:
        assert set(coded) == COMPARED_KEYS
        assert coded["bit_exact"] is True
        # a range keeps a conditioned coding only where it is smaller (at this tiny size
        # its overhead eats the gain: bench codec and test_conditioned*.py measure it at
        # size), so the wire never grows by more than a stream-table entry
        assert 0 < coded["wire_bytes_ratio"] <= 1.01


def test_bench_refit_sealed_compare_measures_the_cost_side_by_side() -> None:
    result, _ = _bench("--link", "stream", "--sealed-compare")
    sealed = result.pop("sealed")
    _check_shape(result, "stream", None)
    assert set(sealed) == {
        "delta_total_s_median",
        "full_total_s",
        "delta_ratio",
        "full_ratio",
        "wire_bytes_ratio",
        "bit_exact",
    }
    assert sealed["bit_exact"] is True
    assert all(isinstance(sealed[k], float) and sealed[k] > 0 for k in sealed if k != "bit_exact")
    # a seal adds a line to the manifest and a hash per chunk entry: the chunks are unchanged
    assert 0.9 < sealed["wire_bytes_ratio"] < 1.1


def _netns_usable() -> str | None:
    why = netns.check_privilege()
    if why is not None:
        return why
    proc = subprocess.run([netns.IP, "netns", "list"], capture_output=True, text=True, check=False)
    return None if proc.returncode == 0 else f"ip netns fails: {proc.stderr.strip()}"


def test_bench_refit_shaped_stream_and_namespaces_cleaned_up() -> None:
    why = _netns_usable()
    if why is not None:
        pytest.skip(f"shaping needs network namespaces: {why}")
    result, pid = _bench("--link", "stream", "--rate-mbit", "50")
    _check_shape(result, "stream", 50.0)
    # the link's time is a floor of the refit's (less tbf's burst: 10 ms at the rate)
    assert all(r["total_s"] >= r["link_s"] - 0.011 for r in result["refits"])
    left = netns.namespaces()
    assert not [n for n in left if n.startswith(f"{netns.PREFIX}-{pid}-")], left
    # namespaces of other live runs (pid in the name) may exist; none may be a dead run's
    stale = [n for n in left if not os.path.exists(f"/proc/{n.split('-')[1]}")]
    assert stale == [], left


def test_rate_without_stream_is_refused() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltarl.cli",
            "bench",
            "refit",
            "--link",
            "shm",
            "--rate-mbit",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "--rate-mbit shapes the stream link only" in out.stderr


def test_without_privilege_it_says_so_and_stops(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltarl.bench import refit  # noqa: PLC0415

    monkeypatch.setattr(refit, "check_privilege", lambda: "--rate-mbit needs root (test)")
    assert refit.main(["--link", "stream", "--rate-mbit", "100", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "needs root" in captured.err


def test_bench_refit_ucx_json_shape_and_bit_exactness() -> None:
    # UCX over its tcp and shared-memory transports (no RDMA here); skipped where the
    # optional ucx extra is not installed.
    pytest.importorskip("ucxx", reason="the ucx extra (ucxx-cu12) is not installed")
    _check_shape(_bench("--link", "ucx")[0], "ucx", None)
