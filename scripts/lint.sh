#!/usr/bin/env bash
# Lint, format check and type check (configured in pyproject.toml): what .ci/run runs before the tests.
# Extra arguments are ignored; fix what it reports with `ruff check --fix` / `ruff format` on your files.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[lint] ruff check"
.venv/bin/ruff check .
echo "[lint] ruff format --check"
.venv/bin/ruff format --check .
echo "[lint] mypy"
.venv/bin/mypy
