"""What ``deltarl up`` shows: a progress line per optimizer step, and the summary.

Every figure is read from the daemons' ``status`` and the scheduler's run history (see the
``deltarl up`` docstring for where each comes from); nothing here starts or stops anything.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltarl.up import Run


def _f(value: Any, fmt: str = ".3f") -> str:  # noqa: ANN401 - a JSON number or None
    return "-" if value is None else format(value, fmt)


class Progress:
    """One line per new trainer step: step, reward, lag, the latest refit, samples/s."""

    def __init__(self, run: Run, out: IO[str]) -> None:
        self.run = run
        self.out = out
        self.shown = 0
        self.t0 = time.monotonic()

    def samples_per_s(self, rows: dict[int, dict[str, Any]], step: int) -> float:
        """Samples trained per second, over the steps so far (first shipped to ``step`` done)."""
        done = [rows[i] for i in sorted(rows) if i <= step]
        if len(done) < 2 or done[-1].get("done_at") is None:
            return 0.0
        span = float(done[-1]["done_at"]) - float(done[0]["shipped_at"])
        return sum(int(r.get("samples") or 0) for r in done) / span if span > 0 else 0.0

    def poll(self) -> int:
        """The trainer's step (0 before the first); prints lines for steps not yet shown."""
        trainer = self.run.status("trainer") or {}
        step = int(trainer.get("step") or 0)
        if step <= self.shown:
            return step
        history = self.run.history()
        rows = {} if history is None else {int(r["step"]): r for r in history.steps}
        export = self.run.status("export") or {}
        last = export.get("last") or {}
        rollout = self.run.status("rollout") or {}
        for s in range(self.shown + 1, step + 1):
            row = rows.get(s, {})
            print(
                f"step {s:>3}/{self.run.steps}  reward {_f(row.get('reward_mean'))}"
                f"  lag {_f(row.get('lag_max'), 'd') if row.get('lag_max') is not None else '-'}"
                f"  refit {_f(last.get('seconds'))} s {(last.get('wire_bytes') or 0) / 1e3:.1f} kB"
                f"  engine v{rollout.get('weight_version', '-')}"
                f"  {self.samples_per_s(rows, s):.1f} samples/s"
                f"  {time.monotonic() - self.t0:6.1f} s",
                file=self.out,
                flush=True,
            )
        self.shown = step
        return step


def _mean_reward(rows: list[dict[str, Any]]) -> float:
    values = [float(r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    return round(statistics.fmean(values), 6) if values else float("nan")


class SummaryError(RuntimeError):
    """The run cannot be summarised honestly (a daemon did not answer)."""


def summarise(run: Run) -> dict[str, Any]:
    history = run.history()
    if history is None:
        raise SummaryError("the scheduler did not return the run history")
    answers = {name: run.status(name) for name in run.rollouts}
    engines = {name: st for name, st in answers.items() if st is not None}
    if len(engines) < len(answers):
        silent = sorted(set(answers) - set(engines))
        raise SummaryError(f"{', '.join(silent)} did not answer status")
    export = run.status("export")
    if export is None:
        raise SummaryError("the export agent did not answer status")
    rows = sorted(history.steps, key=lambda r: int(r["step"])) if history else []
    step_skew = [float(r["skewness"]) for r in rows if r.get("skewness") is not None]
    counters = dict(history.counters) if history else {}
    rollout = engines["rollout"]
    refits: list[dict[str, Any]] = rollout.get("refits") or []
    # From the export agent taking a version out of the trainer's store to the engine holding
    # it, verified (both CLOCK_MONOTONIC, shared by every process on the host). Versions the
    # export agent no longer lists (it keeps its last 64) are left out, not counted as zero.
    taken = {
        int(r["version"]): float(r["taken_at"])
        for r in export.get("recent") or []
        if r.get("outcome") == "active" and r.get("taken_at") is not None
    }

    def refit_seconds(loads: list[dict[str, Any]]) -> list[float]:
        return [
            float(r["done"]) - taken[int(r["version"])]
            for r in loads
            if int(r["version"]) in taken and r.get("done") is not None
        ]

    def bit_exact(st: dict[str, Any]) -> bool:
        loads = st.get("refits") or []
        return bool(loads) and all(r.get("verified") for r in loads) and st.get("mismatches") == 0

    totals = refit_seconds(refits)
    # Duplicates are counted from what the trainer says it trained (StepDone metrics: group id
    # -> samples, one row per step; a step replayed after a trainer restart replaces its row),
    # not from the scheduler's own bookkeeping, so this checks the scheduler rather than
    # repeating it. A group id is "<prompt id>.<attempt>".
    seen: set[str] = set()
    duplicates = 0
    for row in rows:
        for group, samples in ((row.get("metrics") or {}).get("groups") or {}).items():
            prompt = str(group).split(".")[0]
            if prompt in seen:
                duplicates += int(samples)
            seen.add(prompt)
    lags = [int(r["lag_max"]) for r in rows if r.get("lag_max") is not None]
    # The deltas the engine got (full versions left out: they are the model's size).
    deltas = [
        r
        for r in export.get("recent") or []
        if r.get("outcome") == "active" and r["kind"] == "delta"
    ]
    # Held-out rounds (greedy, the task's eval split), in step order; step 0 is the baseline
    # measured before the first optimizer step.
    rounds = sorted(
        (e for e in history.evals if e.get("finished") and e.get("accuracy") is not None),
        key=lambda e: int(e["step"]),
    )
    return {
        "model": run.profile.name,
        "task": run.task,
        "steps": len(rows),
        "engine": str(rollout.get("engine") or "none"),
        "versions_applied": [int(r["version"]) for r in refits],
        "reward_first": _mean_reward(rows[:3]),
        "reward_last": _mean_reward(rows[-3:]),
        "refit_median_s": _median(totals),
        # Every engine's every load, when there are several.
        "refit_bit_exact": all(bit_exact(st) for st in engines.values()),
        "samples_trained": sum(int(r.get("samples") or 0) for r in rows),
        "duplicate_samples": duplicates,
        "max_policy_lag": max(lags, default=0),
        "wire_bytes_median": _median([float(r["wire_bytes"]) for r in deltas]),
        "delta_coding": str((export or {}).get("delta_coding", "rice")),
        "changed_ratio_median": _median(
            [r["changed"] / r["elements"] for r in deltas if r.get("elements")], digits=8
        ),
        # The scheduler keeps P99 per step (its reward calls since the previous step); the
        # run's figure is the worst step's: an upper bound of the run's own P99.
        "reward_p99_s": max(
            (float(r["reward_p99_s"]) for r in rows if r.get("reward_p99_s") is not None),
            default=float("nan"),
        ),
        "eval_accuracy_first": float(rounds[0]["accuracy"]) if rounds else None,
        "eval_accuracy_last": float(rounds[-1]["accuracy"]) if len(rounds) > 1 else None,
        "eval_curve": [
            {
                "step": int(e["step"]),
                "accuracy": float(e["accuracy"]),
                "samples": int(e["samples"]),
                "version_min": e.get("version_min"),
                "version_max": e.get("version_max"),
                "partial": bool(e.get("partial")),
            }
            for e in rounds
        ],
        "reward_curve": [{"step": int(r["step"]), "reward": r.get("reward_mean")} for r in rows],
        "step_time": _step_time(rows, totals),
        "rollouts": len(engines),
        # Generated tokens thrown away stale (dropped over the lag bound), of all generated
        # for training: the run's share, and each step's.
        "wasted_tokens_ratio": _wasted_ratio(rows),
        "wasted_curve": [{"step": int(r["step"]), "ratio": r.get("wasted_ratio")} for r in rows],
        # What partial rollouts cost instead (lag_rule): the trained tokens' mean age in
        # versions, and the share of them more than the bound behind, over the run.
        **dict(zip(("token_lag_mean", "over_bound_token_ratio"), _token_lag(rows), strict=True)),
        # Per step: the lag and the bubbles, as recorded (what the curves PNG draws).
        "step_curve": [
            {
                "step": int(r["step"]),
                "lag_max": r.get("lag_max"),
                "padding_ratio": (r.get("metrics") or {}).get("padding_ratio"),
                "sorting_wait": r.get("sorting_wait"),
                "wasted_ratio": r.get("wasted_ratio"),
                "token_lag_mean": r.get("token_lag_mean"),
                "over_bound_token_ratio": r.get("over_bound_token_ratio"),
            }
            for r in rows
        ],
        # Per version the engine loaded: its kind, wire bytes and export pick-up to engine.
        "refit_curve": _refit_curve(export.get("recent") or [], refits, refit_seconds),
        # What the trainer's objective did with the samples, means over the steps: the share
        # of tokens the clip zeroed, the share whose importance weight the cap truncated, and
        # the last step's k3 KL to the policy that sampled. Under `sync` the samples are
        # fresh, so a cap share or KL above 0 there means the trainer's passes compute
        # another policy than the engines serve (forward_weights "master").
        **_objective_shares(rows),
        # The training side's padding bubble: what the forward passes ran but did not use.
        "padding_ratio_median": _median(
            [
                float(m["padding_ratio"])
                for r in rows
                if (m := r.get("metrics") or {}).get("padding_ratio") is not None
            ],
            digits=6,
        ),
        # Seed 000's sorting wait (pool wait over generation time, per step) and, with a
        # plan, how far the length predictions were (|actual - predicted| / actual).
        "sorting_wait_median": _median(
            [float(r["sorting_wait"]) for r in rows if r.get("sorting_wait") is not None],
            digits=4,
        ),
        "length_error_median": _median(
            [float(r["length_error"]) for r in rows if r.get("length_error") is not None],
            digits=4,
        ),
        "policy": str(history.config.get("policy", "fifo")),
        "lag_rule": str(history.config.get("lag_rule", "oldest_token")),
        "trainer_ranks": int((run.status("trainer") or {}).get("ranks") or 1),
        "engines": [
            {
                "name": name,
                "versions_applied": [int(r["version"]) for r in st.get("refits") or []],
                "refit_median_s": _median(refit_seconds(st.get("refits") or [])),
                "bit_exact": bit_exact(st),
                "submitted_groups": int(st.get("submitted_groups") or 0),
                "generated_tokens": int(st.get("generated_tokens") or 0),
                "busy_s": float(st.get("busy_s") or 0.0),
                # StepTally's sums: what the bench's model prices these steps at
                "steps": st.get("steps") or {},
                "prefix_cache_hit_rate": (st.get("prefix_cache") or {}).get("hit_rate"),
            }
            for name, st in engines.items()
        ],
        # Prompt tokens the engines' prefix caches served (GRPO samples of one prompt share
        # its prefix within a weight version), pooled over the engines.
        "prefix_cache_hit_rate": _hit_rate(engines),
        # Seed 000's instance skew: the busiest engine's time in engine steps over the mean
        # (1.0: evenly loaded; one engine: 1.0 by definition).
        "skewness": _skewness([float(st.get("busy_s") or 0.0) for st in engines.values()]),
        # The same, per step, as the scheduler records it (busy time since the step before),
        # the median over the steps that have it: the whole run's figure also counts its
        # start and its end, when some engines have nothing left to take.
        "step_skewness": _median(step_skew) if step_skew else None,
        "counters": counters,
    }


def _refit_curve(
    sent: list[dict[str, Any]],
    loads: list[dict[str, Any]],
    seconds: Callable[[list[dict[str, Any]]], list[float]],
) -> list[dict[str, Any]]:
    by_version = {int(r["version"]): r for r in sent if r.get("outcome") == "active"}
    curve = []
    for load in loads:
        version = int(load["version"])
        record = by_version.get(version)
        took = seconds([load])
        if record is not None and took:
            curve.append(
                {
                    "version": version,
                    "kind": record["kind"],
                    "wire_bytes": int(record["wire_bytes"]),
                    "seconds": round(took[0], 4),
                }
            )
    return curve


def _hit_rate(engines: dict[str, dict[str, Any]]) -> float | None:
    caches = [st.get("prefix_cache") or {} for st in engines.values()]
    prompt = sum(int(c.get("prompt_tokens") or 0) for c in caches)
    cached = sum(int(c.get("cached_tokens") or 0) for c in caches)
    return round(cached / prompt, 4) if prompt else None


def _finite(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def _skewness(busy: list[float]) -> float | None:
    mean = statistics.fmean(busy) if busy else 0.0
    return None if mean <= 0 else round(max(busy) / mean, 4)


def _token_lag(rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The run's token-weighted mean lag and over-bound share (steps without versions noted
    are left out; None if none has them)."""
    counted = [r for r in rows if r.get("token_lag_mean") is not None]
    weights = [float(r.get("trained_tokens") or 0) for r in counted]
    total = sum(weights)
    if not counted or total <= 0:
        return None, None
    mean = sum(float(r["token_lag_mean"]) * w for r, w in zip(counted, weights, strict=True))
    over = sum(
        float(r.get("over_bound_token_ratio") or 0.0) * w
        for r, w in zip(counted, weights, strict=True)
    )
    return mean / total, over / total


def _objective_shares(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    metrics = [r.get("metrics") or {} for r in rows]
    for key in ("clip_frac", "cap_frac"):
        seen = [float(m[key]) for m in metrics if m.get(key) is not None]
        out[f"{key}_mean"] = sum(seen) / len(seen) if seen else None
    kl = [float(m["kl_behaviour"]) for m in metrics if m.get("kl_behaviour") is not None]
    # k3 grows as exp(log-ratio): a trainer far from the engines can overflow it (None then)
    out["kl_behaviour_last"] = kl[-1] if kl and math.isfinite(kl[-1]) else None
    return out


def _objective_line(s: dict[str, Any]) -> str:
    if s.get("cap_frac_mean") is None and s.get("clip_frac_mean") is None:
        return "no step reported its clip or cap shares"
    return (
        f"clip zeroed {_f(s.get('clip_frac_mean'), '.2%')}, cap truncated "
        f"{_f(s.get('cap_frac_mean'), '.2%')} of the tokens (mean of the steps); KL to the "
        f"sampling policy {_f(s.get('kl_behaviour_last'), '.3g')} at the last step"
    )


def _wasted_ratio(rows: list[dict[str, Any]]) -> float | None:
    """Wasted / (wasted + trained) completion tokens over the run's steps; None if no step
    recorded tokens (a scheduler store of an older deltarl)."""
    counted = [r for r in rows if r.get("trained_tokens") is not None]
    trained = sum(int(r["trained_tokens"]) for r in counted)
    wasted = sum(int(r["wasted_tokens"]) for r in counted)
    return None if trained + wasted == 0 else round(wasted / (trained + wasted), 6)


def _lag_token(s: dict[str, Any]) -> str:
    return "newest" if s.get("lag_rule") == "partial" else "oldest"


def _token_age_line(s: dict[str, Any]) -> str:
    mean, over = s.get("token_lag_mean"), s.get("over_bound_token_ratio")
    if mean is None or over is None:
        return "not recorded"
    return (
        f"trained tokens {mean:.2f} versions behind the trainer on average, {over:.1%} of them "
        f"over the bound (lag rule {s.get('lag_rule', 'oldest_token')})"
    )


def _wasted_line(ratio: float | None) -> str:
    if ratio is None:
        return "not recorded"
    return f"{ratio:.1%} of the generated completion tokens were dropped stale (over the lag bound)"


def _step_time(rows: list[dict[str, Any]], refits: list[float]) -> dict[str, float]:
    """Where a step's time goes, medians over the run. The trainer's side is serial: wait for
    a batch (``wait_s``: the samples were not pooled yet), train, publish. Generation runs
    beside it, a step ahead at a lag bound of 1: ``generate_s`` is a group's time from issue
    to pooled (in the engine's queue, decoding, scoring), ``reward_s`` the scoring part, and
    ``refit_s`` a new version's time from the trainer's store into the engine."""
    done = [float(r["done_at"]) for r in rows if r.get("done_at") is not None]
    walls = [b - a for a, b in itertools.pairwise(done)]
    metrics = [r.get("metrics") or {} for r in rows]
    train = [float(m["step_s"]) for m in metrics if m.get("step_s") is not None]
    publish = [float(m["publish_s"]) for m in metrics if m.get("publish_s") is not None]
    wall, train_s, publish_s = _median(walls, 3), _median(train, 3), _median(publish, 3)
    return {
        "wall_s": wall,
        "train_s": train_s,
        "publish_s": publish_s,
        "wait_s": round(max(0.0, wall - train_s - publish_s), 3) if walls else float("nan"),
        "generate_s": _median(
            [float(r["gen_s_mean"]) for r in rows if r.get("gen_s_mean") is not None], 3
        ),
        "reward_s": _median(
            [float(r["reward_p50_s"]) for r in rows if r.get("reward_p50_s") is not None], 6
        ),
        "refit_s": _median(refits, 3),
    }


def _median(values: list[float], digits: int = 6) -> float:
    return round(statistics.median(values), digits) if values else float("nan")


def _not_trained(counters: dict[str, Any]) -> str:
    """Every drop, requeue and lag action the scheduler counted, with its reason."""
    shown = {
        k: v
        for k, v in counters.items()
        if k.split(".")[0] in ("dropped_groups", "requeued", "lag", "abandoned_prompts", "submit")
        and v
    }
    if not shown:
        return "nothing dropped or requeued"
    return ", ".join(f"{k} {v}" for k, v in sorted(shown.items()))


def _engine_lines(s: dict[str, Any]) -> list[str]:
    """One line per engine when there are several (the line above is the first one's)."""
    engines = s.get("engines") or []
    if len(engines) < 2:
        return []
    return [
        f"    {e['name']:<15} {len(e['versions_applied'])} versions, last "
        f"v{e['versions_applied'][-1] if e['versions_applied'] else '-'}, refit median "
        f"{e['refit_median_s']:.3f} s, {e['submitted_groups']} groups, busy "
        f"{e['busy_s']:.0f} s, bit-exact {'yes' if e['bit_exact'] else 'NO'}"
        for e in engines
    ] + [
        f"    skewness        {s['skewness']} (busiest engine's busy time / the mean; per step, "
        f"median: {_f(s.get('step_skewness'))})"
    ]


def _step_line(t: dict[str, Any]) -> str:
    if not t or math.isnan(t.get("wall_s", math.nan)):
        return "not measured (fewer than two steps)"
    return (
        f"median {t['wall_s']:.1f} s: training {t['train_s']:.1f} s, publishing "
        f"{t['publish_s']:.2f} s, waiting for samples {t['wait_s']:.1f} s; beside it a group "
        f"takes {t['generate_s']:.1f} s to generate and score (scoring {t['reward_s']:.4f} s)"
    )


def _eval_line(s: dict[str, Any]) -> str:
    curve = s.get("eval_curve") or []
    if not curve:
        return "none (the task has no held-out split, or no round finished)"
    points = ", ".join(f"step {e['step']}: {e['accuracy']:.3f}" for e in curve)
    return f"greedy accuracy {points}"


def print_summary(summary: dict[str, Any], run: Run, out: IO[str]) -> None:
    s = summary
    versions = s["versions_applied"]
    shown = ", ".join(map(str, versions[:12])) + (" ..." if len(versions) > 12 else "")
    rise = s["reward_last"] - s["reward_first"]
    exact = (
        "yes: every load checked inside the engine against the manifest"
        if s["refit_bit_exact"]
        else f"NO: see {run.log('rollout')}"
    )
    lines = [
        f"deltarl up: {s['steps']} optimizer steps of GRPO on {run.profile.summary_name}, "
        f"task {s['task']}.",
        f"  rollout engine    {s['engine']}",
        f"  reward            {s['reward_first']:.3f} (first 3 steps) -> "
        f"{s['reward_last']:.3f} (last 3): {rise:+.3f}",
        f"  samples trained   {s['samples_trained']} (trained twice: {s['duplicate_samples']})",
        f"  policy lag        at most {s['max_policy_lag']} steps (trainer version minus a "
        f"group's {_lag_token(s)} token version)",
        f"  token age         {_token_age_line(s)}",
        f"  weight refits     {len(versions)} versions loaded into the engine ({shown})",
        *_engine_lines(s),
        f"  refit time        median {s['refit_median_s']:.3f} s, export pick-up to engine",
        f"  step time         {_step_line(s.get('step_time') or {})}",
        f"  held-out eval     {_eval_line(s)}",
        f"  deltas            median {s['wire_bytes_median'] / 1e6:.3f} MB on the wire "
        f"({s.get('delta_coding', 'rice')} coding), {s['changed_ratio_median'] * 100:.3g}% of the "
        "weights changed per version",
        f"  bit-exact         {exact}",
        f"  not trained       {_not_trained(s.get('counters') or {})}",
        f"  wasted tokens     {_wasted_line(s.get('wasted_tokens_ratio'))}",
        f"  training padding  median {s['padding_ratio_median']:.1%} of the positions the "
        "forward passes ran were padding",
        f"  objective         {_objective_line(s)}",
        f"  prefix cache      {_f(s.get('prefix_cache_hit_rate'))} of prompt tokens served "
        "from cache (pooled over the engines)",
        f"  dispatch          {s['policy']}; sorting wait median "
        f"{_f(_finite(s.get('sorting_wait_median')))} of a group's generation time"
        + (
            f"; length predictions off by {s['length_error_median']:.0%} (median)"
            if _finite(s.get("length_error_median")) is not None
            else ""
        ),
        f"  cpus              {_cpus_line(s.get('cpus'))}",
        f"  logs and state    {run.directory}",
        *([f"  curves            {s['curves_png']}"] if s.get("curves_png") else []),
    ]
    print("\n" + "\n".join(lines), file=out)


def _cpus_line(cpus: dict[str, str] | None) -> str:
    """Where the daemons ran: each pinned daemon's CPUs, rollout daemons together."""
    if not cpus:
        return "not pinned: every daemon on every core (--cpus none, or one CPU)"
    by_list: dict[str, list[str]] = {}
    for daemon, cpu_list in cpus.items():
        by_list.setdefault(cpu_list, []).append(daemon)
    return "; ".join(f"{', '.join(names)} on {cpu_list}" for cpu_list, names in by_list.items())
