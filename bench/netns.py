"""A rate-shaped link between two Linux network namespaces, for `deltarl bench refit`.

Two namespaces, ``<PREFIX>-<pid>-a`` (the sender) and ``<PREFIX>-<pid>-b`` (the receiver),
joined by a veth pair with addresses 10.231.X.1/30 and 10.231.X.2/30 (X from the pid), each
end with a ``tbf`` qdisc at the asked rate (the ack direction too). Needs root (CAP_NET_ADMIN
and CAP_SYS_ADMIN); ``netem`` is not used. Only addresses inside these namespaces are used.

``ShapedLink`` is a context manager; it also registers an atexit hook, and ``clean_stale``
removes namespaces with the prefix whose creating process is gone (a crashed earlier run).

``ThreeHosts``: the several-hosts test's network, three namespaces ``<PREFIX>-<pid>-ha``,
``-hb`` and ``-hc``. A and B share a plain veth link (10.10.0.1 and 10.10.0.2, /24); B and C a
tbf-shaped one (10.10.1.1 and 10.10.1.2, /24). B forwards between them, so C reaches A only
through B and the shaped link, as a host in another region would. The addresses are those of
the example configuration files (examples/several-hosts): they exist only inside these
namespaces, so two runs at once do not collide and nothing outside is ever addressed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
from typing import Self

PREFIX = "drlbench"
IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"


class NetnsError(RuntimeError):
    """The namespaces could not be made (no privilege, no ``ip``/``tc``, ...)."""


def _run(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)  # noqa: S603
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def namespaces() -> list[str]:
    """Names of the network namespaces with our prefix."""
    try:
        out = _run(IP, "netns", "list")
    except (NetnsError, FileNotFoundError):
        return []
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX + "-")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> list[str]:
    """Delete our namespaces whose creating process no longer runs; the names deleted."""
    gone = []
    for name in namespaces():
        parts = name.split("-")
        if len(parts) == 3 and parts[1].isdigit() and _alive(int(parts[1])):
            continue  # another run's, still in use
        with contextlib.suppress(NetnsError):
            _run(IP, "netns", "delete", name)
            gone.append(name)
    return gone


def check_privilege() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "--rate-mbit needs root (CAP_NET_ADMIN) to create network namespaces"
    if not (os.path.exists(IP) and os.path.exists(TC)):
        return f"--rate-mbit needs iproute2 ({IP}, {TC})"
    return None


class _Namespaces:
    """The life of a set of namespaces made by this process: ``up`` checks the privilege,
    removes stale ones of crashed runs, registers ``down`` at exit and builds them
    (``_build``), undoing everything if a step fails; ``down`` deletes the namespaces, and
    any veth end a failed set-up left in the root namespace. Safe to call twice."""

    namespaces: tuple[str, ...]
    root_devices: tuple[str, ...]
    """One end of each veth pair: the name it has while still in the root namespace."""

    def __init__(self) -> None:
        self._up = False

    def _build(self) -> None:
        raise NotImplementedError

    def up(self) -> Self:
        why = check_privilege()
        if why is not None:
            raise NetnsError(why)
        clean_stale()
        atexit.register(self.down)
        self._up = True
        try:
            for ns in self.namespaces:
                _run(IP, "netns", "add", ns)
                _run(IP, "-n", ns, "link", "set", "lo", "up")
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:
            with contextlib.suppress(NetnsError, FileNotFoundError):
                _run(IP, "netns", "delete", ns)
        links = _run(IP, "-o", "link", "show")
        for dev in self.root_devices:
            if dev in links:  # left in the root namespace by a failed set-up
                with contextlib.suppress(NetnsError):
                    _run(IP, "link", "delete", dev)
        with contextlib.suppress(Exception):
            atexit.unregister(self.down)

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


class ShapedLink(_Namespaces):
    """Two namespaces and a veth pair shaped by tbf to ``rate_mbit`` in each direction."""

    def __init__(self, rate_mbit: float) -> None:
        if rate_mbit <= 0:
            raise ValueError(f"rate must be positive, got {rate_mbit}")
        pid = os.getpid()
        self.rate_mbit = rate_mbit
        self.ns_a, self.ns_b = f"{PREFIX}-{pid}-a", f"{PREFIX}-{pid}-b"
        self.dev_a, self.dev_b = f"drl{pid % 100000}a", f"drl{pid % 100000}b"
        x = pid % 256
        self.addr_a, self.addr_b = f"10.231.{x}.1", f"10.231.{x}.2"
        self.namespaces, self.root_devices = (self.ns_a, self.ns_b), (self.dev_a,)
        super().__init__()

    def exec_prefix(self, side: str) -> list[str]:
        """The command prefix that runs a process in namespace ``a`` or ``b``."""
        return [IP, "netns", "exec", self.ns_a if side == "a" else self.ns_b]

    def _build(self) -> None:
        _run(IP, "link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
        for ns, dev, addr in (
            (self.ns_a, self.dev_a, self.addr_a),
            (self.ns_b, self.dev_b, self.addr_b),
        ):
            _run(IP, "link", "set", dev, "netns", ns)
            _run(IP, "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _run(IP, "-n", ns, "link", "set", dev, "up")
            _shape(ns, dev, self.rate_mbit)


def _shape(ns: str, dev: str, rate_mbit: float) -> None:
    # burst: 10 ms at the rate, at least 32 KiB (tbf needs burst >= rate / HZ)
    burst = max(32 << 10, int(rate_mbit * 1e6 / 8 / 100))
    _run(IP, "netns", "exec", ns, TC, "qdisc", "add", "dev", dev, "root", "tbf",
         "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms")  # fmt: skip


class ThreeHosts(_Namespaces):
    """Hosts A, B, C as namespaces: A - B plain, B - C shaped to ``rate_mbit``, B routing."""

    def __init__(self, rate_mbit: float) -> None:
        if rate_mbit <= 0:
            raise ValueError(f"rate must be positive, got {rate_mbit}")
        pid = os.getpid()
        self.rate_mbit = rate_mbit
        self.ns = {h: f"{PREFIX}-{pid}-h{h}" for h in "abc"}
        tag = f"drh{pid % 100000}"
        # veth ends: (namespace, device, address/24) for the A-B and B-C links
        self._ab = (("a", f"{tag}ab", "10.10.0.1"), ("b", f"{tag}ba", "10.10.0.2"))
        self._bc = (("b", f"{tag}bc", "10.10.1.1"), ("c", f"{tag}cb", "10.10.1.2"))
        self.namespaces = tuple(self.ns.values())
        self.root_devices = (self._ab[0][1], self._bc[0][1])
        super().__init__()

    def exec_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a process on host ``a``, ``b`` or ``c``."""
        return [IP, "netns", "exec", self.ns[host]]

    def shaped_bytes(self) -> int:
        """Bytes B's tbf qdisc has sent towards C (what crossed the shaped link that way)."""
        ns, dev = self.ns["b"], self._bc[0][1]
        out = _run(IP, "netns", "exec", ns, TC, "-s", "qdisc", "show", "dev", dev)
        words = out.split()
        return int(words[words.index("Sent") + 1])

    def _build(self) -> None:
        for (h1, d1, a1), (h2, d2, a2) in (self._ab, self._bc):
            _run(IP, "link", "add", d1, "type", "veth", "peer", "name", d2)
            for host, dev, addr in ((h1, d1, a1), (h2, d2, a2)):
                _run(IP, "link", "set", dev, "netns", self.ns[host])
                _run(IP, "-n", self.ns[host], "addr", "add", f"{addr}/24", "dev", dev)
                _run(IP, "-n", self.ns[host], "link", "set", dev, "up")
        for host, dev, _ in self._bc:  # both directions of B - C (acks too)
            _shape(self.ns[host], dev, self.rate_mbit)
        _run(IP, "-n", self.ns["a"], "route", "add", "10.10.1.0/24", "via", "10.10.0.2")
        _run(IP, "-n", self.ns["c"], "route", "add", "10.10.0.0/24", "via", "10.10.1.1")
        _run(IP, "netns", "exec", self.ns["b"], "sysctl", "-qw", "net.ipv4.ip_forward=1")
