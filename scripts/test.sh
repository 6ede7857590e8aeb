#!/usr/bin/env bash
# The test suite: lint, format check, then pytest. Arguments go to pytest, e.g. `bash scripts/test.sh -x tests/test_config.py`.
# Two pytest workers (pytest-xdist), each taking whole files (a file's tests share their launches): alone, the suite
# keeps one of two cores busy. `-n 0` (or a later `-n N`) in the arguments overrides it.
#
# `bash scripts/test.sh --oldest [pytest args]`: the same tests on the oldest versions setup.cfg allows
# (.venv-oldest, scripts/oldest_constraints.py), by default the files that touch a bounded library: Lightning's
# strategy, precision, checkpoint and signal hooks; transformers, safetensors and peft; jsonargparse and matplotlib
# through the CLI. No lint there: ruff is pinned to one version.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OLDEST_TESTS=(
    tests/test_compat.py tests/test_dependencies.py
    tests/test_strategy.py tests/test_precision.py tests/test_checkpoint.py tests/test_fault_tolerance.py
    tests/test_pretrained.py tests/test_lora.py tests/test_export.py tests/test_weights.py
    tests/test_tensor_parallel_hf.py tests/test_cli.py
)

# The versions this run tests, on one line (CI's log is the record of which versions passed).
print_versions() {
    "$1/bin/python" -c "import importlib.metadata as m; print('$2 versions:', ', '.join(f'{d} {m.version(d)}' for d in
        ('torch', 'lightning', 'torchmetrics', 'transformers', 'safetensors', 'peft', 'jsonargparse', 'matplotlib')))"
}

if [ "${1:-}" = "--oldest" ]; then
    shift
    bash scripts/setup.sh --oldest
    print_versions .venv-oldest oldest
    names_tests=false
    for arg in "$@"; do [[ "$arg" == tests* ]] && names_tests=true; done
    $names_tests || set -- "${OLDEST_TESTS[@]}" "$@"
    exec .venv-oldest/bin/python -m pytest -q -n 2 --dist loadfile "$@"
fi

bash scripts/setup.sh
print_versions .venv newest
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
