"""Preemption without lost work: once every rank has stopped at the agreed step, save that step, requeue, exit.

Owns what follows the stop that `fault_tolerance.SchedulerSignal` agrees on: where the preemption checkpoint goes
and its name, the exit code that says "preempted, state saved", ``scontrol requeue`` under SLURM, and what
``ckpt_path="last"`` names under SMPStrategy (the newest complete checkpoint, a preemption save or a
``ModelCheckpoint`` one; none on a first run). Not owned: how a checkpoint reaches the disk whole (`checkpoint/`),
the data position on resume (`data_position`).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_smp import checkpoint as checkpointing

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PREEMPTED_PREFIX",
    "check_torchelastic_restarts",
    "checkpoint_directory",
    "newest_complete_checkpoint",
    "preempted",
    "requeue_slurm_job",
    "save_preempted",
    "search_directories",
]

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""The exit code of every rank after a preemption save: EX_TEMPFAIL of sysexits.h ("temporary failure, try
again"), distinct from success (0), an error (1) and a death by signal (128 + n, or negative under Python)."""
PREEMPTED_PREFIX = "preempted-step="
"""A preemption checkpoint is ``<checkpoint_directory>/preempted-step=<global step>.ckpt``; a newer one replaces it."""


def checkpoint_directory(trainer: pl.Trainer) -> Path:
    """Where a preemption save goes: the first ``ModelCheckpoint``'s directory (once set up: its ``dirpath``, or the
    one it chose), else ``<default_root_dir>/checkpoints`` (where ``ModelCheckpoint`` saves without a logger)."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return Path(callback.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def preempted(trainer: pl.Trainer, stop: SystemExit, *, requeue: bool) -> None:
    """Once every rank stopped at the agreed step (the ``stop`` exception is on its way out of ``fit``): the normal
    save, outside any signal handler; ``scontrol requeue`` from rank 0 when ``requeue`` (the requeue signal came);
    the exit code `PREEMPTED_EXIT_CODE`."""
    save_preempted(trainer)
    if trainer.is_global_zero and requeue:
        requeue_slurm_job(trainer.strategy.cluster_environment)
    stop.code = PREEMPTED_EXIT_CODE


def save_preempted(trainer: pl.Trainer) -> Path:
    """Save the trainer's state as ``preempted-step=N.ckpt`` (collective: every rank calls it, at the same step;
    after an asynchronous save in flight, and whole when it returns), then, on rank 0, delete older preemption
    saves of that directory. Returns the path."""
    directory = checkpoint_directory(trainer)
    path = directory / f"{PREEMPTED_PREFIX}{trainer.global_step}.ckpt"
    trainer.save_checkpoint(path)
    checkpointing.wait_for_saves()  # whole before anything older goes, and before the exit
    if trainer.is_global_zero:
        for old in directory.glob(f"{PREEMPTED_PREFIX}*.ckpt"):
            if old != path:
                checkpointing.remove(old)
    trainer.strategy.barrier("lightning_smp.preemption")  # every rank leaves with one preemption save on disk
    rank_zero_info(f"lightning_smp: preempted; the training state of step {trainer.global_step} is saved at {path}")
    return path


def requeue_slurm_job(environment: object) -> bool:
    """Under ``SLURMEnvironment(auto_requeue=True)``, run ``scontrol requeue <job id>`` (on one rank); whether it
    was requeued. Elsewhere, nothing."""
    if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return False
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        rank_zero_warn(f"lightning_smp: not requeueing: SLURM_JOB_ID is {job!r}, not a job id.")
        return False
    try:
        code = subprocess.call(["scontrol", "requeue", job])
    except OSError as error:
        rank_zero_warn(f"lightning_smp: `scontrol requeue {job}` could not run ({error}); the job is not requeued.")
        return False
    if code != 0:
        rank_zero_warn(f"lightning_smp: `scontrol requeue {job}` failed with exit code {code}.")
        return False
    log.info("lightning_smp: requeued SLURM job %s", job)
    return True


def check_torchelastic_restarts() -> None:
    """Warn, at setup, when torchrun may restart this job (``--max-restarts`` above 0) while its workers share the
    rendezvous store: torch 2.13's restarted attempt then fails in the process-group setup after a long wait
    ("Gloo connectFullMesh failed ... Connect timeout", pytorch#135712; measured in tests/test_fault_tolerance.py)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank_zero_warn(
            f"lightning_smp: torchrun may restart this job (--max-restarts {restarts}), but its workers share the "
            "rendezvous store, and a restarted attempt cannot set up its process group then (pytorch#135712). Set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment: "
            "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts ... train.py`."
        )


def search_directories(trainer: pl.Trainer) -> list[Path]:
    """Where ``ckpt_path="last"`` looks, before setup: the preemption directory as a run without a logger or
    ``ModelCheckpoint`` directory has it, each ``ModelCheckpoint``'s ``dirpath``, and, for those without one, every
    version's ``checkpoints`` of the first logger (a restarted job's logger starts a new version)."""
    directories = [Path(trainer.default_root_dir) / "checkpoints"]
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.dirpath:
            directories.append(Path(callback.dirpath))
        elif trainer.loggers and trainer.loggers[0].save_dir is not None:
            logger = trainer.loggers[0]
            directories.extend(sorted(Path(logger.save_dir, str(logger.name or "")).glob("*/checkpoints")))
    return list(dict.fromkeys(directories))


def newest_complete_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest complete checkpoint in `search_directories` (by the time its last file was written), or None
    with a note that training starts fresh. Complete: a sharded checkpoint with its meta file, which a save writes
    last and publishes by a rename (a half-written one has a hidden staging name), or a single file."""
    candidates, directories = {}, search_directories(trainer)
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in directory.glob("*.ckpt"):
            if checkpointing.is_sharded_checkpoint(path):
                candidates[path] = (path / checkpointing.META_FILENAME).stat().st_mtime
            elif path.is_file():
                candidates[path] = path.stat().st_mtime
    if not candidates:
        rank_zero_info(
            'lightning_smp: `ckpt_path="last"`: no checkpoint in '
            f"{', '.join(str(d) for d in directories)}; training starts from the beginning."
        )
        return None
    newest = max(candidates, key=lambda path: (candidates[path], path.name))
    rank_zero_info(f'lightning_smp: `ckpt_path="last"` resumes from {newest}')
    return str(newest)
