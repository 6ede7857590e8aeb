"""The ``lightning-smp`` command: Lightning's own `LightningCLI` with lightning_smp imported and ``smp`` as the
default strategy.

It owns only the entry point. Importing this module imports the package, which registers the ``smp*`` strategy
names, so a YAML config may say ``strategy: smp_fp16`` or ``class_path: lightning_smp.SMPStrategy``. Any
LightningModule and LightningDataModule are given by class path; the current directory is importable, as with
``python -m``. Parsing, subcommands and config files are LightningCLI's, unchanged (see its docs).

    lightning-smp fit --config examples/configs/dp.yaml
    python -m lightning_smp fit --config examples/configs/dp.yaml --trainer.max_steps 10

One subcommand is its own: ``estimate`` builds the config's LightningModule on the meta device (no memory, no
processes), traces one microbatch of the config's data through it there, and prints what each rank of the
configured layout would hold (`lightning_smp.memory`), with ``--devices`` the layouts that fit a device (and with
``--context-parallel`` the cp x dp layouts, each rank holding 1/cp of every sequence), with ``--plot`` the chart:

    lightning-smp estimate --config examples/configs/pp_tp_dp.yaml --device-memory 40GiB --devices 8 --plot m.png

Another, ``export-hf``, writes a trained model out of a sharded checkpoint (`lightning_smp.export_hf`): a Hugging
Face directory that ``from_pretrained`` loads, or plain safetensors for a LightningModule that wraps no such model:

    lightning-smp export-hf checkpoints/last.ckpt exported/ --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import Namespace
from jsonargparse.typing import import_object
from lightning.pytorch.cli import ArgsType, LightningCLI
from typing_extensions import override

import lightning_smp  # (registers the strategy names)
from lightning_smp import memory, smp
from lightning_smp._compat import tree_map
from lightning_smp.config import SMPConfig

__all__ = ["estimate", "export_hf", "main", "make_cli"]

_DESCRIPTION = (
    "Train any LightningModule with SageMaker-model-parallel-style strategies: Lightning's CLI with lightning_smp "
    "imported (strategy names smp, smp_fp16, smp_bf16, ... and class_path: lightning_smp.SMPStrategy) and "
    "trainer.strategy defaulting to 'smp'. `lightning-smp estimate --config job.yaml` prints the memory each rank "
    "would hold (see `lightning-smp estimate --help`); `lightning-smp export-hf CHECKPOINT OUT_DIR` writes the "
    "trained model as a Hugging Face directory (see `lightning-smp export-hf --help`)."
)


def main(args: ArgsType = None) -> None:
    """The ``lightning-smp`` command; ``args`` replaces ``sys.argv[1:]``."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == ["estimate"]:
        estimate(argv[1:])
        return
    if isinstance(argv, list) and argv[:1] == ["export-hf"]:
        export_hf(argv[1:])
        return
    make_cli(args)


def export_hf(args: Sequence[str]) -> None:
    """``lightning-smp export-hf``: a Hugging Face directory (or plain safetensors) from a sharded checkpoint."""
    parser = argparse.ArgumentParser(
        prog=f"{_prog()} export-hf",
        description="Write the model in a sharded lightning_smp checkpoint (any layout) as a Hugging Face "
        "directory: safetensors files under the wrapped transformers model's own names, their index, config.json "
        "and generation_config.json, so that from_pretrained(OUT_DIR) loads it; a LightningModule that wraps no "
        "transformers model gets its state dict as safetensors, and a peft model its adapters as peft's "
        "save_pretrained writes them (PeftModel.from_pretrained(base, OUT_DIR) loads them). One tensor is in "
        "memory at a time; no process group is needed.",
    )
    parser.add_argument("checkpoint", help="the checkpoint directory, e.g. checkpoints/last.ckpt")
    parser.add_argument("out_dir", help="the directory to write (new, or empty)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: as saved, fp32)")
    parser.add_argument("--max-shard-size", default="5GB", help="the most bytes per file (default: 5GB)")
    options = parser.parse_args(list(args))
    try:
        out_dir = lightning_smp.export_hf(
            options.checkpoint, options.out_dir, dtype=options.dtype, max_shard_size=options.max_shard_size
        )
    except ValueError as error:  # CheckpointError included
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    print(f"Exported {options.checkpoint} to {out_dir}")


def estimate(args: Sequence[str]) -> None:
    """``lightning-smp estimate``: the per-rank memory of the job a LightningCLI config describes."""
    parser = argparse.ArgumentParser(
        prog=f"{_prog()} estimate",
        description="Build the config's LightningModule on the meta device (configure_model included) and print the "
        "bytes each rank of its SMPStrategy layout would hold: parameters, gradients, fp32 masters, optimizer state "
        "and the activations of one microbatch of the config's data, measured by running training_step forward and "
        "backward on the meta device. Nothing is allocated and no process is started.",
    )
    parser.add_argument("--config", required=True, help="a LightningCLI config (model, trainer.strategy, devices)")
    parser.add_argument("--device-memory", help="memory of one device, e.g. 40GiB, 80GB, 141G: says whether it fits")
    parser.add_argument("--devices", type=int, help="also list the pp x tp x dp layouts of this many devices that fit")
    parser.add_argument(
        "--micro-batch-size", type=int, help="samples per microbatch (resizes dim 0 of the data's batch)"
    )
    parser.add_argument(
        "--sequence-length", type=int, help="tokens per sample (resizes dim 1 of the data's batch tensors)"
    )
    parser.add_argument(
        "--context-parallel",
        action="store_true",
        help="with --devices: also list the context-parallel layouts (cp x dp), each rank 1/cp of every sequence",
    )
    parser.add_argument("--plot", metavar="PATH", help="also draw the configured layout's memory per stage (PNG, SVG)")
    options = parser.parse_args(list(args))
    if options.devices is not None and options.device_memory is None:
        parser.error("--devices lists the layouts that fit a device: give --device-memory too")
    if options.device_memory is not None:
        try:
            options.device_memory = memory.parse_bytes(options.device_memory)
        except ValueError as err:
            parser.error(str(err))
    with torch.device("meta"), warnings.catch_warnings():  # a module building layers in __init__ allocates nothing
        warnings.filterwarnings("ignore", message=".*provide both args and command line arguments")  # args are ours
        # a plan trains nothing: no seed_everything, which would set PL_GLOBAL_SEED for the rest of the process
        cli = make_cli(["--config", options.config, "--seed_everything", "false"], run=False)
    strategy = cli.trainer.strategy
    if not isinstance(strategy, lightning_smp.SMPStrategy):
        parser.error(
            f"the config's trainer.strategy is {type(strategy).__name__}; estimate plans SMPStrategy layouts: set "
            "trainer.strategy to smp, smp_fp16, smp_bf16 or class_path: lightning_smp.SMPStrategy."
        )
    config = strategy.config
    world_size = cli.trainer.num_devices * cli.trainer.num_nodes
    blueprint = copy.deepcopy(cli.model)  # before configure_model: rebuilt per tensor-parallel degree below
    activations = {
        "batch": _replica_batch(_first_batch(cli), config),
        "micro_batch_size": options.micro_batch_size,
        "sequence_length": options.sequence_length,
    }
    model = _build_on_meta(cli.model, config, world_size)
    report = memory.estimate_memory(
        model, config=config, world_size=world_size, device_memory=options.device_memory, **activations
    )
    print(report)
    if options.plot is not None:
        print(f"\nWrote the chart to {report.plot(options.plot)}.")
    if options.devices is not None:
        measured = report.ranks[0].activations is not None
        _print_fitting_layouts(blueprint, config, options, activations, measured=measured)
        if measured and options.context_parallel:
            _print_context_parallel_layouts(blueprint, config, options, activations)


def _first_batch(cli: LightningCLI) -> Any:
    """One training batch of the config's data (its datamodule's, else the model's own dataloader), or None."""
    source = cli.datamodule if cli.datamodule is not None else cli.model
    try:
        if isinstance(source, pl.LightningDataModule):
            source.prepare_data()
            source.setup("fit")
        return next(iter(source.train_dataloader()))
    except Exception as error:  # no data, or data not reachable here: the report says activations are unknown
        warnings.warn(
            f"estimate: no training batch from the config's data ({type(error).__name__}: {error})", stacklevel=2
        )
        return None


def _replica_batch(batch: Any, config: SMPConfig) -> Any:
    """What one data-parallel replica trains on per step, from one rank's loader ``batch``: under tensor
    parallelism with smp's ``prescaled_batch=False`` each tensor-parallel rank reads its own batch and the group
    trains on their union, tp times the loader's samples (the planner measures that many, as the run computes)."""
    tp = config.tensor_parallel_degree
    if batch is None or tp == 1 or config.prescaled_batch:
        return batch
    return tree_map(lambda value: torch.cat([value] * tp) if isinstance(value, torch.Tensor) else value, batch)


def _print_fitting_layouts(
    blueprint: pl.LightningModule,
    config: SMPConfig,
    options: argparse.Namespace,
    activations: dict[str, Any],
    *,
    measured: bool,
) -> None:
    """The layouts of ``options.devices`` devices that fit, each tensor-parallel degree built from ``blueprint``."""

    config = dataclasses.replace(config, context_parallel_degree=1)  # cp layouts: `_print_context_parallel_layouts`

    def build(tp: int) -> pl.LightningModule:
        layout = dataclasses.replace(config, tensor_parallel_degree=tp, pipeline_parallel_degree=1, partition=None)
        return _build_on_meta(copy.deepcopy(blueprint), layout, tp)

    fitting = memory.fitting_layouts(
        build, devices=options.devices, device_memory=options.device_memory, config=config, **activations
    )
    size = memory.format_bytes(options.device_memory)
    if not measured:
        print(f"\nNo layout of {options.devices} device(s) is known to fit {size}: the activations were not measured.")
        return
    if not fitting:
        print(f"\nNo pp x tp x dp layout of {options.devices} device(s) fits {size} per device.")
        return
    print(f"\nLayouts of {options.devices} device(s) that fit {size} per device, smallest model-parallel degree first:")
    print(memory.layouts_table(fitting))


def _print_context_parallel_layouts(
    blueprint: pl.LightningModule, config: SMPConfig, options: argparse.Namespace, activations: dict[str, Any]
) -> None:
    """The context-parallel layouts (cp x dp, no pipeline or tensor parallelism) of ``options.devices`` devices: each
    rank holds the whole model and 1/cp of every sequence (`memory.estimate_memory` traces that part)."""
    base = dataclasses.replace(config, pipeline_parallel_degree=1, tensor_parallel_degree=1, partition=None)
    rows = []
    for cp in (degree for degree in range(2, options.devices + 1) if options.devices % degree == 0):
        layout = dataclasses.replace(base, context_parallel_degree=cp)
        try:
            model = _build_on_meta(copy.deepcopy(blueprint), layout, cp)
            report = memory.estimate_memory(
                model, config=layout, world_size=options.devices, device_memory=options.device_memory, **activations
            )
        except ValueError:
            continue  # the sequence does not split into 2 x cp chunks
        largest = report.largest
        rows.append(
            f"| {cp} | {options.devices // cp} | {memory.format_bytes(largest.activations or 0)} | "
            f"{memory.format_bytes(largest.total)} | {'yes' if report.fits else 'no'} |"
        )
    if not rows:
        return
    print(f"\nContext-parallel layouts of {options.devices} device(s) (docs/long-context.md), whole model per rank:")
    print("| cp | dp | activations | largest rank | fits |\n| ---: | ---: | ---: | ---: | --- |")
    print("\n".join(rows))


def _build_on_meta(module: pl.LightningModule, config: SMPConfig, world_size: int) -> pl.LightningModule:
    """Run ``configure_model`` on the meta device, with the smp facade answering for ``config``'s layout."""
    with smp.preview(config, world_size=world_size), torch.device("meta"):
        module.configure_model()
    return module


def make_cli(args: ArgsType = None, *, run: bool = True, **cli_kwargs: Any) -> LightningCLI:
    """The `LightningCLI` behind ``lightning-smp``; ``args`` replaces ``sys.argv[1:]`` (a list, dict or Namespace).

    ``cli_kwargs`` go to `LightningCLI` (for example ``save_config_kwargs``); with ``run=False`` it parses and
    builds the model, data and trainer without running a subcommand, as LightningCLI does.
    """
    _make_cwd_importable()
    trainer_defaults = {"strategy": "smp", **cli_kwargs.pop("trainer_defaults", {})}
    parser_kwargs = {"description": _DESCRIPTION, "prog": _prog(), **cli_kwargs.pop("parser_kwargs", {})}
    return _SMPCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=trainer_defaults,
        parser_kwargs=parser_kwargs,
        args=args,
        run=run,
        **cli_kwargs,
    )


class _SMPCLI(LightningCLI):
    """LightningCLI, except that an SMPStrategy gets only the settings the config gives: the parser fills in every
    default, and a default passed as a keyword argument would win over ``smp_options`` (`SMPConfig.from_sources`).
    A setting written in the config with its default value therefore counts as not given."""

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        strategy = config.get("trainer", {}).get("strategy")
        if not isinstance(strategy, Namespace) or not isinstance(strategy.get("init_args"), Namespace):
            return
        cls = import_object(strategy.class_path)
        if not (isinstance(cls, type) and issubclass(cls, lightning_smp.SMPStrategy)):
            return
        settings = {field.name: field.default for field in dataclasses.fields(SMPConfig)}
        for name in list(vars(strategy.init_args)):
            if name in settings and strategy.init_args[name] == settings[name]:
                del strategy.init_args[name]


def _prog() -> str:
    """The command's name in usage lines: ``lightning-smp``, or ``python -m lightning_smp``."""
    return "python -m lightning_smp" if os.path.basename(sys.argv[0]) == "__main__.py" else "lightning-smp"


def _make_cwd_importable() -> None:
    """Let ``class_path: my_project.MyModule`` name modules in the current directory, as ``python -m`` does.

    The console script's own directory (the venv's ``bin``) is what Python puts first on ``sys.path`` instead.
    """
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
