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
# fio and iperf3: what `dualpath bench storage` and `bench transfer` compare our I/O with (the
# machine's own limits). Installed once where we are root on Debian (CI); elsewhere a hint.
if ! command -v fio >/dev/null || ! command -v iperf3 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing fio and iperf3"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio iperf3; } >/dev/null ||
      echo "[setup] apt-get could not install fio/iperf3: the storage and transfer benchmarks will say so"
  else
    echo "[setup] fio/iperf3 missing (benchmarks only): apt-get install -y fio iperf3"
  fi
fi
# The simulator's hot path as mypyc extensions (same results, ~2x faster; skipped when fresh).
# A failed build is not fatal: everything runs as pure Python. DUALPATH_COMPILED=0 skips it.
if [ "${DUALPATH_COMPILED:-1}" != "0" ]; then
  .venv/bin/dualpath compiled build --if-stale ||
    echo "[setup] mypyc build failed: the simulator runs as pure Python (same results, slower)"
fi
