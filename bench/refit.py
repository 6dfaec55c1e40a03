"""`deltarl bench refit`: refits through the real daemons, against a full transfer.

Starts the synthetic trainer, the export agent and the apply agent as separate processes
(a temporary TOML config, control over ipc://), syncs the rollout store once (not reported),
then for each of K refits lets the trainer take exactly one AdamW step (resume, wait for the
new version, pause) and waits until the apply agent has activated it. Then it asks the export
agent for a full version (``resync``) of one more step, timed the same way: the full transfer
of the same weights over the same link, in the same run.

Per refit, read from the daemons' ``status`` (CLOCK_MONOTONIC is one clock for every process
on the host, namespaces included):

- encode_s: the export agent's taking of the published version (a lease) + time in the
  encoder (diff + coding + checksums + writing the changed elements into its reference, which
  becomes the next version's: no copy of the model);
- transfer_s: time in the link's ``send_chunk``/``send_manifest`` (stream: waiting for window
  room and the manifest's ack; shm: writing chunk files and waiting for the receiver to free
  slots), export agent;
- link_s: the least time the shaped link needs for the refit's bytes, ``wire_bytes`` at
  ``--rate-mbit`` (TCP/IP headers not counted, so the real time on the link is a few percent
  more); 0.0 on an unshaped link, which has no rate. ``transfer_s`` is the sender's time in
  its calls, and the socket buffers take megabytes without waiting: at 100 Mbit a delta
  spends about twice ``transfer_s`` on the link after the calls return, inside no measured
  stage, so without this one "the slowest stage" was not the link that bounds the refit;
- apply_s: opening the inactive buffer (for a delta, copying the active version into it
  first) + applying chunks, apply agent; activate_s: verifying every tensor + the flip;
- total_s: from the export agent taking the published version (before its copy-out) to the
  apply agent's commit. The stages overlap (chunks leave while encoding continues), so
  total_s can be below their sum; the pipeline target is total <= 1.25 x the slowest stage
  (encode, transfer, link, apply, activate).

bit_exact is checked here: lease the trainer's and the rollout store and compare the bytes.
``--sealed-compare`` runs it all again with a fresh cluster key directory (manifests sealed
with a MAC, a BLAKE2b-256 per chunk, the stream link on TLS 1.3) and adds ``sealed``: that
run's medians and their ratios to the plain run's, so the cost of authentication is measured
side by side on the same machine.

``--compare-copy`` runs it all again with the apply agent copying the whole active buffer into
the target before every delta (``catch_up = "off"``) and adds ``copy``: that run's medians and
the ratios to this run's, so what the sparse catch-up (deltarl/refit/catch_up.py) saves is
measured side by side. Each result also gives the delta refits' P95 total and the smallest
speedup over the refits (``speedup_min``: the full transfer over the slowest delta refit).

``--compare-conditioned`` runs it all again with the export agent coding deltas against the
reference (``delta_coding = "conditioned"``, deltarl/codecs/conditioned.py) and adds
``conditioned``: that run's medians (total, encode, transfer, apply, wire bytes) and their
ratios to this run's, so whether fewer bytes on the wire pay for the slower coding on this
link is measured side by side. ``--compare-conditioned-rice`` does the same with
``delta_coding = "conditioned_rice"`` (deltarl/codecs/conditioned_rice.py) and adds
``conditioned_rice``, with the same keys; ``--compare-conditioned-huffman`` with
``delta_coding = "conditioned_huffman"`` (deltarl/codecs/conditioned_huffman.py) adds
``conditioned_huffman``.

``--compare-export-hash`` runs it all again with the trainer committing no tensor digests
(its ``tensor_digests = false``), so the export agent hashes the model itself after the last
chunk, as before the trainer's digests, and adds ``export_hash`` with the same keys as
``conditioned``: what taking the hash off the refit's path saves, side by side.

``--rate-mbit R`` puts the export agent and the apply agent in two network namespaces joined
by a veth pair with a tbf qdisc at R Mbit/s (bench/netns.py); it needs root.

``--cpus split`` (the default where this process may use two CPUs or more) gives the export
agent the lower half of those CPUs and the apply agent the upper half (their ``cpus``
setting), as the two hosts of a real refit each have their own: shared, the two agents'
kernel threads preempted each other on every core, and a refit's kernel waited for its
slowest thread (on two cores at 1 Gbit, 98M parameters, three runs each, alternating: the
slowest refit 124-127 ms split against 129-134 shared, medians 114-122 against 120, the apply
stage 83-84 ms against 100-106). ``--cpus shared`` leaves both agents on every CPU. ``cpus``
in the result is each agent's CPU list as read back from the running process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from deltarl.bench.netns import NetnsError, ShapedLink, check_privilege
from deltarl.bench.refit_report import render

from deltarl.config import write_toml
from deltarl.engine.weight_store import WeightStore
from deltarl.launch import DaemonDied, DaemonGroup, WaitTimeout
from deltarl.ops.placement import format_cpu_list, halves
from deltarl.transport.curve import make_keys
from deltarl.transport.data_keys import KEYS_ENV
from deltarl.transport.messages import Command, Ok, Pause, Resume, Resync
from deltarl.transport.ports import free_port

STREAM_PORT = 47_311  # inside the namespaces nothing else listens


class BenchError(RuntimeError):
    """The bench could not run to the end; the message says why (with the daemons' logs)."""


def _link_table(link: str, host: str, port: int, tmp: Path, sealed: bool) -> dict[str, Any]:
    if link == "shm":
        return {"type": "shm", "name": "bench", "root": str(tmp)}
    # stream or ucx. Unsealed between namespaces is a choice here (the baseline it measures),
    # so it is said: beyond loopback a link refuses to run unauthenticated otherwise.
    return {"type": link, "host": host, "port": port, "security": "on" if sealed else "off"}


def _tables(
    tmp: Path,
    params: int,
    link: dict[str, Any],
    ack_timeout_s: float,
    catch_up: str = "eager",
    delta_coding: str = "rice",
    cpus: tuple[str, str] | None = None,
    tensor_digests: bool = True,
) -> dict:
    """The daemons' tables; ``cpus``: the export agent's and the apply agent's CPU lists;
    ``tensor_digests``: whether the trainer commits them (else the export agent hashes)."""

    def ipc(name: str) -> str:
        return f"ipc://{tmp}/{name}"

    daemons = {
        "trainer": {
            "control": ipc("trainer.sock"),
            "published_store": "pub",
            "store_root": str(tmp),
            "params": params,
            "interval_s": 0.2,
            "tensor_digests": tensor_digests,
        },
        "export": {
            "control": ipc("export.sock"),
            "published_store": "pub",
            "store_root": str(tmp),
            "manifest_store": str(tmp / "versions.sqlite"),
            "apply_control": ipc("apply.sock"),
            "apply_events": ipc("apply.events"),
            "full_resync_every": 1000,
            "ack_timeout_s": ack_timeout_s,
            "poll_s": 0.002,
            "delta_coding": delta_coding,
            "link": link,
        },
        "apply": {
            "control": ipc("apply.sock"),
            "events": ipc("apply.events"),
            "rollout_store": "rollout",
            "store_root": str(tmp),
            "layout_store": "pub",
            "layout_wait_s": 600.0,
            "link": link,
            "catch_up": catch_up,
        },
    }
    if cpus is not None:
        daemons["export"]["cpus"], daemons["apply"]["cpus"] = cpus
    return {"daemons": daemons}


class Daemons(DaemonGroup):
    """The three daemons as processes (export and apply maybe inside network namespaces)."""

    def __init__(self, tmp: Path, prefixes: dict[str, list[str]], tables: dict) -> None:
        config = write_toml(tmp / "deltarl.toml", tables)
        super().__init__(tmp, config, {n: t["control"] for n, t in tables["daemons"].items()})
        self.prefixes = prefixes

    def launch(self, daemon: str) -> None:
        args = ["--synthetic"] if daemon == "trainer" else []
        self.start(daemon, args=args, prefix=self.prefixes.get(daemon, []))

    def fields(self, daemon: str) -> dict[str, Any]:
        reply = self.status(daemon, 5.0)
        if reply is None:
            raise BenchError(f"{daemon} did not answer status")
        return reply.fields

    def command(self, daemon: str, command: Command) -> None:
        reply = self.request(daemon, command, 5.0)
        if not isinstance(reply, Ok):
            raise BenchError(f"{daemon} answered {command!r} with {reply!r}")

    def until(self, what: str, cond: Callable[[], bool], timeout: float) -> None:
        try:
            self.wait(what, cond, timeout)
        except (DaemonDied, WaitTimeout) as e:
            raise BenchError(str(e)) from None


def _cpus_of(daemons: Daemons, name: str) -> str:
    """The CPUs a running daemon may use, read back from the process its status names."""
    pid = int(daemons.fields(name)["runtime"]["pid"])
    return format_cpu_list(os.sched_getaffinity(pid))


def _lease_copy(name: str, tmp: Path) -> tuple[int, np.ndarray]:
    with WeightStore.open(name, root=tmp, readonly=True) as store, store.lease() as snap:
        return snap.version, snap.buffer.copy()


def _bit_exact(tmp: Path, version: int) -> tuple[bool, np.ndarray, int]:
    """Both stores hold ``version`` and the same bytes; the rollout bytes; the element count."""
    with (
        WeightStore.open("pub", root=tmp, readonly=True) as pub,
        WeightStore.open("rollout", root=tmp, readonly=True) as out,
        pub.lease() as a,
        out.lease() as b,
    ):
        same = a.version == b.version == version and bool(np.array_equal(a.buffer, b.buffer))
        return same, b.buffer.copy(), out.layout.numel


class Refits:
    def __init__(self, daemons: Daemons, wait_s: float, rate_mbit: float | None = None) -> None:
        self.d = daemons
        self.wait_s = wait_s
        self.rate_mbit = rate_mbit
        self.diag: list[dict[str, Any]] = []
        """Per refit, where the time between the stages went (table only, not the JSON)."""

    def step_once(self) -> int:
        """Let the trainer take one step; the new version (the trainer is paused again)."""
        before = self.d.fields("trainer")["version"]
        self.d.command("trainer", Resume())
        self.d.until(
            "a trainer step", lambda: self.d.fields("trainer")["version"] > before, self.wait_s
        )
        self.d.command("trainer", Pause())
        self.d.until(
            "the trainer to pause", lambda: not self.d.fields("trainer")["stepping"], self.wait_s
        )
        return int(self.d.fields("trainer")["version"])

    def wait_active(self, version: int) -> None:
        def done() -> bool:
            exp = self.d.fields("export")
            last = exp.get("last") or {}
            if last.get("version") == version and last.get("outcome") != "active":
                raise BenchError(f"version {version} failed: {last.get('outcome')}")
            return exp["reference_version"] == version and last.get("version") == version

        self.d.until(f"version {version} active on the apply agent", done, self.wait_s)

    def one(self, reference: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
        """One refit after one trainer step: its record, and the rollout bytes after it."""
        version = self.step_once()
        self.wait_active(version)
        # One record holds the whole refit: the export agent's figures and, in ``receiver``,
        # the apply agent's own, from the state that acknowledged the version.
        last = self.d.fields("export")["last"]
        applied = last.get("receiver") or {}
        if applied.get("applied_version") != version or last.get("total_s") is None:
            raise BenchError(f"version {version} was not acknowledged as applied: {last}")
        bit_exact, now, numel = _bit_exact(self.d.directory, version)
        a, b = reference.view(np.uint16), now.view(np.uint16)
        changed = int(np.count_nonzero(a != b))
        record = {
            "version": version,
            "kind": last["kind"],
            "changed_ratio": changed / numel,
            "wire_bytes": int(last["wire_bytes"]),
            "encode_s": float(last["copy_s"] + last["encode_s"]),
            "transfer_s": float(last["send_s"]),
            "link_s": int(last["wire_bytes"]) * 8 / (self.rate_mbit * 1e6)
            if self.rate_mbit
            else 0.0,
            "apply_s": float(applied["open_s"] + applied["apply_s"]),
            "activate_s": float(applied["verify_s"] + applied["commit_s"]),
            "total_s": float(last["total_s"]),
            "bit_exact": bit_exact,
            # How the apply agent's target reached the delta's base (catch_up.py): "settled"
            # (kept current after the last commit), "catch_up" (the last delta again, on the
            # path), "copy" (the active buffer), "none" (a full version).
            "opened_by": str(self.d.fields("apply").get("last_opened_by")),
        }
        opened_at = applied["started_at"] - applied["open_s"]
        self.diag.append(
            {
                "version": version,
                "copy_s": last["copy_s"],
                "open_s": applied["open_s"],
                # Of apply_s: tensors hashed as later chunks landed (the verify skips them).
                "early_hash_s": applied["early_hash_s"],
                # The apply's parts (deltarl/refit/receiver_state.py): the worker's own time
                # in its calls, its CPU time, decoding, keeping; and the settle after the
                # last commit, which this version's first chunk may have queued behind.
                "apply_s": applied["apply_s"],
                "apply_calls_s": applied["apply_calls_s"],
                "apply_cpu_s": applied["apply_cpu_s"],
                "decode_s": applied["decode_s"],
                "keep_s": applied["keep_s"],
                "chunks": applied["chunks"],
                "settle": self.d.fields("apply").get("last_settle"),
                "first_chunk_after_s": opened_at - last["started_at"],
                "sent_to_commit_s": applied["committed_at"] - last["sent_at"],
                # From the encoder's last chunk to the last send's return: the link draining
                # the chunks queued for it, and the manifest sent.
                "encoded_to_sent_s": last["sent_at"] - last["encoded_at"],
                # From encoding's start to its last chunk: the encoder's own time (encode_s)
                # and the waits between its chunks, while the sends ran on the agent's CPUs.
                "encode_span_s": last["encoded_at"] - last["started_at"],
                # The acknowledgement's own latency: the flip to the export agent hearing of it
                # (a pushed event; it was a status poll every poll_s before).
                "commit_to_ack_s": last["acked_at"] - applied["committed_at"],
                # How the target reached the delta's base: the last delta again, or a copy.
                "opened_by": self.d.fields("apply").get("last_opened_by"),
            }
        )
        return record, now


@contextlib.contextmanager
def _cluster_keys(tmp: Path, sealed: bool) -> Iterator[None]:
    """With ``sealed``: a fresh key directory in ``DELTARL_CURVE_KEYS`` for the daemons started
    inside (manifests sealed, stream link on TLS 1.3); without: the variable unset."""
    before = os.environ.pop(KEYS_ENV, None)
    try:
        if sealed:
            os.environ[KEYS_ENV] = str(make_keys(tmp / "keys"))
        yield
    finally:
        os.environ.pop(KEYS_ENV, None)
        if before is not None:
            os.environ[KEYS_ENV] = before


def run(
    params: int,
    link: str,
    rate_mbit: float | None,
    refits: int,
    *,
    sealed: bool = False,
    catch_up: str = "eager",
    delta_coding: str = "rice",
    cpus: tuple[str, str] | None = None,
    tensor_digests: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The JSON result and per-refit diagnostics; BenchError (or NetnsError) if it cannot end.
    ``cpus``: pin the export agent and the apply agent to these CPU lists (``halves``)."""
    shm = Path("/dev/shm")  # noqa: S108 - tmpfs for the stores; mkdtemp makes it private
    tmp = Path(tempfile.mkdtemp(prefix="deltarl-bench-refit-", dir=shm if shm.is_dir() else None))
    shaped: ShapedLink | None = None
    daemons: Daemons | None = None
    # The slowest full transfer: 2 bytes a parameter at the shaped rate, plus slack.
    wait_s = 120.0 + (params * 2 * 8 / (rate_mbit * 1e6) * 2 if rate_mbit else params / 2e6)
    try:
        prefixes: dict[str, list[str]] = {}
        if rate_mbit is not None:
            shaped = ShapedLink(rate_mbit).up()
            host, port = shaped.addr_b, STREAM_PORT
            prefixes = {"export": shaped.exec_prefix("a"), "apply": shaped.exec_prefix("b")}
        else:
            host, port = "127.0.0.1", free_port()
        link_table = _link_table(link, host, port, tmp, sealed)
        tables = _tables(
            tmp,
            params,
            link_table,
            wait_s,
            catch_up=catch_up,
            delta_coding=delta_coding,
            cpus=cpus,
            tensor_digests=tensor_digests,
        )
        daemons = Daemons(tmp, prefixes, tables)
        with _cluster_keys(tmp, sealed):
            for name in ("apply", "export", "trainer"):
                daemons.launch(name)
        bench = Refits(daemons, wait_s, rate_mbit)
        try:
            daemons.until("the trainer", lambda: daemons.status("trainer") is not None, wait_s)
            daemons.command("trainer", Pause())
            daemons.until(
                "the trainer to pause", lambda: not daemons.fields("trainer")["stepping"], wait_s
            )
            trainer = daemons.fields("trainer")
            # The first sync is full (the rollout store is empty), then one warm-up delta
            # (first-call compilation in both agents); neither is reported.
            bench.wait_active(int(trainer["version"]))
            _, reference = _lease_copy("rollout", tmp)
            _, reference = bench.one(reference)
            records = []
            for _ in range(refits):
                record, reference = bench.one(reference)
                records.append(record)
            daemons.command("export", Resync())
            full_record, _ = bench.one(reference)
        except BenchError as e:
            raise BenchError(f"{e}\n{daemons.logs(40)}") from None
        if full_record["kind"] != "full":
            raise BenchError(f"the resync'd version was sent as {full_record['kind']}")
        if not full_record["bit_exact"]:
            raise BenchError(f"the full version {full_record['version']} is not bit-exact")
        if daemons.fields("export")["sealed"] != sealed:
            raise BenchError(f"the export agent did not run {'sealed' if sealed else 'unsealed'}")
        deltas = [r["total_s"] for r in records if r["kind"] == "delta"] or [
            r["total_s"] for r in records
        ]
        median = statistics.median(deltas)
        p95 = float(np.percentile(deltas, 95))
        return {
            "link": link,
            "rate_mbit": None if rate_mbit is None else float(rate_mbit),
            "params": int(trainer["params"]),
            "full": {"total_s": full_record["total_s"], "wire_bytes": full_record["wire_bytes"]},
            "refits": records,
            "delta_total_s_median": median,
            "delta_total_s_p95": p95,
            "speedup": full_record["total_s"] / median if median > 0 else 0.0,
            "speedup_min": full_record["total_s"] / max(deltas) if max(deltas) > 0 else 0.0,
            "apply_s_median": statistics.median(r["apply_s"] for r in records),
            "cpus": {name: _cpus_of(daemons, name) for name in ("export", "apply")},
        }, bench.diag[1 : 1 + refits]
    finally:
        if daemons is not None:
            daemons.stop(timeout_s=40)
        if shaped is not None:
            shaped.down()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deltarl bench refit", description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=100_000_000, help="model size (default 100M)")
    ap.add_argument(
        "--link",
        choices=("shm", "stream", "ucx"),
        default="stream",
        help="the data link between the export and the apply agent",
    )
    ap.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="shape the stream link to R Mbit/s (netns + tbf; needs root)",
    )
    ap.add_argument("--refits", type=int, default=5, help="delta refits to time (default 5)")
    ap.add_argument(
        "--sealed-compare",
        action="store_true",
        help="run again with the cluster's keys (sealed manifests, BLAKE2b per chunk, TLS on "
        "the stream link) and report what that costs, side by side",
    )
    ap.add_argument(
        "--compare-copy",
        action="store_true",
        help="run again with the apply agent copying the active buffer before every delta "
        "(catch_up = off) and report the difference, side by side",
    )
    ap.add_argument(
        "--compare-conditioned",
        action="store_true",
        help="run again with deltas coded against the reference (delta_coding = "
        "conditioned) and report the difference, side by side",
    )
    ap.add_argument(
        "--compare-conditioned-rice",
        action="store_true",
        help="run again with deltas coded against the reference with Rice codes "
        "(delta_coding = conditioned_rice) and report the difference, side by side",
    )
    ap.add_argument(
        "--compare-conditioned-huffman",
        action="store_true",
        help="run again with deltas coded against the reference with a value code per "
        "exponent (delta_coding = conditioned_huffman) and report the difference, side by side",
    )
    ap.add_argument(
        "--compare-export-hash",
        action="store_true",
        help="run again with the trainer committing no tensor digests, so the export agent "
        "hashes the model on the refit's path as it did before, and report the difference, "
        "side by side",
    )
    ap.add_argument(
        "--cpus",
        choices=("split", "shared"),
        default="split",
        help="split: the export agent on the lower half of this process's CPUs and the apply "
        "agent on the upper half, as on two hosts (the default; shared where there is only "
        "one CPU); shared: both on every CPU",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.refits < 1 or args.params < 1:
        ap.error("--refits and --params must be at least 1")
    # the export agent on the lower half, the apply agent on the upper (the larger if odd)
    cpus = halves(os.sched_getaffinity(0), lower_larger=False) if args.cpus == "split" else None
    if args.rate_mbit is not None:
        if args.link != "stream":
            ap.error("--rate-mbit shapes the stream link only: use --link stream")
        if args.rate_mbit <= 0:
            ap.error("--rate-mbit must be positive")
        why = check_privilege()
        if why is not None:
            print(f"deltarl bench refit: {why}; run as root or drop --rate-mbit", file=sys.stderr)
            return 2
    if not args.json:
        print(
            f"starting the trainer, export and apply daemons ({args.params:,} parameters, "
            f"{args.link} link) for {args.refits} refits and one full transfer...",
            file=sys.stderr,
        )
    # SIGTERM unwinds like Ctrl-C: the daemons are stopped and the namespaces deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        same = (args.params, args.link, args.rate_mbit, args.refits)
        result, diag = run(*same, cpus=cpus)
        if args.sealed_compare:
            sealed, _ = run(*same, sealed=True, cpus=cpus)
            result["sealed"] = sealed_cost(result, sealed)
        if args.compare_copy:
            copied, _ = run(*same, catch_up="off", cpus=cpus)
            result["copy"] = copy_cost(result, copied)
        if args.compare_conditioned:
            coded, _ = run(*same, delta_coding="conditioned", cpus=cpus)
            result["conditioned"] = conditioned_cost(result, coded)
        if args.compare_conditioned_rice:
            coded, _ = run(*same, delta_coding="conditioned_rice", cpus=cpus)
            result["conditioned_rice"] = conditioned_cost(result, coded)
        if args.compare_conditioned_huffman:
            coded, _ = run(*same, delta_coding="conditioned_huffman", cpus=cpus)
            result["conditioned_huffman"] = conditioned_cost(result, coded)
        if args.compare_export_hash:
            hashed, _ = run(*same, tensor_digests=False, cpus=cpus)
            result["export_hash"] = conditioned_cost(result, hashed)
    except NetnsError as e:
        print(f"deltarl bench refit: cannot shape the link: {e}", file=sys.stderr)
        return 2
    except BenchError as e:
        print(f"deltarl bench refit: {e}", file=sys.stderr)
        return 1
    if args.json:
        import orjson  # noqa: PLC0415 - only the JSON path needs it

        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(render(result, diag))
    exact = all(r["bit_exact"] for r in result["refits"])
    compared = (
        "sealed",
        "copy",
        "conditioned",
        "conditioned_rice",
        "conditioned_huffman",
        "export_hash",
    )
    others = (result.get(k, {}).get("bit_exact", True) for k in compared)
    return 0 if exact and all(others) else 1


def copy_cost(ours: dict[str, Any], copied: dict[str, Any]) -> dict[str, Any]:
    """The copying run's figures beside the catch-up run's (ratios: copy / ours)."""
    return {
        "delta_total_s_median": copied["delta_total_s_median"],
        "delta_total_s_p95": copied["delta_total_s_p95"],
        "apply_s_median": copied["apply_s_median"],
        "speedup": copied["speedup"],
        "speedup_min": copied["speedup_min"],
        "delta_ratio": copied["delta_total_s_median"] / ours["delta_total_s_median"],
        "apply_ratio": copied["apply_s_median"] / ours["apply_s_median"],
        "opened_by": sorted({r["opened_by"] for r in copied["refits"]}),
        "bit_exact": all(r["bit_exact"] for r in copied["refits"]),
    }


def conditioned_cost(ours: dict[str, Any], coded: dict[str, Any]) -> dict[str, Any]:
    """Another run's figures beside this one's (ratios: the other / this): a conditioned
    coding's, or (``export_hash``) the export agent hashing the model itself."""

    def median(run: dict[str, Any], key: str) -> float:
        values = [r[key] for r in run["refits"] if r["kind"] == "delta"]
        return float(statistics.median(values)) if values else 0.0

    out: dict[str, Any] = {
        "delta_total_s_median": coded["delta_total_s_median"],
        "delta_total_s_p95": coded["delta_total_s_p95"],
        "speedup": coded["speedup"],
        "speedup_min": coded["speedup_min"],
        "delta_ratio": coded["delta_total_s_median"] / ours["delta_total_s_median"],
        "bit_exact": all(r["bit_exact"] for r in coded["refits"]),
    }
    for key in ("encode_s", "transfer_s", "apply_s", "wire_bytes"):
        theirs, base = median(coded, key), median(ours, key)
        out[f"{key}_median"] = theirs
        out[f"{key}_ratio"] = theirs / base if base else 0.0
    return out


def sealed_cost(plain: dict[str, Any], sealed: dict[str, Any]) -> dict[str, Any]:
    """The sealed run's figures beside the plain run's, as ratios (sealed / plain)."""
    delta, full = sealed["delta_total_s_median"], sealed["full"]["total_s"]
    return {
        "delta_total_s_median": delta,
        "full_total_s": full,
        "delta_ratio": delta / plain["delta_total_s_median"],
        "full_ratio": full / plain["full"]["total_s"],
        "wire_bytes_ratio": statistics.median(r["wire_bytes"] for r in sealed["refits"])
        / statistics.median(r["wire_bytes"] for r in plain["refits"]),
        "bit_exact": all(r["bit_exact"] for r in sealed["refits"]),
    }
