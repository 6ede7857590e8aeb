"""Pipeline efficiency of SMPStrategy(pipeline_parallel_degree=2) against the ideal, and against torch's own
schedules on the same split — all ratios measured in one run, on CPU with one thread per process.

Model: ``--blocks`` MLP blocks (Linear(width, width) + ReLU), MSE loss, SGD; a batch of ``--batch`` rows cut
into m microbatches (m = ``--microbatches``, default 2, 4, 8). Per m, the seconds per training step of:

- ``single``: one process on one core running the m microbatches one after another (gradient accumulation),
  the whole model; plain PyTorch, so it carries no framework overhead (the strictest baseline);
- ``half``: two independent single-thread processes at the same time, each with half the model and no
  communication, each doing its half's share of ``single``'s work: the second half's input requires grad, as
  it does inside the whole model (its first layer's input gradient is part of the whole's backward), so the two
  halves together compute exactly what ``single`` computes. ``B = single / half`` is the most two processes can
  give on this machine (not 2: shared memory bandwidth and caches), and the ideal pipeline speed-up is
  ``B * m / (m + p - 1)`` with p = 2 stages;
- ``smp_1f1b`` / ``smp_gpipe``: a real ``Trainer.fit`` with ``SMPStrategy(pipeline_parallel_degree=2,
  microbatches=m, pipeline="interleaved" | "simple")`` (GPipe with ``active_microbatches=m``), Lightning's
  loop, hooks and the optimizer step included; timed from one ``on_train_batch_start`` to the next;
  ``smp_virtual2`` the same with ``virtual_stages=2`` (two chunks per rank: its ideal bubble is half, so it can
  exceed 1.0 of the plain ideal, at twice the messages); ``smp_zb`` with ``pipeline="zero_bubble"`` (ZB-H1: each
  backward split into input and weight gradients, the weight gradients filling the bubble: a third of 1F1B's);
- ``torch_gpipe`` / ``torch_1f1b``: ``torch.distributed.pipelining`` (PipelineStage, ScheduleGPipe /
  Schedule1F1B) on the same two halves, gloo, the same optimizer step; ``torch_zb``:
  ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB-H1's shape) on the same halves; ``torch_zbv``:
  ``ScheduleZBVZeroBubble``, the blocks cut into four chunks, two per rank in a V (rank 0 holds the first and the
  last, so the loss is on rank 0).

Each is the median step time over ``--steps`` steps after ``--warmup``, the best of ``--rounds`` rounds (rounds
run the kinds in turn, so drift of a shared machine hits them alike). Printed: step times, speed-ups over
``single``, and each pipeline's speed-up as a fraction of the ideal. ``--pipelines`` times only those named
(``single`` and ``half`` always run: the ideal needs them). ``--out`` writes the JSON.

    python benchmarks/pipeline_bench.py --out pipeline_bench.json
    python benchmarks/pipeline_bench.py --microbatches 8 --pipelines smp_1f1b,smp_zb,torch_zb
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

STAGES = 2
_SMP = {  # name: (pipeline, GPipe's active_microbatches=m, virtual_stages)
    "smp_1f1b": ("interleaved", False, 1),
    "smp_gpipe": ("simple", True, 1),
    "smp_virtual2": ("interleaved", False, 2),
    "smp_zb": ("zero_bubble", False, 1),
}
_TORCH = ("torch_1f1b", "torch_gpipe", "torch_zb", "torch_zbv")
PIPELINES = (*_SMP, *_TORCH)
"""The pipelines a round can time (see the module docstring); ``--pipelines`` picks some."""


def blocks_model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)))


def blocks_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=generator), torch.randn(
        args.batch, args.width, generator=generator
    )


def time_steps(step: Callable[[], None], args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- the kinds ----------------------------------------------------------------------------------------------------


def _accumulate(model: nn.Module, args: argparse.Namespace, microbatches: int, input_grad: bool = False) -> float:
    """Seconds per step of ``model`` over the m microbatches one after another (gradient accumulation);
    ``input_grad``: the input requires grad, as a pipeline stage's received activation does."""
    x, y = blocks_data(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    inputs = [piece.clone().requires_grad_(input_grad) for piece in x.chunk(microbatches)]
    pieces = list(zip(inputs, y.chunk(microbatches), strict=True))

    def step() -> None:
        optimizer.zero_grad()
        for xs, ys in pieces:
            (nn.functional.mse_loss(model(xs), ys) / microbatches).backward()
        optimizer.step()

    return time_steps(step, args)


def _single(rank: int, args: argparse.Namespace, out: Any) -> None:
    out.put({m: _accumulate(blocks_model(args.width, args.blocks), args, m) for m in args.microbatches})


def _half(rank: int, args: argparse.Namespace, out: Any, barrier: Any) -> None:
    half = args.blocks // STAGES
    model = blocks_model(args.width, args.blocks)[rank * half : (rank + 1) * half]
    result = {}
    for m in args.microbatches:
        barrier.wait()  # both halves run at the same time, as pipeline stages would
        result[m] = _accumulate(model, args, m, input_grad=rank > 0)
    out.put((rank, result))


def fit_blocks(
    args: argparse.Namespace,
    strategy: Any,
    steps: int,
    callbacks: list | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda params: torch.optim.SGD(params, lr=1e-4),
    devices: int = STAGES,
) -> None:
    """A real ``Trainer.fit`` of the blocks (MSE loss, SGD unless ``optimizer`` makes another from the parameters)
    on ``devices`` CPU ranks under ``strategy``, ``steps`` steps of the same batch, printing and writing nothing;
    `pipeline_timeline.py` times the same run, `zero1_bench.py` the same with AdamW."""
    import lightning.pytorch as pl

    class Blocks(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks_model(args.width, args.blocks)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.blocks(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.parameters())

    trainer = quiet_trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, callbacks=callbacks)
    loader = torch.utils.data.DataLoader([blocks_data(args)] * steps, batch_size=None)
    trainer.fit(Blocks(), train_dataloaders=loader)


def quiet_trainer(**trainer_kwargs: Any) -> Any:
    """A Trainer that prints and writes nothing (no logger, checkpoint, progress bar or model summary) and takes
    each batch as its loader gives it (no distributed sampler): the step is all a benchmark times."""
    import lightning.pytorch as pl

    return pl.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **trainer_kwargs,
    )


def timed_fit(
    args: argparse.Namespace,
    strategy: Any,
    *,
    clocks: tuple[Callable[[], float], ...] = (time.perf_counter,),
    **fit_options: Any,
) -> list[float]:
    """`fit_blocks` for ``--warmup`` + ``--steps`` steps; per clock (wall time by default; ``time.process_time`` for
    this process's CPU seconds, all its threads), the median seconds from one ``on_train_batch_start`` to the next
    over the steps after warm-up (Lightning's loop, hooks and the optimizer step included)."""
    from lightning.pytorch.callbacks import Callback

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.starts: list[list[float]] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append([clock() for clock in clocks])

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.starts.append([clock() for clock in clocks])

    timer = StepTimes()
    fit_blocks(args, strategy, args.warmup + args.steps, callbacks=[timer], **fit_options)
    steps = list(zip(timer.starts, timer.starts[1:], strict=False))[args.warmup :]
    return [statistics.median(end[i] - start[i] for start, end in steps) for i in range(len(clocks))]


def _smp(rank: int, args: argparse.Namespace, out: Any) -> None:
    from lightning_smp import SMPStrategy

    result = {}
    for name in args.pipelines:
        if name not in _SMP:
            continue
        pipeline, active, virtual_stages = _SMP[name]
        for m in args.microbatches:
            strategy = SMPStrategy(
                pipeline_parallel_degree=STAGES,
                microbatches=m,
                pipeline=pipeline,
                active_microbatches=m if active else None,
                virtual_stages=virtual_stages,
            )
            (result[(name, m)],) = timed_fit(args, strategy)
    out.put((rank, result))


def _torch(rank: int, args: argparse.Namespace, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    model = blocks_model(args.width, args.blocks)
    half, quarter = args.blocks // STAGES, args.blocks // (2 * STAGES)
    module = model[rank * half : (rank + 1) * half]
    # ZB-V: four chunks in a V, rank 0 holding chunks 0 and 3, rank 1 chunks 1 and 2
    v_chunks = (rank, 2 * STAGES - 1 - rank)
    v_modules = [model[c * quarter : (c + 1) * quarter] for c in v_chunks]
    x, y = blocks_data(args)
    device = torch.device("cpu")
    result = {}
    for name in args.pipelines:
        if name not in _TORCH:
            continue
        held = v_modules if name == "torch_zbv" else [module]
        optimizer = torch.optim.SGD([p for m in held for p in m.parameters()], lr=1e-4)
        for m in args.microbatches:
            if name == "torch_zbv":
                stages = [PipelineStage(v, c, 2 * STAGES, device) for v, c in zip(v_modules, v_chunks, strict=True)]
                schedule = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=nn.functional.mse_loss)
                first, last = rank == 0, rank == 0  # the V: rank 0 holds the first and the last chunk
            else:
                stage = PipelineStage(module, rank, STAGES, device)
                if name == "torch_zb":
                    schedule = ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=nn.functional.mse_loss)
                else:
                    make = ScheduleGPipe if name == "torch_gpipe" else Schedule1F1B
                    schedule = make(stage, n_microbatches=m, loss_fn=nn.functional.mse_loss)
                first, last = rank == 0, rank == STAGES - 1

            def step(schedule: Any = schedule, first: bool = first, last: bool = last, optimizer: Any = optimizer):
                optimizer.zero_grad()
                schedule.step(*([x] if first else []), **({"target": y} if last else {}))
                optimizer.step()

            result[(name, m)] = time_steps(step, args)
    dist.destroy_process_group()
    out.put((rank, result))


# -- orchestration ------------------------------------------------------------------------------------------------

# Every rank is forked from a server that imported these once, instead of a fresh interpreter importing them again
# (~10 s of CPU per rank for Lightning); the ranks still share no state with each other or with earlier ranks.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_smp"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, at the first rank
    return ctx


def spawn(
    target: Callable[..., None], processes: int, args: argparse.Namespace, *extra: Any, env: dict | None = None
) -> list:
    ctx = _context()
    out = ctx.Queue()
    port = _free_port()
    children = []
    for rank in range(processes):
        child_env = {
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(processes),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(processes),
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            **(env or {}),
        }
        child = ctx.Process(target=_child, args=(target, rank, child_env, args, out, *extra))
        child.start()
        children.append(child)
    results = []
    deadline = time.monotonic() + args.timeout
    while len(results) < processes:
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            failed = [child.exitcode for child in children if child.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:  # a rank died (its error is on stderr) or the run hangs
                for child in children:
                    child.kill()
                reason = f"a rank exited with {failed[0]}" if failed else f"no result in {args.timeout:.0f} s"
                raise RuntimeError(f"{getattr(target, '__name__', target)}: {reason}") from None
    for child in children:
        child.join(timeout=30)
    return results


def _child(target: Callable[..., None], rank: int, env: dict, args: argparse.Namespace, out: Any, *extra: Any) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    target(rank, args, out, *extra)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slowest(per_rank: list, kinds_key: Callable[[Any], Any] = lambda r: r[1]) -> dict:
    """A pipeline step ends when its slowest rank's does: the max over ranks of each entry."""
    merged: dict = {}
    for item in per_rank:
        for key, value in kinds_key(item).items():
            merged[key] = max(merged.get(key, 0.0), value)
    return merged


def describe_machine() -> None:
    """Print the core counts first: every figure is a ratio of what the ranks' cores do, so it belongs to them."""
    info = machine()
    print(
        f"{info['processor']}: {info['cpu_count']} cores, {info['cpu_affinity_count']} usable here; "
        f"one thread per process; torch {info['torch']}",
        file=sys.stderr,
        flush=True,
    )


def measure(args: argparse.Namespace) -> dict:
    best: dict = {}

    def keep(key: Any, seconds: float) -> None:
        best[key] = min(best.get(key, float("inf")), seconds)

    torchelastic = {"TORCHELASTIC_RUN_ID": "bench"}  # Lightning then takes the ranks as launched, like torchrun
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for m, seconds in spawn(_single, 1, args)[0].items():
            keep(("single", m), seconds)
        barrier = _context().Barrier(STAGES)
        for m, seconds in slowest(spawn(_half, STAGES, args, barrier)).items():
            keep(("half", m), seconds)
        for kinds, target, env in ((_SMP, _smp, torchelastic), (_TORCH, _torch, None)):
            if any(name in args.pipelines for name in kinds):
                for key, seconds in slowest(spawn(target, STAGES, args, env=env)).items():
                    keep(key, seconds)
    return best


def report(best: dict, args: argparse.Namespace) -> dict:
    pipelines = args.pipelines
    rows = []
    for m in args.microbatches:
        single, half = best[("single", m)], best[("half", m)]
        bound = single / half
        ideal = bound * m / (m + STAGES - 1)
        row = {"microbatches": m, "single_s": single, "half_s": half, "B": bound, "ideal_speedup": ideal}
        for name in pipelines:
            speedup = single / best[(name, m)]
            row[f"{name}_s"] = best[(name, m)]
            row[f"{name}_speedup"] = speedup
            row[f"{name}_of_ideal"] = speedup / ideal
        for other in ("smp_1f1b", "torch_zb"):
            if "smp_zb" in pipelines and other in pipelines:
                row[f"smp_zb_over_{other}"] = best[("smp_zb", m)] / best[(other, m)]
        rows.append(row)
    header = f"{'m':>3} {'single ms':>10} {'B':>5} {'ideal':>6} " + " ".join(f"{n:>18}" for n in pipelines)
    print(header)
    for row in rows:
        cells = " ".join(
            f"{row[f'{n}_s'] * 1e3:7.1f}ms {row[f'{n}_of_ideal']:5.2f}/{row[f'{n}_speedup']:4.2f}" for n in pipelines
        )
        first = f"{row['microbatches']:>3} {row['single_s'] * 1e3:10.1f} {row['B']:5.2f} {row['ideal_speedup']:6.2f}"
        print(f"{first} {cells}")
    print("(each pipeline: step time, fraction of the ideal speed-up / speed-up over `single`)")
    for row in rows:
        ratios = [
            f"/ {other} step = {row[key]:.3f}"
            for other in ("smp_1f1b", "torch_zb")
            if (key := f"smp_zb_over_{other}") in row
        ]
        if ratios:
            print(f"m={row['microbatches']}: smp_zb step " + ", ".join(ratios))
    return record(rows, args)


def machine() -> dict:
    """The machine a run measures on: its CPU, its cores (all of them, and those this process may run on: a
    container or ``taskset`` can allow fewer), torch and Python. Every rank runs one thread, whatever the count."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "processor": _processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity_count": usable,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _processor() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, where `platform.processor` says only "x86_64")."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor()


def parse_pipelines(text: str) -> list[str]:
    """``--pipelines``: names from PIPELINES, comma-separated; returned in PIPELINES' order, each once."""
    names = text.split(",")
    unknown = [name for name in names if name not in PIPELINES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown pipeline(s) {', '.join(unknown)}; choose from {', '.join(PIPELINES)}"
        )
    return [name for name in PIPELINES if name in names]


def record(rows: list[dict], args: argparse.Namespace) -> dict:
    """A run's rows with the date, machine, command and settings that produced them (the JSON of ``--out``)."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--pipelines",
        type=parse_pipelines,
        default=list(PIPELINES),
        help="a comma-separated subset of: " + ", ".join(PIPELINES),
    )
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    describe_machine()
    result = report(measure(args), args)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
