"""``deltarl up [--steps N] [--json]``: the whole RL loop on this machine, then a summary.

It starts the five daemons as separate processes through the same entry points systemd uses
(``deltarl scheduler|trainer|export|apply|rollout --config FILE``), with a configuration it
writes into a fresh run directory, on the embedded default (a tiny Qwen2-shaped model and a
tokenizer built locally, and a rule-based reward: ``deltarl.rl``). It shows one progress line
per optimizer step, stops everything with SIGTERM once the trainer has taken N steps, and ends
with a summary. With ``--json``, progress goes to stderr and stdout carries exactly one JSON
object:

    {"steps", "engine", "versions_applied", "reward_first", "reward_last", "refit_median_s",
     "refit_bit_exact", "samples_trained", "duplicate_samples", "max_policy_lag"}

Where the figures come from (each daemon's ``status``, and the scheduler's run history):
- reward_first / reward_last: mean reward of the first / last three steps (scheduler history);
- versions_applied: every version the rollout engine loaded (rollout status ``refits``);
- refit_median_s: per version the engine loaded, from the export agent taking it out of the
  trainer's store to the engine holding it, verified; median;
- refit_bit_exact: every engine load's digest equalled the manifest's (checked inside the
  rollout daemon against what the apply agent verified), and there was at least one;
- samples_trained, max_policy_lag: summed / maximal over the scheduler's per-step history;
- duplicate_samples: samples of a prompt that the trainer reported training in two steps.
``counters`` (every drop, requeue and lag action with its reason) is added to the object.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from deltarl.rl.protocol import REPLIES, GetHistory, History
from deltarl.transport.control import ControlProtocolError, ControlTimeoutError, request_sync
from deltarl.transport.messages import GetStatus, Status

ORDER = ("scheduler", "trainer", "export", "apply", "rollout")
START_TIMEOUT_S = 900.0
# A random-init model of 1M parameters learning the default task: 1e-2 learned fastest among
# 5e-3, 1e-2, 2e-2 at a lag bound of 1 (20 steps each, `deltarl up --lr X`); 2e-2 moved the
# policy so far per step that a third of the tokens were clipped.
LR = 1e-2  # the first run builds the model and tokenizer, vLLM imports slowly


def default_home() -> Path:
    return Path(os.environ.get("DELTARL_HOME", Path.home() / ".cache" / "deltarl"))


@dataclass
class Run:
    """One ``deltarl up``: its directory, configuration and daemon processes."""

    directory: Path
    shm: Path
    steps: int
    procs: dict[str, subprocess.Popen[bytes]]

    @property
    def config(self) -> Path:
        return self.directory / "deltarl.toml"

    def endpoint(self, daemon: str) -> str:
        # In the short shared-memory directory, not the run directory: an ipc:// path must fit
        # sockaddr_un (107 bytes), which a run directory under a long home may not.
        return f"ipc://{self.shm}/{daemon}.sock"

    def log(self, daemon: str) -> Path:
        return self.directory / f"{daemon}.log"

    def start(self, daemon: str) -> None:
        args = [sys.executable, "-m", "deltarl.cli", daemon, "--config", str(self.config)]
        with self.log(daemon).open("ab") as log:
            # A session of its own: a Ctrl-C at the terminal reaches `deltarl up`, which stops
            # the daemons in order, instead of killing them all at once mid-write.
            self.procs[daemon] = subprocess.Popen(  # noqa: S603 - our own entry point
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def status(self, daemon: str) -> dict[str, Any] | None:
        try:
            reply = request_sync(self.endpoint(daemon), GetStatus(), 2.0)
        except (ControlTimeoutError, ControlProtocolError):
            return None
        return reply.fields if isinstance(reply, Status) else None

    def history(self) -> History | None:
        try:
            reply = request_sync(self.endpoint("scheduler"), GetHistory(), 5.0, replies=REPLIES)
        except (ControlTimeoutError, ControlProtocolError):
            return None
        return reply if isinstance(reply, History) else None

    def dead(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return f"{name} exited with status {p.returncode}"
        return None

    def tail(self, daemon: str, lines: int = 25) -> str:
        try:
            text = self.log(daemon).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM the rollout daemon and wait for it (it stops asking for work and submits
        nothing half-done), then the others together; a daemon still running after
        ``timeout`` is killed (its exit code is then None)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for wave in (("rollout",), tuple(d for d in reversed(ORDER) if d != "rollout")):
            procs = {d: self.procs[d] for d in wave if d in self.procs}
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for name, p in procs.items():
                try:
                    codes[name] = p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
                    codes[name] = None
        return codes


def write_config(run: Run, model_dir: Path, args: argparse.Namespace) -> None:
    d, shm = run.directory, run.shm
    sampling = "{ temperature = 1.0, top_p = 1.0, max_tokens = " + f"{args.max_tokens} }}"
    run.config.write_text(f"""# Written by `deltarl up`: the five daemons of one machine.
[daemons.scheduler]
control = "{run.endpoint("scheduler")}"
db = "{d}/scheduler.sqlite"
group_size = {args.group_size}
groups_per_step = {args.groups_per_step}
pool_capacity = {4 * args.groups_per_step}
max_policy_lag_steps = {args.max_policy_lag}
on_lag_exceeded = "{args.on_lag_exceeded}"
sampling = {sampling}
seed = {args.seed}

[daemons.trainer]
control = "{run.endpoint("trainer")}"
scheduler = "{run.endpoint("scheduler")}"
published_store = "published"
store_root = "{shm}"
model_dir = "{model_dir}"
checkpoint_dir = "{d}/checkpoints"
checkpoint_every = 5
groups_per_step = {args.groups_per_step}
max_steps = {run.steps}
lr = {args.lr}
seed = {args.seed}

[daemons.export]
control = "{run.endpoint("export")}"
published_store = "published"
store_root = "{shm}"
manifest_store = "{d}/versions.sqlite"
apply_control = "{run.endpoint("apply")}"
chunk_bytes = 1048576
poll_s = 0.02

[daemons.export.link]
type = "shm"
name = "up"
root = "{shm}"

[daemons.apply]
control = "{run.endpoint("apply")}"
rollout_store = "rollout"
store_root = "{shm}"
layout_store = "published"

[daemons.apply.link]
type = "shm"
name = "up"
root = "{shm}"

[daemons.rollout]
control = "{run.endpoint("rollout")}"
scheduler = "{run.endpoint("scheduler")}"
apply_control = "{run.endpoint("apply")}"
rollout_store = "rollout"
store_root = "{shm}"
model_dir = "{model_dir}"
max_running_groups = {2 * args.groups_per_step}
""")


# -- progress and summary -----------------------------------------------------------------


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
    if run.status("rollout") is None or run.status("export") is None:
        raise SummaryError("the rollout daemon or the export agent did not answer status")
    rows = sorted(history.steps, key=lambda r: int(r["step"])) if history else []
    counters = dict(history.counters) if history else {}
    rollout = run.status("rollout") or {}
    export = run.status("export") or {}
    refits: list[dict[str, Any]] = rollout.get("refits") or []
    # From the export agent taking a version out of the trainer's store to the engine holding
    # it, verified (both CLOCK_MONOTONIC, shared by every process on the host). Versions the
    # export agent no longer lists (it keeps its last 64) are left out, not counted as zero.
    taken = {int(r["version"]): float(r["taken_at"]) for r in export.get("recent") or []
             if r.get("outcome") == "active" and r.get("taken_at") is not None}  # fmt: skip
    totals = [float(r["done"]) - taken[int(r["version"])] for r in refits
              if int(r["version"]) in taken and r.get("done") is not None]  # fmt: skip
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
    return {
        "steps": len(rows),
        "engine": str(rollout.get("engine") or "none"),
        "versions_applied": [int(r["version"]) for r in refits],
        "reward_first": _mean_reward(rows[:3]),
        "reward_last": _mean_reward(rows[-3:]),
        "refit_median_s": round(statistics.median(totals), 6) if totals else float("nan"),
        "refit_bit_exact": bool(refits)
        and all(r.get("verified") for r in refits)
        and rollout.get("mismatches") == 0,
        "samples_trained": sum(int(r.get("samples") or 0) for r in rows),
        "duplicate_samples": duplicates,
        "max_policy_lag": max(lags, default=0),
        "counters": counters,
    }


def _not_trained(counters: dict[str, Any]) -> str:
    """Every drop, requeue and lag action the scheduler counted, with its reason."""
    shown = {k: v for k, v in counters.items()
             if k.split(".")[0] in ("dropped_groups", "requeued", "lag", "abandoned_prompts",
                                    "submit") and v}  # fmt: skip
    if not shown:
        return "nothing dropped or requeued"
    return ", ".join(f"{k} {v}" for k, v in sorted(shown.items()))


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
        f"deltarl up: {s['steps']} optimizer steps of GRPO on the embedded tiny model.",
        f"  rollout engine    {s['engine']}",
        f"  reward            {s['reward_first']:.3f} (first 3 steps) -> "
        f"{s['reward_last']:.3f} (last 3): {rise:+.3f}",
        f"  samples trained   {s['samples_trained']} (trained twice: {s['duplicate_samples']})",
        f"  policy lag        at most {s['max_policy_lag']} steps (trainer version minus a "
        "sample's oldest token version)",
        f"  weight refits     {len(versions)} versions loaded into the engine ({shown})",
        f"  refit time        median {s['refit_median_s']:.3f} s, export pick-up to engine",
        f"  bit-exact         {exact}",
        f"  not trained       {_not_trained(s.get('counters') or {})}",
        f"  logs and state    {run.directory}",
    ]
    print("\n" + "\n".join(lines), file=out)


# -- main ---------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="deltarl up", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps to run (default 30)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--workdir", type=Path, help="the run directory (default: a new one under "
                    "$DELTARL_HOME/runs)")  # fmt: skip
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-policy-lag", type=int, default=1,
                    help="max_policy_lag_steps of the scheduler (default 1)")  # fmt: skip
    ap.add_argument("--on-lag-exceeded", choices=("throttle", "drop", "sync"), default="throttle")
    ap.add_argument("--lr", type=float, default=LR, help=f"the trainer's AdamW lr (default {LR})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600.0, help="give up after this long")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    return args


def _recorded(run: Run, step: int) -> bool:
    """Whether the scheduler has recorded step ``step`` as done (the trainer's StepDone)."""
    history = run.history()
    rows = [] if history is None else [r for r in history.steps if int(r["step"]) == step]
    return bool(rows) and rows[0].get("done_at") is not None


def prepare(args: argparse.Namespace) -> Run:
    """A fresh run directory and shared-memory directory, the model, and the configuration."""
    from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415 - transformers

    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    directory = args.workdir or default_home() / "runs" / run_id
    directory.mkdir(parents=True, exist_ok=False)
    shm = Path("/dev/shm") / f"deltarl-up-{run_id}"  # noqa: S108 - shared memory, not a temp file
    shm.mkdir()
    run = Run(directory.resolve(), shm, args.steps, {})
    write_config(run, ensure_default_model(default_home() / "models"), args)
    return run


def main(argv: list[str]) -> int:
    args = _parse(argv)
    out = sys.stderr if args.json else sys.stdout
    print("deltarl up: preparing (the first run builds the tiny model and its tokenizer)",
          file=out, flush=True)  # fmt: skip
    run = prepare(args)
    print(f"deltarl up: run directory {run.directory}", file=out, flush=True)
    code = 1
    try:
        for daemon in ORDER:
            run.start(daemon)
        print(f"started {', '.join(ORDER)}; waiting for the first step "
              "(the rollout engine takes a while to start)", file=out, flush=True)  # fmt: skip
        progress = Progress(run, out)
        deadline = time.monotonic() + args.timeout
        while progress.poll() < args.steps or not _recorded(run, args.steps):
            why = run.dead()
            if why is None and time.monotonic() > deadline:
                why = f"not done after {args.timeout:.0f} s"
            if why is not None:
                print(f"deltarl up: {why}; the last lines of each log:", file=sys.stderr)
                for d in ORDER:
                    print(f"--- {run.log(d)}\n{run.tail(d)}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        try:
            summary = summarise(run)
        except SummaryError as e:
            print(f"deltarl up: {e}", file=sys.stderr)
            return 1
        code = 0
    except KeyboardInterrupt:
        # Ctrl-C reaches only us (the daemons have sessions of their own): stop them in order.
        print(f"\ndeltarl up: interrupted; stopping the daemons (logs: {run.directory})",
              file=sys.stderr)  # fmt: skip
        return 130
    finally:
        codes = run.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(run.shm)
        bad = {d: c for d, c in codes.items() if c != 0}
        if bad:
            print(f"deltarl up: daemons that did not stop cleanly: {bad}", file=sys.stderr)
            code = 1
    print_summary(summary, run, out)
    if args.json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    return code
