"""Host memory of `export_hf` and `consolidate_checkpoint` on a 165M-parameter Llama's checkpoint, against its
largest tensor.

A Hugging Face ``LlamaForCausalLM`` (vocabulary 32000, width 1024, 8 layers of 16 heads with 4 key/value heads, MLP
3200, untied head: 165M parameters; its largest tensors, the embedding and the head, are 131 MB each in fp32) is
built under ``delayed_parameter_initialization``, trained one fp16 step under ``--layout`` (default pp2 x tp2,
Lightning launching the ranks; the figures in docs/benchmarks.md: tp2) and saved. Then each of ``export_hf`` (fp32,
as saved; and bf16) and ``consolidate_checkpoint`` runs in a fresh process with no allocator variables set, which
reports its peak resident memory above the RSS it had just before the call (Linux: ``/proc/self/status``'s VmHWM,
reset first), its time and its throughput. The goal: peak growth at most 1.2 x the largest tensor.

    python benchmarks/export_memory.py --layout tp2 --out export_memory.json   # the 165M Llama (minutes on a CPU)
    python benchmarks/export_memory.py --size smoke --layout 1                 # a tiny one: a quick check it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, consolidate_checkpoint, export_hf, smp

try:
    from benchmarks.pipeline_bench import describe_machine, record
except ImportError:  # run as `python benchmarks/export_memory.py` without the repo root on sys.path
    from pipeline_bench import describe_machine, record

SIZES: dict[str, dict[str, int]] = {
    "smoke": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    "full": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3200, "num_hidden_layers": 8},
}
HEADS = {"smoke": (4, 2), "full": (16, 4)}  # attention heads, key/value heads
LAYOUTS = {
    "1": {},
    "tp2": {"tensor_parallel_degree": 2},
    "pp2xtp2": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2},
}
WORKS = ("export_fp32", "export_bf16", "consolidate")


class Llama(L.LightningModule):
    def __init__(self, size: str) -> None:
        super().__init__()
        self.size = size
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        if self.model is not None:
            return
        heads, kv_heads = HEADS[self.size]
        config = LlamaConfig(**SIZES[self.size], num_attention_heads=heads, num_key_value_heads=kv_heads)
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, target = batch
        return F.cross_entropy(self.model(input_ids=ids).logits.float().flatten(0, 1), target.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def save(size: str, layout: str, path: str) -> None:
    """Train one step and save, in this process and the ranks Lightning launches from it."""
    torch.set_num_threads(1)
    tokens = torch.randint(0, SIZES[size]["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(0))
    strategy = SMPStrategy(
        **LAYOUTS[layout],
        microbatches=2 if "pp" in layout else 1,
        fp16=True,
        dynamic_loss_args={"init_scale": 2.0**8},
        delayed_parameter_initialization=True,
    )
    devices = {"1": 1, "tp2": 2, "pp2xtp2": 4}[layout]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Llama(size), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
    trainer.save_checkpoint(path)


def run_work(work: str, checkpoint: str, out: str) -> dict[str, Any]:
    """One export or consolidation in this (fresh) process: its peak RSS above the RSS before it, and its time."""
    torch.set_num_threads(1)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    if work == "consolidate":
        written = consolidate_checkpoint(checkpoint, out).stat().st_size
    else:
        target = export_hf(checkpoint, out, dtype="bfloat16" if work == "export_bf16" else None)
        written = sum(file.stat().st_size for file in target.glob("*.safetensors"))
    seconds = time.perf_counter() - start
    return {"work": work, "peak_growth": _status("VmHWM") - before, "seconds": seconds, "bytes_written": written}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def largest_tensor(checkpoint: Path) -> int:
    """The bytes of the largest model tensor the checkpoint holds (fp32, as saved)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return max(
        info.size.numel() * info.properties.dtype.itemsize
        for name, info in entries.items()
        if name.startswith("model/") and isinstance(info, TensorStorageMetadata)
    )


def measure(size: str, layout: str, directory: Path) -> dict[str, Any]:
    checkpoint = directory / "llama.ckpt"
    script = [sys.executable, str(Path(__file__).resolve())]
    subprocess.run([*script, "--size", size, "--layout", layout, "--save", str(checkpoint)], check=True)
    largest = largest_tensor(checkpoint)
    rows = []
    for work in WORKS:
        out = directory / work
        done = subprocess.run(
            [*script, "--work", work, str(checkpoint), str(out)], check=True, capture_output=True, text=True
        )
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["peak_over_largest"] = row["peak_growth"] / largest
        rows.append(row)
    return {"largest_tensor": largest, "parameters": _parameters(directory / "export_fp32"), "rows": rows}


def _parameters(exported: Path) -> int:
    from safetensors import safe_open

    count = 0
    for file in exported.glob("*.safetensors"):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                numel = 1
                for size in tensors.get_slice(name).get_shape():
                    numel *= size
                count += numel
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--layout", choices=LAYOUTS, default="pp2xtp2")
    parser.add_argument("--out", help="write the results (with the machine, command and date) to this JSON file")
    parser.add_argument("--save", help=argparse.SUPPRESS)  # internal: train and save to this path
    parser.add_argument("--work", nargs=3, help=argparse.SUPPRESS)  # internal: WORK CHECKPOINT OUT
    args = parser.parse_args()
    if args.save:
        save(args.size, args.layout, args.save)
        return
    if args.work:
        print(json.dumps(run_work(*args.work)))
        return
    describe_machine()
    with tempfile.TemporaryDirectory() as directory:
        result = measure(args.size, args.layout, Path(directory))
    largest = result["largest_tensor"] / 2**20
    print(f"{result['parameters'] / 1e6:.1f}M parameters, largest tensor {largest:.1f} MiB (fp32)")
    for row in result["rows"]:
        print(
            f"{row['work']}: peak RSS growth {row['peak_growth'] / 2**20:.1f} MiB = {row['peak_over_largest']:.2f} x "
            f"the largest tensor; {row['seconds']:.1f} s, {row['bytes_written'] / 2**20 / row['seconds']:.0f} MiB/s"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(record([result], args), indent=2) + "\n")


if __name__ == "__main__":
    main()
