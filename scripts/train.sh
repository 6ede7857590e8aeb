#!/usr/bin/env bash
# The main job: train the digits CNN with SMPStrategy (fp16 by default; CPU here, GPU when present).
# Arguments go to the example, e.g. `bash scripts/train.sh --no-fp16 --epochs 3`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/digits_cnn.py "$@"
