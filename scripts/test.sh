#!/usr/bin/env bash
# The test suite: lint, format check, then pytest. Arguments go to pytest, e.g. `bash scripts/test.sh -x tests/test_config.py`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
