"""The same layout through each door: a step of Lightning's Trainer (`SMPStrategy`), of an smp v1 script
(``smp.init``, ``smp.DistributedModel``, ``@smp.step``) and, where it exists, of a Lightning Fabric loop
(``L.Fabric(strategy=...)``), two CPU ranks, one thread each, gloo. The three run the same step engine, so their
step times should match: the doors add no copies and no extra collectives.

Model and data: ``--blocks`` torch transformer layers (``nn.TransformerEncoderLayer``, width ``--width``, 4 heads,
built under ``smp.model_creation(tensor_parallelism=...)``) over a batch of ``--batch`` sequences of ``--seq``
vectors per rank, MSE loss against a fixed target, AdamW. Layouts (``--layouts``): ``pp2`` (two pipeline stages,
``--microbatches`` microbatches, 1F1B interleaved, smp's default) and ``tp2`` (two tensor-parallel ranks, each
reading its own batch and the pair training on their union, smp's ``prescaled_batch=False``).

Per door and layout, the median seconds per training step over ``--steps`` steps after ``--warmup`` (the whole
step: forward, backward, gradient reduction, optimizer step; the Trainer's loop and hooks included, timed from one
``on_train_batch_start`` to the next; a script's or Fabric loop's from one iteration to the next), the slower
rank's, the best of ``--rounds`` rounds (each round runs every door in turn, so the drift of a shared machine hits
them alike). Printed: the step times and each door's ratio to the Trainer's. ``--out`` writes the JSON (with the
machine, command and date).

    python benchmarks/doors_bench.py --out doors_bench.json
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
    from benchmarks import pipeline_bench as bench
except ImportError:  # run as `python benchmarks/doors_bench.py`
    import pipeline_bench as bench

RANKS = 2
LAYOUTS = {"pp2": {"pipeline_parallel_degree": 2}, "tp2": {"tensor_parallel_degree": 2}}
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

    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
        return Layers(args)


def _data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq, args.width)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _settings(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    microbatches = args.microbatches if layout == "pp2" else 1
    return {**LAYOUTS[layout], "microbatches": microbatches}


def _median_step(starts: list[float], args: argparse.Namespace) -> float:
    steps = [end - start for start, end in itertools.pairwise(starts)][args.warmup :]
    return statistics.median(steps)


def _trainer(rank: int, args: argparse.Namespace, out: Any, layout: str) -> None:
    import lightning.pytorch as pl

    from lightning_smp import SMPStrategy, smp

    starts: list[float] = []

    class Module(pl.LightningModule):
        def configure_model(self) -> None:
            self.model = _model(args)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            starts.append(time.perf_counter())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def on_train_end(self) -> None:
            starts.append(time.perf_counter())

    steps = args.warmup + args.steps + 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=SMPStrategy(**_settings(args, layout)),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader([_data(args)] * steps, batch_size=None))
    assert smp.tp_size() == LAYOUTS[layout].get("tensor_parallel_degree", 1)
    out.put((rank, _median_step(starts[1:], args)))


def _script(rank: int, args: argparse.Namespace, out: Any, layout: str) -> None:
    from lightning_smp import smp

    smp.init(_settings(args, layout))
    model = smp.DistributedModel(_model(args))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = _data(args)
    starts = []
    for _ in range(args.warmup + args.steps + 1):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        train_step(model, x, y).reduce_mean()
        optimizer.step()
    starts.append(time.perf_counter())
    out.put((rank, _median_step(starts[1:], args)))


def _fabric(rank: int, args: argparse.Namespace, out: Any, layout: str) -> None:
    import lightning as L

    from lightning_smp.fabric import SMPFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=RANKS, strategy=SMPFabricStrategy(**_settings(args, layout)))
    fabric.launch()
    model = fabric.setup_module(_model(args))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    x, y = _data(args)
    starts = []
    for _ in range(args.warmup + args.steps + 1):
        starts.append(time.perf_counter())
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    starts.append(time.perf_counter())
    out.put((rank, _median_step(starts[1:], args)))


_DOORS = {"trainer": _trainer, "script": _script, "fabric": _fabric}


def measure(args: argparse.Namespace) -> dict[tuple[str, str], float]:
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for layout in args.layouts:
            for door in args.doors:
                if door == "fabric" and layout == "pp2":
                    continue  # pipelines under Fabric run through smp.step: the script door's figure
                per_rank = bench.spawn(_DOORS[door], RANKS, args, layout)
                seconds = max(value for _, value in per_rank)  # a step ends when the slower rank's does
                best[(door, layout)] = min(best.get((door, layout), float("inf")), seconds)
    return best


def report(best: dict[tuple[str, str], float], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for layout in args.layouts:
        row: dict[str, Any] = {"layout": layout, **_settings(args, layout)}
        trainer = best[("trainer", layout)]
        for door in args.doors:
            if (door, layout) not in best:
                continue
            row[f"{door}_s"] = best[(door, layout)]
            row[f"{door}_over_trainer"] = best[(door, layout)] / trainer
            print(f"{layout}: {door} {best[(door, layout)] * 1e3:.1f} ms/step ({row[f'{door}_over_trainer']:.3f}x)")
        rows.append(row)
    return {"rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8, help="under pp2")
    parser.add_argument("--layouts", type=lambda text: text.split(","), default=list(LAYOUTS))
    parser.add_argument("--doors", type=lambda text: text.split(","), default=list(DOORS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=str, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench.describe_machine()
    result = bench.record(report(measure(args), args)["rows"], args)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
