"""What activation checkpointing saves and costs: a GPT trained with and without `smp.set_activation_checkpointing`.

Each mode trains the nanoGPT-style GPT of `benchmarks/gpt.py` for a few steps through `Trainer.fit` with
`SMPStrategy` (fp32 on the CPU, fp16 with fp32 masters on a GPU), in a fresh process, so that the memory figure
is that mode's alone: on the CPU the peak resident memory of the process (``ru_maxrss``: the Python runtime,
weights, optimizer state and activations) and its growth from the start of training (the optimizer state and
the activations; the allocator keeps some freed memory, so it is an upper bound), on a GPU the peak of
``torch.cuda.max_memory_allocated``. Time is the median step after the warm-up. "plain" keeps every
activation; "checkpointed" marks the transformer blocks (each its own checkpoint), which then keep only their
inputs and run their forward again in backward; "offloaded" also keeps those inputs in host memory until their
backward (``offload_activations=True``, the default ``activation_loading_horizon`` of 4).

    python benchmarks/activation_memory.py                       # CPU default: 8 layers, 256 wide, 16 x 256 tokens
    python benchmarks/activation_memory.py --out memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_smp import SMPStrategy, smp

try:
    from benchmarks.gpt import GPTConfig, GPTModule
    from benchmarks.pipeline_bench import record
    from benchmarks.precision_bench import make_batches
except ImportError:  # run as `python benchmarks/activation_memory.py` without the repo root on sys.path
    from gpt import GPTConfig, GPTModule
    from pipeline_bench import record
    from precision_bench import make_batches

MODES = ("plain", "checkpointed", "offloaded")
SETTINGS = ("layers", "heads", "width", "block", "batch", "vocab", "steps", "warmup")  # what a child is given


class _CheckpointedGPT(GPTModule):
    def configure_model(self) -> None:
        super().configure_model()
        smp.set_activation_checkpointing(self.model.transformer.h)  # an nn.ModuleList: each block on its own


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.rss_at_start = 0  # bytes resident once the model and optimizer are set up (CPU)

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not torch.cuda.is_available():
            with open("/proc/self/statm") as statm:
                self.rss_at_start = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode, in this process: fit the warm-up and timed steps; report peak memory and the median step time."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    config = GPTConfig(
        n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.block, vocab_size=args.vocab
    )
    module = (GPTModule if mode == "plain" else _CheckpointedGPT)(config)
    total = args.warmup + args.steps
    batches = make_batches(config, args.batch, total + 1, seed=0, pin=cuda)
    times = _StepTimes()
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=SMPStrategy(fp16=cuda, offload_activations=mode == "offloaded"),
        max_steps=total + 1,  # the last step's start closes the last timed step
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[times],
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    steps = [b - a for a, b in zip(times.starts, times.starts[1:], strict=False)][args.warmup :]
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "mode": mode,
        "memory": "cuda max_memory_allocated" if cuda else "peak RSS",
        "peak_mib": peak / 2**20,
        "growth_mib": (peak - times.rss_at_start) / 2**20 if not cuda else None,  # what training added (CPU)
        "ms_per_step": 1000 * statistics.median(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--block", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, default=None, help="run one mode here and print its JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args)))
        return
    rows = []
    for mode in MODES:
        command = [sys.executable, __file__, "--mode", mode, *(f"--{name}={getattr(args, name)}" for name in SETTINGS)]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    plain = rows[0]
    print(f"{'mode':<14}{'peak MiB':>10}{'growth MiB':>12}{'ms/step':>10}   ({plain['memory']})")
    for row in rows:
        growth = "-" if row["growth_mib"] is None else f"{row['growth_mib']:.0f}"
        print(f"{row['mode']:<14}{row['peak_mib']:>10.0f}{growth:>12}{row['ms_per_step']:>10.1f}")
    for row in rows[1:]:
        saved = plain["peak_mib"] - row["peak_mib"]
        slower = row["ms_per_step"] / plain["ms_per_step"]
        print(f"{row['mode']}: {saved:.0f} MiB less than plain ({saved / plain['peak_mib']:.0%}), steps x{slower:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(record(rows, args), indent=2))


if __name__ == "__main__":
    main()
