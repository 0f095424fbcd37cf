#!/usr/bin/env bash
# `make gpu-check`, also where make is missing: bash bench/gpu_check.sh [gpu_check.py's options]
# From the checkout's root or anywhere. The Python is $PYTHON, else the checkout's .venv, else python3 (on a
# lent GPU machine, the image's own, with its torch, triton and transformers). Packages the engine path needs
# that it lacks come from the wheels `make gpu-prepare` staged in .gpu/whl, installed once into
# $GPU_CHECK_SITE (no network, no dependencies resolved, nothing of the image's replaced).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
site=${GPU_CHECK_SITE:-/tmp/chatcore-gpu-site}
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ! "$python" -c "import pydantic_settings, xgrammar" 2>/dev/null; then
  shopt -s nullglob
  wheels=(.gpu/whl/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu-check: $python lacks pydantic_settings or xgrammar, and .gpu/whl has no wheels: run make gpu-prepare" >&2
    exit 2
  fi
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
fi
exec "$python" -m chatcore.bench.gpu_check "$@"
