"""The figures of ``deltarl chaos``: read from the scheduler's store and the checker's result.

Nothing here starts or stops anything. Where each figure comes from:

- steps: the steps the trainer reported done (``StepDone``: the scheduler's ``steps`` table,
  one row per step; a step replayed after a trainer restart replaces its row);
- duplicate_samples: samples of a prompt that the trainer reported training in two steps
  (its own per-step ``groups``, as ``deltarl up`` counts them);
- lost_samples: samples the scheduler accepted (``pooled_samples``: every group it pooled)
  that are neither trained (in a done step, as the trainer reported), nor dropped with a
  reason after they were accepted (``dropped_samples.lag_exceeded``, the one way out of the
  pool but a step), nor still on their way at the end (pooled, or shipped to a step not done
  yet). A balance below zero (trained more than accepted) is reported as ``overdrawn``;
- half_applied_seen, non_bit_exact, versions_monotonic: the checker process's findings
  (``deltarl.chaos_checker``).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import IO, Any

import orjson


def scheduler_figures(db: Path) -> dict[str, int]:
    """Steps, duplicates and lost samples from the scheduler's sqlite file (read-only)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        counters = dict(conn.execute("SELECT name, value FROM counters"))
        steps = conn.execute("SELECT step, samples, done_at, metrics FROM steps ORDER BY step")
        rows = [(int(s), int(n or 0), done, m) for s, n, done, m in steps]
        pooled = [
            len(orjson.loads(r)) if r else 0
            for (r,) in conn.execute("SELECT rewards FROM prompts WHERE state = 'pooled'")
        ]
    seen: set[str] = set()
    duplicates = trained = in_training = done_steps = 0
    for _step, samples, done_at, metrics in rows:
        if done_at is None:
            in_training += samples  # shipped, not trained yet when the run stopped
            continue
        done_steps += 1
        groups = (orjson.loads(metrics) if metrics else {}).get("groups") or {}
        for group, n in groups.items():
            prompt = str(group).split(".")[0]  # a group id is "<prompt id>.<attempt>"
            if prompt in seen:
                duplicates += int(n)
            seen.add(prompt)
            trained += int(n)
    accepted = int(counters.get("pooled_samples", 0))
    dropped = int(counters.get("dropped_samples.lag_exceeded", 0))
    balance = accepted - dropped - trained - in_training - sum(pooled)
    return {
        "steps": done_steps,
        "accepted": accepted,
        "trained": trained,
        "dropped_after_accept": dropped,
        "pending": in_training + sum(pooled),
        "lost_samples": max(balance, 0),
        "overdrawn": max(-balance, 0),
        "duplicate_samples": duplicates,
    }


def figures(
    kills: int, sched: dict[str, int], checker: dict[str, Any], converged: list[float]
) -> dict[str, Any]:
    """The JSON contract's object, keys exactly as the issue wrote them."""
    return {
        "kills": kills,
        "steps": sched["steps"],
        "half_applied_seen": len(checker["half_applied"]),
        "non_bit_exact": len(checker["non_bit_exact"]),
        "lost_samples": sched["lost_samples"],
        "duplicate_samples": sched["duplicate_samples"],
        "versions_monotonic": not checker["store_backwards"] and not checker["engine_backwards"],
        "converged_s_max": round(max(converged, default=0.0), 3),
    }


def print_report(
    result: dict[str, Any], details: dict[str, Any], problems: list[str], out: IO[str]
) -> None:
    r, sched, checker = result, details["scheduler"], details["checker"]
    per = ", ".join(f"{k['daemon']} {k['converged_s']:.1f}" for k in details["kill_log"])
    lines = [
        f"deltarl chaos: {r['kills']} SIGKILLs (seed {details['seed']}), "
        f"{details['wall_s']:.0f} s, {r['steps']} optimizer steps.",
        f"  half-applied seen   {r['half_applied_seen']} "
        f"({checker['leases']} leases of the rollout store checked)",
        f"  not bit-exact       {r['non_bit_exact']} "
        f"({checker['engine_loads_checked']} engine loads checked against the manifests)",
        f"  samples             {sched['accepted']} accepted, {sched['trained']} trained, "
        f"{sched['dropped_after_accept']} dropped (lag), {sched['pending']} on their way; "
        f"lost {r['lost_samples']}, trained twice {r['duplicate_samples']}",
        f"  versions monotonic  {'yes' if r['versions_monotonic'] else 'NO'}"
        f" (store {checker['versions_leased'][:1]}..{checker['versions_leased'][-1:]})",
        f"  converged           max {r['converged_s_max']:.1f} s after a restart ({per})",
        f"  logs and state      {details['directory']}",
    ]
    lines += [f"  PROBLEM: {p}" for p in problems]
    print("\n" + "\n".join(lines), file=out, flush=True)
