"""The ``lightning-smp`` command: Lightning's own `LightningCLI` with lightning_smp imported and ``smp`` as the
default strategy.

It owns only the entry point. Importing this module imports the package, which registers the ``smp*`` strategy
names, so a YAML config may say ``strategy: smp_fp16`` or ``class_path: lightning_smp.SMPStrategy``. Any
LightningModule and LightningDataModule are given by class path; the current directory is importable, as with
``python -m``. Parsing, subcommands and config files are LightningCLI's, unchanged (see its docs).

    lightning-smp fit --config examples/configs/dp.yaml
    python -m lightning_smp fit --config examples/configs/dp.yaml --trainer.max_steps 10
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_smp  # noqa: F401  (registers the strategy names)

__all__ = ["main", "make_cli"]

_DESCRIPTION = (
    "Train any LightningModule with SageMaker-model-parallel-style strategies: Lightning's CLI with lightning_smp "
    "imported (strategy names smp, smp_fp16, smp_bf16, ... and class_path: lightning_smp.SMPStrategy) and "
    "trainer.strategy defaulting to 'smp'."
)


def main(args: ArgsType = None) -> None:
    """The ``lightning-smp`` command; ``args`` replaces ``sys.argv[1:]``."""
    make_cli(args)


def make_cli(args: ArgsType = None, *, run: bool = True, **cli_kwargs: Any) -> LightningCLI:
    """The `LightningCLI` behind ``lightning-smp``; ``args`` replaces ``sys.argv[1:]`` (a list, dict or Namespace).

    ``cli_kwargs`` go to `LightningCLI` (for example ``save_config_kwargs``); with ``run=False`` it parses and
    builds the model, data and trainer without running a subcommand, as LightningCLI does.
    """
    _make_cwd_importable()
    trainer_defaults = {"strategy": "smp", **cli_kwargs.pop("trainer_defaults", {})}
    parser_kwargs = {"description": _DESCRIPTION, "prog": _prog(), **cli_kwargs.pop("parser_kwargs", {})}
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=trainer_defaults,
        parser_kwargs=parser_kwargs,
        args=args,
        run=run,
        **cli_kwargs,
    )


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
