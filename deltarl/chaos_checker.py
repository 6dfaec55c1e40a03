"""The checker of ``deltarl chaos``: a process of its own that watches the rollout side.

    python -m deltarl.chaos_checker --root DIR --store NAME --out FILE
        [--manifests versions.sqlite] [--rollout ENDPOINT]

Until SIGTERM (or SIGINT) it does two things, then writes one JSON object to ``--out``:

- leases the rollout store as a reader, over and over, and for every snapshot recomputes the
  model digest of the bytes it reads (``codecs.checksum``: per-tensor xxh3-128, then the
  model digest) and compares it with the digest committed with that version
  (``Snapshot.digest``) and with the manifest store's digest of that version. A snapshot whose
  bytes match neither is a half-applied (torn, or overwritten) version a reader could have
  loaded: ``half_applied``. A version without a committed digest cannot be proven whole, so it
  counts too;
- asks the rollout daemon for its status and checks every engine load it reports (``refits``,
  and the current ``weight_version`` / ``digest``) against the manifest store: a load whose
  engine digest is not the manifest's, or that the daemon itself did not verify, is
  ``non_bit_exact``.

It also notes every time the version it leases, or the engine's version, goes backwards.
The store is opened again when its file is replaced (an apply agent that had to create it
anew), so the checker outlives restarts of every daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.engine.segment import segment_path
from deltarl.engine.weight_store import LeaseTimeout, NoVersionError, WeightStore
from deltarl.refit.manifest_store import ManifestStore
from deltarl.transport.control import ControlProtocolError, ControlTimeoutError, request_sync
from deltarl.transport.messages import GetStatus, Status

LEASE_EVERY_S = 0.02  # between leases: the writer must get its lock, and CPUs are shared
ENGINE_EVERY_S = 0.2


@dataclass
class Findings:
    """What the checker saw; written as JSON at the end."""

    leases: int = 0
    versions_leased: list[int] = field(default_factory=list)  # each new version, in order
    half_applied: list[dict[str, Any]] = field(default_factory=list)
    store_backwards: list[list[int]] = field(default_factory=list)  # [from, to]
    engine_polls: int = 0
    engine_loads_checked: int = 0
    non_bit_exact: list[dict[str, Any]] = field(default_factory=list)
    engine_backwards: list[list[int]] = field(default_factory=list)
    engine_versions: list[int] = field(default_factory=list)  # each new version, in order
    reopened: int = 0


class Manifests:
    """The manifest store's model digest per version (None: not recorded yet), cached."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.store: ManifestStore | None = None
        self.known: dict[int, str] = {}

    def digest(self, version: int) -> str | None:
        if version in self.known:
            return self.known[version]
        if self.path is None:
            return None
        if self.store is None:
            if not self.path.exists():
                return None
            self.store = ManifestStore(self.path, readonly=True)
        record = self.store.get(version)
        if record is None:
            return None
        # Cached only once recorded: a failed send may be recorded again, with the same bytes.
        self.known[version] = record.manifest.model_xxh3_128
        return self.known[version]


class StoreChecker:
    """Leases the rollout store and proves each snapshot's bytes."""

    def __init__(self, root: Path, name: str, manifests: Manifests, found: Findings) -> None:
        self.root, self.name = root, name
        self.manifests = manifests
        self.found = found
        self.store: WeightStore | None = None
        self.identity: tuple[int, int] | None = None
        # (file, generation, digest read) of each bad snapshot: one finding each, however
        # often it is leased again
        self.bad: set[tuple[tuple[int, int] | None, int, str]] = set()
        self.last: int | None = None

    def _attach(self) -> WeightStore | None:
        path = segment_path(self.name, self.root)
        try:
            st = path.stat()
        except FileNotFoundError:
            return self.store
        if self.store is not None and (st.st_dev, st.st_ino) == self.identity:
            return self.store
        if self.store is not None:
            self.store.close()
            self.found.reopened += 1
        try:
            self.store = WeightStore.open(self.name, root=self.root, readonly=True)
        except FileNotFoundError:
            self.store = None
            return None
        self.identity = (st.st_dev, st.st_ino)
        return self.store

    def check_once(self) -> None:
        store = self._attach()
        if store is None:
            return
        try:
            with store.lease(timeout=2.0) as snap:
                version, committed, generation = snap.version, snap.digest, snap.generation
                # Hashed at every lease, not once per version: bytes that change under a
                # version (written behind the store's back) must be seen too.
                got = model_digest(tensor_digests(store.layout, snap.buffer))
                if snap.revoked:
                    # I4: this read outlasted the apply agent's lease bound and the buffer
                    # was rewritten under it; the store promises nothing about such a read.
                    return
        except (NoVersionError, LeaseTimeout):
            return
        self.found.leases += 1
        expected = self.manifests.digest(version)
        key = (self.identity, generation, got)
        bad = got != committed or (expected is not None and got != expected)
        if bad and key not in self.bad:
            self.bad.add(key)
            self.found.half_applied.append(
                {"version": version, "read": got, "committed": committed, "manifest": expected}
            )
        if self.last is not None and version < self.last:
            self.found.store_backwards.append([self.last, version])
        if version != self.last:
            self.found.versions_leased.append(version)
        self.last = version


class EngineChecker:
    """Asks the rollout daemon what its engine loaded, and proves it against the manifests."""

    def __init__(self, endpoint: str, manifests: Manifests, found: Findings) -> None:
        self.endpoint = endpoint
        self.manifests = manifests
        self.found = found
        self.done: set[tuple[str, int, str | None]] = set()  # (session, version, digest)
        self.last: int | None = None

    def check_load(self, session: str, version: int, digest: str | None, verified: bool) -> None:
        key = (session, version, digest)
        if key in self.done:
            return
        expected = self.manifests.digest(version)
        if expected is None and verified:
            return  # its manifest is not recorded yet: checked at a later poll
        self.done.add(key)
        self.found.engine_loads_checked += 1
        if not verified or digest != expected:
            self.found.non_bit_exact.append(
                {
                    "session": session,
                    "version": version,
                    "engine": digest,
                    "manifest": expected,
                    "verified": verified,
                }
            )

    def _saw_version(self, version: int) -> None:
        if self.last is not None and version < self.last:
            self.found.engine_backwards.append([self.last, version])
        if version != self.last:
            self.found.engine_versions.append(version)
        self.last = version

    def poll(self) -> None:
        try:
            reply = request_sync(self.endpoint, GetStatus(), 1.0)
        except (ControlTimeoutError, ControlProtocolError, OSError):
            return  # down or restarting: the next poll asks again
        if not isinstance(reply, Status):
            return
        self.found.engine_polls += 1
        fields = reply.fields
        session = str(fields.get("session"))
        for r in fields.get("refits") or []:
            self.check_load(session, int(r["version"]), r.get("digest"), bool(r["verified"]))
        version = fields.get("weight_version")
        if version is not None:
            self._saw_version(int(version))
            # The current load was in ``refits`` too; checked here again in case the list
            # was cut, and as the daemon answers now (the engine's digest, continuously).
            self.check_load(session, int(version), fields.get("digest"), True)


def run(args: argparse.Namespace, stop: list[bool]) -> Findings:
    found = Findings()
    manifests = Manifests(args.manifests)
    store = StoreChecker(args.root, args.store, manifests, found)
    engine = None if args.rollout is None else EngineChecker(args.rollout, manifests, found)
    next_poll = 0.0
    while not stop[0]:
        store.check_once()
        if engine is not None and time.monotonic() >= next_poll:
            engine.poll()
            next_poll = time.monotonic() + ENGINE_EVERY_S
        time.sleep(LEASE_EVERY_S)
    store.check_once()  # what is active at the end, too
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltarl.chaos_checker")
    ap.add_argument("--root", type=Path, required=True, help="the stores' directory")
    ap.add_argument("--store", required=True, help="the rollout store's name")
    ap.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    ap.add_argument("--manifests", type=Path, help="the export agent's versions.sqlite")
    ap.add_argument("--rollout", help="the rollout daemon's control endpoint")
    args = ap.parse_args(argv)
    stop = [False]

    def _stop(_signum: int, _frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    found = run(args, stop)
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}")
    tmp.write_bytes(orjson.dumps(asdict(found)))
    tmp.replace(args.out)  # whole or absent: the reader never parses half a result
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
