#!/usr/bin/env bash
# The one script to run on the lent GPU (H200): environment, CUDA-marked tests, then the precision benchmark for
# GPT-2 124M (all modes) and 350M (in priority order, as time allows). Everything lands under $OUT:
#   gpu_checks.log          this script's whole output
#   bench.log               the benchmark runs' output
#   precision_124m.json     precision_350m.json     sync_progress_bar.json     profile_124m.json (top kernels)
#   activation_memory_124m.json (activation checkpointing, plain and offloaded: peak memory and step time)
# Budget: about 7 minutes on an H200; each mode's time is printed as it ends. Each benchmark writes its JSON after
# every mode, so a run cut short still leaves the modes it finished.
# Without CUDA (here, to test this script's logic) it runs the tiny model for a few steps instead:
#   OUT=/tmp/out bash benchmarks/gpu_checks.sh
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
elapsed() { echo $(($(date +%s) - START)); }
STATUS=0

echo "== environment ($(date -Iseconds))"
nvidia-smi || echo "(no nvidia-smi)"
$PY - <<'EOF'
import sys, torch, lightning
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| lightning", lightning.__version__)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
EOF
if $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then CUDA=1; else CUDA=0; fi

echo "== CUDA-marked tests (t=$(elapsed)s)"
set -o pipefail
timeout 150 $PY -m pytest -q -m cuda tests/ -p no:cacheprovider 2>&1 | tail -n 40
rc=$?
if [ $rc -eq 5 ]; then
    echo "no CUDA-marked tests collected: ok"
elif [ $rc -ne 0 ]; then
    echo "CUDA-marked tests FAILED (exit $rc)"
    STATUS=1
fi

# bench NAME TIMEOUT_S ARGS...: one benchmark process; its output goes to bench.log too.
bench() {
    local name=$1 limit=$2
    shift 2
    echo "== benchmark $name (t=$(elapsed)s, hard limit ${limit}s)" | tee -a "$OUT/bench.log"
    timeout "$limit" $PY benchmarks/precision_bench.py "$@" 2>&1 | tee -a "$OUT/bench.log"
    local rc=$?
    echo "== benchmark $name exit $rc after t=$(elapsed)s" | tee -a "$OUT/bench.log"
    [ $rc -eq 0 ] || STATUS=1
}

# Modes the time budget may drop come last: the goals need smp_fp16, 16-mixed and the three compiled modes.
PRIORITY=smp_fp16,16-mixed,16-true,smp_fp16_compile,16-true_compile,16-mixed_compile,bf16-mixed,32-true
END_S=${END_S:-420} # aim to be done by then (7 min); a mode starts only while its run's --time-budget lasts
if [ $CUDA -eq 1 ]; then
    bench 124m 300 --size 124m --batch-size 16 --steps 30 --warmup 20 --modes all \
        --time-budget 240 --out "$OUT/precision_124m.json"
    # Lightning reads prog_bar metrics (smp logs loss_scale there) at every step when the bar is on: count syncs.
    bench sync_progress_bar 60 --size 124m --batch-size 16 --steps 3 --warmup 20 --modes smp_fp16 \
        --progress-bar --sync-check-steps 4 --out "$OUT/sync_progress_bar.json"
    # Where smp_fp16's eager step still loses to the pure-fp16 ceiling: the top kernels of each, per step.
    bench profile_124m 120 --size 124m --batch-size 16 --steps 5 --warmup 20 --sync-check-steps 0 \
        --profile-steps 3 --modes smp_fp16,16-true,16-mixed --out "$OUT/profile_124m.json"
    # What activation checkpointing (and offloading its inputs) saves on GPT-2 124M (fp16, max_memory_allocated)
    # and costs per step.
    echo "== activation memory 124m (t=$(elapsed)s)" | tee -a "$OUT/bench.log"
    timeout 180 $PY benchmarks/activation_memory.py --layers 12 --heads 12 --width 768 --block 1024 --batch 16 \
        --vocab 50304 --steps 10 --out "$OUT/activation_memory_124m.json" 2>&1 | tee -a "$OUT/bench.log" || STATUS=1
    budget=$((END_S - $(elapsed) - 80)) # keep ~80 s for the mode that starts last (a 350m compile)
    bench 350m $((END_S + 120 - $(elapsed))) --size 350m --batch-size 16 --steps 20 --warmup 20 \
        --modes "$PRIORITY" --time-budget $((budget > 20 ? budget : 20)) --out "$OUT/precision_350m.json"
else
    echo "(no CUDA: tiny model, few steps, eager modes; the logic only)"
    bench tiny 300 --size tiny --steps 5 --warmup 5 --modes smp_fp16,16-mixed,16-true,32-true \
        --time-budget 200 --out "$OUT/precision_tiny.json"
    bench tiny_budget 120 --size tiny --steps 3 --warmup 5 --modes "$PRIORITY" --skip-modes 32-true \
        --time-budget 1 --out "$OUT/precision_tiny_budget.json"
    bench tiny_profile 120 --size tiny --steps 2 --warmup 3 --profile-steps 2 --modes smp_fp16,16-true \
        --out "$OUT/profile_tiny.json"
fi

echo "== done in $(elapsed)s, status $STATUS; files in $OUT:"
ls -l "$OUT"
exec >&- 2>&-
wait $TEE_PID # let tee finish writing gpu_checks.log
exit $STATUS
