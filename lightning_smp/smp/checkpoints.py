"""smp's checkpoint calls: ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` through the running run's
sharded checkpoints (tags, the ``newest`` file, partial checkpoints kept), and ``smp.save`` / ``smp.load`` with the
way to replace them.
"""

from __future__ import annotations

from typing import Any

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


def save(obj: Any, f: Any, partial: bool = True, **kwargs: Any) -> None:
    """smp's ``smp.save`` wrote ``obj`` per rank (``partial``) or once; lightning_smp saves the run's state itself."""
    raise RuntimeError(_SAVE_INSTEAD.format(call="smp.save"))


def load(f: Any, partial: bool = True, **kwargs: Any) -> Any:
    """smp's ``smp.load``: see `save`."""
    raise RuntimeError(_SAVE_INSTEAD.format(call="smp.load"))


_SAVE_INSTEAD = (
    "{call}() is not provided by lightning_smp: save the training state with trainer.save_checkpoint(path) or "
    "smp.save_checkpoint(path, tag) (sharded, loadable under any layout), make one file of it with "
    "lightning_smp.consolidate_checkpoint(path), and save other objects with torch.save / torch.load on the ranks "
    "you choose (e.g. `if smp.rank() == 0:`)."
)


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
