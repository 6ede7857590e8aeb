"""Peak host memory per rank while a pretrained Llama loads into a split model, against one device.

A Llama (grouped-query attention, an untied head; 166M parameters at ``--size full``) is saved once with
``save_pretrained`` in several safetensors shards. Each layout then runs in fresh processes whose ranks Lightning
launches: ``from_pretrained(dir, dtype=float32)`` in ``configure_model`` under ``smp.model_creation`` with
``delayed_parameter_initialization=True``, then ``STEPS`` AdamW steps in fp32. Every rank reports the resident
memory it held before ``Trainer.fit``, its peak when training starts (loading and setup: what the load added) and
at the end (training too), and the bytes of the parameters it keeps.

    python benchmarks/load_pretrained.py                                  # 166M Llama; one device, pp2xtp2
    python benchmarks/load_pretrained.py --size smoke --layouts 1,tp2     # a tiny one
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

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, smp

try:
    from benchmarks.pipeline_bench import record
except ImportError:  # run as `python benchmarks/load_pretrained.py` without the repo root on sys.path
    from pipeline_bench import record

SIZES: dict[str, dict[str, int]] = {
    "smoke": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4},
    # 166M parameters: 2 x 32.8M (embedding, head) + 9 x 11.2M
    "full": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 9},
}
HEADS = {"num_attention_heads": 16, "num_key_value_heads": 4}
SHARD = {"smoke": "100KB", "full": "200MB"}
# (pp, tp): each layout runs pp x tp ranks
LAYOUTS: dict[str, tuple[int, int]] = {"1": (1, 1), "tp2": (1, 2), "pp2": (2, 1), "pp2xtp2": (2, 2)}
STEPS, BATCH, SEQ = 1, 2, 16


class FineTune(L.LightningModule):
    """``from_pretrained`` in ``configure_model``, as docs/fine-tuning.md writes it."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.model = path, None

    def configure_model(self) -> None:
        from transformers import LlamaForCausalLM

        if self.model is None:
            with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
                self.model = LlamaForCausalLM.from_pretrained(self.path, dtype=torch.float32)
            self.peak_after_from_pretrained = _peak_bytes()  # headers only: nothing is read yet

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    """The process's peak resident memory since `_reset_peak` (VmHWM; ``ru_maxrss`` would start from the launching
    process's size, since a forked child inherits it across ``exec``)."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


class _Measure(Callback):
    def __init__(self, path: str, rss_before_fit: int) -> None:
        self.path = path
        self.record: dict[str, int] = {"rss_before_fit": rss_before_fit}

    def on_train_start(self, trainer: L.Trainer, module: FineTune) -> None:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
        self.record["kept"] = sum(p.numel() * p.element_size() for p in local)
        self.record["peak_after_loading"] = _peak_bytes()
        self.record["peak_after_from_pretrained"] = module.peak_after_from_pretrained

    def on_train_end(self, trainer: L.Trainer, module: FineTune) -> None:
        self.record["peak"] = _peak_bytes()
        records: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(records, {"rank": trainer.global_rank, **self.record})
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(records))


def save(size: str, directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokens = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    model = LlamaForCausalLM(LlamaConfig(**SIZES[size], **HEADS, **tokens, tie_word_embeddings=False))
    model.save_pretrained(directory, max_shard_size=SHARD[size])


def run_layout(layout: str, directory: str, vocab: int, path: str) -> None:
    """One layout, in this process and the ranks Lightning launches from it; rank 0 writes the records."""
    _reset_peak()
    rss_before_fit = _rss_bytes()
    torch.set_num_threads(1)
    pp, tp = LAYOUTS[layout]
    ids = torch.randint(0, vocab, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    kwargs: dict[str, Any] = {"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp}
    if pp > 1:
        kwargs["microbatches"] = 2
    trainer = L.Trainer(
        accelerator="cpu",
        devices=pp * tp,
        strategy=SMPStrategy(delayed_parameter_initialization=True, **kwargs),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Measure(path, rss_before_fit)],
    )
    trainer.fit(FineTune(directory), DataLoader(TensorDataset(ids), batch_size=BATCH))


def measure(size: str, layouts: list[str]) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "llama")
        save(size, directory)
        for layout in layouts:
            path = os.path.join(tmp, f"{layout}.json")
            command = [sys.executable, __file__, "--run", layout, "--dir", directory, "--size", size, "--json", path]
            done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{layout} failed:\n{done.stderr[-4000:]}")
            rows.append({"layout": layout, "ranks": json.loads(Path(path).read_text())})
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout, the largest rank's growth while loading and over the whole fit, and as fractions of one device's."""
    one = next((row["ranks"][0] for row in rows if row["layout"] == "1"), None)
    summary = []
    for row in rows:
        loading = max(r["peak_after_loading"] - r["rss_before_fit"] for r in row["ranks"])
        fit = max(r["peak"] - r["rss_before_fit"] for r in row["ranks"])
        summary.append(
            {
                "layout": row["layout"],
                "kept_mib": max(r["kept"] for r in row["ranks"]) / 2**20,
                "loading_growth_mib": loading / 2**20,
                "fit_growth_mib": fit / 2**20,
                "loading_of_one_device": loading / (one["peak_after_loading"] - one["rss_before_fit"]) if one else None,
                "fit_of_one_device": fit / (one["peak"] - one["rss_before_fit"]) if one else None,
            }
        )
    return summary


def print_table(summary: list[dict[str, Any]]) -> None:
    print(
        "| layout | parameters kept, largest rank | growth by train start | / one device | growth over the fit |"
        " / one device |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for s in summary:
        ratios = [f"{s[k]:.3f}" if s[k] is not None else "-" for k in ("loading_of_one_device", "fit_of_one_device")]
        print(
            f"| {s['layout']} | {s['kept_mib']:.1f} MiB | {s['loading_growth_mib']:.0f} MiB | {ratios[0]} | "
            f"{s['fit_growth_mib']:.0f} MiB | {ratios[1]} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--layouts", default="1,pp2xtp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--out", default=None, help="write the records (JSON) here")
    parser.add_argument("--run", choices=LAYOUTS, help="run one layout here (internal)")
    parser.add_argument("--dir", help="with --run: the save_pretrained directory (internal)")
    parser.add_argument("--json", help="with --run: where rank 0 writes the records (internal)")
    args = parser.parse_args()
    if args.run:
        run_layout(args.run, args.dir, SIZES[args.size]["vocab_size"], args.json)
        return
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layout {', '.join(unknown)}; layouts: {', '.join(LAYOUTS)}")
    rows = measure(args.size, layouts)
    summary = summarise(rows)
    print_table(summary)
    if args.out:
        Path(args.out).write_text(json.dumps({**record(rows, args), "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
