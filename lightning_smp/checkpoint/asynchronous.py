"""Asynchronous saves (``async_checkpoint=True``): a saving step copies its part of the checkpoint; a thread writes it.

Owns the snapshot (tensors and chunks copied to host memory, a DTensor's local piece on its device), the writer
thread with its own gloo group (its collectives never meet training's), and waiting: the next save, a preemption
save, a load and the run's end wait for the save in flight and raise its error. Not owned: what a save writes
(`saving.py`). torch DCP's ``async_save`` stages only tensors DCP knows; our chunked entries need this copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_smp.checkpoint.dcp_adapter import Chunks
from lightning_smp.checkpoint.verification import CheckpointError

__all__ = ["forget_process_group", "process_group", "snapshot", "submit", "wait"]


class _Writer:
    """The save in flight (at most one) and the process group its collectives use."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.group: Any = None
        self.world: Any = None


_writer = _Writer()


def process_group() -> Any:
    """The writers' gloo group over every rank (created collectively at the first asynchronous save of a job)."""
    if _writer.group is None or _writer.world is not dist.group.WORLD:
        _writer.group, _writer.world = dist.new_group(backend="gloo"), dist.group.WORLD
    return _writer.group


def forget_process_group() -> None:
    """Drop the writers' group (the process groups are being destroyed), after the save in flight."""
    wait()
    _writer.group = _writer.world = None


def snapshot(value: Any) -> Any:
    """``value`` with every tensor in it copied, so that training may change the originals while it is written."""
    if isinstance(value, DTensor):
        local = value.to_local().detach().clone()
        return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Chunks):
        return value.copied(lambda chunk: chunk.detach().to("cpu", copy=True))
    if isinstance(value, dict):
        return type(value)((key, snapshot(item)) for key, item in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(snapshot(item) for item in value)
    return value


def submit(write: Callable[[], None]) -> None:
    """Run ``write`` on the writer thread, once the save before it is whole."""
    wait()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the snapshot's device-to-host copies have landed
    _writer.thread = threading.Thread(target=_run, args=(write,), name="lightning_smp-async-save", daemon=True)
    _writer.thread.start()


def _run(write: Callable[[], None]) -> None:
    try:
        write()
    except BaseException as error:  # raised by `wait`, on the training thread
        _writer.error = error


def wait() -> None:
    """Block until the save in flight (if any) is published; raise its error here."""
    thread, _writer.thread = _writer.thread, None
    if thread is not None:
        thread.join()
    error, _writer.error = _writer.error, None
    if error is not None:
        raise CheckpointError(
            f"An asynchronous checkpoint save failed: {error}. Nothing was published (a checkpoint it was replacing "
            "is whole). Fix the cause, or pass `SMPStrategy(async_checkpoint=False)` to have the save raise at its "
            "own step."
        ) from error
