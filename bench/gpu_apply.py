"""`deltarl bench gpu-apply`: a decoded delta scattered into device memory, against copying the
whole model host to device.

A rollout engine on a GPU holds its weights in device memory. Once the apply agent holds a
version in the host store, the device copy can be brought to it in two ways:

- full: copy the whole model host -> device (from pinned memory), which is what reloading
  every changed tensor amounts to (after an optimizer step nearly every tensor changes);
- sparse: upload only the changed elements (their positions and new bits, as the decoder
  has them) and scatter them into the device copy, which holds the previous version.

Either way the device copy can then be checked on the device, tensor by tensor
(``device_checksums``: the sum and a position-weighted sum of each tensor's 16-bit words,
computed by torch where the tensor lives, so only 16 bytes a tensor come back).

Per size (``--params``: the layout of ``deltarl.sim``'s Llama-shaped transformer at that
size, built on torch's meta device, so no memory) a delta changes ``--changed`` of the
elements (gaps drawn from a geometric distribution; each changed element one ulp away, its
lowest bit flipped), then, each timed ``--repeat`` times (median; the scatter and the copy
are idempotent, so each repetition does the same work) and synchronised with the device:

- ``sparse_s``: upload positions (int32 where the model has fewer than 2**31 elements,
  else int64) and new bits, and scatter them;
- ``checksum_s``: every tensor's device checksums;
- ``full_s``: copy the whole model host -> device.

``bit_exact``: the device copy after the scatter, read back, equals the host's bytes
(checked outside the timing). ``checksums_match``: the device checksums after the scatter
equal those after the full copy. ``faster``: which path wins, the sparse one paying for its
checksums (``speedup`` = full_s / (sparse_s + checksum_s)). ``--largest`` adds the largest
model that fits both device and host memory (up to ``--max-params``).

On a machine without a GPU it runs on the CPU (``--device cpu``: the full path is then a
memcpy), which is what the tests do; the figures that matter come from
``scripts/gpu-check.sh``, or on a GPU machine that cannot install deltarl from
``scripts/gpu-apply-offline.sh`` (this file run from the checkout, orjson carried as a wheel).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deltarl.engine.layout import Layout
from deltarl.sim.tiny_transformer import TinyCausalLM, TinyConfig

WEIGHT_PERIOD = 32_749
"""Word i of a tensor weighs (i mod WEIGHT_PERIOD) + 1 in the weighted sum: a prime, so two
words swapped less than a period apart change the sum, and small enough that a 16-bit word
times its weight fits int32 (65535 * 32749 < 2**31), halving the temporaries."""
CHUNK_ELEMS = WEIGHT_PERIOD * 2048
"""Checksums widen at most this many elements at a time (256 MiB a temporary): a chunk
starts at a multiple of the period, so one weights tensor serves every chunk."""


def layout_for(params: int) -> Layout:
    """The bf16 layout of deltarl.sim's transformer of about ``params`` parameters."""
    with torch.device("meta"):
        model = TinyCausalLM(TinyConfig.for_params(params))
    return Layout.pack((n, "bfloat16", tuple(p.shape)) for n, p in model.named_parameters())


def _bases(layout: Layout) -> np.ndarray:
    """Each tensor's first element in the flat 16-bit view of the model buffer."""
    return np.array([t.offset // 2 for t in layout.tensors], np.int64)


def device_checksums(words: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(sum, weighted sum) of each tensor's 16-bit words, modulo 2**64, as int64 [n, 2].

    ``words`` is the model buffer viewed as int16, on any device; the sums are made there and
    only the result comes back. Every bit of a word counts (it is widened as unsigned), and
    the weights make a moved word count as well as a changed one. Not the manifest's xxh3
    (no GPU kernel of it here): a refit checked this way needs these sums in the manifest.
    """
    longest = max((t.numel for t in layout.tensors), default=0)
    weights = torch.arange(
        min(CHUNK_ELEMS, max(longest, 1)), dtype=torch.int32, device=words.device
    )
    weights = weights % WEIGHT_PERIOD + 1
    out = torch.zeros((len(layout.tensors), 2), dtype=torch.int64, device=words.device)
    for tid, (t, base) in enumerate(zip(layout.tensors, _bases(layout), strict=True)):
        for start in range(0, t.numel, CHUNK_ELEMS):
            n = min(CHUNK_ELEMS, t.numel - start)
            w = words[base + start : base + start + n].to(torch.int32) & 0xFFFF
            out[tid, 0] += w.sum(dtype=torch.int64)
            out[tid, 1] += (w * weights[:n]).sum(dtype=torch.int64)
    return out.cpu()


def _changed_positions(layout: Layout, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted flat 16-bit positions of about ``ratio`` of the model's elements."""
    numel = np.array([t.numel for t in layout.tensors], np.int64)
    total = int(numel.sum())
    expected = max(1, int(total * ratio))
    gaps = rng.geometric(ratio, size=expected + 4 * int(np.sqrt(expected)) + 16)
    picked = np.cumsum(gaps) - 1
    picked = picked[picked < total]
    first = np.zeros(len(numel), np.int64)
    np.cumsum(numel[:-1], out=first[1:])
    tid = np.searchsorted(first, picked, side="right") - 1
    return _bases(layout)[tid] + (picked - first[tid])


def _median_s(fn: Callable[[], None], repeat: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _equal(device_words: torch.Tensor, host_words: torch.Tensor) -> bool:
    """The device copy equals the host's, compared a GiB at a time (no second full copy)."""
    step = 1 << 29
    return all(
        torch.equal(device_words[a : a + step].cpu(), host_words[a : a + step])
        for a in range(0, host_words.numel(), step)
    )


def measure(
    params: int, device: torch.device, ratio: float, repeat: int, seed: int
) -> dict[str, Any]:
    """One model size: both paths timed on the same delta, both checked."""
    layout = layout_for(params)
    cuda = device.type == "cuda"
    rng = np.random.default_rng(seed)
    host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=cuda)
    host_words = host.view(torch.int16)
    host_words.numpy()[:] = rng.integers(0, 1 << 16, size=host_words.numel(), dtype=np.uint16)
    on_device = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    on_device.copy_(host)  # the device holds the base version

    positions = _changed_positions(layout, ratio, rng)
    host_words.numpy()[positions] ^= np.int16(1)  # the host store now holds the new version
    index_dtype = torch.int32 if layout.nbytes // 2 < 1 << 31 else torch.int64
    index = torch.from_numpy(positions).to(index_dtype)
    bits = host_words[torch.from_numpy(positions)]
    if cuda:
        index, bits = index.pin_memory(), bits.pin_memory()
    words = on_device.view(torch.int16)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def sparse() -> None:
        words.index_put_((index.to(device, non_blocking=True),), bits.to(device, non_blocking=True))

    try:
        sparse()
        sync()
    except RuntimeError:
        # a torch build whose device indexing takes int64 positions only: upload those
        index = index.to(torch.int64)
        index = index.pin_memory() if cuda else index
        sparse()
    sums: list[torch.Tensor] = []
    sparse_s = _median_s(sparse, repeat, sync)
    checksum_s = _median_s(lambda: sums.append(device_checksums(words, layout)), repeat, sync)
    bit_exact = _equal(words, host_words)
    after_sparse = sums[-1]
    full_s = _median_s(lambda: on_device.copy_(host, non_blocking=True), repeat, sync)
    checksums_match = bool(torch.equal(after_sparse, device_checksums(words, layout)))
    model_bytes = layout.payload_nbytes
    return {
        "params": layout.numel,
        "model_bytes": model_bytes,
        "changed": len(positions),
        "changed_ratio": len(positions) / layout.numel,
        "upload_bytes_sparse": index.numel() * index.element_size() + bits.numel() * 2,
        "sparse_s": sparse_s,
        "checksum_s": checksum_s,
        "full_s": full_s,
        "full_gbps": model_bytes / full_s / 1e9,
        "speedup": full_s / (sparse_s + checksum_s),
        "faster": "sparse" if sparse_s + checksum_s < full_s else "full",
        "bit_exact": bit_exact,
        "checksums_match": checksums_match,
    }


def largest_fit(device: torch.device, ratio: float, cap: int) -> int:
    """The most parameters both memories hold for this bench, at most ``cap``: the device
    copy plus the uploaded delta and a checksum chunk's temporaries on the device; the
    pinned host copy, the delta and its positions on the host (with a quarter spare)."""
    per_param_device = 2 + ratio * 8
    per_param_host = 2 + ratio * 18
    device_free = (
        torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _host_available()
    ) - 3 * CHUNK_ELEMS * 8
    fit = min(device_free / per_param_device, _host_available() / per_param_host) * 0.75
    return max(0, min(cap, int(fit)))


def _host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def run(
    sizes: list[int], device: torch.device, ratio: float, repeat: int, seed: int
) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = [measure(p, device, ratio, repeat, seed) for p in sizes]
    faster = {r["faster"] for r in results}
    return {
        "device": name,
        "changed_ratio": ratio,
        "repeat": repeat,
        "sizes": results,
        # which path worker_ext should take on this device, if every size agrees
        "worker_ext_path": faster.pop() if len(faster) == 1 else "depends on the size",
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"gpu-apply benchmark on {result['device']}: {result['changed_ratio']:.2%} of the "
        f"elements changed, median of {result['repeat']}",
        "",
        f"{'params':>14} {'model MB':>9} {'sparse ms':>9} {'check ms':>9} {'full ms':>9} "
        f"{'full GB/s':>9} {'speedup':>8}  faster  bit-exact",
    ]
    lines += [
        f"{r['params']:>14,} {r['model_bytes'] / 1e6:>9.1f} {r['sparse_s'] * 1e3:>9.2f} "
        f"{r['checksum_s'] * 1e3:>9.2f} {r['full_s'] * 1e3:>9.2f} {r['full_gbps']:>9.2f} "
        f"{r['speedup']:>7.2f}x  {r['faster']:<6}  "
        f"{'yes' if r['bit_exact'] and r['checksums_match'] else 'NO'}"
        for r in result["sizes"]
    ]
    lines += [
        "",
        "sparse = upload the changed elements' positions and bits, scatter them into the device "
        "copy; check = every tensor's checksums on the device; full = copy the whole model "
        "host -> device; speedup = full / (sparse + check)",
        f"worker_ext should take: {result['worker_ext_path']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deltarl bench gpu-apply", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--params", type=int, nargs="+", default=[98_000_000], help="model sizes (default 98M)"
    )
    ap.add_argument(
        "--largest",
        action="store_true",
        help="also the largest model that fits device and host memory (up to --max-params)",
    )
    ap.add_argument("--max-params", type=int, default=8_000_000_000, help="default 8B")
    ap.add_argument(
        "--changed",
        type=float,
        default=0.037,
        help="fraction of elements changed (default 0.037, step 1 of the simulated AdamW deltas)",
    )
    ap.add_argument("--repeat", type=int, default=5, help="timed runs; the median counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda where there is one)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.repeat < 1 or not 0 < args.changed < 1:
        ap.error("--repeat must be at least 1 and --changed lie in (0, 1)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("deltarl bench gpu-apply: no CUDA device here (torch sees none)", file=sys.stderr)
        return 2
    sizes = list(args.params)
    try:
        if args.largest:
            sizes.append(largest_fit(device, args.changed, args.max_params))
        if min(sizes) < 10_000:
            ap.error(f"a model needs at least 10k parameters, not {min(sizes)}")
        if not args.json:
            print(f"timing {len(sizes)} model sizes on {device}...", file=sys.stderr)
        result = run(sizes, device, args.changed, args.repeat, args.seed)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"deltarl bench gpu-apply: {e}", file=sys.stderr)
        return 2
    if args.json:
        import orjson  # noqa: PLC0415 - only the JSON path needs it

        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(render(result))
    exact = all(r["bit_exact"] and r["checksums_match"] for r in result["sizes"])
    return 0 if exact else 1
