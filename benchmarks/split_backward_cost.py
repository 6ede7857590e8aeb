"""What splitting a backward costs: one pipeline stage's backward run whole against `BackwardSplitter`'s input pass
plus its weight pass (`pipeline="zero_bubble"`), in CPU time of one thread.

Model: one stage of `pipeline_bench.py`'s split, ``--blocks`` × (``Linear(width, width)`` + ReLU), a microbatch of
``--rows`` rows whose input requires grad (as a later stage's received activation does), one thread. The two kinds
alternate, ``--repeats`` times each, on fresh forwards; each figure is the median of ``time.thread_time`` (this
thread's CPU seconds, so other jobs on the machine do not count). Printed per width: the whole backward, the input
pass (B), the weight pass (W), and (B + W) / whole; the zero-bubble schedule gains only where that ratio's excess
costs less than the bubble it fills. ``--out`` writes the JSON.

    python benchmarks/split_backward_cost.py --widths 512,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

try:
    from benchmarks import pipeline_bench as bench
except ImportError:  # run as `python benchmarks/split_backward_cost.py`
    import pipeline_bench as bench

from lightning_smp.pipeline.split_backward import BackwardSplitter


def measure(width: int, args: argparse.Namespace) -> dict:
    stage = bench.blocks_model(width, args.blocks)
    params = list(stage.parameters())
    whole, inputs, weights = [], [], []
    for _ in range(args.repeats):
        for split in (False, True):
            x = torch.randn(args.rows, width, requires_grad=True)
            y = stage(x)
            grad = torch.randn_like(y)
            start = time.thread_time()
            if not split:
                torch.autograd.backward([y], [grad])
                whole.append(time.thread_time() - start)
                continue
            weight_pass = BackwardSplitter(params).backward_input([y], [grad], [x])
            middle = time.thread_time()
            weight_pass()
            inputs.append(middle - start)
            weights.append(time.thread_time() - middle)
    row = {
        "width": width,
        "whole_ms": 1e3 * statistics.median(whole),
        "input_pass_ms": 1e3 * statistics.median(inputs),
        "weight_pass_ms": 1e3 * statistics.median(weights),
    }
    row["split_over_whole"] = (row["input_pass_ms"] + row["weight_pass_ms"]) / row["whole_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=lambda s: [int(v) for v in s.split(",")], default=[512, 1024])
    parser.add_argument("--blocks", type=int, default=4, help="blocks of one stage (pipeline_bench's 8 over 2)")
    parser.add_argument("--rows", type=int, default=32, help="rows of a microbatch (pipeline_bench's 256 / 8)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(width, args) for width in args.widths]
    for row in rows:
        print(
            f"width {row['width']}: whole {row['whole_ms']:.2f} ms, input pass {row['input_pass_ms']:.2f} ms + "
            f"weight pass {row['weight_pass_ms']:.2f} ms = {row['split_over_whole']:.2f}x the whole backward"
        )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(bench.record(rows, args), handle, indent=2)


if __name__ == "__main__":
    main()
