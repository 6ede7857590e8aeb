#!/usr/bin/env bash
# constraints.txt: the exact versions in .venv, after the suite passed there (docs/contributing.md). Users install
# with them through `pip install -c constraints.txt -e ".[test]"` or `CONSTRAINTS=constraints.txt bash scripts/setup.sh`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
{
    echo "# The versions of the last green run of the newest job (Python $(.venv/bin/python -c 'import sys; print(*sys.version_info[:2], sep=".")'), CPU), written by scripts/freeze_constraints.sh:"
    echo "# pip install -c constraints.txt -e \".[test]\" installs exactly these."
    .venv/bin/python -m pip freeze --exclude-editable | sed 's/+cpu$//'
} >constraints.txt
