"""How long a checkpoint save stalls training: a saving step against a normal step, synchronous against
``SMPStrategy(async_checkpoint=True)``.

The model is `memory_scale.py`'s GPT (``--size full``: the 166M GPT of the memory benchmark, untied head) under pp2
with fp16, fp32 masters and AdamW, two CPU ranks that Lightning launches from a fresh process per kind, one thread
each. ``ModelCheckpoint(every_n_train_steps=--save-every)`` saves the whole training state (each stage writes its
fp32 masters and AdamW moments) to a temporary directory. Rank 0 times every step from one
``on_train_batch_start`` to the next, so a step's time includes the save made at its end. Per kind:

- ``normal``: the median time of the steps that did not save (the first ``--warmup`` steps left out);
- ``saving``: the median time of the steps that saved;
- ``stall``: ``saving - normal``, the time a save adds to its step; ``async / sync`` is the ratio of the stalls;
- ``after``: the median time of the steps that follow a saving step, while an asynchronous save is written (on
  a machine with as many cores as ranks, the writer thread takes them from training).

    python benchmarks/checkpoint_stall.py                          # the 166M GPT, pp2
    python benchmarks/checkpoint_stall.py --size smoke --steps 6   # a tiny GPT, for tests
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy

try:
    from benchmarks.memory_scale import SIZES, ScaleGPT, strategy_kwargs
    from benchmarks.pipeline_bench import record
except ImportError:  # run as `python benchmarks/checkpoint_stall.py`
    from memory_scale import SIZES, ScaleGPT, strategy_kwargs
    from pipeline_bench import record

KINDS = ("sync", "async")


class _Steps(Callback):
    """Rank 0's step start times; which steps saved; written to ``path`` at the end."""

    def __init__(self, path: str) -> None:
        self.path, self.starts, self.saved = path, [], []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        self.saved.append(len(self.starts) - 1)  # the step whose end saves

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        self.starts.append(time.perf_counter())  # the last step's end (an asynchronous save may still run)
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"starts": self.starts, "saved": self.saved}))


def run_kind(kind: str, size: str, steps: int, save_every: int, path: str) -> None:
    """One kind, in this process and the rank Lightning launches from it."""
    torch.set_num_threads(1)
    shape = SIZES[size]
    tokens = torch.randint(0, shape["vocab"], (steps * shape["batch"], shape["seq"] + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=shape["batch"])
    with tempfile.TemporaryDirectory() as directory:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=SMPStrategy(
                **strategy_kwargs("pp2"), dynamic_loss_args={"init_scale": 2.0**8}, async_checkpoint=kind == "async"
            ),
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[_Steps(path), ModelCheckpoint(dirpath=directory, every_n_train_steps=save_every)],
        )
        model = ScaleGPT(**{k: v for k, v in shape.items() if k != "batch"}, tied=False)
        trainer.fit(model, data)


def summarise(kind: str, timing: dict[str, Any], warmup: int) -> dict[str, Any]:
    starts, saved = timing["starts"], set(timing["saved"])
    seconds = [b - a for a, b in itertools.pairwise(starts)]
    counted = range(warmup, len(seconds))
    normal = [seconds[i] for i in counted if i not in saved and i - 1 not in saved]
    after = [seconds[i] for i in counted if i - 1 in saved and i not in saved]
    saving = [seconds[i] for i in counted if i in saved]
    row = {"kind": kind, "normal": statistics.median(normal), "saving": statistics.median(saving)}
    row["after"] = statistics.median(after) if after else None
    row["stall"] = row["saving"] - row["normal"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--run-kind", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--timing", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_kind:
        run_kind(args.run_kind, args.size, args.steps, args.save_every, args.timing)
        return
    rows = []
    for kind in KINDS:
        with tempfile.NamedTemporaryFile(suffix=".json") as timing:
            command = [sys.executable, __file__, "--run-kind", kind, "--timing", timing.name]
            command += ["--size", args.size, "--steps", str(args.steps), "--save-every", str(args.save_every)]
            subprocess.run(command, check=True)
            rows.append(summarise(kind, json.loads(Path(timing.name).read_text()), args.warmup))
    ratio = rows[1]["stall"] / rows[0]["stall"] if rows[0]["stall"] > 0 else float("nan")
    for row in rows:
        after = f"{row['after']:.3f}" if row["after"] is not None else "-"
        print(
            f"{row['kind']:>5}: normal step {row['normal']:.3f} s, saving step {row['saving']:.3f} s, "
            f"stall {row['stall']:.3f} s, step after a save {after} s"
        )
    print(f"stall async / sync: {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({**record(rows, args), "stall_ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
