"""smp's checkpoint calls: ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` through the running run's
sharded checkpoints (tags, the ``newest`` file, partial checkpoints kept; the Trainer's or an smp script's), and
``smp.save`` / ``smp.load`` of any object per model-parallel rank, as smp wrote them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_smp import checkpoint as _checkpoint
from lightning_smp.smp.run import current, running

__all__ = [
    "load",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
]


def save_checkpoint(
    path: str,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """smp's ``save_checkpoint``: the run's full training state to ``<path>/<tag>_partial``, named in
    ``<path>/newest``; call it on every rank. ``user_content`` comes back from `resume_from_checkpoint`.

    It is the strategy's sharded checkpoint (model, fp32 masters, optimizer, loss scaler, loops), so it loads
    under any layout, which smp's partial checkpoints could not; ``partial=False`` writes the same (use
    ``lightning_smp.consolidate_checkpoint`` for one file). ``model`` and ``optimizer`` are the strategy's.
    """
    run = running("save_checkpoint", "after fit returns, `trainer.save_checkpoint(path)` writes the same checkpoint")
    assert run.save_checkpoint is not None and run.group is not None  # a running record has its callables
    run.save_checkpoint(_checkpoint.tagged_path(path, tag), user_content)
    if run.ranks["world"] == 0:
        _checkpoint.record_newest(path, tag, keep=num_kept_partial_checkpoints)
    dist.barrier(group=run.group("world"))


def save(obj: Any, f: str | os.PathLike, partial: bool = True, **_: Any) -> None:
    """smp's ``smp.save``: with ``partial`` each model-parallel rank of the first data-parallel replica writes its
    ``obj`` (``model.local_state_dict()``, say) to ``<f>_<pp_rank>_<tp_rank>``; without, rank 0 writes ``f``. Call it
    on every rank. Each file appears whole or not at all (written beside, then renamed). A sharded training state
    that loads under any layout is ``smp.save_checkpoint``'s."""
    run = running("save", "after fit returns, `trainer.save_checkpoint(path)` writes the whole training state")
    writes = run.ranks["rdp"] == 0 if partial else run.ranks["world"] == 0
    if writes:
        target = Path(_partial_path(f, run.ranks) if partial else f)
        staging = target.with_name(f".{target.name}.tmp")
        torch.save(obj, staging)
        os.replace(staging, target)
    assert run.group is not None  # a running record has its callables
    dist.barrier(group=run.group("world"))


def load(f: str | os.PathLike, partial: bool = True, **kwargs: Any) -> Any:
    """smp's ``smp.load``: what `save` wrote for this rank (``partial``: this rank's ``<f>_<pp_rank>_<tp_rank>``,
    written by the first replica's rank of the same place), on the CPU; ``kwargs`` go to ``torch.load``."""
    path = _partial_path(f, current().ranks) if partial else os.fspath(f)
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"smp.load({os.fspath(f)!r}, partial={partial}) found no {path}: save it with smp.save(obj, "
            f"{os.fspath(f)!r}, partial={partial}) first, under the same pipeline and tensor-parallel degrees, or use "
            "smp.save_checkpoint / smp.resume_from_checkpoint, which load under any layout."
        )
    return torch.load(path, **{"map_location": "cpu", **kwargs})


def _partial_path(f: str | os.PathLike, ranks: Any) -> str:
    return f"{os.fspath(f)}_{ranks['pp']}_{ranks['tp']}"


def resume_from_checkpoint(
    path: str,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    **_: Any,
) -> Any:
    """smp's ``resume_from_checkpoint``: load checkpoint ``tag`` (default: the newest) of ``path`` into the running
    model and optimizers, whatever layout saved it; returns its ``user_content``. Call it on every rank once the
    model and optimizers exist (``on_fit_start`` or later). Loops and LR schedulers resume with Lightning's
    ``trainer.fit(model, ckpt_path=...)`` on the same directory, which is the way to resume a whole run.
    """
    target = _checkpoint.tagged_path(path, tag)
    load = current().load_checkpoint
    loaded = load(target, strict, load_optimizer) if load is not None else None
    if loaded is None:
        raise RuntimeError(
            "smp.resume_from_checkpoint() loads into the running model and optimizers: call it inside the "
            "LightningModule's `on_fit_start` (or later), or resume the whole run (loops and schedulers too) with "
            f"`trainer.fit(model, ckpt_path={str(target)!r})`."
        )
    return loaded.get("user_content")
