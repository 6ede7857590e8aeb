"""The same layout through each door: a step of Lightning's Trainer (`SMPStrategy`), of an smp v1 script
(``smp.init``, ``smp.DistributedModel``, ``@smp.step``) and, where it exists, of a Lightning Fabric loop
(``L.Fabric(strategy=...)``). The three run the same step engine, so their step times should match: the doors add
no copies and no extra collectives.

Model and data (``--model``): ``layers``, ``--blocks`` torch transformer layers (``nn.TransformerEncoderLayer``,
width ``--width``, 4 heads, built under ``smp.model_creation(tensor_parallelism=...)``) over a batch of ``--batch``
sequences of ``--seq`` vectors per rank, MSE loss against a fixed target; or ``gpt``, the precision benchmark's
nanoGPT-style GPT-2 (``--size``, benchmarks/gpt.py) over ``--batch`` random sequences of its block size, next-token
cross-entropy. AdamW (fused on a GPU). Layouts (``--layouts``): ``pp2`` (two pipeline stages, ``--microbatches``
microbatches, 1F1B interleaved, smp's default) and ``tp2`` (two tensor-parallel ranks, each reading its own batch
and the pair training on their union, smp's ``prescaled_batch=False``), two CPU ranks, one thread each, gloo; and
``one``, one process on one device (``--accelerator cuda``: the GPU), where the doors differ only in the host work
around the same step. ``--fp16``: fp16 parameters with fp32 masters and smp's dynamic loss scale, in every door.

Per door and layout, the seconds per training step over ``--steps`` steps after ``--warmup`` (the whole step:
forward, backward, gradient reduction, optimizer step; the Trainer's loop and hooks included, timed from one
``on_train_batch_start`` to the next; a script's or Fabric loop's from one iteration to the next): on the CPU the
median step, the slower rank's; on a GPU the timed steps' mean, from a ``torch.cuda.synchronize()`` before the
first to one after the last (so the device's queue is counted, not the host's launches). The best of ``--rounds``
rounds (each round runs every door in turn, so the drift of a shared machine hits them alike). Each door also
reports its last step's loss, the steps its loss scale skipped and, on a GPU, its peak memory: the same in every
door, as they train the same model on the same data. Printed: the step times and each door's ratio to the
Trainer's. ``--out`` writes the JSON (with the machine, command and date).

    python benchmarks/doors_bench.py --out doors_bench.json
    python benchmarks/doors_bench.py --accelerator cuda --layouts one --model gpt --size 124m --batch 16 --fp16 \
        --steps 30 --warmup 20 --rounds 2 --out doors_gpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

try:
    from benchmarks import gpt as gpt_model
    from benchmarks import pipeline_bench as bench
except ImportError:  # run as `python benchmarks/doors_bench.py`
    import gpt as gpt_model
    import pipeline_bench as bench

LAYOUTS = {
    "one": {},
    "pp2": {"pipeline_parallel_degree": 2},
    "tp2": {"tensor_parallel_degree": 2},
}
FABRIC = importlib.util.find_spec("lightning_smp.fabric") is not None
DOORS = ("trainer", "script", *(("fabric",) if FABRIC else ()))


class Layers(nn.Module):
    """The benchmark's model: a trunk of torch transformer layers (the pipeline splits ``layers``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(args.width, 4, 4 * args.width, dropout=0.0, batch_first=True)
                for _ in range(args.blocks)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _model(args: argparse.Namespace) -> nn.Module:
    from lightning_smp import smp

    torch.manual_seed(0)  # built on the CPU in every door (a Trainer's configure_model runs on the device)
    with torch.device("cpu"), smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
        if args.model == "gpt":
            return gpt_model.GPT(gpt_model.GPTConfig.preset(args.size))
        return Layers(args)


def _data(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if args.model == "gpt":
        config = gpt_model.GPTConfig.preset(args.size)
        tokens = torch.randint(config.vocab_size, (args.batch, config.block_size + 1), generator=generator)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    shape = (args.batch, args.seq, args.width)
    return torch.randn(shape, generator=generator).to(device), torch.randn(shape, generator=generator).to(device)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.dim() == target.dim() + 1:  # logits over the vocabulary: next-token cross-entropy in fp32
        return nn.functional.cross_entropy(output.float().flatten(0, 1), target.flatten())
    return nn.functional.mse_loss(output.float(), target)


def _optimizer(params: Any, device: torch.device) -> torch.optim.Optimizer:
    on_cuda = device.type == "cuda"  # fused: one kernel for the update, as the precision benchmark's GPT
    return torch.optim.AdamW(params, lr=1e-4, fused=on_cuda, foreach=not on_cuda)


def _settings(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    microbatches = args.microbatches if layout == "pp2" else 1
    return {**LAYOUTS[layout], "microbatches": microbatches, "fp16": args.fp16}


def _ranks(layout: str) -> int:
    return 1 if layout == "one" else 2


class _Clock:
    """Step boundaries as one door sees them: ``tick()`` at each step's start and once after the last."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.warmup = args.warmup
        self.last = args.warmup + args.steps  # the tick after the last step
        self.cuda = device.type == "cuda"
        self.ticks: list[float] = []

    def tick(self) -> None:
        if self.cuda and len(self.ticks) in (self.warmup, self.last):
            torch.cuda.synchronize()  # the first timed step starts; the last one ended
        self.ticks.append(time.perf_counter())

    def seconds_per_step(self) -> float:
        """The median timed step on the CPU; on a GPU the mean, between the two synchronizations."""
        timed = self.ticks[self.warmup :]
        if self.cuda:
            return (timed[-1] - timed[0]) / (len(timed) - 1)
        return statistics.median(end - start for start, end in itertools.pairwise(timed))


def _result(rank: int, clock: _Clock, loss: torch.Tensor, skipped: Any) -> tuple[int, dict[str, float]]:
    result = {"seconds": clock.seconds_per_step(), "loss": float(loss), "skipped": float(skipped)}
    if clock.cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return rank, result


def _device(rank: int, args: argparse.Namespace) -> torch.device:
    return torch.device("cuda", rank) if args.accelerator == "cuda" else torch.device("cpu")


def _trainer(rank: int, args: argparse.Namespace, out: Any, layout: str) -> None:
    import lightning.pytorch as pl

    from lightning_smp import SMPStrategy, smp

    device = _device(rank, args)
    clock = _Clock(args, device)

    class Module(pl.LightningModule):
        def configure_model(self) -> None:
            self.model = _model(args)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            clock.tick()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.last_loss = _loss(self.model(x), y)
            return self.last_loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.parameters(), self.device)

        def on_train_end(self) -> None:
            clock.tick()

    steps = args.warmup + args.steps
    trainer = bench.quiet_trainer(
        accelerator=args.accelerator,
        devices=_ranks(layout),
        strategy=SMPStrategy(**_settings(args, layout)),
        max_steps=steps,
    )
    module = Module()
    data = _data(args, torch.device("cpu"))  # the Trainer moves each batch to the device
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([data] * steps, batch_size=None))
    assert smp.tp_size() == LAYOUTS[layout].get("tensor_parallel_degree", 1)
    masters = trainer.strategy.precision_plugin.master_weight_optimizers
    out.put(_result(rank, clock, module.last_loss, masters[0].skipped_steps if masters else 0))


def _script(rank: int, args: argparse.Namespace, out: Any, layout: str) -> None:
    from lightning_smp import smp

    smp.init(_settings(args, layout))
    device = _device(smp.local_rank(), args)
    model = smp.DistributedModel(_model(args))
    scaling = {"dynamic_loss_scale": True} if args.fp16 else {}  # smp's default is a static scale of 1.0
    optimizer = smp.DistributedOptimizer(_optimizer(model.parameters(), device), **scaling)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = _data(args, device)
    clock = _Clock(args, device)
    for _ in range(args.warmup + args.steps):
        clock.tick()
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        optimizer.step()
    clock.tick()
    out.put(_result(rank, clock, loss, optimizer.skipped_steps if args.fp16 else 0))


def _fabric(rank: int, args: argparse.Namespace, out: Any, layout: str) -> None:
    import lightning as L

    from lightning_smp.fabric import SMPFabricStrategy

    strategy = SMPFabricStrategy(**_settings(args, layout))
    fabric = L.Fabric(accelerator=args.accelerator, devices=_ranks(layout), strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_model(args))
    optimizer = fabric.setup_optimizers(_optimizer(model.parameters(), fabric.device))
    x, y = _data(args, fabric.device)
    clock = _Clock(args, fabric.device)
    for _ in range(args.warmup + args.steps):
        clock.tick()
        optimizer.zero_grad()
        loss = _loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
    clock.tick()
    out.put(_result(rank, clock, loss, optimizer.optimizer.skipped_steps if args.fp16 else 0))


_DOORS = {"trainer": _trainer, "script": _script, "fabric": _fabric}


def measure(args: argparse.Namespace) -> dict[tuple[str, str], dict[str, float]]:
    """Per (door, layout): the best round's step time (the slower rank's) with that round's loss, skipped steps and
    peak memory."""
    best: dict[tuple[str, str], dict[str, float]] = {}
    for _ in range(args.rounds):
        for layout in args.layouts:
            for door in args.doors:
                if door == "fabric" and layout == "pp2":
                    continue  # pipelines under Fabric run through smp.step: the script door's figure
                per_rank = [result for _, result in bench.spawn(_DOORS[door], _ranks(layout), args, layout)]
                slowest = max(per_rank, key=lambda result: result["seconds"])  # a step ends with the slower rank's
                print(f"{layout} {door}: " + ", ".join(f"{k} {v:.6g}" for k, v in slowest.items()), file=sys.stderr)
                if slowest["seconds"] < best.get((door, layout), {"seconds": float("inf")})["seconds"]:
                    best[(door, layout)] = slowest
    return best


def report(best: dict[tuple[str, str], dict[str, float]], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for layout in args.layouts:
        row: dict[str, Any] = {"layout": layout, **_settings(args, layout)}
        trainer = best[("trainer", layout)]["seconds"]
        for door in args.doors:
            if (door, layout) not in best:
                continue
            result = best[(door, layout)]
            row[f"{door}_s"] = result["seconds"]
            row[f"{door}_over_trainer"] = result["seconds"] / trainer
            row.update({f"{door}_{key}": value for key, value in result.items() if key != "seconds"})
            memory = f", peak {result['peak_gib']:.2f} GiB" if "peak_gib" in result else ""
            print(
                f"{layout}: {door} {result['seconds'] * 1e3:.2f} ms/step ({row[f'{door}_over_trainer']:.3f}x); "
                f"last loss {result['loss']:.6f}, {result['skipped']:.0f} skipped{memory}"
            )
        rows.append(row)
    return {"rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("layers", "gpt"), default="layers")
    parser.add_argument("--size", choices=tuple(gpt_model.PRESETS), default="tiny", help="the GPT's, --model gpt")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8, help="under pp2")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--layouts", type=lambda text: text.split(","), default=["pp2", "tp2"])
    parser.add_argument("--doors", type=lambda text: text.split(","), default=list(DOORS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args(argv)
    if args.accelerator == "cuda" and args.layouts != ["one"]:
        parser.error("--accelerator cuda runs the layout `one` only (--layouts one): NCCL refuses two ranks on one GPU")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench.describe_machine()
    result = bench.record(report(measure(args), args)["rows"], args)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
