#!/usr/bin/env bash
# Idempotent environment setup: .venv in the repo root with torch and this package installed editable with its
# test extras. Cheap when nothing changed (a stamp of setup.cfg + pyproject.toml), so every script calls it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_VERSION="2.13.0"
STAMP=.venv/.lightning_smp-setup

# The first Python >= 3.11 (setup.cfg's python_requires) among $PYTHON, python3.11, python3.12, python3.13, python3.
find_python() {
    local candidate candidates=(python3.11 python3.12 python3.13 python3)
    if [ -n "${PYTHON:-}" ]; then candidates=("$PYTHON" "${candidates[@]}"); fi
    for candidate in "${candidates[@]}"; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if [ ! -x .venv/bin/python ]; then
    asked="${PYTHON:-}"
    if ! PYTHON="$(find_python)"; then
        echo "scripts/setup.sh: lightning_smp needs Python >= 3.11, and none of ${asked:+\$PYTHON=$asked, }python3.11," \
            "python3.12, python3.13 or python3 ($(python3 --version 2>&1 || echo 'not found')) is one." \
            "Install Python 3.11 or newer, or point PYTHON at one: PYTHON=/path/to/python3.12 bash scripts/setup.sh" >&2
        exit 1
    fi
    "$PYTHON" -m venv .venv
fi
# torch first, pinned: left to resolve `torch` from setup.cfg, pip would pull a newer multi-GB CUDA build.
if ! .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    2>/dev/null; then
    .venv/bin/python -m pip install --quiet --quiet "torch==$TORCH_VERSION"
fi
wanted="$(cat setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/python -m pip install --quiet --quiet -e ".[test]"
    echo "$wanted" >"$STAMP"
fi
