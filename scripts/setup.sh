#!/usr/bin/env bash
# Create .venv (if needed) and install DualPath with its test extras.
# torch: the CPU build 2.13.0 by default (DUALPATH_TORCH overrides, e.g. "torch" for a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.dualpath-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing torch (${DUALPATH_TORCH:-torch==2.13.0}) and dualpath[test]"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q "${DUALPATH_TORCH:-torch==2.13.0}"
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
