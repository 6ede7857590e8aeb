"""Activations with and without sequence parallelism, counted on live ranks; the memory planner against those counts;
step time against Lightning's ModelParallelStrategy running torch's own tensor-parallel plan.

Three measurements; the layouts of one device count share one launch of processes Lightning starts, fitted one after
the other:

- ``bytes``: the GPT of ``memory_scale.py`` (``nn.TransformerEncoderLayer``s with ReLU, fp16, residual dropout 0.1
  unless ``--dropout``) at tp2 and tp4, with and without ``sequence_parallel``: the exact bytes each rank keeps for
  backward for one microbatch (every tensor autograd saves, each storage once, parameters left out: `SavedBytes`),
  those of its transformer layers per layer, and Korthikanti et al.'s per-layer accounting, as published and for
  this layer (`formula_per_layer`).
- ``planner``: the GPT and a Hugging Face Llama on one device, tp2, pp2 and pp2 x tp2, with and without activation
  checkpointing: each rank's measured bytes per microbatch against what `lightning_smp.estimate_memory` traces on the
  meta device for its stage.
- ``time``: a Llama at tp2, ours without and with sequence parallelism, and Lightning's ``ModelParallelStrategy``
  with torch's ``ColwiseParallel`` / ``RowwiseParallel`` (``+ SequenceParallel``) plan on the same model, fp32: the
  median step after a warm-up step, in wall-clock seconds and in CPU seconds of the slowest rank (which other jobs
  on a shared machine inflate less), all four in turn in one launch, ``--repeats`` rounds (interleaved: a change in
  the machine's load falls on every layout alike); the ratios are taken within each round, then their median.

    python benchmarks/sequence_parallel.py bytes --out bytes.json              # full size, seq 1024
    python benchmarks/sequence_parallel.py planner --size smoke --out p.json   # what tests/test_memory.py runs
    python benchmarks/sequence_parallel.py time --out time.json              # 5 rounds
    python benchmarks/sequence_parallel.py time --size smoke --steps 1 --repeats 1 --out t.json   # the test's
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPConfig, SMPStrategy, estimate_memory, smp
from lightning_smp.activation_memory import SavedBytes, by_trunk_child
from lightning_smp.pipeline.partition import find_trunk

try:
    from benchmarks.memory_scale import ScaleGPT
    from benchmarks.pipeline_bench import record
except ImportError:  # run as `python benchmarks/sequence_parallel.py` without the repo root on sys.path
    from memory_scale import ScaleGPT
    from pipeline_bench import record

# model shapes: vocabulary, width, heads (key/value heads for the Llama), feed-forward width, layers, tokens, samples
SIZES: dict[str, dict[str, int]] = {
    "smoke": {"vocab": 256, "width": 32, "heads": 4, "kv_heads": 2, "ff": 64, "layers": 4, "seq": 16, "batch": 4},
    "time": {"vocab": 8192, "width": 512, "heads": 8, "kv_heads": 4, "ff": 1536, "layers": 4, "seq": 512, "batch": 2},
    # benchmarks/context_parallel.py: a sequence of 4,096 tokens, attention-bound (a small vocabulary and width)
    "long": {"vocab": 1024, "width": 256, "heads": 4, "kv_heads": 2, "ff": 1024, "layers": 2, "seq": 4096, "batch": 1},
    "long_smoke": {"vocab": 256, "width": 32, "heads": 4, "kv_heads": 2, "ff": 64, "layers": 2, "seq": 64, "batch": 1},
    "full": {
        "vocab": 32000,
        "width": 1024,
        "heads": 16,
        "kv_heads": 8,
        "ff": 4096,
        "layers": 8,
        "seq": 1024,
        "batch": 1,
    },
}
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
LAYOUTS: dict[str, dict[str, Any]] = {
    "1": {},
    "tp2": {"tensor_parallel_degree": 2},
    "tp2+sp": {"tensor_parallel_degree": 2, "sequence_parallel": True},
    "tp4": {"tensor_parallel_degree": 4},
    "tp4+sp": {"tensor_parallel_degree": 4, "sequence_parallel": True},
    "pp2": PP2,
    "pp2xtp2": {**PP2, "tensor_parallel_degree": 2},
    "pp2xtp2+sp": {**PP2, "tensor_parallel_degree": 2, "sequence_parallel": True},
    "tp2+sp-shared": {"tensor_parallel_degree": 2, "sequence_parallel": True, "prescaled_batch": True},
    "cp2": {"context_parallel_degree": 2},
    "cp4": {"context_parallel_degree": 4},
    "torch-tp2": {},  # Lightning's ModelParallelStrategy, torch's plan
    "torch-tp2+sp": {},
}
MEASURED_STEP = 0  # what a step keeps for backward does not depend on the optimizer's state


class LlamaLM(L.LightningModule):
    """transformers' ``LlamaForCausalLM`` built under ``smp.model_creation`` (split by its own plan), its loss."""

    def __init__(self, shape: dict[str, int], *, dropout: float = 0.0, checkpointing: bool = False) -> None:
        super().__init__()
        self.shape, self.dropout, self.checkpointing = shape, dropout, checkpointing
        self.model: nn.Module | None = None

    def build(self) -> nn.Module:
        import transformers

        s = self.shape
        config = transformers.LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["ff"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
            attention_dropout=self.dropout, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.model = self.build()
        if self.checkpointing:
            smp.set_activation_checkpointing(self.model.model.layers)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        ids, _ = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TorchPlanLlama(LlamaLM):
    """The same Llama under Lightning's ``ModelParallelStrategy``, split by torch's own plan (torchtitan's, for a
    transformers Llama): q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``; with ``sequence_parallel``
    the norms ``SequenceParallel``, the blocks' inputs gathered by ``PrepareModuleInput``, the row-parallel outputs
    reduce-scattered (``Shard(1)``) and the head taking the slice."""

    def __init__(self, shape: dict[str, int], *, sequence_parallel: bool) -> None:
        super().__init__(shape)
        self.sequence_parallel = sequence_parallel

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        if self.model is not None:
            return
        torch.manual_seed(0)
        self.model = self.build()
        parallelize_module(
            self.model, self.device_mesh["tensor_parallel"], torch_plan(self.model, self.sequence_parallel)
        )


def torch_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }
    if sp:
        plan["model.norm"] = SequenceParallel()
        plan["model.layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
        )
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{p}.{name}"] = (
                RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
            )
        if sp:
            plan[f"{p}.input_layernorm"] = plan[f"{p}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{p}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            plan[f"{p}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def build_model(model: str, size: str, *, dropout: float, checkpointing: bool, layout: str = "1") -> L.LightningModule:
    shape = SIZES[size]
    if layout.startswith("torch-"):
        return TorchPlanLlama(shape, sequence_parallel=layout.endswith("+sp"))
    if model == "llama":
        return LlamaLM(shape, dropout=dropout, checkpointing=checkpointing)
    gpt = {k: shape[k] for k in ("vocab", "width", "heads", "ff", "layers", "seq")}
    return ScaleGPT(**gpt, tied=False, dropout=dropout, checkpointing=checkpointing)


def batches(size: str, steps: int) -> DataLoader:
    s = SIZES[size]
    tokens = torch.randint(
        0, s["vocab"], (steps * s["batch"], s["seq"] + 1), generator=torch.Generator().manual_seed(0)
    )
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=s["batch"])


class _Probe(Callback):
    """Counts what one step keeps for backward (per microbatch, per trunk child) and times every step."""

    def __init__(self, path: str, microbatches: int) -> None:
        self.path, self.microbatches = path, microbatches
        self.steps: list[float] = []
        self.cpu: list[float] = []  # the rank's CPU seconds per step (all its threads): steady on a shared machine
        self.counts: dict[str, Any] = {}
        self._stack = ExitStack()

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
        self._start, self._cpu = time.perf_counter(), time.process_time()
        if idx == MEASURED_STEP:
            self._saved = SavedBytes(exclude=[*module.parameters(), *module.buffers()])
            self._stack.enter_context(self._saved)
            try:
                trunk = find_trunk(module, None)[1]
            except ValueError:
                trunk = None
            self._stack.enter_context(by_trunk_child(trunk, self._saved))
            self._layers = len(list(trunk.children())) if trunk is not None else 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, out: Any, batch: Any, idx: int) -> None:
        self.steps.append(time.perf_counter() - self._start)
        self.cpu.append(time.process_time() - self._cpu)
        if idx == MEASURED_STEP:
            self._stack.close()
            children = [str(i) for i in range(self._layers)]
            held = [child for child in children if child in self._saved.saved]
            self.counts = {
                "per_microbatch": self._saved.total() // self.microbatches,
                "layers_per_microbatch": self._saved.total(held) // self.microbatches,
                "layers_held": len(held),
            }
            del self._saved

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        record = {
            "rank": trainer.global_rank,
            "stage": smp.pp_rank() if isinstance(trainer.strategy, SMPStrategy) else 0,
            "step_seconds": self.steps,
            "cpu_seconds": self.cpu,
            **self.counts,
        }
        records: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(records, record)
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(records))


def run_layouts(model: str, layouts: list[str], size: str, path: str, args: argparse.Namespace) -> None:
    """Layouts of one device count, in this process and the ranks Lightning launches from it, each without and
    (``--checkpointing``) with activation checkpointing, one fit after the other, all of them ``--repeats`` times
    in turn (interleaved, so that a change in the machine's load falls on every layout alike); rank 0 writes the
    records of each fit (to ``path`` + ``.layout.0.repeat`` or ``.layout.1.repeat``)."""
    for repeat in range(args.repeats):
        for layout in layouts:
            for checkpointing in (False, True) if args.checkpointing else (False,):
                fit_path = f"{path}.{layout}.{int(checkpointing)}.{repeat}"
                _fit_layout(model, layout, size, fit_path, args, checkpointing=checkpointing)


def _fit_layout(
    model: str, layout: str, size: str, path: str, args: argparse.Namespace, *, checkpointing: bool
) -> None:
    torch.set_num_threads(1)
    kwargs = dict(LAYOUTS[layout])
    if layout.startswith("torch-"):
        strategy: Any = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    else:
        dynamic = {"dynamic_loss_args": {"init_scale": 2.0**8}} if args.fp16 else {}
        # timed against ModelParallelStrategy, whose tensor-parallel ranks read one batch: so do ours, the same tokens
        same_batch = {"prescaled_batch": True} if args.what == "time" else {}
        strategy = SMPStrategy(**kwargs, fp16=args.fp16, **dynamic, **same_batch)
    steps = MEASURED_STEP + 1 + args.steps
    trainer = L.Trainer(
        accelerator="cpu", devices=devices(layout), strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[_Probe(path, kwargs.get("microbatches", 1))],
    )  # fmt: skip
    module = build_model(model, size, dropout=args.dropout, checkpointing=checkpointing, layout=layout)
    trainer.fit(module, batches(size, steps))


def _launch(
    model: str, layouts: list[str], args: argparse.Namespace, tmp: str, *, checkpointing: bool = False
) -> dict[tuple[str, bool], list[dict[str, Any]]]:
    """Run layouts of one device count in fresh processes; every rank's record per (layout, checkpointed)."""
    path = os.path.join(tmp, f"{model}.json")
    command = [sys.executable, __file__, "run", "--model", model, "--layout", ",".join(layouts), "--size", args.size]
    command += ["--json", path, "--dropout", str(args.dropout), "--steps", str(args.steps)]
    command += ["--checkpointing"] * checkpointing + ["--fp16"] * args.fp16
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{model} {','.join(layouts)} failed:\n{done.stderr[-4000:]}")
    return records(path, layouts, checkpointing=checkpointing)


def records(
    path: str, layouts: list[str], *, checkpointing: bool, repeat: int = 0
) -> dict[tuple[str, bool], list[dict[str, Any]]]:
    """What the ranks of ``run_layouts(..., path, ...)`` wrote in round ``repeat``: every rank's record per (layout,
    checkpointed)."""
    variants = (False, True) if checkpointing else (False,)
    return {
        (layout, ckpt): json.loads(Path(f"{path}.{layout}.{int(ckpt)}.{repeat}").read_text())
        for layout in layouts
        for ckpt in variants
    }


def devices(layout: str) -> int:
    """The ranks a layout trains on (torch's plan: two)."""
    if layout.startswith("torch-"):
        return 2
    kwargs = LAYOUTS[layout]
    degrees = ("pipeline_parallel_degree", "tensor_parallel_degree", "context_parallel_degree")
    return math.prod(kwargs.get(degree, 1) for degree in degrees)


def _by_devices(layouts: list[str]) -> list[list[str]]:
    """``layouts`` grouped by their device count (one launch each), in order."""
    groups: dict[int, list[str]] = {}
    for layout in layouts:
        groups.setdefault(devices(layout), []).append(layout)
    return list(groups.values())


def planned(model: str, layout: str, args: argparse.Namespace, *, checkpointing: bool = False) -> list[tuple[int, int]]:
    """The planner's (activations per microbatch, recompute) per stage, for the model built on the meta device."""
    config = SMPConfig(**LAYOUTS[layout], fp16=args.fp16)
    module = build_model(model, args.size, dropout=args.dropout, checkpointing=checkpointing)
    with smp.preview(config, world_size=config.model_parallel_degree), torch.device("meta"):
        module.configure_model()
    batch = next(iter(batches(args.size, 1)))
    report = estimate_memory(module, config=config, batch=batch)
    if report.ranks[0].activations is None:
        sys.exit(f"the planner measured nothing for {model} {layout}: {report.activation_note}")
    return [(rank.activations, rank.recompute) for rank in report.ranks]


def formula_per_layer(
    size: str, tp: int, sequence_parallel: bool, *, dropout: bool, activation: str, mask_bytes: float
) -> float:
    """Bytes one transformer layer keeps for backward by Korthikanti et al. 2022's accounting (Table 2, "selective
    recompute" rows: a fused attention keeps no attention matrix), for 16-bit activations, in units of s·b·h bytes:
    the two layer norms' inputs 4, the attention's input 2, q, k, v 6/t, the attention's output (``out_proj``'s
    input) 2/t, the MLP's input 2, its hidden layer 16/t with GeLU (its input, and its output as the second linear's
    input) or 8/t with ReLU (whose output it keeps is that input), and with ``dropout`` two residual masks of
    ``mask_bytes`` per element. Without sequence parallelism the first, second, fifth and the masks are whole on
    every rank; with it all is divided by t. The paper's figures are GeLU with 1-byte masks: 10 + 24/t and 34/t."""
    s = SIZES[size]
    sbh = s["seq"] * s["batch"] * s["width"]
    hidden = {"gelu": 16.0, "relu": 8.0}[activation]
    whole, split = 8.0 + (2 * mask_bytes if dropout else 0.0), 8.0 + hidden
    return sbh * ((whole + split) / tp if sequence_parallel else whole + split / tp)


def measure_bytes(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        launched: dict[tuple[str, bool], list[dict[str, Any]]] = {}
        for group in (["tp2", "tp2+sp"], ["tp4", "tp4+sp"]):
            launched.update(_launch("gpt", group, args, tmp))
        for layout in ("tp2", "tp2+sp", "tp4", "tp4+sp"):
            ranks = launched[(layout, False)]
            tp, sp = LAYOUTS[layout]["tensor_parallel_degree"], layout.endswith("+sp")
            per_layer = max(r["layers_per_microbatch"] for r in ranks) / SIZES[args.size]["layers"]
            dropout = args.dropout > 0
            paper = formula_per_layer(args.size, tp, sp, dropout=True, activation="gelu", mask_bytes=1)
            # this layer: ReLU (nn.TransformerEncoderLayer's default); masks of torch's CPU dropout (the activations'
            # dtype) outside sequence parallelism, one byte (SequenceParallelDropout's) inside
            formula = formula_per_layer(
                args.size, tp, sp, dropout=dropout, activation="relu", mask_bytes=1 if sp else 2
            )
            plan = planned("gpt", layout, args)[0][0]
            rows.append({
                "layout": layout, "per_microbatch": max(r["per_microbatch"] for r in ranks), "per_layer": per_layer,
                "formula_per_layer": formula, "of_formula": per_layer / formula, "paper_formula_per_layer": paper,
                "planned": plan, "planned_error": plan / max(r["per_microbatch"] for r in ranks) - 1,
            })  # fmt: skip
    by = {row["layout"]: row for row in rows}
    for t in (2, 4):
        sp, plain = by[f"tp{t}+sp"], by[f"tp{t}"]
        sp["layers_of_tp"] = sp["per_layer"] / plain["per_layer"]
        sp["whole_of_tp"] = sp["per_microbatch"] / plain["per_microbatch"]
    return {"rows": rows}


def measure_planner(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for group in _by_devices(args.layouts.split(",")):
                for (layout, checkpointing), ranks in _launch(model, group, args, tmp, checkpointing=True).items():
                    plan = planned(model, layout, args, checkpointing=checkpointing)
                    for rank in ranks:
                        kept, _ = plan[rank["stage"]]
                        rows.append({
                            "model": model, "layout": layout, "checkpointing": checkpointing, "rank": rank["rank"],
                            "stage": rank["stage"], "measured": rank["per_microbatch"], "planned": kept,
                            "error": kept / rank["per_microbatch"] - 1,
                        })  # fmt: skip
    return {"rows": rows}


TIMED = ("tp2", "tp2+sp", "torch-tp2", "torch-tp2+sp")


def measure_time(args: argparse.Namespace) -> dict[str, Any]:
    """Every layout of `TIMED`, ``--repeats`` rounds in turn, with this process as rank 0 (Lightning starts rank 1
    by running this command again; it leaves once the fits are done); per layout the median over the rounds of each
    round's median step of the slowest rank, and its ratio to ours at tp2 in the same round."""
    os.environ["OMP_NUM_THREADS"] = "1"  # for rank 1 too
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama.json")
        run_layouts("llama", list(TIMED), args.size, path, args)
        if os.environ.get("LOCAL_RANK", "0") != "0":
            sys.exit(0)
        rounds = [records(path, list(TIMED), checkpointing=False, repeat=r) for r in range(args.repeats)]
    launched = {layout: [found[(layout, False)] for found in rounds] for layout in TIMED}
    medians = {  # (layout, key) -> per repeat: the median over steps of the slowest rank's time
        (layout, key): [
            statistics.median(max(times) for times in zip(*(r[key][MEASURED_STEP + 1 :] for r in ranks), strict=True))
            for ranks in launched[layout]
        ]
        for layout in TIMED
        for key in ("step_seconds", "cpu_seconds")
    }
    rows = []
    for layout in TIMED:
        row: dict[str, Any] = {"layout": layout, "repeats": args.repeats}
        for key, ratio in (("step_seconds", "of_ours_tp2"), ("cpu_seconds", "cpu_of_ours_tp2")):
            mine, ours = medians[(layout, key)], medians[("tp2", key)]
            row[key] = statistics.median(mine)
            row[ratio] = statistics.median(m / o for m, o in zip(mine, ours, strict=True))
            row[f"{key}_per_repeat"] = mine
        rows.append(row)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("bytes", "planner", "time", "run"))
    parser.add_argument("--size", choices=SIZES, default=None, help="default: full (bytes), smoke (planner), time")
    parser.add_argument("--models", default="gpt,llama", help="planner: comma-separated, of gpt, llama")
    parser.add_argument(
        "--layouts", default="1,tp2,tp2+sp,pp2,pp2xtp2,pp2xtp2+sp", help="planner: comma-separated layouts"
    )
    parser.add_argument("--dropout", type=float, default=None, help="default: 0.1 (bytes), 0 otherwise")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after the measured one")
    parser.add_argument("--repeats", type=int, default=None, help="time: rounds over the layouts (default 5)")
    parser.add_argument("--fp16", action="store_true", help="planner / time: fp16 with fp32 masters (bytes: always)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", choices=("gpt", "llama"), help="with run (internal)")
    parser.add_argument("--layout", help="with run: comma-separated layouts of one device count (internal)")
    parser.add_argument("--checkpointing", action="store_true", help="with run: fit again, checkpointed (internal)")
    parser.add_argument("--json", help="with run (internal)")
    args = parser.parse_args()
    args.repeats = args.repeats if args.repeats is not None else (5 if args.what == "time" else 1)
    if args.what == "run":
        run_layouts(args.model, args.layout.split(","), args.size, args.json, args)
        return
    args.size = args.size or {"bytes": "full", "planner": "smoke", "time": "time"}[args.what]
    args.dropout = args.dropout if args.dropout is not None else (0.1 if args.what == "bytes" else 0.0)
    args.steps = args.steps if args.steps is not None else (0 if args.what != "time" else 4)
    args.fp16 = args.fp16 or args.what == "bytes"
    measured = {"bytes": measure_bytes, "planner": measure_planner, "time": measure_time}[args.what](args)
    print(json.dumps(measured["rows"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record(measured["rows"], args), indent=2))


if __name__ == "__main__":
    main()
