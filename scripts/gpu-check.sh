#!/usr/bin/env bash
# The GPU path in one go, on a machine with one NVIDIA GPU (under 10 minutes there):
#   1. install with the CUDA build of vLLM (scripts/install.sh picks it when nvidia-smi works);
#   2. run the GPU-marked tests (tests/gpu: SmolLM2 in bf16 on the GPU, refits bit-exact inside
#      the engine, async scheduling off, tokens keep their version across a refit) and the
#      rollout-engine tests, which run on whatever platform vLLM finds;
#   3. time a decoded delta scattered into device memory against copying the whole model
#      host -> device (`deltarl bench gpu-apply`, the 98M model and the largest that fits, up
#      to 8B parameters): which path worker_ext should take on this GPU;
#   4. run `deltarl up` on SmolLM2 with two rollout engines on the one GPU (each with a 0.3
#      share of its memory), and print the figures: steps/s, refit time, engine tokens/s.
# The trainer trains on the GPU too (device = "auto"). Figures go to $OUT (default ./gpu-check).
# The install needs the package index install.sh uses; on a GPU machine without one, step 3
# alone runs from the checkout with scripts/gpu-apply-offline.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"

nvidia-smi -L || { echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L failed)" >&2; exit 1; }
bash scripts/install.sh --test 2>&1 | tail -n 3

export DELTARL_HOME="$PWD/$out/home"
.venv/bin/python -m pytest -q -s -m gpu tests/gpu tests/rollout/test_vllm_engine.py \
  -p no:cacheprovider 2>&1 | tee "$out/tests.txt" | grep -E "GPU engine|passed|failed|error" || true
.venv/bin/python -m pytest -q tests/rollout/test_vllm_engine.py -p no:cacheprovider \
  2>&1 | tail -n 1 | tee -a "$out/tests.txt"

# A failure here is reported at the end, not fatal: deltarl up below is worth running anyway.
gpu_apply=0
.venv/bin/deltarl bench gpu-apply --params 98000000 --largest --json > "$out/gpu_apply.json" \
  2> "$out/gpu_apply.txt" || gpu_apply=$?
if [ -s "$out/gpu_apply.json" ]; then
  .venv/bin/python - "$out/gpu_apply.json" <<'PY'
import json, sys
from deltarl.bench.gpu_apply import render
print(render(json.load(open(sys.argv[1]))))
PY
else
  echo "gpu-check: bench gpu-apply failed ($gpu_apply); its output:" >&2; tail -n 20 "$out/gpu_apply.txt" >&2
fi

# Two engines on one GPU: each its own vLLM process, so each must leave room for the other.
.venv/bin/deltarl up --model smollm2-135m --steps 10 --rollouts 2 --json \
  --engine-arg gpu_memory_utilization=0.3 > "$out/up.json" 2> "$out/up.txt" || {
  echo "gpu-check: deltarl up failed; its output:" >&2; tail -n 40 "$out/up.txt" >&2; exit 1; }

.venv/bin/python - "$out/up.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
t = s["step_time"]
print(f"steps {s['steps']}, {1 / t['wall_s']:.3f} steps/s (median step {t['wall_s']:.1f} s: "
      f"train {t['train_s']:.1f} s, waiting for samples {t['wait_s']:.1f} s)")
print(f"refit median {s['refit_median_s']:.3f} s, bit-exact {s['refit_bit_exact']}, "
      f"wire median {s['wire_bytes_median'] / 1e6:.2f} MB, changed {s['changed_ratio_median']:.4%}")
for e in s["engines"]:
    rate = e["generated_tokens"] / (s["steps"] * t["wall_s"])  # over the run, roughly
    print(f"  {e['name']}: {len(e['versions_applied'])} versions, refit median "
          f"{e['refit_median_s']:.3f} s, {e['generated_tokens']} tokens (~{rate:.0f} tokens/s "
          f"over the run), bit-exact {e['bit_exact']}")
print(f"eval accuracy {s['eval_accuracy_first']} -> {s['eval_accuracy_last']}")
PY
[ "$gpu_apply" -eq 0 ] || { echo "gpu-check: bench gpu-apply exited $gpu_apply" >&2; exit 1; }
