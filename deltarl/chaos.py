"""``deltarl chaos [--kills K] [--seconds S] [--json]``: the pipeline under SIGKILL.

It runs the pipeline as ``deltarl up`` does (the five daemons as processes, through the entry
points systemd uses) and, K times, SIGKILLs a daemon drawn at random (scheduler, trainer,
export, apply, rollout) at a random moment, waits ``--restart-sec`` and starts the same
command again with the same configuration, as systemd's ``Restart=always`` would. After each
restart it waits until the rollout side is back on the trainer's newest version: the restarted
daemon answers, and the rollout store's active version and the engine's loaded version both
equal the newest version the trainer has published (converged_s: from the restart to then).
A daemon that exits on its own is restarted the same way and reported: that is a finding.

Meanwhile a checker process (``deltarl.chaos_checker``) leases the rollout store and asks the
rollout daemon for its engine's digest, continuously. At the end everything is stopped with
SIGTERM and the figures are read (``deltarl.chaos_figures``). With ``--json``, progress goes to
stderr and stdout carries exactly one JSON object:

    {"kills", "steps", "half_applied_seen", "non_bit_exact", "lost_samples",
     "duplicate_samples", "versions_monotonic", "converged_s_max"}

Exit status 0 when the target is met (K kills delivered, every count 0, versions monotonic,
every restart converged within ``--converge-limit``), else 1. Everything else the run saw
(each kill, the checker's findings, the sample balance) is in ``chaos.json`` in the run
directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import orjson

from deltarl import up
from deltarl.chaos_figures import figures, print_report, scheduler_figures
from deltarl.engine.weight_store import WeightStore
from deltarl.launch import DaemonDied, WaitTimeout

DAEMONS = up.ORDER
POLL_S = 0.05
START_TIMEOUT_S = 300.0  # the first step: the rollout engine starts slowly on a CPU


class Chaos:
    """One run: the daemons, the checker, and what is observed of the versions."""

    def __init__(self, run: up.Run, restart_s: float, out: IO[str]) -> None:
        self.run = run
        self.restart_s = restart_s
        self.out = out
        self.stores: dict[str, WeightStore] = {}
        self.newest = -1  # the newest version the trainer has published, as observed
        self.crashes: list[dict[str, Any]] = []  # daemons that exited without our SIGKILL
        self.checker: subprocess.Popen[bytes] | None = None
        self.checker_out = run.directory / "checker.json"

    def say(self, text: str) -> None:
        print(f"deltarl chaos: {text}", file=self.out, flush=True)

    def start_checker(self) -> None:
        argv = [sys.executable, "-m", "deltarl.chaos_checker", "--root", str(self.run.shm)]
        argv += ["--store", "rollout", "--out", str(self.checker_out)]
        argv += ["--manifests", str(self.run.directory / "versions.sqlite")]
        argv += ["--rollout", self.run.endpoint("rollout")]
        with (self.run.directory / "checker.log").open("ab") as log:
            self.checker = subprocess.Popen(  # noqa: S603 - our own module
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop_checker(self) -> dict[str, Any] | None:
        """The checker's findings; None (and why, said) if it failed: no figures then."""
        if self.checker is None:
            return None
        self.checker.send_signal(signal.SIGTERM)
        try:
            self.checker.wait(60)
        except subprocess.TimeoutExpired:
            self.checker.kill()
            self.checker.wait(10)
        if self.checker.returncode != 0 or not self.checker_out.exists():
            log = (self.run.directory / "checker.log").read_text(errors="replace")[-3000:]
            self.say(f"the checker failed (status {self.checker.returncode}):\n{log}")
            return None
        result: dict[str, Any] = orjson.loads(self.checker_out.read_bytes())
        return result

    # -- what is observed --------------------------------------------------------------

    def _active(self, name: str) -> int | None:
        """A store's active version (an unlocked hint), or None if it is not there yet."""
        if name not in self.stores:
            try:
                self.stores[name] = WeightStore.open(name, root=self.run.shm, readonly=True)
            except FileNotFoundError:
                return None
        return self.stores[name].active_version

    def observe(self) -> tuple[int | None, int | None]:
        """(the rollout store's version, the engine's); notes the trainer's newest version."""
        published = self._active("published")
        if published is not None:
            self.newest = max(self.newest, published)
        st = self.run.status("rollout") or {}
        engine = st.get("weight_version")
        return self._active("rollout"), None if engine is None else int(engine)

    def converged(self, daemon: str) -> bool:
        rollout, engine = self.observe()
        back = self.run.status(daemon) is not None
        return back and rollout == engine == self.newest

    def supervise(self) -> None:
        """Restart, as systemd would, any daemon that exited without our SIGKILL."""
        for name, proc in list(self.run.procs.items()):
            if proc.poll() is not None:
                self.crashes.append({"daemon": name, "status": proc.returncode})
                self.say(f"{name} exited on its own (status {proc.returncode}); restarting it")
                time.sleep(self.restart_s)
                self.run.start(name)

    # -- the faults -------------------------------------------------------------------

    def kill_and_restart(self, daemon: str) -> bool:
        """SIGKILL ``daemon``, wait RestartSec, start it again; whether the kill landed."""
        proc = self.run.procs[daemon]
        delivered = False
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            delivered = proc.wait(10) == -signal.SIGKILL
        time.sleep(self.restart_s)
        self.run.start(daemon)
        return delivered

    def wait_converged(self, daemon: str, deadline: float) -> float | None:
        """Seconds until the rollout side is on the newest version again; None: not by then."""
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            self.supervise()
            if self.converged(daemon):
                return time.monotonic() - t0
            time.sleep(POLL_S)
        return None

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="deltarl chaos", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs to deliver (default 20)")
    ap.add_argument("--seconds", type=float, default=900.0, help="bound on the run (default 900)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--seed", type=int, help="of the daemons and moments (default: random)")
    ap.add_argument("--restart-sec", type=float, default=0.5, help="systemd's RestartSec")
    ap.add_argument("--gap-max", type=float, default=8.0, help="most seconds between kills")
    ap.add_argument("--converge-limit", type=float, default=30.0, help="target for converged_s_max")
    ap.add_argument("--workdir", type=Path, help="the run directory (default: a new one)")
    args = ap.parse_args(argv)
    if args.kills < 0 or args.seconds <= 0:
        ap.error("--kills must be at least 0 and --seconds positive")
    if args.seed is None:
        args.seed = secrets.randbelow(1 << 31)
    return args


def _first_step(chaos: Chaos, deadline: float) -> None:
    def ready() -> bool:
        trainer = chaos.run.status("trainer") or {}
        return int(trainer.get("step") or 0) >= 1 and chaos.converged("rollout")

    chaos.run.wait("the first step and the engine on it", ready, deadline - time.monotonic())


def _kills(chaos: Chaos, args: argparse.Namespace, deadline: float) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)  # noqa: S311 - a reproducible schedule, not a secret
    log: list[dict[str, Any]] = []
    while len(log) < args.kills:
        pause = rng.uniform(0.0, args.gap_max)
        daemon = rng.choice(DAEMONS)
        if time.monotonic() + pause + 20.0 > deadline:
            chaos.say(f"out of time after {len(log)} kills")
            break
        end = time.monotonic() + pause
        while time.monotonic() < end:  # a random moment, supervised meanwhile
            chaos.supervise()
            chaos.observe()
            time.sleep(POLL_S)
        delivered = chaos.kill_and_restart(daemon)
        seconds = chaos.wait_converged(daemon, deadline)
        log.append(
            {
                "daemon": daemon,
                "delivered": delivered,
                "converged": seconds is not None,
                # not converged: the wait until the deadline, a lower bound
                "converged_s": seconds if seconds is not None else deadline - end,
            }
        )
        back = "back on" if seconds is not None else "NOT back on"
        chaos.say(
            f"kill {len(log)}/{args.kills}: {daemon}; {back} version {chaos.newest} "
            f"{log[-1]['converged_s']:.2f} s after its restart"
        )
    return log


def _problems(
    args: argparse.Namespace, result: dict[str, Any], details: dict[str, Any]
) -> list[str]:
    """Why the target is not met (empty: it is)."""
    counts = ("half_applied_seen", "non_bit_exact", "lost_samples", "duplicate_samples")
    found = [f"{key} = {result[key]}" for key in counts if result[key]]
    if result["kills"] < args.kills:
        found.append(f"{result['kills']} of {args.kills} kills delivered")
    if not result["versions_monotonic"]:
        found.append("a version went backwards (see checker in chaos.json)")
    if details["scheduler"]["overdrawn"]:
        found.append(
            f"{details['scheduler']['overdrawn']} samples trained that were never accepted"
        )
    if any(not k["converged"] for k in details["kill_log"]):
        found.append("a restart did not converge before the deadline")
    if result["converged_s_max"] > args.converge_limit:
        found.append(f"converged_s_max over the limit of {args.converge_limit:g} s")
    if details["crashes"]:
        found.append(f"daemons exited on their own: {details['crashes']}")
    bad = {d: c for d, c in details["stop_codes"].items() if c != 0}
    if bad:
        found.append(f"daemons that did not stop cleanly: {bad}")
    return found


def main(argv: list[str]) -> int:
    args = _parse(argv)
    out = sys.stderr if args.json else sys.stdout
    started = time.monotonic()
    deadline = started + args.seconds
    # The trainer runs until it is stopped: the run ends after the kills, not after N steps.
    workdir = ["--workdir", str(args.workdir)] if args.workdir else []
    run = up.prepare(up._parse(["--steps", str(10**9), *workdir]))
    chaos = Chaos(run, args.restart_sec, out)
    chaos.say(f"seed {args.seed}; run directory {run.directory}")
    failed: list[str] = []
    kill_log: list[dict[str, Any]] = []
    try:
        for daemon in DAEMONS:
            run.start(daemon)
        chaos.start_checker()
        _first_step(chaos, min(deadline, started + START_TIMEOUT_S))
        chaos.say(f"pipeline up after {time.monotonic() - started:.0f} s; killing")
        kill_log = _kills(chaos, args, deadline)
    except (DaemonDied, WaitTimeout) as e:
        failed.append(f"{e}\n{run.logs()}")
    except KeyboardInterrupt:
        chaos.say("interrupted; stopping the daemons")
        return 130
    finally:
        codes = run.stop()
        checker = chaos.stop_checker()
        chaos.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(run.shm)
    db = run.directory / "scheduler.sqlite"
    if checker is None or not db.exists():
        # No honest figures: the checker's findings or the scheduler's record are missing.
        chaos.say("no figures: " + ("; ".join(failed) or "the checker failed"))
        return 1
    sched = scheduler_figures(db)
    kills = sum(1 for k in kill_log if k["delivered"])
    result = figures(kills, sched, checker, [k["converged_s"] for k in kill_log])
    details = {
        "seed": args.seed,
        "directory": str(run.directory),
        "wall_s": time.monotonic() - started,
        "kill_log": kill_log,
        "crashes": chaos.crashes,
        "stop_codes": codes,
        "scheduler": sched,
        "checker": checker,
    }
    problems = failed + _problems(args, result, details)
    (run.directory / "chaos.json").write_bytes(
        orjson.dumps({"result": result, "problems": problems, **details})
    )
    print_report(result, details, problems, out)
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0 if not problems else 1
