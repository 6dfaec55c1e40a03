"""Three hosts as network namespaces, each daemon started from its own configuration file.

Host A runs the scheduler, the trainer (2 data-parallel ranks) and the export agent; hosts B
and C each run an apply agent and a rollout daemon (a vLLM engine on the CPU). C is reached
only through B, over a tbf-shaped link: its versions come through B's apply agent, which
relays every chunk, and its engine's work and samples cross B to the scheduler on A. Every
tcp:// socket speaks CURVE, the stream links TLS, and manifests carry a MAC (``deltarl keys``).

The configuration files are the ones under examples/several-hosts, which the README's "Several
hosts" section shows. The test changes in them only what a test must: the paths
(/var/lib/deltarl, /run/deltarl, /srv/deltarl/models go to the test's directory) and the
weight stores' root (each host its own, as each machine has its own /dev/shm). The addresses
are used as written: they exist only inside the namespaces the test makes.

Checked: real steps are trained with both ranks; every version reaches both hosts and is
activated there; every load of each engine is proven against the manifest's digest; both
engines generated; no sample was trained twice; an operator on host A reaches both apply
agents over CURVE, and a client without the keys gets no answer. The refit time per host (the
export agent taking a version to each engine holding it, verified) is printed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from deltarl.bench.netns import NetnsError, ThreeHosts, check_privilege

from deltarl.config import write_toml
from deltarl.launch import DaemonDied, DaemonGroup, WaitTimeout
from deltarl.transport.curve import KEYS_ENV
from deltarl.transport.messages import Ok, Pause
from tests.installed import require_vllm

require_vllm()

pytestmark = pytest.mark.timeout(900)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "several-hosts"
# (host, table, command), in the order they start: the apply agents before the engines that
# read their stores, C's before B's (B relays to it).
DAEMONS = (
    ("a", "scheduler", "scheduler"),
    ("a", "trainer", "trainer"),
    ("a", "export", "export"),
    ("c", "apply", "apply"),
    ("b", "apply", "apply"),
    ("b", "rollout-0", "rollout"),
    ("c", "rollout-1", "rollout"),
)
ENGINES = {"b": "rollout-0", "c": "rollout-1"}
APPLY = {"b": "tcp://10.10.0.2:5563", "c": "tcp://10.10.1.2:5563"}
STEPS = 4
LINK_MBIT = 50.0  # B - C


def _netns_usable() -> str | None:
    why = check_privilege()
    if why is not None:
        return why
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return None if proc.returncode == 0 else f"ip netns fails: {proc.stderr.strip()}"


def _deltarl(*args: str, prefix: list[str] | None = None, **kw: Any) -> str:
    proc = subprocess.run(
        [*(prefix or []), sys.executable, "-m", "deltarl.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **kw,
    )
    assert proc.returncode == 0, f"deltarl {' '.join(args)}: {proc.stderr[-3000:]}"
    return proc.stdout


def _localise(value: Any, host_dir: Path, models: Path) -> Any:
    """The example's value with its host paths moved into the test's directory."""
    if isinstance(value, dict):
        return {k: _localise(v, host_dir, models) for k, v in value.items()}
    if isinstance(value, list):
        return [_localise(v, host_dir, models) for v in value]
    if isinstance(value, str):
        return (
            value.replace("/var/lib/deltarl", str(host_dir / "state"))
            .replace("/run/deltarl", str(host_dir / "run"))
            .replace("/srv/deltarl/models", str(models))
        )
    return value


def host_config(host: str, table: str, root: Path, models: Path) -> Path:
    """examples/several-hosts/host-H/TABLE.toml, localised, written under root/H."""
    host_dir = root / host
    tables = _localise(
        tomllib.loads((EXAMPLES / f"host-{host}" / f"{table}.toml").read_text()), host_dir, models
    )
    for t in tables["daemons"].values():
        if "published_store" in t or "rollout_store" in t:
            t["store_root"] = str(host_dir / "shm")
    return write_toml(host_dir / f"{table}.toml", tables)


class Cluster(DaemonGroup):
    def __init__(self, root: Path, hosts: ThreeHosts, models: Path) -> None:
        self.hosts = hosts
        self.configs: dict[str, Path] = {}
        endpoints: dict[str, str] = {}
        for host, table, _ in DAEMONS:
            for sub in ("state", "run", "shm"):
                (root / host / sub).mkdir(parents=True, exist_ok=True)
            name = f"{host}-{table}"
            self.configs[name] = host_config(host, table, root, models)
            daemons = tomllib.loads(self.configs[name].read_text())["daemons"]
            endpoints[name] = daemons[table]["control"]
        super().__init__(root, root / "unused.toml", endpoints)

    def start_all(self) -> None:
        for host, table, command in DAEMONS:
            name = f"{host}-{table}"
            self.start(
                name,
                daemon=command,
                table=table,
                config=self.configs[name],
                prefix=self.hosts.exec_prefix(host),
            )

    def fields(self, name: str) -> dict[str, Any]:
        """Status of a daemon with an ipc:// control socket (reachable from any namespace)."""
        reply = self.status(name)
        assert reply is not None, f"{name} did not answer; logs:\n{self.logs(40)}"
        return reply.fields

    def now(self, name: str) -> dict[str, Any]:
        """Its status fields, or {} while it does not answer yet (starting)."""
        reply = self.status(name)
        return {} if reply is None else reply.fields

    def ctl(self, host: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        """``deltarl ctl ... --json`` run by an operator on ``host``."""
        out = _deltarl("ctl", *args, "--json", prefix=self.hosts.exec_prefix(host), env=env)
        return orjson.loads(out)  # type: ignore[no-any-return]

    def wait_for(self, what: str, cond: Any, timeout: float) -> None:
        try:
            self.wait(what, cond, timeout)
        except (DaemonDied, WaitTimeout) as e:
            raise AssertionError(f"{e}; logs:\n{self.logs(40)}") from None


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    why = _netns_usable()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    models = tmp_path / "models"
    # What each host does before its daemons start (the README's steps): the model, the keys,
    # and on the rollout hosts the layout their apply agent creates its store with.
    model_dir = Path(_deltarl("model", "tiny", "--root", str(models)).strip())
    keys = tmp_path / "keys"
    _deltarl("keys", str(keys))
    monkeypatch.setenv(KEYS_ENV, str(keys))
    for host in "bc":
        (tmp_path / host / "state").mkdir(parents=True)
        _deltarl("layout", str(model_dir), "--out", str(tmp_path / host / "state" / "layout.json"))
    hosts = ThreeHosts(LINK_MBIT)
    try:
        hosts.up()
    except NetnsError as e:
        pytest.fail(f"the namespaces could not be made: {e}")
    c = Cluster(tmp_path, hosts, models)
    try:
        yield c
    finally:
        for name, proc in c.procs.items():
            if proc.poll() is None:
                c.kill(name)
        hosts.down()


def test_three_hosts_train_and_prove_every_engine(cluster: Cluster) -> None:
    cluster.start_all()
    cluster.wait_for(
        f"{STEPS} trainer steps",
        lambda: int(cluster.now("a-trainer").get("step") or 0) >= STEPS,
        timeout=600,
    )
    assert cluster.request("a-trainer", Pause()) == Ok("paused (after the step in flight)")
    cluster.wait_for(
        "the trainer paused", lambda: cluster.now("a-trainer").get("activity") == "paused", 120
    )
    trainer = cluster.fields("a-trainer")
    version = int(trainer["published_version"])
    assert trainer["ranks"] == 2, trainer
    assert trainer["ranks_alive"] == 2, trainer
    cluster.wait_for(
        f"version {version} in both engines",
        lambda: all(
            cluster.now(f"{h}-{e}").get("weight_version") == version for h, e in ENGINES.items()
        ),
        timeout=120,
    )

    # Every version went out once and was activated by the whole tree (B and C).
    export = cluster.fields("a-export")
    recent = export["recent"]
    assert [int(r["version"]) for r in recent] == list(range(version + 1)), recent
    assert all(r["outcome"] == "active" for r in recent), recent
    taken = {int(r["version"]): float(r["taken_at"]) for r in recent}
    # C's versions crossed the shaped link, relayed by B: at least the full version 0.
    assert cluster.hosts.shaped_bytes() > int(recent[0]["wire_bytes"]), recent[0]

    # Each engine generates: groups submitted, or tokens of groups the scheduler had the
    # engine abort because they fell behind the lag bound while generating (a slow host's
    # first ones). Waited for, not read at one instant: on two loaded cores the faster host
    # can fill the first STEPS steps while the slower one's first groups are still running
    # (seen once here: host C held 8 groups, 0 done, when the trainer paused). Its groups'
    # pool slots are reserved at issue, so they can still be submitted after the pause.
    def made(st: dict) -> int:
        return int(st.get("submitted_groups") or 0) + int(st.get("aborted_groups") or 0)

    cluster.wait_for(
        "every engine to have generated",
        lambda: all(made(cluster.now(f"{h}-{e}")) > 0 for h, e in ENGINES.items()),
        timeout=180,
    )

    # Each engine proved every load against the manifest's digest, and generated.
    refit_s: dict[str, list[float]] = {}
    for host, engine in ENGINES.items():
        st = cluster.fields(f"{host}-{engine}")
        assert st["engine"] == "vllm", st
        loads = st["refits"]
        assert loads, st
        assert all(r["verified"] for r in loads), loads
        assert st["mismatches"] == 0, st
        assert st["unverified"] is None, st
        assert made(st) > 0, f"{engine} on host {host} generated nothing: {st}"
        refit_s[host] = [float(r["done"]) - taken[int(r["version"])] for r in loads[1:]]

    # An operator on host A reaches both apply agents over CURVE ...
    for host, endpoint in APPLY.items():
        reply = cluster.ctl("a", endpoint, "status")
        assert reply["ok"], reply
        assert reply["reply"]["body"]["fields"]["active_version"] == version, (host, reply)
    # ... and a client without the keys gets no answer (exit 3: no reply in time).
    no_keys = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
    proc = subprocess.run(
        [
            *cluster.hosts.exec_prefix("a"),
            sys.executable,
            "-m",
            "deltarl.cli",
            "ctl",
            APPLY["c"],
            "status",
            "--timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=no_keys,
        check=False,
    )
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-2000:])

    # No sample trained twice (the trainer's own account, per step).
    history = cluster.ctl("a", "tcp://10.10.0.1:5561", "history")
    steps = history["reply"]["body"]["steps"]
    assert len(steps) >= STEPS, steps
    seen: set[str] = set()
    for row in steps:
        for group in (row.get("metrics") or {}).get("groups") or {}:
            prompt = str(group).split(".")[0]
            assert prompt not in seen, f"prompt {prompt} trained twice"
            seen.add(prompt)

    codes = cluster.stop(waves=[[f"{h}-{e}" for h, e in ENGINES.items()]], timeout_s=90)
    assert all(c == 0 for c in codes.values()), f"{codes}; logs:\n{cluster.logs(30)}"
    for host, seconds in refit_s.items():
        if seconds:
            print(
                f"host {host}: refit median {statistics.median(seconds):.3f} s "
                f"over {len(seconds)} versions (export pick-up to the engine, verified)"
            )


def test_each_hosts_files_make_one_configuration() -> None:
    """The README's ``cat host-X/*.toml > /etc/deltarl/deltarl.toml``: a host's files hold
    distinct tables, so together they are one valid file with every daemon of the host."""
    for host in "abc":
        files = sorted((EXAMPLES / f"host-{host}").glob("*.toml"))
        merged = tomllib.loads("\n".join(f.read_text() for f in files))
        expected = {table for h, table, _ in DAEMONS if h == host}
        assert set(merged["daemons"]) == expected, (host, files)
