"""What the messages alone cost a two-stage pipeline step on gloo: the model replaced by busy-waits of a fixed
length, so only the schedule and its sends and receives differ from the ideal.

Each forward and each backward of a microbatch on a stage spins for ``C`` microseconds (``--compute-us``; an
autograd function, so backward runs through the autograd engine as in training); a microbatch's activation and
its gradient are ``--rows`` x ``--width`` fp32 tensors (the `pipeline_bench.py` model's at m = 8 by default).
The ideal step is (m + p - 1) x 2C with p = 2 stages. Per C, the median seconds per step of:

- ``ours``: lightning_smp's transport (`lightning_smp.pipeline.p2p.Transport`) driven by its 1F1B plan
  (`schedule.build("interleaved")`), as `runtime.py` drives them, without Lightning and without the step's
  result message;
- ``torch``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` on the same busy-wait stages.

Spinning keeps a core per stage busy as compute does; where the machine has no other core free (two cores for
the two stages), a message's delivery waits until gloo's receiving thread gets one. At C = 0 the stages' cores
are mostly idle and what remains is the latency of each message. The JSON records the machine's core count.

    python benchmarks/pipeline_messages.py --compute-us 0,200,1000
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from benchmarks import pipeline_bench as bench
except ImportError:  # run as `python benchmarks/pipeline_messages.py`
    import pipeline_bench as bench

STAGES = bench.STAGES  # the two-stage split of pipeline_bench.py


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Busy(torch.autograd.Function):
    """Identity whose forward and backward each spin for a fixed time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        _spin(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _spin(ctx.seconds)
        return grad.clone(), None


class _BusyStage(nn.Module):
    """A stage: a scale parameter (so that every stage has a backward to run) and the busy-wait."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Busy.apply(x * self.scale, self.seconds)


def _ours_step(
    rank: int, args: argparse.Namespace, module: nn.Module, inputs: list, transport: Any, plan: list
) -> None:
    """One step of this rank's 1F1B plan over the transport, in the engine's order of posts, sends and waits."""
    transport.begin_step()
    if rank == 1:
        transport.expect(src=0, tag=0, count=args.microbatches)
    live: dict[int, Any] = {}
    for action in plan:
        index = action.microbatch
        if action.forward and rank == 0:
            sent = transport.send_activation(module(inputs[index]), dst=1, tag=0)
            live[index] = (sent, transport.post_grads(sent, src=1, tag=1))
        elif action.forward:
            received, leaves = transport.recv_activation(src=0, requires_grad=True, tag=0)
            live[index] = (leaves, module(received).sum())
        elif rank == 0:
            sent, posted = live.pop(index)
            torch.autograd.backward(sent, transport.wait_grads(posted))
        else:
            leaves, loss = live.pop(index)
            loss.backward()
            transport.send_grads(leaves, dst=0, tag=1)
    transport.wait_sends()


def _rank(rank: int, args: argparse.Namespace, out: Any) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lightning_smp import topology as layout
    from lightning_smp.pipeline import schedule
    from lightning_smp.pipeline.p2p import Transport

    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    run = layout.build(dp=1, pp=STAGES, tp=1, order="cluster", device_type="cpu")  # owns the pipeline group
    plan = schedule.build("interleaved", stages=STAGES, stage=rank, microbatches=args.microbatches)
    batch = torch.zeros(args.rows * args.microbatches, args.width)
    result = {}
    for micros in args.compute_us:
        seconds = micros * 1e-6
        transport = Transport(run, torch.device("cpu"))
        inputs = list(batch.chunk(args.microbatches))
        ours = functools.partial(_ours_step, rank, args, _BusyStage(seconds), inputs, transport, plan)
        result[("ours", micros)] = _time(ours, args)
        stage = PipelineStage(_BusyStage(seconds), rank, STAGES, torch.device("cpu"))
        one_f_one_b = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=lambda out, _: out.sum())
        torch_step = (
            functools.partial(one_f_one_b.step, batch)
            if rank == 0
            else functools.partial(one_f_one_b.step, target=batch)
        )
        result[("torch", micros)] = _time(torch_step, args)
    dist.destroy_process_group()
    out.put((rank, result))


def _time(step: Any, args: argparse.Namespace) -> float:
    times = []
    for index in range(args.warmup + args.steps):
        dist.barrier()  # both stages start each step together
        start = time.perf_counter()
        step()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute-us", type=lambda s: [int(v) for v in s.split(",")], default=[0, 200, 1000])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    bench.describe_machine()
    best: dict = {}
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for key, seconds in bench.slowest(bench.spawn(_rank, STAGES, args)).items():
            best[key] = min(best.get(key, float("inf")), seconds)
    rows = []
    print(f"{'C us':>6} {'ideal ms':>9} {'ours ms':>8} {'of ideal':>8} {'torch ms':>9} {'of ideal':>8}")
    for micros in args.compute_us:
        ideal = (args.microbatches + STAGES - 1) * 2 * micros * 1e-6
        row = {"compute_us": micros, "ideal_s": ideal}
        row.update({f"{kind}_s": best[(kind, micros)] for kind in ("ours", "torch")})
        rows.append(row)
        fractions = [f"{ideal / row[k]:8.2f}" if micros else f"{'-':>8}" for k in ("ours_s", "torch_s")]
        print(
            f"{micros:>6} {ideal * 1e3:9.2f} {row['ours_s'] * 1e3:8.2f} {fractions[0]} "
            f"{row['torch_s'] * 1e3:9.2f} {fractions[1]}"
        )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(bench.record(rows, args), handle, indent=2)


if __name__ == "__main__":
    main()
