#!/usr/bin/env bash
# The test suite: lint, format check, then pytest. Arguments go to pytest, e.g. `bash scripts/test.sh -x tests/test_config.py`.
# Two pytest workers (pytest-xdist), each taking whole files (a file's tests share their launches): alone, the suite
# keeps one of two cores busy. `-n 0` (or a later `-n N`) in the arguments overrides it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
