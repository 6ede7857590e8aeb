#!/usr/bin/env bash
# The one script to run on the lent GPU (H200): every single-GPU check and benchmark, in priority order, each
# started only while the time budget (END_S seconds, default 480) lasts, each under its own hard limit. Everything
# lands under $OUT (at most 8 files come back from the lent machine):
#   gpu_checks.log          this script's whole output
#   doors_gpu.json          the three doors (Trainer, smp script, Fabric) on one GPU, fp16 GPT-2 124M
#   precision_124m.json     smp_fp16 against Lightning's 16-mixed and 16-true, eager, with the per-phase device time
#   pipeline_bench.json     the pipeline benchmark on the lent machine's idle CPU cores (gloo, one thread per rank)
#   profile_124m.json       the top kernels per mode
#   activation_memory_124m.json, precision_350m.json: when time remains
# A section that fails does not stop the others; the exit status says whether any failed. The import check comes
# first and ends the run at once if the package does not import (a broken run then costs seconds, not minutes).
# Without CUDA (here, to test this script's logic) it runs the tiny sizes for a few steps instead:
#   OUT=/tmp/out END_S=300 bash benchmarks/gpu_checks.sh
set -u
OUT=${OUT:-/tmp/gpu_checks_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_checks.log") 2>&1
TEE_PID=$!

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
START=$(date +%s)
END_S=${END_S:-480}
elapsed() { echo $(($(date +%s) - START)); }
STATUS=0

finish() {
    echo "== done in $(elapsed)s, status $STATUS; files in $OUT:"
    ls -l "$OUT"
    exec >&- 2>&-
    wait $TEE_PID # let tee finish writing gpu_checks.log
    exit $STATUS
}

# section KEY NAME LIMIT_S NEEDS_S COMMAND...: run COMMAND under LIMIT_S if NEEDS_S seconds of the budget remain
# (and, when ONLY lists keys, if it lists KEY: `ONLY=doors,pipeline bash benchmarks/gpu_checks.sh` reruns two).
section() {
    local key=$1 name=$2 limit=$3 needs=$4
    shift 4
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$key,"* ]]; then return; fi
    local left=$((END_S - $(elapsed)))
    if [ $left -lt "$needs" ]; then
        echo "== $name: skipped, ${left}s of the budget left (needs ${needs}s)"
        return
    fi
    [ "$limit" -gt $left ] && limit=$left
    echo "== $name (t=$(elapsed)s, limit ${limit}s)"
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc at t=$(elapsed)s"
    [ $rc -eq 0 ] || STATUS=1
}

# The lent machine's Python has its own torch, which may be older than setup.cfg's range (torch 2.11 there on
# 2026-12-04, against >=2.13) and cannot be replaced (no registry; a CUDA wheel is over the transfer limit). Under an
# older torch, a sitecustomize gives the one name our import needs that torch 2.11 lacks (FSDP2's
# ShardPlacementResult, used only by sharded data parallelism's small-parameter placement, which one GPU never runs)
# a stand-in that refuses to be built. The log says so: figures from such a run are that torch's.
if ! $PY -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 13))'
then
    mkdir -p /tmp/torch_shim
    cat >/tmp/torch_shim/sitecustomize.py <<'SHIM'
import torch.distributed.fsdp._fully_shard._fsdp_common as common

if not hasattr(common, "ShardPlacementResult"):

    class ShardPlacementResult:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("sharded data parallelism's placement needs torch >= 2.13 (gpu_checks.sh stand-in)")

    common.ShardPlacementResult = ShardPlacementResult
SHIM
    export PYTHONPATH=/tmp/torch_shim:$PYTHONPATH
    echo "torch is older than setup.cfg's range: FSDP2's ShardPlacementResult comes from /tmp/torch_shim"
fi

echo "== environment ($(date -Iseconds)), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "(no nvidia-smi)"
if ! $PY -c '
import os, sys, torch, lightning, lightning_smp
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| lightning", lightning.__version__, "| lightning_smp", lightning_smp.__version__, "| cores", os.cpu_count())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
'; then
    echo "lightning_smp does not import: nothing else runs"
    STATUS=1
    finish
fi
if $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then CUDA=1; else CUDA=0; fi

section tests "CUDA-marked tests" 150 60 $PY -m pytest -q -m cuda -p no:cacheprovider -rs $(grep -l "mark.cuda" tests/test_*.py)

if [ $CUDA -eq 1 ]; then
    # Issue 33: the three doors run one engine; on a GPU a door's extra host work would show in the step time.
    section doors "doors, one GPU, fp16 GPT-2 124M" 200 120 $PY benchmarks/doors_bench.py --accelerator cuda \
        --layouts one --model gpt --size 124m --batch 16 --fp16 --steps 30 --warmup 20 --rounds 2 \
        --out "$OUT/doors_gpu.json"
    # The README's main job (examples/digits_cnn.py: fp16 by default, the GPU when present): its validation accuracy.
    section example "README main job on the GPU" 90 60 $PY examples/digits_cnn.py
    # Where smp_fp16's eager step goes against 16-mixed and 16-true, phase by phase (device time), and host syncs.
    section precision "precision 124M, eager" 170 90 $PY benchmarks/precision_bench.py --size 124m --batch-size 16 \
        --steps 30 --warmup 20 --modes smp_fp16,16-mixed,16-true --time-budget 110 \
        --out "$OUT/precision_124m.json"
    # The pipeline on idle cores: the machine's CPUs, one thread per rank, gloo (docs/benchmarks.md's command).
    # torch's own schedules are left out: torch 2.11's fail over gloo there ("Pair is not connected", 2026-12-04).
    section pipeline "pipeline bench, idle CPU cores" 150 100 $PY benchmarks/pipeline_bench.py --microbatches 8 \
        --rounds 2 --steps 10 --pipelines smp_1f1b,smp_gpipe,smp_virtual2,smp_zb --out "$OUT/pipeline_bench.json"
    section profile "profile 124M" 110 80 $PY benchmarks/precision_bench.py --size 124m --batch-size 16 --steps 5 \
        --warmup 20 --sync-check-steps 0 --profile-steps 3 --modes smp_fp16,16-true,16-mixed \
        --out "$OUT/profile_124m.json"
    section activations "activation memory 124M" 150 90 $PY benchmarks/activation_memory.py --layers 12 --heads 12 \
        --width 768 --block 1024 --batch 16 --vocab 50304 --steps 10 --out "$OUT/activation_memory_124m.json"
    section precision350 "precision 350M, eager" 150 100 $PY benchmarks/precision_bench.py --size 350m --batch-size 16 \
        --steps 20 --warmup 20 --modes smp_fp16,16-mixed,16-true --time-budget 90 \
        --out "$OUT/precision_350m.json"
else
    echo "(no CUDA: tiny sizes, few steps; the logic only)"
    section doors "doors, one process, fp16 tiny GPT" 120 30 $PY benchmarks/doors_bench.py --layouts one \
        --model gpt --size tiny --batch 4 --fp16 --steps 3 --warmup 2 --rounds 1 --out "$OUT/doors_gpu.json"
    section precision "precision tiny" 200 60 $PY benchmarks/precision_bench.py --size tiny --steps 3 --warmup 3 \
        --modes smp_fp16,16-mixed,16-true --time-budget 100 --out "$OUT/precision_124m.json"
    section pipeline "pipeline bench, smallest" 200 60 $PY benchmarks/pipeline_bench.py --microbatches 2 --rounds 1 \
        --steps 2 --warmup 1 --width 64 --blocks 4 --batch 16 --timeout 100 --out "$OUT/pipeline_bench.json"
    section budget "a section the budget has no room for" 60 100000 true
fi
finish
