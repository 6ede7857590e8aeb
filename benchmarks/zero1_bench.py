"""ZeRO-1's step time: SMPStrategy(shard_optimizer_state=True) against plain data parallelism, two CPU ranks (dp2),
and torch's ``ZeroRedundancyOptimizer`` against plain ``DistributedDataParallel`` as the peer — ratios measured in
one run, one thread per rank, gloo.

Model and data: `pipeline_bench.py`'s (``--blocks`` MLP blocks of ``--width``, MSE loss, a batch of ``--batch``
rows per rank), trained with AdamW, whose two state tensors per parameter are what ZeRO-1 shards. Per kind, the
seconds per training step:

- ``smp_dp``: a real ``Trainer.fit`` with ``SMPStrategy()`` on two ranks (data parallelism: DDP's bucketed
  all-reduce, overlapped with backward), Lightning's loop and hooks included; timed from one
  ``on_train_batch_start`` to the next;
- ``smp_zero1``: the same with ``SMPStrategy(shard_optimizer_state=True)``: gradients reduce-scattered in
  buckets of 25 MiB, each bucket's started during the backward once its gradients are final (on gloo: all-reduced,
  each rank keeping its share), each rank updating its half of the parameters, the updated halves all-gathered;
  the default model is one bucket (8.4 MB), so the reduction can only start when backward ends; ``--width 1024
  --batch 64`` makes two buckets (33.6 MB) and a step where communication weighs more;
- ``torch_ddp`` / ``torch_zero``: a plain loop (no Lightning) over the same model in ``DistributedDataParallel``,
  with ``torch.optim.AdamW`` / with ``ZeroRedundancyOptimizer(optimizer_class=AdamW)`` (DDP's all-reduce, then each
  rank updates its share of the parameters and broadcasts it).

Each is the median step time over ``--steps`` steps after ``--warmup``, the best of ``--rounds`` rounds (rounds
run the kinds in turn, so drift of a shared machine hits them alike); a step ends when the slower rank's does.
For the two ``smp`` kinds also the CPU seconds per step (``time.process_time`` of each rank's process, gloo's
threads included; the median step, the larger rank, the best round): on a machine other jobs share, wall time
measures them too, CPU time only the work (overlap hides communication in wall time and saves no CPU).
Printed: step times and the ratios ``smp_zero1 / smp_dp`` (wall and CPU) and ``torch_zero / torch_ddp``.
``--out`` writes the JSON (with the machine, command and date).

    python benchmarks/zero1_bench.py --out zero1_bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

import torch
from torch import nn

try:
    from benchmarks import pipeline_bench as bench
except ImportError:  # run as `python benchmarks/zero1_bench.py`
    import pipeline_bench as bench

RANKS = 2
KINDS = ("smp_dp", "smp_zero1", "torch_ddp", "torch_zero")
"""What each round times (see the module docstring)."""
CPU_KINDS = ("smp_dp_cpu", "smp_zero1_cpu")
"""The CPU seconds per step of the two ``smp`` kinds."""


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _smp(rank: int, args: argparse.Namespace, out: Any) -> None:
    from lightning_smp import SMPStrategy

    result = {}
    for name, shard in (("smp_dp", False), ("smp_zero1", True)):
        strategy = SMPStrategy(shard_optimizer_state=shard)
        clocks = (time.perf_counter, time.process_time)  # wall, and this process's CPU seconds (gloo's threads too)
        result[name], result[f"{name}_cpu"] = bench.timed_fit(args, strategy, clocks=clocks, optimizer=_adamw)
    out.put((rank, result))


def _torch(rank: int, args: argparse.Namespace, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    x, y = bench.blocks_data(args)
    result = {name: _time_torch(name, args, x, y) for name in ("torch_ddp", "torch_zero")}
    # The DDP models are freed (their reducers hold the group) while the group is still registered, so that its
    # last reference is dropped by destroy_process_group, which releases the GIL while gloo's workers stop. Freed
    # from DDP's reducer instead (the GIL held), a worker that still has to release a finished collective's tensors
    # waits for the GIL forever and the rank hangs at exit (pytorch #56297).
    gc.collect()
    dist.destroy_process_group()
    out.put((rank, result))


def _time_torch(name: str, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> float:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(bench.blocks_model(args.width, args.blocks))
    if name == "torch_zero":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        optimizer = _adamw(model.parameters())

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    return bench.time_steps(step, args)


def measure(args: argparse.Namespace) -> dict:
    best: dict = {}
    torchelastic = {"TORCHELASTIC_RUN_ID": "bench"}  # Lightning then takes the ranks as launched, like torchrun
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        timed = {
            **bench.slowest(bench.spawn(_smp, RANKS, args, env=torchelastic)),
            **bench.slowest(bench.spawn(_torch, RANKS, args)),
        }
        for name, seconds in timed.items():
            best[name] = min(best.get(name, float("inf")), seconds)
    return best


def report(best: dict, args: argparse.Namespace) -> dict:
    row = {f"{name}_s": best[name] for name in (*KINDS, *CPU_KINDS)}
    row["smp_zero1_over_smp_dp"] = best["smp_zero1"] / best["smp_dp"]
    row["smp_zero1_over_smp_dp_cpu"] = best["smp_zero1_cpu"] / best["smp_dp_cpu"]
    row["torch_zero_over_torch_ddp"] = best["torch_zero"] / best["torch_ddp"]
    print(" ".join(f"{name} {best[name] * 1e3:7.1f}ms" for name in (*KINDS, *CPU_KINDS)))
    print(
        f"smp_zero1 / smp_dp = {row['smp_zero1_over_smp_dp']:.3f} wall, {row['smp_zero1_over_smp_dp_cpu']:.3f} CPU; "
        f"torch_zero / torch_ddp = {row['torch_zero_over_torch_ddp']:.3f}"
    )
    parameters = sum(p.numel() for p in bench.blocks_model(args.width, args.blocks).parameters())
    row["parameters"] = parameters
    return bench.record([row], args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    bench.describe_machine()
    result = report(measure(args), args)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
