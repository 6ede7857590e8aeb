"""How a checkpoint reaches the disk whole: a hidden staging directory, the atomic publish, fsync and removal.

Owns the files' life (staging beside the target, the two renames of a publish, ``.previous``, deleting), SIGTERM
held off during a save, and the two object collectives a save and a load need. Not owned: what goes into the
files (`saving.py`) or whether what is on disk is whole (`verification.py`). Everything is written under a
temporary name and renamed into place, so a crash at any point leaves the previous checkpoint and nothing that
looks whole.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_object",
    "broadcast_object",
    "fsync_dir",
    "glob_escape",
    "previous_path",
    "publish",
    "remove",
    "remove_path",
    "remove_stale_staging",
    "signals_deferred",
    "staging_path",
    "write_file",
]


def publish(staging: Path, path: Path) -> None:
    """Rename the finished ``staging`` directory to ``path`` (rank 0). An existing checkpoint at ``path`` moves to
    ``<path>.previous`` first and is deleted last, so one of the two is whole at every moment; `load` falls back
    to ``.previous`` when a crash came between the two renames."""
    fsync_dir(staging)
    previous = previous_path(path)
    if path.exists() or path.is_symlink():
        remove_path(previous)
        os.replace(path, previous)
        os.replace(staging, path)
        fsync_dir(path.parent)
        remove_path(previous)
    else:
        os.replace(staging, path)
        fsync_dir(path.parent)
        remove_path(previous)  # left by a crash between the two renames of an earlier save


def staging_path(path: Path) -> Path:
    # hidden and without the final suffix, so neither a user nor ModelCheckpoint's `*.ckpt` search takes it
    return path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:12]}")


def remove_stale_staging(path: Path) -> None:
    """Delete the leftovers of earlier saves to ``path`` that a crash interrupted."""
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{glob_escape(path.name)}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def previous_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.previous")


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint (a directory or a file) and any ``.previous`` copy of it; call on one rank."""
    path = Path(path)
    remove_path(path)
    remove_path(previous_path(path))


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGTERM until the block is done: a scheduler's SIGTERM arriving mid-save must neither interrupt the
    write nor run Lightning's handler, whose collective would interleave with DCP's (a hang). It is delivered
    to the previous handler right after, at the same point on every rank that received it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            if callable(previous):
                previous(signal.SIGTERM, None)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)


def write_file(path: Path, obj: Any) -> None:
    with open(path, "wb") as stream:
        torch.save(obj, stream)
        stream.flush()
        os.fsync(stream.fileno())


def fsync_dir(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. a filesystem that does not open directories; the renames are still atomic
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj: Any, group: Any = None) -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
