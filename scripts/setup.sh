#!/usr/bin/env bash
# Idempotent environment setup: .venv in the repo root with torch and this package installed editable with its
# test extras. Cheap when nothing changed (a stamp of setup.cfg + pyproject.toml), so every script calls it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
STAMP=.venv/.lightning_smp-setup

if [ ! -x .venv/bin/python ]; then
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
