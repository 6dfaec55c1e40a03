"""`deltarl bench samples`: one real-size group of samples through the samples data path.

One group as GRPO makes it (16 samples of 8192 completion tokens after a 512-token prompt,
with their log-probabilities, token versions and text), measured side by side in one run:

- ours: ``encode_group`` -> put on a ``BlobServer`` over ipc:// -> get -> ``decode_group``
  (bytes on the wire, seconds per stage and in all);
- old: the orjson dict form the control plane carried (``SubmitGroup`` with samples inline:
  dumps and loads), and whether it fits the control plane's ``MAX_MESSAGE_BYTES`` at all;
- memcpy: a copy of as many bytes as ours puts, the floor of any data path.

Every timing is the median of ``--repeat`` runs. The figures go out as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from deltarl.rl.samples import Group, Sample, decode_group, encode_group
from deltarl.transport.blobs import BlobClient, BlobServer
from deltarl.transport.messages import MAX_MESSAGE_BYTES


def make_group(samples: int, tokens: int, prompt_tokens: int, seed: int = 0) -> Group:
    """A plausible group: ``samples`` completions of ``tokens`` tokens each, random ids of a
    150k vocabulary, log-probabilities mostly near 0 with a long tail, the weight version
    changing once mid-completion (a refit), and text of about four characters a token."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    freq = np.linspace(2.0, 0.1, len(letters))
    vocabulary = [
        "".join(rng.choice(letters, size=int(rng.integers(2, 9)), p=freq / freq.sum()))
        for _ in range(4000)
    ]
    prompt = rng.integers(0, 151_000, prompt_tokens, dtype=np.int32)
    out = []
    for i in range(samples):
        length = tokens
        logprobs = -rng.exponential(0.6, length).astype(np.float32)
        versions = np.full(length, 41, dtype=np.int32)
        versions[length // 2 :] = 42
        words = rng.choice(vocabulary, size=max(length * 4 // 5, 1))
        out.append(
            Sample(
                prompt,
                rng.integers(0, 151_000, length, dtype=np.int32),
                logprobs,
                versions,
                " ".join(words.tolist()),
                "length" if i % 4 else "stop",
            )
        )
    return Group("1234.0", 1234, tuple(out))


def old_form(group: Group) -> dict[str, Any]:
    """The group as the control plane carried it: a SubmitGroup with sample dicts inline."""
    samples = [
        {
            "prompt_token_ids": s.prompt_token_ids.tolist(),
            "token_ids": s.token_ids.tolist(),
            "logprobs": s.logprobs.astype(np.float64).tolist(),
            "token_versions": s.token_versions.tolist(),
            "text": s.text,
            "finish_reason": s.finish_reason,
        }
        for s in group.samples
    ]
    body = {"instance": "rollout-0", "session": "0f3a", "group_id": group.group_id}
    return {"type": "rl.submit_group", "timeout": 5.0, "body": {**body, "samples": samples}}


def _median(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def _amedian(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


async def _over_ipc(data: bytes, repeat: int) -> tuple[float, float, bool]:
    with tempfile.TemporaryDirectory(prefix="deltarl-bench-") as d:
        async with BlobServer(f"ipc://{d}/s.samples") as srv, BlobClient(srv.endpoint) as c:
            digest = await c.put(data)  # connects; the timed runs find the socket open
            put_s = await _amedian(lambda: c.put(data), repeat)
            get_s = await _amedian(lambda: c.get([digest]), repeat)
            same = (await c.get([digest]))[0] == data
    return put_s, get_s, same


def run(samples: int, tokens: int, prompt_tokens: int, repeat: int) -> dict[str, Any]:
    group = make_group(samples, tokens, prompt_tokens)
    lists = old_form(group)["body"]["samples"]
    from_lists_s = _median(
        lambda: Group(group.group_id, group.prompt_id, tuple(Sample(**s) for s in lists)), repeat
    )
    data = encode_group(group)
    encode_s = _median(lambda: encode_group(group), repeat)
    put_s, get_s, same = asyncio.run(_over_ipc(data, repeat))
    decode_s = _median(lambda: decode_group(data), repeat)
    ours_total = encode_s + put_s + get_s + decode_s

    old = old_form(group)
    wire = orjson.dumps(old)
    dumps_s = _median(lambda: orjson.dumps(old), repeat)
    loads_s = _median(lambda: orjson.loads(wire), repeat)

    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.zeros_like(src)  # touched, so page faults are not timed
    memcpy_s = _median(lambda: np.copyto(dst, src), repeat)
    return {
        "samples": samples,
        "completion_tokens": group.tokens,
        "prompt_tokens": prompt_tokens,
        "repeat": repeat,
        "ours": {
            "bytes": len(data),
            "from_lists_s": from_lists_s,
            "encode_s": encode_s,
            "put_s": put_s,
            "get_s": get_s,
            "decode_s": decode_s,
            "total_s": ours_total,
            "round_trip_ok": same and decode_group(data) == group,
        },
        "old": {
            "bytes": len(wire),
            "dumps_s": dumps_s,
            "loads_s": loads_s,
            "total_s": dumps_s + loads_s,
            "control_cap_bytes": MAX_MESSAGE_BYTES,
            "over_control_cap": len(wire) > MAX_MESSAGE_BYTES,
        },
        "memcpy": {"bytes": len(data), "s": memcpy_s},
        "ratios": {
            "old_bytes_over_ours": len(wire) / len(data),
            "old_s_over_ours": (dumps_s + loads_s) / ours_total,
            "ours_s_over_memcpy": ours_total / memcpy_s,
            "ours_gbps": len(data) / ours_total / 1e9,
            "memcpy_gbps": len(data) / memcpy_s / 1e9,
        },
    }


def render(r: dict[str, Any]) -> str:
    ours, old, ratio = r["ours"], r["old"], r["ratios"]
    cap = "OVER" if old["over_control_cap"] else "under"
    return "\n".join(
        (
            f"one group: {r['samples']} samples, {r['completion_tokens']} completion tokens, "
            f"{r['prompt_tokens']}-token prompt (median of {r['repeat']})",
            f"  ours    {ours['bytes']:>12,} B  encode {ours['encode_s'] * 1e3:.2f} ms, put "
            f"{ours['put_s'] * 1e3:.2f} ms, get {ours['get_s'] * 1e3:.2f} ms, decode "
            f"{ours['decode_s'] * 1e3:.2f} ms = {ours['total_s'] * 1e3:.2f} ms",
            f"  old     {old['bytes']:>12,} B  dumps {old['dumps_s'] * 1e3:.2f} ms, loads "
            f"{old['loads_s'] * 1e3:.2f} ms = {old['total_s'] * 1e3:.2f} ms ({cap} the "
            f"{old['control_cap_bytes']:,} B control cap)",
            f"  memcpy  {r['memcpy']['bytes']:>12,} B  {r['memcpy']['s'] * 1e3:.2f} ms",
            f"  old/ours bytes {ratio['old_bytes_over_ours']:.2f}x, time "
            f"{ratio['old_s_over_ours']:.2f}x; ours/memcpy {ratio['ours_s_over_memcpy']:.1f}x",
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deltarl bench samples", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=16, help="samples in the group (default 16)")
    ap.add_argument("--tokens", type=int, default=8192, help="completion tokens (default 8192)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs; the median counts")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args(argv)
    if min(args.samples, args.tokens, args.prompt_tokens, args.repeat) < 1:
        ap.error("--samples, --tokens, --prompt-tokens and --repeat must be at least 1")
    result = run(args.samples, args.tokens, args.prompt_tokens, args.repeat)
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(render(result))
    return 0 if result["ours"]["round_trip_ok"] else 1
