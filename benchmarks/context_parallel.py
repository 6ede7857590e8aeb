"""Context parallelism against one device and against tp2 + sequence parallelism, on the benchmark GPT at 4,096 tokens.

The GPT of ``memory_scale.py`` (``nn.TransformerEncoderLayer``s, causal, no positional embedding: context
parallelism needs nothing from it) at the ``long`` size of ``sequence_parallel.py`` (width 256, 2 layers, vocabulary
1,024: attention-bound), fp32, one sequence per step, trained by ``sequence_parallel.py run`` in fresh processes
(one launch per device count; the ranks one thread each). Per layout:

- ``bytes_of_one``: what the largest rank keeps for backward in one step (every tensor autograd saves, each storage
  once, parameters left out: `activation_memory.SavedBytes`), over one device's;
- ``cpu_of_one``: the slowest rank's CPU seconds per step (median of the steps after the measured one), over one
  device's (CPU time, not wall time: the ranks share a machine's cores).

torch's own ``context_parallel`` is not measured: on CPU it fails ("…flash_attention_for_cpu does not have a
sharding strategy registered"), its ring handlers being for the CUDA kernels only.

    python benchmarks/context_parallel.py --out cp.json                     # 1, cp2, tp2+sp, cp4 at 4,096 tokens
    python benchmarks/context_parallel.py --size long_smoke --steps 1       # what tests/test_benchmarks.py runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

try:
    from benchmarks.pipeline_bench import record
    from benchmarks.sequence_parallel import MEASURED_STEP, _by_devices, _launch
except ImportError:  # run as `python benchmarks/context_parallel.py` without the repo root on sys.path
    from pipeline_bench import record
    from sequence_parallel import MEASURED_STEP, _by_devices, _launch

LAYOUTS = ("1", "cp2", "tp2+sp-shared", "cp4")  # tp2+sp reading one batch per group: the same tokens as the others


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    launched: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for group in _by_devices(list(args.layouts.split(","))):
            launched.update({layout: ranks for (layout, _), ranks in _launch("gpt", group, args, tmp).items()})

    def step_cpu(ranks: list[dict[str, Any]]) -> float:
        timed = [rank["cpu_seconds"][MEASURED_STEP + 1 :] for rank in ranks]
        return statistics.median(max(step) for step in zip(*timed, strict=True))

    one = launched["1"]
    rows = []
    for layout, ranks in launched.items():
        largest = max(rank["per_microbatch"] for rank in ranks)
        rows.append({
            "layout": layout, "ranks": len(ranks), "saved_bytes_largest_rank": largest,
            "bytes_of_one": largest / one[0]["per_microbatch"], "cpu_seconds_slowest_rank": step_cpu(ranks),
            "cpu_of_one": step_cpu(ranks) / step_cpu(one),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="long", help="a size of sequence_parallel.py (long, long_smoke)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layouts of sequence_parallel.py")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the measured one")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.dropout, args.fp16, args.what = 0.0, False, "context_parallel"
    rows = measure(args)
    print(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record(rows, args), indent=2))


if __name__ == "__main__":
    main()
