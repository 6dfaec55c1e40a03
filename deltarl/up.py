"""``deltarl up [--steps N] [--json]``: the whole RL loop on this machine, then a summary.

It starts the five daemons as separate processes through the same entry points systemd uses
(``deltarl scheduler|trainer|export|apply|rollout --config FILE``), with a configuration it
writes into a fresh run directory, on the embedded default (a tiny Qwen2-shaped model and a
tokenizer built locally, and a rule-based reward: ``deltarl.rl``). It shows one progress line
per optimizer step, stops everything with SIGTERM once the trainer has taken N steps, and ends
with a summary. With ``--json``, progress goes to stderr and stdout carries exactly one JSON
object:

    {"steps", "engine", "versions_applied", "reward_first", "reward_last", "refit_median_s",
     "refit_bit_exact", "samples_trained", "duplicate_samples", "max_policy_lag",
     "model", "task", "eval_accuracy_first", "eval_accuracy_last", "wire_bytes_median",
     "changed_ratio_median", "reward_p99_s"}

Where the figures come from (each daemon's ``status``, and the scheduler's run history):
- reward_first / reward_last: mean reward of the first / last three steps (scheduler history);
- versions_applied: every version the rollout engine loaded (rollout status ``refits``);
- refit_median_s: per version the engine loaded, from the export agent taking it out of the
  trainer's store to the engine holding it, verified; median;
- refit_bit_exact: every engine load's digest equalled the manifest's (checked inside the
  rollout daemon against what the apply agent verified), and there was at least one;
- samples_trained, max_policy_lag: summed / maximal over the scheduler's per-step history;
- duplicate_samples: samples of a prompt that the trainer reported training in two steps;
- model, task: the policy (``--model``: tiny, smollm2-135m) and the task it learns;
- eval_accuracy_first / _last: greedy accuracy on the task's held-out split before the first
  step and at the last round (``eval_curve`` has every round); null without a split;
- wire_bytes_median, changed_ratio_median: over the delta versions the engine loaded;
- reward_p99_s: the worst step's P99 reward latency (scheduler history).
Added to the object: ``counters`` (every drop, requeue and lag action with its reason),
``eval_curve`` (every held-out round), ``reward_curve`` (the mean reward of every step),
``step_time`` (where a step's time goes: wall, train, publish, wait for samples, a group's
generation and scoring, refit; medians), ``rollouts`` and ``engines`` (per rollout daemon:
versions applied, refit median, bit-exact, groups and tokens generated, busy seconds, and
``steps``: the engine steps and the seconds of the rounds that ran them, ``StepTally``),
``lag_rule``
(``--lag-rule``: which token of a group its lag is measured from), ``token_lag_mean`` and
``over_bound_token_ratio`` (the trained tokens' mean age in versions and the share of them
over the bound, token-weighted over the run: ``deltarl/scheduler/token_lag.py``),
``delta_coding`` (``--delta-coding``: how the deltas were coded, deltarl/codecs/).

``--trainer-ranks M`` runs the trainer as M data-parallel ranks (``trainer_ranks`` in the
object). ``--rollouts N`` runs N rollout daemons (``rollout``, ``rollout-2`` ...), each its own vLLM
engine and scheduler instance, all reading the one apply agent's weight store. The keys about
"the engine" above (versions_applied, refit_median_s) are the first one's; refit_bit_exact
holds for every engine's every load.

Placement (``cpus`` in the object: daemon -> the CPUs it was pinned to): by default the rollout
daemons run on the lower half of the machine's CPUs and the trainer on the upper half, as
separate machines would, since a training step beside busy engines on the same cores takes
several times as long (``auto_cpus``). ``--cpus DAEMON=LIST`` pins only the daemons named
(``rollout``: every rollout daemon); ``--cpus none`` pins nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from deltarl import up_curves
from deltarl.config import write_toml
from deltarl.config.rl import FORWARD_WEIGHTS, RLTrainerConfig
from deltarl.launch import DaemonGroup
from deltarl.ops.placement import halves, parse_cpu_list
from deltarl.recorded_versions import VersionRecorder
from deltarl.rl.protocol import REPLIES, GetHistory, History
from deltarl.rl.task import ShapedLengths, make_task
from deltarl.up_models import PROFILES, Profile
from deltarl.up_summary import Progress, SummaryError, print_summary, summarise

ORDER = ("scheduler", "trainer", "export", "apply", "rollout")
START_TIMEOUT_S = 900.0
CHECKPOINT_DIR = "checkpoints"  # the trainer's checkpoints, inside the run directory


def default_home() -> Path:
    return Path(os.environ.get("DELTARL_HOME", Path.home() / ".cache" / "deltarl"))


class Run(DaemonGroup):
    """One ``deltarl up``: its directory, configuration and daemon processes."""

    def __init__(
        self,
        directory: Path,
        shm: Path,
        steps: int,
        profile: Profile = PROFILES["tiny"],
        rollouts: int = 1,
    ) -> None:
        if rollouts < 1:
            raise ValueError(f"rollouts must be at least 1, got {rollouts}")
        # "rollout", then "rollout-2" ...: each its own daemon, vLLM engine and scheduler
        # instance, all reading the one apply agent's weight store.
        self.rollouts = rollout_names(rollouts)
        self.order = [d for d in ORDER if d != "rollout"] + self.rollouts
        # The sockets live in the short shared-memory directory, not the run directory: an
        # ipc:// path must fit sockaddr_un (107 bytes), which a run directory under a long
        # home may not.
        endpoints = {d: f"ipc://{shm}/{d}.sock" for d in self.order}
        super().__init__(directory, directory / "deltarl.toml", endpoints)
        self.shm = shm
        self.steps = steps
        self.profile = profile
        self.task = profile.task

    def endpoint(self, daemon: str, kind: str = "sock") -> str:
        return f"ipc://{self.shm}/{daemon}.{kind}"

    def start(self, daemon: str) -> None:  # type: ignore[override]
        # A session of its own: a Ctrl-C at the terminal reaches `deltarl up`, which stops the
        # daemons in order, instead of killing them all at once mid-write.
        command = "rollout" if daemon in self.rollouts else daemon
        super().start(daemon, daemon=command, own_session=True)

    def status(self, daemon: str) -> dict[str, Any] | None:  # type: ignore[override]
        reply = super().status(daemon)
        return None if reply is None else reply.fields

    def history(self) -> History | None:
        reply = self.request("scheduler", GetHistory(), 5.0, replies=REPLIES)
        return reply if isinstance(reply, History) else None

    def stop(self, timeout: float = 60.0) -> dict[str, int | None]:  # type: ignore[override]
        """SIGTERM the rollout daemon and wait for it (it stops asking for work and hands
        back what it holds), then the others together; a daemon still running after
        ``timeout`` is killed (its exit code is then None)."""
        return super().stop(waves=[self.rollouts], timeout_s=timeout)


def write_config(run: Run, model_dir: Path, args: argparse.Namespace) -> None:
    d, shm = run.directory, str(run.shm)
    link = {"type": "shm", "name": "up", "root": shm}
    daemons = {
        "scheduler": {
            "control": run.endpoint("scheduler"),
            "db": str(d / "scheduler.sqlite"),
            "task": args.task,
            "group_size": args.group_size,
            "groups_per_step": args.groups_per_step,
            "pool_capacity": 4 * args.groups_per_step,
            "max_policy_lag_steps": args.max_policy_lag,
            "on_lag_exceeded": args.on_lag_exceeded,
            "lag_rule": args.lag_rule,
            **(
                {"max_token_lag_steps": args.max_token_lag}
                if args.max_token_lag is not None
                else {}
            ),
            "policy": args.policy,
            **({"lookahead": args.lookahead} if args.lookahead is not None else {}),
            **({"plan": str(args.plan.resolve())} if args.plan is not None else {}),
            "seed": args.seed,
            "sampling": {
                "temperature": args.temperature,
                "top_p": 1.0,
                "max_tokens": args.max_tokens,
            },
            **run.profile.scheduler,
            **({"eval_prompts": args.eval_prompts} if args.eval_prompts is not None else {}),
            **({"eval_every": args.eval_every} if args.eval_every is not None else {}),
        },
        "trainer": {
            "control": run.endpoint("trainer"),
            "scheduler": run.endpoint("scheduler"),
            "published_store": "published",
            "store_root": shm,
            "model_dir": str(model_dir),
            "checkpoint_dir": str(d / CHECKPOINT_DIR),
            "checkpoint_every": 5,
            "groups_per_step": args.groups_per_step,
            "max_steps": run.steps,
            "lr": args.lr,
            "objective": args.objective,
            "forward_weights": args.forward_weights,
            "seed": args.seed,
            "ranks": args.trainer_ranks,
            **run.profile.trainer_table(args.trainer_ranks, args.cpus.get("trainer")),
        },
        "export": {
            "control": run.endpoint("export"),
            "published_store": "published",
            "store_root": shm,
            "manifest_store": str(d / "versions.sqlite"),
            "apply_control": run.endpoint("apply"),
            "apply_events": run.endpoint("apply", "events"),
            "chunk_bytes": 1 << 20,
            "delta_coding": args.delta_coding,
            "poll_s": 0.02,
            "link": link,
        },
        "apply": {
            "control": run.endpoint("apply"),
            "events": run.endpoint("apply", "events"),
            "rollout_store": "rollout",
            "store_root": shm,
            "layout_store": "published",
            "link": link,
        },
    }
    engine = _engine_table(run.profile.engine(), args.engine_args)
    for name in run.rollouts:
        # Every engine reads the one apply agent's store (a lease each while it loads a
        # version); the scheduler tells them apart by instance name.
        daemons[name] = {
            "control": run.endpoint(name),
            "instance": name,
            "scheduler": run.endpoint("scheduler"),
            "rollout_store": "rollout",
            "store_root": shm,
            "model_dir": str(model_dir),
            "max_running_groups": 2 * args.groups_per_step,
            "engine": engine,
        }
    for name, cpus in args.cpus.items():
        daemons[name]["cpus"] = cpus
    for i, name in enumerate(run.order):
        daemons[name]["metrics"] = (
            f"unix:{shm}/{name}.metrics"
            if args.metrics_port is None
            else f"127.0.0.1:{args.metrics_port + i}"
        )
    write_toml(run.config, {"daemons": daemons})


def _engine_table(profile: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The rollout engine's table: the profile's knobs, ``--engine-arg`` fields merged into
    its ``engine_args``."""
    table = dict(profile)
    if extra:
        table["engine_args"] = {**table.get("engine_args", {}), **extra}
    return table


# -- main ---------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="deltarl up", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps to run (default 30)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument(
        "--workdir",
        type=Path,
        help="the run directory (default: a new one under $DELTARL_HOME/runs)",
    )
    ap.add_argument(
        "--model",
        choices=sorted(PROFILES),
        default="tiny",
        help="the policy: the embedded tiny model (default) or SmolLM2-135M-Instruct",
    )
    ap.add_argument("--task", help="the task (default: the model's: default / arithmetic)")
    ap.add_argument(
        "--metrics-port",
        type=int,
        metavar="BASE",
        help="serve each daemon's Prometheus metrics on 127.0.0.1:BASE, BASE+1, ... in the"
        " order scheduler, trainer, export, apply, rollout(s) (default: on unix sockets"
        " beside the control sockets)",
    )
    ap.add_argument("--group-size", type=int, help="samples per prompt (GRPO group)")
    ap.add_argument("--groups-per-step", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument(
        "--max-policy-lag",
        type=int,
        default=1,
        help="max_policy_lag_steps of the scheduler (default 1)",
    )
    ap.add_argument("--on-lag-exceeded", choices=("throttle", "drop", "sync"), default="throttle")
    ap.add_argument(
        "--max-token-lag",
        type=int,
        default=None,
        metavar="K",
        help="under --lag-rule partial: drop (or abort) a group whose oldest token is more "
        "than K versions behind (default: no cap)",
    )
    ap.add_argument(
        "--lookahead",
        type=int,
        default=None,
        metavar="N",
        help="with --policy deltarl: how many prompts past those that may be issued now it "
        "chooses among, longest first (the scheduler's lookahead; default 64)",
    )
    ap.add_argument(
        "--delta-coding",
        choices=("rice", "conditioned", "conditioned_rice", "conditioned_huffman"),
        default="rice",
        help="how the export agent codes deltas (default rice; conditioned: also against "
        "the reference's exponents, fewer bytes for more CPU; conditioned_rice: the same "
        "with Rice codes, a few more bytes for less CPU; conditioned_huffman: values by a "
        "code per exponent, about conditioned's bytes for conditioned_rice's CPU)",
    )
    ap.add_argument(
        "--lag-rule",
        choices=("oldest_token", "partial"),
        default="oldest_token",
        help="which token a group's lag is measured from (default oldest_token; partial: "
        "groups go on under new weights, a partial rollout)",
    )
    ap.add_argument(
        "--policy",
        choices=("fifo", "least_requests", "sync", "deltarl"),
        default="fifo",
        help="the scheduler's dispatch policy (default fifo; sync: the synchronous baseline)",
    )
    ap.add_argument(
        "--plan",
        type=Path,
        help="an offline plan from `deltarl plan` (its task, seed and step shape must match)",
    )
    ap.add_argument("--lr", type=float, help="the trainer's AdamW lr (default: the model's)")
    ap.add_argument(
        "--objective",
        choices=("clipped", "decoupled"),
        default="decoupled",
        help="the trainer's policy loss (default decoupled: the clip around the step's "
        "policy, staleness corrected by truncated importance weights; clipped: PPO's clip "
        "against the behaviour policy)",
    )
    ap.add_argument(
        "--forward-weights",
        choices=FORWARD_WEIGHTS,
        default=RLTrainerConfig.forward_weights,
        help="the weights the trainer's passes run at (default published: its float32 master "
        "weights rounded to the bf16 the engines serve; master: the float32 ones)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        help="the sampling temperature of training groups (default: the model's)",
    )
    ap.add_argument(
        "--eval-prompts", type=int, metavar="N", help="held-out problems per eval round"
    )
    ap.add_argument("--eval-every", type=int, metavar="K", help="an eval round every K steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--keep-versions",
        type=int,
        default=0,
        metavar="N",
        help="record the first N consecutive published versions in the run's versions/ "
        "(real deltas for `deltarl bench codec --versions DIR`)",
    )
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further vllm.EngineArgs field for every rollout engine, VALUE read as JSON "
        "where it parses (gpu_memory_utilization=0.3: two engines on one GPU); repeatable",
    )
    ap.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        metavar="M",
        help="data-parallel trainer ranks (the trainer's `ranks`; default 1)",
    )
    ap.add_argument(
        "--rollouts",
        type=int,
        default=1,
        metavar="N",
        help="rollout daemons, each its own vLLM engine, all fed by the scheduler and reading "
        "the one apply agent's weight store (default 1)",
    )
    ap.add_argument(
        "--cpus",
        action="append",
        default=[],
        metavar="DAEMON=LIST",
        help="run a daemon on these CPUs (a Linux cpu list: 0, 2-3, 0,4-7; its table's "
        "`cpus`): scheduler, trainer, export, apply, or rollout (every rollout daemon) or "
        "rollout-N (one); repeatable, and then only those are pinned. Default: the rollout "
        "daemons on the lower half of this machine's CPUs and the trainer on the upper half, "
        "as separate machines would be (on two cores, 3x faster steps than sharing them); "
        "`none`: nothing pinned",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="give up after this long")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.keep_versions < 0:
        ap.error("--keep-versions must not be negative")
    if args.rollouts < 1:
        ap.error("--rollouts must be at least 1")
    if args.trainer_ranks < 1:
        ap.error("--trainer-ranks must be at least 1")
    args.engine_args = {}
    for item in args.engine_arg:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--engine-arg takes KEY=VALUE, got {item!r}")
        try:
            args.engine_args[key] = orjson.loads(value)
        except orjson.JSONDecodeError:
            args.engine_args[key] = value  # a plain string
    args.cpus = _cpus(ap, args.cpus, args.rollouts)
    profile = PROFILES[args.model]
    args.task = args.task or profile.task
    try:
        task = make_task(args.task)
    except ValueError as e:
        ap.error(f"--task: {e}")
    if args.max_tokens is None and isinstance(task, ShapedLengths):
        # A task that forces its completion lengths needs room for them: at the profile's
        # max_tokens (16 for the tiny model) every long one would be cut to it.
        args.max_tokens = task.max_tokens
    for key in ("group_size", "groups_per_step", "max_tokens", "lr", "temperature"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(profile, key))
    return args


def rollout_names(count: int) -> list[str]:
    """The rollout daemons of a run of ``count``: ``rollout``, then ``rollout-2`` ..."""
    return ["rollout", *(f"rollout-{i}" for i in range(2, count + 1))]


def auto_cpus(cpus: Iterable[int], rollouts: list[str]) -> dict[str, str]:
    """The default placement: the rollout daemons on the lower half of ``cpus`` (the larger
    half when their number is odd: generation is most of a step's work), the trainer on the
    rest; nothing pinned with one CPU. The scheduler and the agents float: they are light."""
    split = halves(cpus, lower_larger=True)
    if split is None:
        return {}
    generation, training = split
    return {"trainer": training, **dict.fromkeys(rollouts, generation)}


def cpu_placement(items: Sequence[str], rollouts: int) -> dict[str, str]:
    """``--cpus`` as daemon name -> cpu list: none given, ``auto_cpus`` over this process's
    CPUs; ``none``, nothing pinned; else each ``DAEMON=LIST`` (``rollout``: every rollout
    daemon; a later item for the same daemon wins), and only those. ValueError saying what is
    wrong with an item."""
    names = [d for d in ORDER if d != "rollout"]
    rollouts_named = rollout_names(rollouts)
    if not items:
        return auto_cpus(os.sched_getaffinity(0), rollouts_named)
    if "none" in items:
        if list(items) != ["none"]:
            raise ValueError("--cpus none pins nothing: it takes no DAEMON=LIST beside it")
        return {}
    out: dict[str, str] = {}
    for item in items:
        daemon, eq, cpus = item.partition("=")
        if not eq or daemon not in [*names, *rollouts_named]:
            raise ValueError(
                f"--cpus takes DAEMON=LIST with DAEMON one of "
                f"{', '.join([*names, *rollouts_named])}, got {item!r}"
            )
        try:
            parse_cpu_list(cpus)
        except ValueError as e:
            raise ValueError(f"--cpus {item!r}: {e}") from None
        for name in rollouts_named if daemon == "rollout" else [daemon]:
            out[name] = cpus
    return out


def _cpus(ap: argparse.ArgumentParser, items: list[str], rollouts: int) -> dict[str, str]:
    """``cpu_placement``, its errors as the parser's."""
    try:
        return cpu_placement(items, rollouts)
    except ValueError as e:
        ap.error(str(e))


def _recorded(run: Run, step: int) -> bool:
    """Whether the scheduler has recorded step ``step`` as done (the trainer's StepDone), and
    every held-out round it opened has finished: a round opened by the last step measures the
    final policy, the figure a run is judged by, so the run waits for it."""
    history = run.history()
    rows = [] if history is None else [r for r in history.steps if int(r["step"]) == step]
    if not rows or rows[0].get("done_at") is None:
        return False
    return history is not None and all(e.get("finished") for e in history.evals)


def prepare(args: argparse.Namespace) -> Run:
    """A fresh run directory and shared-memory directory, the model, and the configuration."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    directory = args.workdir or default_home() / "runs" / run_id
    directory.mkdir(parents=True, exist_ok=False)
    shm = Path("/dev/shm") / f"deltarl-up-{run_id}"  # noqa: S108 - shared memory, not a temp file
    shm.mkdir(mode=0o700)  # private: the daemons' ipc sockets live here
    profile = PROFILES[args.model]
    run = Run(directory.resolve(), shm, args.steps, profile, args.rollouts)
    run.task = args.task
    write_config(run, profile.model_dir(default_home() / "models"), args)
    return run


def _draw_curves(summary: dict[str, Any], run: Run) -> str | None:
    """The run's curves as ``<run directory>.png``, beside it; its path, or None (said why)."""
    out = run.directory.with_name(run.directory.name + ".png")
    title = f"deltarl up: {run.profile.summary_name}, task {run.task}, {summary['steps']} steps"
    try:
        return str(up_curves.draw(summary, out, title))
    except (OSError, ValueError, RuntimeError) as e:  # the run stands; only the picture is lost
        print(f"deltarl up: curves not drawn: {e}", file=sys.stderr)
        return None


def main(argv: list[str]) -> int:
    args = _parse(argv)
    # SIGTERM unwinds like Ctrl-C: the daemons run in sessions of their own, so without this a
    # `kill` of `deltarl up` would leave all five running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = sys.stderr if args.json else sys.stdout
    print(
        f"deltarl up: preparing {PROFILES[args.model].summary_name} on the {args.task} task "
        "(the first run builds the model)",
        file=out,
        flush=True,
    )
    run = prepare(args)
    print(f"deltarl up: run directory {run.directory}", file=out, flush=True)
    recorder = (
        VersionRecorder("published", run.shm, run.directory / "versions", args.keep_versions)
        if args.keep_versions
        else None
    )
    code = 1
    try:
        for daemon in run.order:
            run.start(daemon)
        print(
            f"started {', '.join(run.order)}; waiting for the first step "
            "(the rollout engine takes a while to start)",
            file=out,
            flush=True,
        )
        progress = Progress(run, out)
        deadline = time.monotonic() + args.timeout
        while progress.poll() < args.steps or not _recorded(run, args.steps):
            why = run.dead()
            if why is None and time.monotonic() > deadline:
                why = f"not done after {args.timeout:.0f} s"
            if why is not None:
                print(f"deltarl up: {why}; the last lines of each log:", file=sys.stderr)
                for d in run.order:
                    print(f"--- {run.log(d)}\n{run.tail(d)}", file=sys.stderr)
                return 1
            if recorder is not None:
                recorder.poll()
            time.sleep(0.5 if recorder is None or recorder.done else 0.1)
        try:
            summary = summarise(run)
        except SummaryError as e:
            print(f"deltarl up: {e}", file=sys.stderr)
            return 1
        summary["cpus"] = args.cpus
        summary["curves_png"] = _draw_curves(summary, run)
        code = 0
    except KeyboardInterrupt:
        # Ctrl-C reaches only us (the daemons have sessions of their own): stop them in order.
        print(
            f"\ndeltarl up: interrupted; stopping the daemons (logs: {run.directory})",
            file=sys.stderr,
        )
        return 130
    finally:
        if recorder is not None:
            recorder.close()
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
