"""Per-rank training-state memory of tensor-parallel transformer blocks against one device.

For a GPT-like model built from ``nn.TransformerEncoderLayer`` under ``smp.model_creation(tensor_parallelism=...)``
and trained one step with ``SMPStrategy(fp16=True, tensor_parallel_degree=tp)`` and AdamW, it counts, on every rank,
the bytes of the blocks' parameters (fp16), their fp32 master weights and the optimizer state of those masters
(AdamW: exp_avg, exp_avg_sq, step), and compares them with the same count at tp=1. The target is
``per-rank / single-device <= 1/tp + 5%`` (what stays replicated in a block: norms and two output biases).
The whole model (the tied token embedding stays replicated) is reported alongside. Counts are exact: this
measures sizes, not time, so it runs on CPU (gloo) with any number of cores.

    python benchmarks/tp_memory.py                 # tp = 1, 2, 4: prints the table
    python benchmarks/tp_memory.py --tp 2 --json out.json   # one layout (launched by the line above)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, smp

VOCAB, D_MODEL, HEADS, FF, LAYERS, SEQ = 1024, 256, 8, 1024, 4, 16
TP_DEGREES = (1, 2, 4)


class _Gpt(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.tok = nn.Embedding(VOCAB, D_MODEL)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(LAYERS)
            )
            self.norm = nn.LayerNorm(D_MODEL)
            self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, target = batch
        h = self.tok(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return F.cross_entropy(self.head(self.norm(h)).float().flatten(0, 1), target.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def _masters(optimizer: torch.optim.Optimizer) -> dict[int, Tensor]:
    """Model parameter id -> the fp32 tensor the inner optimizer updates for it (whole masters: no sharding here)."""
    return optimizer.master_parts()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Measure(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: _Gpt) -> None:
        optimizer = trainer.strategy.optimizers[0]
        masters = _masters(optimizer)
        state = optimizer.optimizer.state

        def count(params: list[Tensor]) -> dict[str, int]:
            own = [masters[id(p)] for p in params]
            optimizer_state = [t for m in own for t in state[m].values() if isinstance(t, Tensor)]
            return {"params": _bytes(params), "masters": _bytes(own), "optimizer_state": _bytes(optimizer_state)}

        if not state:
            raise RuntimeError("the step was skipped (fp16 overflow): AdamW holds no state to measure")
        record = {
            "blocks": count(list(pl_module.blocks.parameters())),
            "model": count(list(pl_module.parameters())),
        }
        records = [None] * trainer.world_size
        dist.all_gather_object(records, record)
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(records))


def run_one(tp: int, path: str) -> None:
    """One tp degree, in this process and the ranks Lightning launches from it; rank 0 writes the records."""
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=tp,
        # a small initial scale: the measured step must not be skipped, or AdamW would hold no state yet
        strategy=SMPStrategy(fp16=True, tensor_parallel_degree=tp, dynamic_loss_args={"init_scale": 2.0**8}),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Measure(path)],
    )
    trainer.fit(_Gpt())


def _total(record: dict[str, int]) -> int:
    return sum(record.values())


def measure() -> dict[int, list[dict[str, Any]]]:
    """Every rank's records per tp degree, each degree in fresh processes (Lightning launches its ranks)."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in TP_DEGREES:
            path = os.path.join(tmp, f"tp{tp}.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--tp", str(tp), "--json", path], check=True, env=env)
            results[tp] = json.loads(Path(path).read_text())
    return results


def report(results: dict[int, list[dict[str, Any]]]) -> None:
    """Print the table and, per tp degree, the verdict against the 1/tp + 5% target."""
    single = results[1][0]
    print(
        f"GPT blocks: {LAYERS} x nn.TransformerEncoderLayer(d_model={D_MODEL}, nhead={HEADS}, "
        f"dim_feedforward={FF}); vocab {VOCAB} tied; fp16 params + fp32 masters + AdamW state, bytes per rank"
    )
    columns = ("params", "masters", "opt state", "total")
    print(f"{'tp':>3} {'part':>7} " + " ".join(f"{c:>11}" for c in columns) + f" {'ratio':>7} {'1/tp+5%':>8}")
    for tp, records in results.items():
        for part in ("blocks", "model"):
            worst = max(records, key=lambda r, part=part: _total(r[part]))[part]
            ratio = _total(worst) / _total(single[part])
            bound = f"{1 / tp + 0.05:.3f}" if part == "blocks" else ""
            print(
                f"{tp:>3} {part:>7} {worst['params']:>11,} {worst['masters']:>11,} {worst['optimizer_state']:>11,} "
                f"{_total(worst):>11,} {ratio:>7.4f} {bound:>8}"
            )
    for tp, records in results.items():
        worst = max(_total(record["blocks"]) for record in records) / _total(single["blocks"])
        verdict = "meets" if worst <= 1 / tp + 0.05 else "MISSES"
        print(f"tp={tp}: largest per-rank block state is {worst:.4f} of one device; {verdict} the 1/tp + 5% target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, help="run one layout (internal)")
    parser.add_argument("--json", help="where --tp writes its per-rank records")
    args = parser.parse_args()
    if args.tp is not None:
        run_one(args.tp, args.json)
        return
    report(measure())


if __name__ == "__main__":
    main()
