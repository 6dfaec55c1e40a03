#!/usr/bin/env bash
# `deltarl bench gpu-apply` on a GPU machine that cannot install deltarl: python3 with a CUDA
# build of torch and numpy, no package index (an air-gapped box, a bare GPU image). The bench
# needs nothing else but orjson, which travels as a wheel; deltarl itself runs from this
# checkout, uninstalled. scripts/gpu-check.sh does the whole GPU path where an install can run.
#
#   where pip reaches an index:  bash scripts/gpu-apply-offline.sh --fetch [DIR]
#       saves orjson's wheel for the GPU machine's Python (PY_VERSION, default 3.12; x86-64
#       Linux) into DIR (default .whl): carry DIR along with the checkout;
#   on the GPU machine:          bash scripts/gpu-apply-offline.sh [bench arguments]
#       installs the wheels of $WHEELS (default .whl) into a scratch folder if orjson is
#       missing, runs the bench (by default on the 98M model and the largest that fits) and
#       leaves gpu_apply.json and gpu_apply.txt (its stderr) in $OUT (default ./gpu-check),
#       then prints the table and which path worker_ext should take.
#
# Exit status: the bench's (0 every size bit-exact, 1 one was not, 2 it could not run), or 3
# when orjson is missing and no wheel of it is at hand.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

if [ "${1:-}" = "--fetch" ]; then
  "$python" -m pip download --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "${2:-.whl}" orjson
  exit
fi

if ! "$python" -c "import numpy, torch" 2>/dev/null; then
  echo "gpu-apply-offline: $python cannot import numpy and torch, which the bench runs on" \
    "(set PYTHON to an interpreter that has them)" >&2
  exit 2
fi
out=${OUT:-gpu-check}
mkdir -p "$out"
site=""
if ! "$python" -c "import orjson" 2>/dev/null; then
  wheels=${WHEELS:-.whl}
  shopt -s nullglob
  found=("$wheels"/orjson-*.whl)
  if [ ${#found[@]} -eq 0 ]; then
    echo "gpu-apply-offline: $python has no orjson and $wheels holds no orjson wheel: run" \
      "'bash scripts/gpu-apply-offline.sh --fetch $wheels' where pip reaches an index, and" \
      "bring $wheels along" >&2
    exit 3
  fi
  site=$(mktemp -d)
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${found[@]}"
fi

args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--params 98000000 --largest)
# The bench's module is loaded from its file: bench/ installs as deltarl.bench, which an
# uninstalled checkout does not have; it imports only deltarl.engine and deltarl.sim.
load='import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gpu_apply", "bench/gpu_apply.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["gpu_apply"] = bench
spec.loader.exec_module(bench)'
export PYTHONPATH="$site${site:+:}$PWD"
rc=0
"$python" -c "$load; sys.exit(bench.main(sys.argv[1:]))" "${args[@]}" --json \
  > "$out/gpu_apply.json" 2> "$out/gpu_apply.txt" || rc=$?
if [ -s "$out/gpu_apply.json" ]; then
  "$python" -c "$load; print(bench.render(json.load(open(sys.argv[1]))))" "$out/gpu_apply.json"
else
  echo "gpu-apply-offline: the bench printed no result (exit $rc); its output:" >&2
  tail -n 20 "$out/gpu_apply.txt" >&2
fi
exit "$rc"
