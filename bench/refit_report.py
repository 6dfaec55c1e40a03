"""How ``deltarl bench refit`` reports: the targets, the verdicts, the table, the limit.

The figures come from ``bench/refit.py``'s result; see its docstring for what each means.
"""

from __future__ import annotations

import statistics
from typing import Any

# At 1 Gbit the speedup must hold in every refit (over the slowest, ``speedup_min``), not only
# the median.
TARGETS = {"speedup_100mbit": 20.0, "speedup_1gbit": 10.0, "pipeline": 1.25}
# link_s: the shaped link's least time for the bytes (bench/refit.py); 0.0 when unshaped.
STAGES = ("encode_s", "transfer_s", "link_s", "apply_s", "activate_s")


def limits(result: dict[str, Any]) -> str:
    """Which stage bounds the delta refits, as a sentence."""
    deltas = [r for r in result["refits"] if r["kind"] == "delta"] or result["refits"]
    med = {s: statistics.median(r[s] for r in deltas) for s in STAGES}
    slowest = max(med, key=med.__getitem__)
    total = result["delta_total_s_median"]
    parts = ", ".join(f"{s[:-2]} {v * 1e3:.1f} ms" for s, v in med.items())
    other = total - med[slowest]
    return (
        f"delta refits are limited by {slowest[:-2]} ({med[slowest] * 1e3:.1f} ms of "
        f"{total * 1e3:.1f} ms median total; medians: {parts}; the rest, "
        f"{other * 1e3:.1f} ms, is unoverlapped stages, copy-out and control round trips)"
    )


def verdicts(result: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each target as (description with the measured figure, met)."""
    rows: list[tuple[str, bool]] = []
    pipe = TARGETS["pipeline"]
    for r in result["refits"]:
        slowest = max(r[s] for s in STAGES)
        ratio = r["total_s"] / slowest if slowest > 0 else float("inf")
        rows += [
            (
                f"refit {r['version']}: bit-exact (checked against the trainer's store)",
                r["bit_exact"],
            ),
            (
                f"refit {r['version']}: total {ratio:.2f}x its slowest stage (target <= {pipe})",
                ratio <= pipe,
            ),
        ]
    rate, speedup = result["rate_mbit"], result["speedup"]
    where = f"{result['params']:,} params" + (
        "" if result["params"] == 100_000_000 else ", the target is stated for 100M"
    )
    if rate == 100:
        t = TARGETS["speedup_100mbit"]
        rows.append((f"speedup {speedup:.1f}x at 100 Mbit ({where}; target >= {t})", speedup >= t))
    elif rate == 1000:
        t = TARGETS["speedup_1gbit"]
        rows.append((f"speedup {speedup:.1f}x at 1 Gbit ({where}; target >= {t})", speedup >= t))
        low = result["speedup_min"]
        rows.append((f"slowest refit {low:.1f}x faster at 1 Gbit (target >= {t})", low >= t))
    return rows


def render(result: dict[str, Any], diag: list[dict[str, Any]] | None = None) -> str:
    rate = "unshaped" if result["rate_mbit"] is None else f"{result['rate_mbit']:g} Mbit/s (tbf)"
    full = result["full"]
    cpus = result["cpus"]
    lines = [
        f"refit benchmark: {result['params']:,} parameters (bf16), link {result['link']}, {rate}",
        f"export agent on CPUs {cpus['export']}, apply agent on CPUs {cpus['apply']}"
        + (" (shared)" if cpus["export"] == cpus["apply"] else ""),
        "",
        f"{'version':>7} {'kind':>5} {'changed':>8} {'wire KB':>10} {'encode ms':>9} "
        f"{'xfer ms':>8} {'link ms':>8} {'apply ms':>8} {'activ ms':>8} {'total ms':>9} "
        f"{'bit-exact':>9}",
    ]
    lines += [
        f"{r['version']:>7} {r['kind']:>5} {r['changed_ratio']:>8.4%} "
        f"{r['wire_bytes'] / 1e3:>10.1f} {r['encode_s'] * 1e3:>9.1f} "
        f"{r['transfer_s'] * 1e3:>8.1f} {r['link_s'] * 1e3:>8.1f} {r['apply_s'] * 1e3:>8.1f} "
        f"{r['activate_s'] * 1e3:>8.1f} {r['total_s'] * 1e3:>9.1f} "
        f"{'yes' if r['bit_exact'] else 'NO':>9}"
        for r in result["refits"]
    ]
    lines += [
        "",
        f"full transfer: {full['wire_bytes'] / 1e6:.1f} MB in {full['total_s'] * 1e3:.1f} ms; "
        f"median delta {result['delta_total_s_median'] * 1e3:.1f} ms (P95 "
        f"{result['delta_total_s_p95'] * 1e3:.1f} ms); speedup {result['speedup']:.1f}x "
        f"(over the slowest delta: {result['speedup_min']:.1f}x)",
        limits(result),
    ]
    for d in diag or []:
        lines.append(
            f"  version {d['version']}: lease {d['copy_s'] * 1e3:.1f} ms, apply opened "
            f"{d['first_chunk_after_s'] * 1e3:.1f} ms after encoding began (open, base by "
            f"{d.get('opened_by') or '?'}: {d['open_s'] * 1e3:.1f} ms), the last chunk encoded "
            f"{d['encode_span_s'] * 1e3:.1f} ms after it began, the last send returned "
            f"{d['encoded_to_sent_s'] * 1e3:.1f} ms after that, commit "
            f"{d['sent_to_commit_s'] * 1e3:.1f} ms after the last send returned, acknowledged "
            f"{d['commit_to_ack_s'] * 1e3:.2f} ms after the commit; "
            f"{d['early_hash_s'] * 1e3:.1f} ms of apply hashed tensors as chunks landed"
        )
        if "apply_calls_s" in d:
            settle = d.get("settle")
            lines.append(
                f"    apply {d['apply_s'] * 1e3:.1f} ms over {d['chunks']} chunk(s): the worker "
                f"{d['apply_calls_s'] * 1e3:.1f} ms (CPU {d['apply_cpu_s'] * 1e3:.1f} ms; decode "
                f"and write {d['decode_s'] * 1e3:.1f}, keep {d['keep_s'] * 1e3:.1f}, early hash "
                f"{d['early_hash_s'] * 1e3:.1f}); last settle: "
                + (
                    "none"
                    if settle is None
                    else f"to version {settle['version']} in {settle['seconds'] * 1e3:.1f} ms"
                )
            )
    sealed = result.get("sealed")
    if sealed is not None:
        lines.append(
            f"sealed (MAC + BLAKE2b per chunk{', TLS 1.3' if result['link'] == 'stream' else ''}"
            f"), same machine, run after: median delta {sealed['delta_total_s_median'] * 1e3:.1f}"
            f" ms ({sealed['delta_ratio']:.2f}x plain), full {sealed['full_total_s'] * 1e3:.1f} "
            f"ms ({sealed['full_ratio']:.2f}x), wire bytes {sealed['wire_bytes_ratio']:.3f}x, "
            f"bit-exact: {'yes' if sealed['bit_exact'] else 'NO'}"
        )
    copied = result.get("copy")
    if copied:
        lines.append(
            f"copying the active buffer instead (catch_up = 'off'), same machine, run after: "
            f"median delta {copied['delta_total_s_median'] * 1e3:.1f} ms "
            f"({copied['delta_ratio']:.2f}x), P95 {copied['delta_total_s_p95'] * 1e3:.1f} ms, "
            f"apply {copied['apply_s_median'] * 1e3:.1f} ms ({copied['apply_ratio']:.2f}x), "
            f"speedup {copied['speedup']:.1f}x (slowest {copied['speedup_min']:.1f}x), "
            f"bit-exact: {'yes' if copied['bit_exact'] else 'NO'}"
        )
    for key in ("conditioned", "conditioned_rice", "conditioned_huffman"):
        coded = result.get(key)
        if not coded:
            continue
        lines.append(
            f"deltas coded against the reference (delta_coding = '{key}'), same machine, "
            f"run after: median delta {coded['delta_total_s_median'] * 1e3:.1f} ms "
            f"({coded['delta_ratio']:.2f}x), wire {coded['wire_bytes_ratio']:.2f}x, encode "
            f"{coded['encode_s_ratio']:.2f}x, transfer {coded['transfer_s_ratio']:.2f}x, apply "
            f"{coded['apply_s_ratio']:.2f}x, speedup {coded['speedup']:.1f}x (slowest "
            f"{coded['speedup_min']:.1f}x), bit-exact: {'yes' if coded['bit_exact'] else 'NO'}"
        )
    hashed = result.get("export_hash")
    if hashed:
        lines.append(
            f"the export agent hashing the model itself (the trainer commits no tensor "
            f"digests), same machine, run after: median delta "
            f"{hashed['delta_total_s_median'] * 1e3:.1f} ms ({hashed['delta_ratio']:.2f}x), "
            f"P95 {hashed['delta_total_s_p95'] * 1e3:.1f} ms, encode "
            f"{hashed['encode_s_ratio']:.2f}x, speedup {hashed['speedup']:.1f}x (slowest "
            f"{hashed['speedup_min']:.1f}x), bit-exact: {'yes' if hashed['bit_exact'] else 'NO'}"
        )
    lines.append("")
    lines += [f"  [{'ok' if ok else 'MISS'}] {text}" for text, ok in verdicts(result)]
    return "\n".join(lines)
