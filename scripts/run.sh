#!/usr/bin/env bash
# Set up, then serve a tiny model with the whole stack (embedded NATS, local storage) on :8000.
# Extra arguments go to `dualpath up` (e.g. --topology 2P2D --port 8080 --model DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dualpath up "$@"
