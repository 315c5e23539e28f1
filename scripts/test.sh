#!/usr/bin/env bash
# Set up, then run the whole test suite (unit + integration on real nats-server and processes).
# Extra arguments go to pytest (e.g. -m "not slow" or tests/unit).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
