"""Helpers of the fault-injection tests: a pipeline on the stream link, a checking reader
process, a lease-holding process, and a TCP proxy that corrupts or cuts the stream link.

Run as a module for the helper processes (the tests start them):

    python -m tests.daemons.faultlib reader TMP OUT STOPFILE
    python -m tests.daemons.faultlib hold TMP OUT SECONDS
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from deltarl.transport.ports import free_port
from tests.daemons.pipeline import Pipeline, refit_tables, stream_link

ROOT = Path(__file__).resolve().parents[2]
MANIFEST_WAIT_S = 5.0  # the export agent records a manifest before it sends it: a margin


def fault_tables(
    tmp: Path,
    *,
    params: int,
    interval_s: float,
    apply_port: int,
    export_port: int,
    compress: bool = True,
    chunk_bytes: int = 4 << 20,
    ack_timeout_s: float = 20.0,
    steps: int = 0,
    lease_bound_s: float = 10.0,
) -> dict[str, Any]:
    """Trainer, export and apply on the stream link; the export agent connects to
    ``export_port`` (a proxy, or ``apply_port`` itself), the apply agent listens on
    ``apply_port``."""

    def link(port: int) -> dict[str, Any]:
        return stream_link(
            port, compress=compress, connections=2, ack_timeout_s=10.0, backoff_max_s=0.5
        )

    tables = refit_tables(
        tmp,
        export_link=link(export_port),
        apply_link=link(apply_port),
        trainer={"params": params, "interval_s": interval_s, "steps": steps},
        export={
            "full_resync_every": 1000,
            "chunk_bytes": chunk_bytes,
            "ack_timeout_s": ack_timeout_s,
        },
    )
    tables["daemons"]["apply"]["lease_bound_s"] = lease_bound_s
    return tables


class FaultPipeline(Pipeline):
    """``Pipeline`` with the fault tests' config; ``proxy`` puts a port between the links."""

    def __init__(self, tmp: Path, *, proxy: bool = False, **knobs: Any) -> None:
        self.apply_port = free_port()
        self.export_port = free_port() if proxy else self.apply_port
        ports = {"apply_port": self.apply_port, "export_port": self.export_port}
        super().__init__(tmp, fault_tables(tmp, **ports, **knobs))

    def kill(self, daemon: str) -> int:
        code = super().kill(daemon)
        assert code == -9, code
        return code


# -- helper processes -----------------------------------------------------------------


class Helper:
    """A helper process (``reader`` or ``hold``) writing one JSON result to ``out``."""

    def __init__(self, mode: str, tmp: Path, *args: str) -> None:
        self.out = tmp / f"{mode}-{time.monotonic_ns()}.json"
        self.stop_file = tmp / f"{mode}-{time.monotonic_ns()}.stop"
        self.log = tmp / f"{mode}.log"
        argv = [sys.executable, "-m", "tests.daemons.faultlib", mode, str(tmp), str(self.out)]
        argv += [str(self.stop_file) if mode == "reader" else "", *args]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def file(self, suffix: str) -> Path:
        return self.out.with_suffix(suffix)

    def result(self, timeout: float = 30.0) -> dict[str, Any]:
        self.stop_file.touch()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"{self.out.stem} did not finish: {self._log()}") from None
        assert self.proc.returncode == 0, f"{self.out.stem} failed: {self._log()}"
        return orjson.loads(self.out.read_bytes())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def _log(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _open(tmp: Path, deadline: float) -> tuple[Any, Any]:
    from deltarl.engine.weight_store import WeightStore  # noqa: PLC0415
    from deltarl.refit.manifest_store import ManifestStore  # noqa: PLC0415

    while True:
        try:
            store = WeightStore.open("rollout", root=tmp, readonly=True)
            manifests = ManifestStore(tmp / "versions.sqlite", readonly=True)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        return store, manifests


def _expected(manifests: Any, version: int) -> list[str] | None:
    """The manifest's tensor digests of ``version``, waiting briefly for its row."""
    deadline = time.monotonic() + MANIFEST_WAIT_S
    while True:
        record = manifests.get(version)
        if record is not None:
            return [t.xxh3_128 for t in record.manifest.tensors]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def reader_main(tmp: Path, out: Path, stop_file: Path) -> None:
    """Lease the rollout store in a loop until ``stop_file`` exists; check every snapshot's
    tensor digests against its version's manifest. Writes {checks, mismatches, ...}."""
    from deltarl.codecs.checksum import tensor_digests  # noqa: PLC0415
    from deltarl.engine.weight_store import LeaseTimeout, NoVersionError  # noqa: PLC0415

    store, manifests = _open(tmp, time.monotonic() + 120)
    checks, mismatches, unverified, timeouts, revoked = 0, [], [], 0, 0
    versions: set[int] = set()
    expected: dict[int, list[str] | None] = {}
    while not stop_file.exists():
        try:
            with store.lease(timeout=2.0) as snap:
                version = snap.version
                got = tensor_digests(store.layout, snap.buffer)
                if snap.revoked:  # I4: a read the writer overwrote is discarded, never used
                    revoked += 1
                    continue
        except NoVersionError:
            time.sleep(0.02)
            continue
        except LeaseTimeout:
            timeouts += 1
            continue
        if version not in expected or expected[version] is None:
            expected[version] = _expected(manifests, version)
        want = expected[version]
        checks += 1
        versions.add(version)
        if want is None:
            unverified.append(version)
        elif got != want:
            bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            mismatches.append({"version": version, "tensors": bad[:10]})
        time.sleep(0.01)  # let the writer take the lock between leases
    result = {
        "checks": checks,
        "versions": sorted(versions),
        "mismatches": mismatches,
        "unverified": unverified,
        "lease_timeouts": timeouts,
        "revoked": revoked,
    }
    out.write_bytes(orjson.dumps(result))


def hold_main(tmp: Path, out: Path, seconds: float, until_revoked: bool = False) -> None:
    """Lease the active version for ``seconds`` (``until_revoked``: or until the writer
    revokes the lease, whichever comes first), noting the rollout store's active version
    (an unlocked hint) every 20 ms meanwhile, and the trainer's published version at the end;
    digests at the start and at the end. Writes ``out.with_suffix('.held')`` once the lease is
    taken, and the result at the end."""
    from deltarl.codecs.checksum import tensor_digests  # noqa: PLC0415
    from deltarl.engine.weight_store import WeightStore  # noqa: PLC0415

    store, manifests = _open(tmp, time.monotonic() + 60)
    published = WeightStore.open("pub", root=tmp, readonly=True)
    seen: list[int | None] = []
    with store.lease(timeout=10.0) as snap:
        version = snap.version
        start = tensor_digests(store.layout, snap.buffer)
        out.with_suffix(".held").write_bytes(orjson.dumps({"version": version}))
        end_at = time.monotonic() + seconds
        while time.monotonic() < end_at and not (until_revoked and snap.revoked):
            seen.append(store.active_version)
            time.sleep(0.02)
        published_at_end = published.active_version
        end = tensor_digests(store.layout, snap.buffer)
        still = snap.version
        revoked = snap.revoked
    want = _expected(manifests, version)
    result = {
        "version": version,
        "version_at_end": still,
        "start": start,
        "end": end,
        "active_seen": seen,
        "published_at_end": published_at_end,
        "revoked": revoked,
    }
    out.write_bytes(orjson.dumps({**result, "manifest": want}))


# -- the proxy ----------------------------------------------------------------------------


class FaultProxy:
    """A TCP proxy on 127.0.0.1 between the export agent's sender and the apply agent's
    receiver, run on its own event loop in a thread. Reads sender->receiver traffic frame by
    frame (stream_wire) so it can, once armed:

    - ``corrupt``: flip the last payload byte of the next CHUNK frame (a chunk body byte,
      covered by the frame checksum); the stream link must be uncompressed for the flip to
      reach the apply agent as a checksum mismatch;
    - ``cut``: at the next CHUNK frame of a version (chunk id >= ``cut_min_chunk``), forward
      its header and half its payload, then abort every connection, both sides;
    - ``drop_version``: of that version, forward only chunk 0 and drop every other frame (a
      version half-delivered: the apply agent holds its first chunk, never its manifest).
    """

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.listen_port = listen_port
        self.target_port = target_port
        self.corrupt_armed = threading.Event()
        self.cut_armed = threading.Event()
        self.cut_min_chunk = 0
        self.drop_version: int | None = None
        self.dropped = threading.Event()
        self.corrupted: tuple[int, int] | None = None  # (version, chunk id)
        self.cut: tuple[int, int] | None = None
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._main, name="fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"
        return self

    def __exit__(self, *_: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _main(self) -> None:
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.listen_port)
        self._ready.set()
        async with server:
            await self._stop.wait()
            for w in list(self._writers):
                w.transport.abort()

    def _abort_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            down_w.transport.abort()
            return
        self.connections += 1
        self._writers |= {down_w, up_w}
        tasks = [
            asyncio.create_task(self._frames(down_r, up_w)),
            asyncio.create_task(self._pipe(up_r, down_w)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in (down_w, up_w):
            w.transport.abort()
            self._writers.discard(w)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()

    async def _frames(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        from deltarl.transport.stream_wire import FLAG_ZSTD, HEADER, MSG_CHUNK  # noqa: PLC0415

        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                raw = await src.readexactly(HEADER.size)
                code, version, chunk_id, length = HEADER.unpack(raw)
                payload = bytearray(await src.readexactly(length)) if length else bytearray()
                is_chunk = code & ~FLAG_ZSTD == MSG_CHUNK and length > 0
                if version == self.drop_version and not (is_chunk and chunk_id == 0):
                    self.dropped.set()
                    continue
                if is_chunk and self.corrupt_armed.is_set():
                    self.corrupt_armed.clear()
                    payload[-1] ^= 0x5A
                    self.corrupted = (version, chunk_id)
                if is_chunk and self.cut_armed.is_set() and chunk_id >= self.cut_min_chunk:
                    self.cut_armed.clear()
                    self.cut = (version, chunk_id)
                    dst.write(raw + payload[: length // 2])
                    with contextlib.suppress(OSError):
                        await dst.drain()
                    self._abort_all()
                    return
                dst.write(raw + payload)
                await dst.drain()


def main(argv: list[str]) -> int:
    mode, tmp, out, stop = argv[0], Path(argv[1]), Path(argv[2]), argv[3]
    if mode == "reader":
        reader_main(tmp, out, Path(stop))
    elif mode == "hold":
        hold_main(tmp, out, float(argv[4]), until_revoked=argv[5:6] == ["until-revoked"])
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
