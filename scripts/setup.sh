#!/usr/bin/env bash
# Idempotent environment setup: .venv in the repo root with torch and this package installed editable with its
# test extras, at the newest versions setup.cfg's ranges allow, and LitGPT for its tests. Cheap when nothing changed
# (a stamp of setup.cfg + pyproject.toml, and LitGPT's installed version), so every script calls it.
# `bash scripts/setup.sh --oldest`: .venv-oldest instead, every dependency at the oldest version its range allows
# (scripts/oldest_constraints.py), for CI's second job. `CONSTRAINTS=constraints.txt bash scripts/setup.sh`: the
# exact versions of the last green CI run (constraints.txt), instead of the newest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
if [ "${1:-}" = "--oldest" ]; then VENV=.venv-oldest; fi
TORCH_VERSION="2.13.0"
STAMP=$VENV/.lightning_smp-setup

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

if [ ! -x "$VENV/bin/python" ]; then
    asked="${PYTHON:-}"
    if ! PYTHON="$(find_python)"; then
        echo "scripts/setup.sh: lightning_smp needs Python >= 3.11, and none of ${asked:+\$PYTHON=$asked, }python3.11," \
            "python3.12, python3.13 or python3 ($(python3 --version 2>&1 || echo 'not found')) is one." \
            "Install Python 3.11 or newer, or point PYTHON at one: PYTHON=/path/to/python3.12 bash scripts/setup.sh" >&2
        exit 1
    fi
    "$PYTHON" -m venv "$VENV"
fi
# torch first, pinned: left to resolve `torch` from setup.cfg, pip would pull a newer multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --quiet "torch==$TORCH_VERSION"
fi
constraints=()
if [ "$VENV" = .venv-oldest ]; then
    "$VENV/bin/python" scripts/oldest_constraints.py >"$VENV/oldest-constraints.txt"
    constraints=(-c "$VENV/oldest-constraints.txt")
elif [ -n "${CONSTRAINTS:-}" ]; then
    constraints=(-c "$CONSTRAINTS")
fi
wanted="$(cat setup.cfg pyproject.toml ${CONSTRAINTS:+"$CONSTRAINTS"} | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]; then
    "$VENV/bin/python" -m pip install --quiet --quiet "${constraints[@]}" -e ".[test]"
    echo "$wanted" >"$STAMP"
fi
# LitGPT, for the tests that train its GPT as a model no test here wrote (tests/test_fabric.py), in the newest job
# only (the oldest runs none of them). Pinned to the version they passed on, and installed with --no-deps: its own
# pins (jsonargparse<=4.41 and huggingface-hub<1.4, below the newest versions setup.cfg's ranges resolve to, and
# psutil==7.2.2 exactly) would hold the environment back, which is also why it is not a setup.cfg extra; the tests
# use only litgpt.GPT and litgpt.Config, and `import litgpt` needs nothing that .[test] does not install.
# tests/test_dependencies.py checks the installed version against this pin (docs/contributing.md).
LITGPT_VERSION="0.5.13"
if [ "$VENV" = .venv ] && ! "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('litgpt') != '$LITGPT_VERSION')" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --quiet --no-deps "litgpt==$LITGPT_VERSION"
fi
