"""What each rank holds when a GPT is split over devices: measured bytes per rank, the planner's estimate, peak RSS.

The GPT is the one of the memory issue — ``nn.Embedding(V, d)``, L × ``nn.TransformerEncoderLayer(d, heads, ff)``
in an ``nn.ModuleList`` (the pipelined trunk), a LayerNorm and a ``smp.nn.DistributedLMHead`` (an ``nn.Linear``
split along the vocabulary under tensor parallelism, with its vocabulary-parallel loss), tied to the embedding or
not — built in ``configure_model`` under ``smp.model_creation(tensor_parallelism=smp.tp_size() > 1)`` and trained
with fp16, fp32 masters and AdamW. Each layout
(one device, tp2, pp2, pp2×tp2, dp2 with and without ``shard_optimizer_state``, and sdp2:
``sharded_data_parallel_degree=2`` with ``sdp_param_persistence_threshold=0`` so that every module shards) and head
runs in a fresh process whose ranks Lightning launches (as ``tp_memory.py``). Every rank reports, from the live
model and optimizer (the local shards, where a tensor is a DTensor):

- the exact bytes of its parameters, their gradients (before the second optimizer step), the fp32 masters and their
  gradient buffer, and the optimizer state (after it);
- its peak RSS over the whole process (``ru_maxrss``: imports, model creation, setup, training), the same peak
  when training starts (model creation and setup only), and the RSS it held just before ``Trainer.fit`` (so that
  the growth is what the fit added);
- what `lightning_smp.estimate_memory` plans for that rank, from the same model built on the meta device;
- the wall time of its last training step (dp2-sharded's and sdp2's are compared with plain dp2's in the summary);
- its peak RSS after ``trainer.save_checkpoint`` at the end of training, against the training peak (the save must
  not hold what sharding spared: a ZeRO-1 replica writes its share of the masters and optimizer state).

    python benchmarks/memory_scale.py                             # the 166M GPT of the issue (a while on a CPU)
    python benchmarks/memory_scale.py --size smoke --out x.json   # a tiny GPT, for tests
    python benchmarks/memory_scale.py --delayed-init              # modules built on meta, each rank keeps its part
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPConfig, SMPStrategy, estimate_memory, smp

try:
    from benchmarks.pipeline_bench import record
except ImportError:  # run as `python benchmarks/memory_scale.py` without the repo root on sys.path
    from pipeline_bench import record

# vocabulary, width, heads, feed-forward width, layers, tokens per sample, samples per batch
SIZES: dict[str, dict[str, int]] = {
    "smoke": {"vocab": 256, "width": 32, "heads": 4, "ff": 64, "layers": 4, "seq": 8, "batch": 4},
    "medium": {"vocab": 8000, "width": 256, "heads": 8, "ff": 1024, "layers": 8, "seq": 16, "batch": 4},
    "full": {"vocab": 32000, "width": 1024, "heads": 16, "ff": 4096, "layers": 8, "seq": 16, "batch": 2},
}
# (pp, tp, dp, shard_optimizer_state, sharded_data_parallel_degree)
LAYOUTS: dict[str, tuple[int, int, int, bool, int]] = {
    "1": (1, 1, 1, False, 1),
    "tp2": (1, 2, 1, False, 1),
    "pp2": (2, 1, 1, False, 1),
    "pp2xtp2": (2, 2, 1, False, 1),
    "dp2": (1, 1, 2, False, 1),
    "dp2-sharded": (1, 1, 2, True, 1),
    "sdp2": (1, 1, 2, False, 2),
}
UNSHARDED = {"dp2-sharded": "dp2", "sdp2": "dp2"}  # a sharded layout → the same degrees without the sharding
HEADS = ("untied", "tied")
STEPS = 2  # the optimizer state exists after the first; the second is measured
STATES = ("parameters", "gradients", "masters", "master_gradients", "optimizer_state")


class ScaleGPT(L.LightningModule):
    """The benchmark's GPT; ``tied`` shares the head's weight with the token embedding."""

    def __init__(
        self,
        *,
        vocab: int,
        width: int,
        heads: int,
        ff: int,
        layers: int,
        seq: int,
        tied: bool,
        dropout: float = 0.0,
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.shape = {"vocab": vocab, "width": width, "heads": heads, "ff": ff, "layers": layers, "seq": seq}
        self.tied, self.dropout, self.checkpointing = tied, dropout, checkpointing
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        s = self.shape
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.tok = nn.Embedding(s["vocab"], s["width"])
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    s["width"], s["heads"], s["ff"], dropout=self.dropout, batch_first=True, norm_first=True
                )
                for _ in range(s["layers"])
            )
            self.norm = nn.LayerNorm(s["width"])
            self.head = smp.nn.DistributedLMHead(s["width"], s["vocab"])
        if self.tied:
            self.head.weight = self.tok.weight
        for block in self.blocks:  # `dropout` is on the residual stream only (GPT-2's resid_pdrop)
            block.dropout.p, block.self_attn.dropout = 0.0, 0.0
        if self.checkpointing:
            smp.set_activation_checkpointing(self.blocks)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, target = batch  # (B, T) each
        h = self.tok(ids)  # (B, T, d)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1), dtype=h.dtype, device=h.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(h))  # (B, T, V / tp): split over the vocabulary
        return self.head.loss(logits, target)  # vocabulary-parallel cross entropy under tensor parallelism

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def strategy_kwargs(layout: str, *, delayed_init: bool = False) -> dict[str, Any]:
    """The `SMPStrategy` settings of ``layout`` (the planner is given the same)."""
    pp, tp, _, sharded, sdp = LAYOUTS[layout]
    kwargs: dict[str, Any] = {"fp16": True, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp}
    if sharded:
        kwargs["shard_optimizer_state"] = True
    if sdp > 1:
        kwargs.update(sharded_data_parallel_degree=sdp, sdp_param_persistence_threshold=0)
    if delayed_init:
        kwargs["delayed_parameter_initialization"] = True
    if pp > 1:
        kwargs.update(microbatches=2, pipeline_module="blocks")
    return kwargs


def _local(tensor: Tensor) -> Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard (sharded data parallelism), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors: list[Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once, whole)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Measure(Callback):
    """Counts this rank's bytes by kind at the last step; gathers every rank's record on rank 0."""

    def __init__(self, path: str, rss_before_fit: int) -> None:
        self.path = path
        self.counts: dict[str, int] = {"rss_before_fit": rss_before_fit}

    def on_train_start(self, trainer: L.Trainer, module: ScaleGPT) -> None:
        self.counts["peak_rss_before_training"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def on_train_batch_start(self, trainer: L.Trainer, module: ScaleGPT, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: ScaleGPT, outputs: Any, batch: Any, idx: int) -> None:
        self.counts["step_seconds"] = time.perf_counter() - self._step_start  # the last step's is kept

    def on_before_optimizer_step(self, trainer: L.Trainer, module: ScaleGPT, optimizer: Any) -> None:
        if trainer.global_step != STEPS - 1:
            return
        params = list({id(p): p for p in module.parameters()}.values())
        own = {id(p) for p in params}  # fp32 parameters (unsharded, or sdp's shards) are their own masters
        masters = [m for m in optimizer.master_params() if id(m) not in own]
        self.counts.update(
            parameters=_bytes(params),
            gradients=_bytes([p.grad for p in params if p.grad is not None]),
            masters=_storage_bytes(masters),
            master_gradients=_storage_bytes([m.grad for m in masters if m.grad is not None]),
        )

    def on_train_end(self, trainer: L.Trainer, module: ScaleGPT) -> None:
        state = trainer.strategy.optimizers[0].optimizer.state
        if not state:
            raise RuntimeError("every step was skipped (fp16 overflow): AdamW holds no state to measure")
        tensors = [t for per_param in state.values() for t in per_param.values() if isinstance(t, Tensor)]
        self.counts["optimizer_state"] = _bytes(tensors)
        self.counts["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with tempfile.TemporaryDirectory() as checkpoint:  # the same path on every rank: rank 0's is broadcast
            trainer.save_checkpoint(Path(checkpoint) / "save.ckpt")
            trainer.strategy.barrier()
        self.counts["peak_rss_after_save"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        record = {"rank": trainer.global_rank, "stage": smp.pp_rank(), "tp_rank": smp.tp_rank(), **self.counts}
        records: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(records, record)
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(records))


def run_layout(layout: str, head: str, size: str, path: str, *, delayed_init: bool) -> None:
    """One layout, in this process and the ranks Lightning launches from it; rank 0 writes the records."""
    rss_before_fit = _rss_bytes()
    torch.set_num_threads(1)
    shape = SIZES[size]
    pp, tp, dp, *_ = LAYOUTS[layout]
    samples = STEPS * shape["batch"] * dp  # each replica runs STEPS batches
    tokens = torch.randint(0, shape["vocab"], (samples, shape["seq"] + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=shape["batch"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=pp * tp * dp,
        # a small initial scale: the measured steps must not be skipped, or AdamW would hold no state yet
        strategy=SMPStrategy(
            **strategy_kwargs(layout, delayed_init=delayed_init), dynamic_loss_args={"init_scale": 2.0**8}
        ),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Measure(path, rss_before_fit)],
    )
    trainer.fit(_model(size, head), data)


def _model(size: str, head: str) -> ScaleGPT:
    shape = {k: v for k, v in SIZES[size].items() if k != "batch"}
    return ScaleGPT(**shape, tied=head == "tied")


def planned(layout: str, head: str, size: str) -> list[dict[str, int]]:
    """The planner's model states per pipeline stage, for the model built on the meta device."""
    pp, tp, dp, *_ = LAYOUTS[layout]
    config = SMPConfig(**strategy_kwargs(layout))
    model = _model(size, head)
    with smp.preview(config, world_size=pp * tp * dp), torch.device("meta"):
        model.configure_model()
    report = estimate_memory(model, config=config, world_size=pp * tp * dp)
    return [{kind: getattr(rank, kind) for kind in STATES} for rank in report.ranks]


def measure(size: str, layouts: list[str], heads: list[str], *, delayed_init: bool) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for head in heads:
            for layout in layouts:
                path = os.path.join(tmp, f"{layout}_{head}.json")
                command = [sys.executable, __file__, "--run", layout, "--head", head, "--size", size, "--json", path]
                command += ["--delayed-init"] if delayed_init else []
                done = subprocess.run(
                    command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
                )
                if done.returncode != 0:
                    sys.exit(f"{layout} {head} failed:\n{done.stderr[-4000:]}")
                rows.append(row(layout, head, size, path))
    return rows


def row(layout: str, head: str, size: str, path: str) -> dict[str, Any]:
    """The records `run_layout` wrote to ``path``, each rank's with what the planner plans for it."""
    ranks = json.loads(Path(path).read_text())
    plan = planned(layout, head, size)
    for rank in ranks:
        rank["planned"] = plan[rank["stage"]]
    return {"layout": layout, "head": head, "ranks": ranks}


def _states(rank: dict[str, Any], kinds: tuple[str, ...] = STATES) -> int:
    return sum(rank[kind] for kind in kinds)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout and head: the largest rank's figures, as fractions of one device's; a sharded layout's model states,
    masters + optimizer state and step time also as fractions of the same layout unsharded (`UNSHARDED`)."""
    single = {row["head"]: row["ranks"][0] for row in rows if row["layout"] == "1"}
    by_layout = {(row["layout"], row["head"]): row for row in rows}
    kept = ("parameters", "masters", "optimizer_state")
    sharded_kinds = ("masters", "optimizer_state")
    summary = []
    for row in rows:
        one = single.get(row["head"])
        unsharded = by_layout.get((UNSHARDED.get(row["layout"], ""), row["head"]))
        largest = max(row["ranks"], key=_states)
        step = max(r["step_seconds"] for r in row["ranks"])
        worst_plan = max(abs(_states(r["planned"]) / _states(r) - 1) for r in row["ranks"])
        peak = max(r["peak_rss"] for r in row["ranks"])
        save_peak = max(r["peak_rss_after_save"] / r["peak_rss"] for r in row["ranks"])
        growth = max(r["peak_rss"] - r["rss_before_fit"] for r in row["ranks"])
        creation = max(r["peak_rss_before_training"] - r["rss_before_fit"] for r in row["ranks"])
        summary.append(
            {
                "layout": row["layout"],
                "head": row["head"],
                "model_states_mib": _states(largest) / 2**20,
                "kept_of_one_device": _states(largest, kept) / _states(one, kept) if one else None,
                "planned_error": worst_plan,
                "peak_rss_mib": peak / 2**20,
                "growth_mib": growth / 2**20,
                "creation_growth_mib": creation / 2**20,
                "growth_of_one_device": growth / (one["peak_rss"] - one["rss_before_fit"]) if one else None,
                "step_seconds": step,
                "save_peak_of_training_peak": save_peak,
                "model_states_of_unsharded": (
                    _states(largest) / max(_states(r) for r in unsharded["ranks"]) if unsharded else None
                ),
                "masters_and_state_of_unsharded": (
                    _states(largest, sharded_kinds) / max(_states(r, sharded_kinds) for r in unsharded["ranks"])
                    if unsharded
                    else None
                ),
                "step_time_of_unsharded": (
                    step / max(r["step_seconds"] for r in unsharded["ranks"]) if unsharded else None
                ),
            }
        )
    return summary


def print_table(summary: list[dict[str, Any]], size: str) -> None:
    s = SIZES[size]
    print(
        f"GPT ({size}): Embedding({s['vocab']}, {s['width']}), {s['layers']} x TransformerEncoderLayer({s['width']}, "
        f"{s['heads']}, {s['ff']}), Linear head; fp16 + fp32 masters + AdamW; batch {s['batch']} x {s['seq']} tokens"
    )
    header = ("head", "layout", "model states", "params+masters+opt / 1", "planned vs measured", "peak RSS")
    header += ("growth", "growth / 1", "growth at train start", "step", "states / unsharded")
    header += ("masters+opt / unsharded", "step / unsharded", "save peak / training peak")
    print("  ".join(header))
    for r in summary:
        kept, growth = _fraction(r["kept_of_one_device"]), _fraction(r["growth_of_one_device"])
        print(
            f"{r['head']:>4}  {r['layout']:>7}  {r['model_states_mib']:>9.1f} MiB  {kept:>22}  "
            f"{r['planned_error']:>19.1%}  {r['peak_rss_mib']:>4.0f} MiB  {r['growth_mib']:>6.0f} MiB  {growth:>10}  "
            f"{r['creation_growth_mib']:>17.0f} MiB  {r['step_seconds']:>5.2f} s  "
            f"{_fraction(r['model_states_of_unsharded']):>18}  {_fraction(r['masters_and_state_of_unsharded']):>23}  "
            f"{_fraction(r['step_time_of_unsharded']):>16}  {r['save_peak_of_training_peak']:>25.3f}"
        )


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--heads", default=",".join(HEADS), help=f"comma-separated, of {', '.join(HEADS)}")
    parser.add_argument("--out", default=None, help="write the records (JSON) here")
    parser.add_argument(
        "--delayed-init",
        action="store_true",
        help="delayed_parameter_initialization=True: build on the meta device, each rank materialises what it keeps",
    )
    parser.add_argument("--run", choices=LAYOUTS, help="run one layout here (internal)")
    parser.add_argument("--head", choices=HEADS, default="untied", help="with --run (internal)")
    parser.add_argument("--json", help="with --run: where rank 0 writes the records (internal)")
    args = parser.parse_args()
    if args.run:
        run_layout(args.run, args.head, args.size, args.json, delayed_init=args.delayed_init)
        return
    layouts, heads = args.layouts.split(","), args.heads.split(",")
    unknown = sorted({*layouts} - set(LAYOUTS)) + sorted({*heads} - set(HEADS))
    if unknown:
        parser.error(
            f"unknown layout or head {', '.join(unknown)}; layouts: {', '.join(LAYOUTS)}; heads: {', '.join(HEADS)}"
        )
    rows = measure(args.size, layouts, heads, delayed_init=args.delayed_init)
    summary = summarise(rows)
    print_table(summary, args.size)
    if args.out:
        payload = record(rows, args)
        payload["summary"] = summary
        Path(args.out).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
