"""``deltarl export-dry-run --config FILE``: what deltas would cost on this trainer, sending
nothing.

Reads the export agent's table (``[daemons.export]``, or ``--name``) for the trainer's
published store, then for each of the next ``--versions`` versions the trainer publishes:
takes it under a lease (as the export agent does, beside it if one runs), encodes it against
the previous version it took (the first one in full), applies the chunks to a copy of that
previous version and checks the result is bit-exact and matches the manifest's checksums (so
a delta that would not apply is found here, not in production), and reports the wire bytes,
the changed ratio (overall and the tensors that changed most), the encode time, and the ratio
to a full version. Nothing is sent, no manifest is recorded, no receiver is needed.

What an operator runs before turning deltas on for a model (seed 004's "measure the changed
ratio, do not assume it"), and what ``deltarl ctl export deltas on`` should follow.

Exit status: 0 when every version encoded and applied bit-exact; 1 when one did not; 2 for
a configuration error; 3 when the trainer published fewer versions within ``--timeout``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder, delta_coding_options
from deltarl.codecs.manifest import RefitManifest
from deltarl.config import ConfigError, load
from deltarl.config.refit import ExportConfig
from deltarl.engine.weight_store import WeightStore

TOP_TENSORS = 5


def measure(
    store: WeightStore,
    versions: int,
    timeout_s: float,
    chunk_bytes: int,
    poll_s: float = 0.05,
    *,
    conditioned: bool = False,
    conditioned_coder: str = "range",
    value_classes: bool = True,
) -> list[dict[str, Any]]:
    """The next ``versions`` versions of ``store`` (the first in full), encoded and applied;
    TimeoutError (with the versions measured so far in its args) if they do not come.
    ``conditioned`` and ``conditioned_coder``: code the deltas as a ``delta_coding`` setting
    does (encoder.delta_coding_options);
    ``value_classes`` as the export agent's setting of that name does."""
    encoder = DeltaEncoder(
        store.layout,
        chunk_bytes=chunk_bytes,
        conditioned=conditioned,
        conditioned_coder=conditioned_coder,
        value_classes=value_classes,
    )
    full_bytes = store.layout.nbytes
    previous: np.ndarray | None = None
    previous_version: int | None = None
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < versions:
        if store.active_version is None or store.active_version == previous_version:
            if time.monotonic() > deadline:
                raise TimeoutError(out)
            time.sleep(poll_s)
            continue
        with store.lease() as snap:
            current = snap.buffer.copy()  # the lease only for the copy, as the export agent
            version = snap.version
        t0 = time.perf_counter()
        encoding = encoder.encode(
            current, previous, target_version=version, base_version=previous_version
        )
        chunks = list(encoding)
        encode_s = time.perf_counter() - t0
        manifest = encoding.manifest
        assert manifest is not None  # set once the chunks are exhausted
        exact = _applies(store, previous, previous_version, version, chunks, manifest, current)
        wire = sum(len(c.data) for c in chunks)
        out.append(
            {
                "version": version,
                "base": previous_version,
                "kind": manifest.kind,
                "wire_bytes": wire,
                "full_bytes": full_bytes,
                "ratio_to_full": round(wire / full_bytes, 6) if full_bytes else None,
                "changed": manifest.changed,
                "elements": store.layout.numel,
                "changed_ratio": round(manifest.changed / max(store.layout.numel, 1), 8),
                "bytes_per_change": round(wire / manifest.changed, 4) if manifest.changed else None,
                "encode_s": round(encode_s, 6),
                "bit_exact": exact,
                "most_changed": _most_changed(manifest) if manifest.kind == "delta" else [],
            }
        )
        previous, previous_version = current, version
    return out


def _applies(
    store: WeightStore,
    previous: np.ndarray | None,
    base: int | None,
    version: int,
    chunks: list[Any],
    manifest: RefitManifest,
    current: np.ndarray,
) -> bool:
    """Whether the chunks, applied to the previous version (a fresh buffer for a full one),
    give ``current`` bit for bit and pass the manifest's checks."""
    target = np.zeros_like(current) if previous is None else previous.copy()
    apply = VersionApply(store.layout, target, target if previous is not None else None,
                         base=base, version=version)  # fmt: skip
    try:
        for chunk in chunks:
            apply.apply(chunk.data)
        apply.verify(manifest)
    except ValueError:
        return False
    finally:
        apply.close()  # a refused chunk leaves early hashes running (VersionApply)
    return bool(np.array_equal(target, current))


def _most_changed(manifest: RefitManifest) -> list[dict[str, Any]]:
    rows = []
    for t in manifest.tensors:
        numel = int(np.prod(t.shape)) if t.shape else 1
        rows.append({"tensor": t.name, "changed_ratio": round(t.changed / max(numel, 1), 6)})
    rows.sort(key=lambda r: -r["changed_ratio"])
    return rows[:TOP_TENSORS]


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'version':>8} {'base':>6} {'kind':>6} {'wire MB':>10} {'of full':>8} "
        f"{'changed':>10} {'B/change':>9} {'encode s':>9}  bit-exact"
    ]
    for r in rows:
        bpc = "-" if r["bytes_per_change"] is None else f"{r['bytes_per_change']:.3f}"
        lines.append(
            f"{r['version']:>8} {'-' if r['base'] is None else r['base']:>6} {r['kind']:>6} "
            f"{r['wire_bytes'] / 1e6:>10.3f} {r['ratio_to_full']:>8.2%} "
            f"{r['changed_ratio']:>10.4%} {bpc:>9} {r['encode_s']:>9.3f}  "
            f"{'yes' if r['bit_exact'] else 'NO'}"
        )
        lines.extend(
            f"{'':>8}   {t['changed_ratio']:>8.4%}  {t['tensor']}" for t in r["most_changed"][:3]
        )
    lines.append("nothing was sent: a dry run")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="deltarl export-dry-run", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--config", help="the deltarl TOML; reads [daemons.export]")
    ap.add_argument("--name", default="export", help="read [daemons.NAME] instead")
    ap.add_argument("--versions", type=int, default=3, help="versions to measure (default 3)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for them")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    args = ap.parse_args(argv)
    if args.versions < 1:
        ap.error("--versions must be at least 1")
    try:
        cfg = load(ExportConfig, args.name, args.config)
        store = WeightStore.open(cfg.published_store, root=cfg.store_root, readonly=True)
    except (ConfigError, FileNotFoundError) as e:
        print(f"deltarl export-dry-run: {e}", file=sys.stderr)
        return 2
    code = 0
    conditioned, coder = delta_coding_options(cfg.delta_coding)
    try:
        rows = measure(
            store,
            args.versions,
            args.timeout,
            cfg.chunk_bytes,
            cfg.poll_s,
            conditioned=conditioned,
            conditioned_coder=coder,
            value_classes=cfg.value_classes,
        )
    except TimeoutError as e:
        rows, code = list(e.args[0]), 3
        print(
            f"deltarl export-dry-run: {len(rows)} of {args.versions} versions published within "
            f"{args.timeout:g} s",
            file=sys.stderr,
        )
    finally:
        store.close()
    if code == 0 and not all(r["bit_exact"] for r in rows):
        code = 1
    if args.json:
        report = {
            "ok": code == 0,
            "sent": 0,
            "versions": rows,
            "store": str(Path(cfg.published_store)),
        }
        print(orjson.dumps(report).decode())
    else:
        print(render(rows))
    return code
