"""Training-step speed, peak memory and MFU of `smp_fp16` against Lightning's own precisions, on a GPT-2.

Every mode is a real `Trainer.fit` on the same pre-generated random tokens, in this one process, one after the
other. A callback times the steps after the warm-up from the host, synchronising the device only at the two ends
of the timed window, so a path that never waits for the host (smp_fp16's fused, on-device overflow handling) is
measured as it runs. Results are printed as a table with ratios against `16-mixed` (and, for compiled modes,
against the compiled `16-mixed` and `16-true`) and written to JSON after each mode.

    python benchmarks/precision_bench.py --size 124m --batch-size 16 --steps 30 --warmup 20 --modes all \
        --out results.json
    python benchmarks/precision_bench.py --sizes 124m,350m --out 'precision_{size}.json'

Modes: smp_fp16 (SMPStrategy(fp16=True): fp16 params, fp32 flat masters, smp's dynamic loss scale), 16-mixed
(torch.autocast + GradScaler), bf16-mixed, 32-true (TF32 matmuls by default, see --matmul-precision), 16-true
(fp16 params, no masters, no scaler: the ceiling), and `<mode>_compile` for smp_fp16, 16-mixed and 16-true
(torch.compile of the inner GPT in `configure_model`). smp keeps its init scale 2**32 unless --init-scale is
given: its ~16 overflow-skipped first steps fall in the warm-up (default 20), and the JSON counts any that do not.
The timed steps are also split at Lightning's hooks into forward, backward, unscale, optimizer and loop, on the
device's clock (``phases_ms``), so the time one mode loses against another is placed in a phase. With
``--profile-steps N``, N more steps per mode run under torch.profiler and the JSON keeps each mode's top kernels by
self time per step (``profile_top``) and the device's busy time per step (``profile_total_us_per_step``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightning_smp
from lightning_smp import SMPStrategy

try:
    from benchmarks.gpt import GPTConfig, GPTModule
except ImportError:  # run as `python benchmarks/precision_bench.py` without the repo root on sys.path
    from gpt import GPTConfig, GPTModule

# Eager first (the main comparison), compiled last; within each, the reference modes right after smp.
ALL_MODES = (
    "smp_fp16",
    "16-mixed",
    "16-true",
    "bf16-mixed",
    "32-true",
    "smp_fp16_compile",
    "16-true_compile",
    "16-mixed_compile",
)

# Dense fp16/bf16 tensor-core peaks (FLOP/s) for MFU, by GPU name.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

# Measured on the same H200 on 2026-11-29 with raw PyTorch loops (reference/pp-tp-fp16.md, "Measured here"),
# GPT-2 124M, B=16, T=1024: ms/step, for a sanity column in the 124m table.
ANCHORS_124M_MS = {
    "16-mixed": 47.66,
    "bf16-mixed": 46.78,
    "32-true": 100.6,
    "16-true": 41.47,
    "smp_fp16": 43.03,
    "16-mixed_compile": 41.81,
    "16-true_compile": 38.09,
    "smp_fp16_compile": 40.06,
}

# Goals from the issues: (mode, reference, metric, bound, is_lower_bound).
GOALS = (
    ("smp_fp16", "16-mixed", "tokens_per_s", 1.12, True),
    ("smp_fp16", "16-mixed", "peak_mem_gib", 1.05, False),
    ("smp_fp16_compile", "16-true_compile", "tokens_per_s", 0.97, True),
    ("smp_fp16_compile", "16-mixed_compile", "tokens_per_s", 1.04, True),
)


@dataclass(frozen=True)
class Mode:
    name: str
    precision: str | None  # Lightning's precision flag; None: SMPStrategy chooses
    compile: bool

    @property
    def smp(self) -> bool:
        return self.precision is None

    @classmethod
    def parse(cls, name: str) -> Mode:
        if name not in ALL_MODES:
            raise ValueError(f"Unknown mode {name!r}; choose from {', '.join(ALL_MODES)} or 'all'.")
        base = name.removesuffix("_compile")
        return cls(name=name, precision=None if base == "smp_fp16" else base, compile=name.endswith("_compile"))


# -- timing --------------------------------------------------------------------------------------------------


class StepTimer(Callback):
    """Times steps ``warmup .. warmup+steps-1`` from the host; syncs the device only at the window's two ends.

    After the window, ``sync_check_steps`` more steps run with `torch.cuda.set_sync_debug_mode("warn")` and every
    implicit device→host synchronisation in them is counted by its Python source line (CUDA only).
    """

    def __init__(self, warmup: int, steps: int, sync_check_steps: int) -> None:
        self.warmup = warmup
        self.steps = steps
        self.sync_check_steps = sync_check_steps
        self.cuda = False
        self.result: dict[str, Any] = {}
        self._fit_start = 0.0
        self._t0 = 0.0
        self._first_loss: torch.Tensor | None = None
        self._marks: list[float] = []  # host time at each timed step's start, and at the window's end
        self._catcher: warnings.catch_warnings | None = None
        self._caught: list[warnings.WarningMessage] = []

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @staticmethod
    def _smp_optimizer(trainer: L.Trainer) -> Any:
        plugin = trainer.strategy.precision_plugin
        wrapped = getattr(plugin, "master_weight_optimizers", None)
        return wrapped[0] if wrapped else None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.cuda = pl_module.device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            self._sync()  # sync: start of the timed window
            self._t0 = time.perf_counter()
            self._marks = []
            self.result["setup_and_warmup_s"] = self._t0 - self._fit_start
            optimizer = self._smp_optimizer(trainer)
            if optimizer is not None:
                self.result["skipped_steps_in_warmup"] = int(optimizer.skipped_steps.item())
        if self.warmup <= idx < self.warmup + self.steps:
            self._marks.append(time.perf_counter())
        first_check, last = self.warmup + self.steps, self.warmup + self.steps + self.sync_check_steps - 1
        if self.cuda and self.sync_check_steps > 1:
            if idx == first_check:
                self._start_sync_check()
            elif idx == last:  # full cycles first_check .. last-1 are in, from one batch start to the next
                self._stop_sync_check(cycles=last - first_check)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if idx == 0:
            self._first_loss = outputs["loss"].detach()
        if idx != self.warmup + self.steps - 1:
            return
        self._sync()  # sync: end of the timed window
        end = time.perf_counter()
        elapsed = end - self._t0
        x, _ = batch
        tokens = self.steps * x.numel()
        intervals = sorted(b - a for a, b in zip(self._marks, [*self._marks[1:], end], strict=True))
        self.result.update(
            time_s=elapsed,
            ms_per_step=1000 * elapsed / self.steps,
            # Host-side step intervals: exact on the CPU (robust to a busy machine); on a GPU they only show
            # the launch rate until the queue fills, so the wall time above is the number to use there.
            host_ms_per_step_median=1000 * intervals[len(intervals) // 2],
            tokens_per_s=tokens / elapsed,
            loss_first=float(self._first_loss) if self._first_loss is not None else None,
            loss_final=float(outputs["loss"]),
        )
        if self.cuda:
            self.result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        optimizer = self._smp_optimizer(trainer)
        if optimizer is not None:
            skipped = int(optimizer.skipped_steps.item())
            self.result.update(
                skipped_steps=skipped,
                skipped_steps_timed=skipped - self.result.get("skipped_steps_in_warmup", 0),
                loss_scale_final=optimizer.loss_scale,
            )

    def _start_sync_check(self) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def _stop_sync_check(self, cycles: int) -> None:
        if self._catcher is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(None, None, None)
        self._catcher = None
        syncs = [w for w in self._caught if "synchroniz" in str(w.message)]
        where = Counter(f"{_short_path(w.filename)}:{w.lineno}" for w in syncs)
        self.result["sync_check"] = {
            "steps": cycles,
            "syncs_per_step": len(syncs) / cycles,
            "where": dict(where.most_common()),
        }

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_sync_check(cycles=1)


PHASES = ("forward", "backward", "unscale", "optimizer", "loop")


class PhaseTimer(Callback):
    """Splits each timed step at Lightning's hooks into ``PHASES``, timed on the device's own clock: forward
    (batch start → before backward, the loss included), backward (→ after backward), unscale (→ before the
    optimizer step: GradScaler's unscale, clipping), optimizer (→ batch end: the step, masters copied back, the
    scale updated) and loop (→ the next batch's start: Lightning's bookkeeping). On CUDA each boundary is an event
    recorded in the stream (no sync; read after fit), so a phase is what the GPU spent between two points,
    waiting for the host included; on the CPU it is host time. Keeps each phase's median over the steps."""

    def __init__(self, first: int, steps: int) -> None:
        self.first, self.steps = first, steps
        self.result: dict[str, float] = {}
        self._cuda = False
        self._step: list[Any] | None = None  # the boundaries of the step running now
        self._done: list[list[Any]] = []

    def _stamp(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _mark(self) -> None:
        if self._step is not None:
            self._step.append(self._stamp())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._cuda = pl_module.device.type == "cuda"

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self._step is not None:  # the previous step's loop phase ends here
            self._mark()
            self._done.append(self._step)
            self._step = None
        if self.first <= idx < self.first + self.steps:
            self._step = [self._stamp()]

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._mark()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._mark()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._mark()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = [marks for marks in self._done if len(marks) == len(PHASES) + 1]
        if not steps:
            return
        if self._cuda:
            torch.cuda.synchronize()  # sync: after fit, the recorded events have all run
        for index, phase in enumerate(PHASES):
            spans = sorted(self._elapsed_ms(marks[index], marks[index + 1]) for marks in steps)
            self.result[phase] = spans[len(spans) // 2]

    def _elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self._cuda else 1000 * (end - start)


class StepProfiler(Callback):
    """Runs ``steps`` whole steps from batch ``start`` under `torch.profiler` and keeps the ``top`` operators and
    kernels by self time on the device (CUDA) or the host, per step: where one precision's step differs from
    another's, kernel by kernel."""

    def __init__(self, start: int, steps: int, top: int = 30) -> None:
        self.start, self.steps, self.top = start, steps, top
        self.result: list[dict[str, Any]] = []
        self.total_us_per_step: float | None = None
        self._profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        elif idx == self.start + self.steps and self._profiler is not None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize()  # sync: the profiled kernels end
            self._profiler.__exit__(None, None, None)
            device = pl_module.device.type == "cuda"
            rows = [
                {
                    "name": event.key,
                    "self_us_per_step": (event.self_device_time_total if device else event.self_cpu_time_total)
                    / self.steps,
                    "calls_per_step": event.count / self.steps,
                }
                for event in self._profiler.key_averages()
            ]
            rows.sort(key=lambda row: row["self_us_per_step"], reverse=True)
            self.result = rows[: self.top]
            # all of it, not only the top: the device's busy time per step, to set against the step's wall time
            self.total_us_per_step = sum(row["self_us_per_step"] for row in rows)
            self._profiler = None


def _short_path(filename: str) -> str:
    for marker in ("site-packages/", "lightning_smp/", "benchmarks/"):
        if marker in filename:
            head = "" if marker == "site-packages/" else marker
            return head + filename.split(marker, 1)[1]
    return filename


# -- one mode ------------------------------------------------------------------------------------------------


def make_batches(config: GPTConfig, batch_size: int, count: int, seed: int, pin: bool) -> list[tuple[Any, Any]]:
    """``count`` batches of random tokens as contiguous (x, y) pairs, pinned when a GPU will read them."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (count, batch_size, config.block_size + 1), generator=generator)
    batches = []
    for seq in tokens:  # (B, T+1)
        x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T) each: y is x shifted by one
        batches.append((x.pin_memory(), y.pin_memory()) if pin else (x, y))
    return batches


def run_mode(mode: Mode, config: GPTConfig, batches: list, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    L.seed_everything(args.seed, verbose=False)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # init on the GPU: seconds faster at 350m
        module = GPTModule(config, compile_model=mode.compile)
    if mode.smp:
        dynamic_loss_args = {"init_scale": args.init_scale} if args.init_scale else None
        extra: dict[str, Any] = {"strategy": SMPStrategy(fp16=True, dynamic_loss_args=dynamic_loss_args)}
    else:
        extra = {"precision": mode.precision}
    timer = StepTimer(args.warmup, args.steps, args.sync_check_steps)
    profiled = args.warmup + args.steps + args.sync_check_steps
    profiler = StepProfiler(profiled, args.profile_steps)
    phases = PhaseTimer(args.warmup, args.steps)
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=profiled + args.profile_steps + (1 if args.profile_steps else 0),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the same batches in the same order for every strategy
        callbacks=[timer, phases, profiler],
        **extra,
    )
    # batch_size=None: the loader hands out the pre-made (pinned) tensors as they are, no collate copy.
    loader = DataLoader(batches, batch_size=None, shuffle=False, num_workers=0)
    start = time.perf_counter()
    trainer.fit(module, loader)
    result = {
        "mode": mode.name,
        "precision_requested": mode.precision or "smp_fp16",
        "precision_used": str(trainer.precision),
        "precision_plugin": type(trainer.precision_plugin).__name__,
        "strategy": type(trainer.strategy).__name__,
        "compiled": mode.compile,
        "mode_wall_s": time.perf_counter() - start,
        **timer.result,
        "phases_ms": phases.result,
    }
    if profiler.result:
        result["profile_top"] = profiler.result
        result["profile_total_us_per_step"] = profiler.total_us_per_step
    del trainer, module, timer, phases, profiler, loader
    _release_memory()
    return result


def _release_memory() -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -- reporting -----------------------------------------------------------------------------------------------


def peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def add_ratios(results: dict[str, dict[str, Any]], flops_per_token: float, peak: float | None) -> None:
    for result in results.values():
        if "tokens_per_s" not in result:
            continue
        result["mfu"] = flops_per_token * result["tokens_per_s"] / peak if peak else None
        for ref in ("16-mixed", "16-mixed_compile", "16-true_compile"):
            base = results.get(ref, {})
            if ref.endswith("_compile") and not result["compiled"]:
                continue
            if "tokens_per_s" in base:
                result[f"speed_vs_{ref}"] = result["tokens_per_s"] / base["tokens_per_s"]
            if result.get("peak_mem_gib") and base.get("peak_mem_gib"):
                result[f"mem_vs_{ref}"] = result["peak_mem_gib"] / base["peak_mem_gib"]


def check_goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    goals = []
    for mode, ref, metric, bound, lower in GOALS:
        value, base = results.get(mode, {}).get(metric), results.get(ref, {}).get(metric)
        ratio = value / base if value and base else None
        met = None if ratio is None else (ratio >= bound if lower else ratio <= bound)
        goals.append({"mode": mode, "vs": ref, "metric": metric, "goal": f"{'>=' if lower else '<='} {bound}",
                      "ratio": ratio, "met": met})  # fmt: skip
    return goals


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(size: str, results: dict[str, dict[str, Any]], goals: list[dict[str, Any]]) -> None:
    anchors = ANCHORS_124M_MS if size == "124m" else {}
    header = (
        f"{'mode':<18}{'ms/step':>9}{'host-ms':>9}{'tok/s':>10}{'peak GiB':>9}{'MFU':>7}{'x16-mixed':>10}{'mem x':>7}"
        f"{'x16m_comp':>10}{'x16t_comp':>10}{'loss':>8}{'skip':>6}{'syncs':>6}{'anchor':>8}  used"
    )
    print(f"\n== {size} ==\n{header}")
    for name, r in results.items():
        if "tokens_per_s" not in r:
            print(f"{name:<18}  {r.get('status', 'no result')}")
            continue
        syncs = r.get("sync_check", {}).get("syncs_per_step")
        print(
            f"{name:<18}{r['ms_per_step']:>9.2f}{r['host_ms_per_step_median']:>9.2f}{r['tokens_per_s']:>10.0f}"
            f"{_fmt(r.get('peak_mem_gib'), '.2f'):>9}"
            f"{_fmt(r.get('mfu'), '.1%'):>7}{_fmt(r.get('speed_vs_16-mixed'), '.3f'):>10}"
            f"{_fmt(r.get('mem_vs_16-mixed'), '.3f'):>7}{_fmt(r.get('speed_vs_16-mixed_compile'), '.3f'):>10}"
            f"{_fmt(r.get('speed_vs_16-true_compile'), '.3f'):>10}{_fmt(r.get('loss_final'), '.3f'):>8}"
            f"{_fmt(r.get('skipped_steps_timed'), 'd'):>6}{_fmt(syncs, '.1f'):>6}{_fmt(anchors.get(name), '.1f'):>8}"
            f"  {r['precision_used']}"
        )
    phased = {name: r["phases_ms"] for name, r in results.items() if r.get("phases_ms")}
    if phased:
        print(f"\n{'phases (ms, median)':<22}" + "".join(f"{phase:>11}" for phase in PHASES) + f"{'sum':>9}")
        for name, spans in phased.items():
            cells = "".join(f"{spans[phase]:>11.2f}" for phase in PHASES)
            print(f"{name:<22}{cells}{sum(spans.values()):>9.2f}")
    for goal in goals:
        state = {True: "met", False: "NOT met", None: "n/a"}[goal["met"]]
        ratio = _fmt(goal["ratio"], ".3f")
        print(f"goal {goal['mode']} {goal['metric']} vs {goal['vs']} {goal['goal']}: {ratio} {state}")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "lightning_smp": lightning_smp.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "peak_flops": peak_flops(args),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)


# -- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="124m" if cuda else "tiny", help="tiny, 124m or 350m")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes run one after another (overrides --size)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=None, help="sequence length (default: the size's)")
    parser.add_argument("--steps", type=int, default=30 if cuda else 20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (compile, smp's init overflows)")
    parser.add_argument("--modes", default="all", help=f"'all' or comma-separated from: {', '.join(ALL_MODES)}")
    parser.add_argument("--skip-modes", default="", help="comma-separated modes to leave out of --modes")
    parser.add_argument("--init-scale", type=float, default=None, help="smp init loss scale (default smp's 2**32)")
    parser.add_argument("--sync-check-steps", type=int, default=4, help="CUDA: steps after timing run in sync-debug")
    parser.add_argument("--matmul-precision", default="high", help="torch.set_float32_matmul_precision (32-true)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (default by GPU name)")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; modes not started by then skip")
    parser.add_argument(
        "--threads", type=int, default=None if cuda else 1, help="torch CPU threads (CPU default 1: steadier)"
    )
    parser.add_argument("--progress-bar", action="store_true", help="enable Lightning's progress bar (sync check)")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="steps after the others run under torch.profiler (top kernels)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="JSON path; '{size}' in it gives one file per size")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    if not cuda:
        args.sync_check_steps = 0  # `torch.cuda.set_sync_debug_mode` needs CUDA
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`max_epochs` was not set.*")
    warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores.*")
    torch.set_float32_matmul_precision(args.matmul_precision)
    # Lightning's DDP launcher (which SMPStrategy uses) sets torch's CPU threads to cores / processes unless
    # OMP_NUM_THREADS is set; pin it so a mode run after smp_fp16 keeps the same thread count.
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

    sizes = (args.sizes or args.size).split(",")
    wanted = ALL_MODES if args.modes == "all" else tuple(args.modes.split(","))
    modes = [Mode.parse(name) for name in wanted if name not in args.skip_modes.split(",")]
    cuda = torch.cuda.is_available()
    env = environment(args)
    print(f"{env['date']}  {env['device']}  torch {env['torch']}  lightning {env['lightning']}  {env['command']}")

    begin = time.perf_counter()
    everything: dict[str, Any] = {**env, "results": {}, "goals": {}}
    for size in sizes:
        config = GPTConfig.preset(size)
        if args.block_size:
            config = replace(config, block_size=args.block_size)
        # The flops of this config (GPT on the meta device: no memory, no init cost).
        with torch.device("meta"):
            flops_per_token = GPTModule(config).model.flops_per_token()
        count = args.warmup + args.steps + args.sync_check_steps + args.profile_steps + 1
        batches = make_batches(config, args.batch_size, count, args.seed, pin=cuda)
        results: dict[str, dict[str, Any]] = {}
        size_info = {"config": asdict(config), "batch_size": args.batch_size, "flops_per_token": flops_per_token}
        for mode in modes:
            if args.time_budget and time.perf_counter() - begin > args.time_budget:
                results[mode.name] = {"mode": mode.name, "status": "skipped: time budget spent"}
                print(f"[{size}] {mode.name}: skipped (time budget)", flush=True)
                continue
            started = time.perf_counter()
            try:
                results[mode.name] = run_mode(mode, config, batches, args)
            except Exception as error:  # one broken mode must not lose the others' numbers
                trace = traceback.format_exc()
                print(trace, file=sys.stderr, flush=True)
                status = f"error: {type(error).__name__}: {error}"
                results[mode.name] = {"mode": mode.name, "status": status, "traceback": trace}
                _release_memory()
            now, brief = time.perf_counter(), _brief(results[mode.name])
            print(f"[{size}] {mode.name}: {now - started:.1f} s (total {now - begin:.0f} s)  {brief}", flush=True)
            add_ratios(results, flops_per_token, env["peak_flops"])
            everything["results"][size] = {**size_info, "modes": results}
            everything["goals"][size] = check_goals(results)
            _save(args.out, size, everything)
        print_table(size, results, everything["goals"][size])
    everything["total_s"] = time.perf_counter() - begin
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # SMPStrategy's (one-rank) group, left up by Lightning
    for size in sizes:
        _save(args.out, size, everything)
    return everything


def _brief(result: dict[str, Any]) -> str:
    if "ms_per_step" not in result:
        return result.get("status", "")
    return f"{result['ms_per_step']:.2f} ms/step, {result['tokens_per_s']:.0f} tok/s, loss {result['loss_final']:.3f}"


def _save(out: str | None, size: str, everything: dict[str, Any]) -> None:
    if not out:
        return
    if "{size}" in out:
        payload = {k: v for k, v in everything.items() if k not in ("results", "goals")}
        payload["size"] = size
        payload.update(results=everything["results"].get(size, {}), goals=everything["goals"].get(size, []))
        write_json(Path(out.format(size=size)), payload)
    else:
        write_json(Path(out), everything)


if __name__ == "__main__":
    outcome = main()
    statuses = [r.get("status", "") for size in outcome["results"].values() for r in size["modes"].values()]
    sys.exit(1 if any(status.startswith("error") for status in statuses) else 0)
