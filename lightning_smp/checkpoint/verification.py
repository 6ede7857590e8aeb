"""Checking a checkpoint before use: the meta record, the DCP index, and the size and CRC-32 of every shard file.

Owns the format's constants (the meta file, the record in it, the format version), `CheckpointError`, the record a
save writes about its run and its files, and which directory a path means (falling back to ``.previous``). Not
owned: whether the checkpoint fits the model being loaded (`loading.py`) or how files are written (`storage.py`).
Problems are collected, not raised one by one, so a user sees all of them and every rank raises the same error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lightning_smp.checkpoint.storage import all_gather_object, glob_escape, previous_path
from lightning_smp.version import __version__

__all__ = [
    "FORMAT_VERSION",
    "META_FILENAME",
    "RECORD",
    "CheckpointError",
    "describe_own_files",
    "describe_run",
    "file_problems",
    "is_sharded_checkpoint",
    "raise_if_any",
    "read_checked",
    "read_dcp_metadata",
    "read_meta",
    "reraised_as_checkpoint_error",
    "resolve",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILENAME = "meta.pt"  # Lightning's name (lightning/fabric/utilities/load.py), so its tools see a sharded dir
RECORD = "lightning_smp"
_DCP_METADATA = ".metadata"
_SHARD_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_CRC_CHUNK = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked: the message says what is wrong, where, and what to do."""


def describe_run(*, topology: Any, config: Any, precision: str) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (its layout, precision and smp config)."""
    settings = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        settings[field.name] = dict(value) if isinstance(value, Mapping) else value
    return {
        "layout": {
            "dp": topology.dp,
            "pp": topology.pp,
            "tp": topology.tp,
            "cp": topology.cp,
            "order": topology.order,
            "world_size": topology.world_size,
        },
        "precision": precision,
        "config": settings,
    }


def describe_own_files(directory: Path, rank: int) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the shard files this rank wrote (reading them back from the page cache)."""
    files = {}
    for file in directory.iterdir():
        match = _SHARD_FILE.match(file.name)
        if match and int(match.group(1)) == rank:
            files[file.name] = {"rank": rank, "size": file.stat().st_size, "crc32": _crc32(file)}
    return files


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file()


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory to read for ``path``, or a `CheckpointError` saying why there is none."""
    path = Path(path)
    if path.exists():
        return path
    previous = previous_path(path)
    if is_sharded_checkpoint(previous):
        log.warning(
            "lightning_smp: %s is missing but %s is whole: a save that was replacing it was interrupted between "
            "its two renames. Loading the previous checkpoint.",
            path,
            previous,
        )
        return previous
    partial = sorted(path.parent.glob(f".{glob_escape(path.name)}.partial-*")) if path.parent.is_dir() else []
    hint = (
        f" An interrupted save left {partial[0].name} beside it; that one is incomplete and is never loaded."
        if partial
        else ""
    )
    raise CheckpointError(f"There is no checkpoint at {str(path)!r}.{hint}")


def read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    meta_file = path / META_FILENAME
    if not path.is_dir() or not meta_file.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a complete lightning_smp checkpoint: it has no {META_FILENAME}. A checkpoint "
            "directory gets it last, when every rank's files are written; without it, the save did not finish."
        )
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=bool(weights_only))
    except Exception as exception:
        raise CheckpointError(f"{str(meta_file)!r} cannot be read ({exception}); the checkpoint is damaged.") from None
    record = meta.get(RECORD) if isinstance(meta, dict) else None
    if record is None:
        raise CheckpointError(
            f"{str(path)!r} is a sharded checkpoint, but not one written by lightning_smp (its {META_FILENAME} has "
            f"no {RECORD!r} record). Load it with the strategy that wrote it, or consolidate it to one file first."
        )
    if record.get("format", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path)!r} has checkpoint format {record['format']} (lightning_smp {record.get('version')}); this "
            f"lightning_smp {__version__} reads format {FORMAT_VERSION} and older. Upgrade lightning_smp."
        )
    return meta


def read_checked(path: str | os.PathLike, action: str) -> tuple[Path, dict[str, Any], dict[str, Any], Metadata]:
    """For one process reading a checkpoint whole: its directory, meta dict (without the record), record and DCP
    index, after checking every shard file; a `CheckpointError` listing the problems saying it cannot ``action``."""
    path = resolve(path)
    if not path.is_dir():
        raise CheckpointError(
            f"Cannot {action} {str(path)!r}: it is a file, not a sharded lightning_smp checkpoint (the directory "
            "that `trainer.save_checkpoint` and `ModelCheckpoint` write under SMPStrategy). Pass that directory."
        )
    meta = read_meta(path, weights_only=False)
    record = meta.pop(RECORD)
    metadata = read_dcp_metadata(path)
    problems = file_problems(path, record, metadata, share=(0, 1))
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise CheckpointError(f"Cannot {action} the checkpoint {str(path)!r}:\n{listed}")
    return path, meta, record, metadata


def read_dcp_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"{str(path)!r} has no {_DCP_METADATA} file (the index of every rank's tensors); the checkpoint is "
            "incomplete. Use an earlier checkpoint."
        ) from None
    except Exception as exception:
        raise CheckpointError(
            f"{str(path / _DCP_METADATA)!r} cannot be read ({type(exception).__name__}: {exception}); the checkpoint "
            "is damaged. Use an earlier checkpoint."
        ) from None


def file_problems(path: Path, record: dict, metadata: Metadata, *, share: tuple[int, int]) -> list[str]:
    """Missing, truncated or corrupted shard files. Every file's size is checked; the CRC-32s are split over the
    ranks (``share`` = (rank, world size)), so each file is read once."""
    expected = dict(record.get("files", {}))
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    rank, world_size = share
    for position, name in enumerate(sorted(set(expected) | set(ends))):
        file = path / name
        writer = _writer_of(name, expected.get(name))
        if not file.is_file():
            problems.append(f"the shard file {name} ({writer}) is missing")
            continue
        size = file.stat().st_size
        want = expected.get(name, {}).get("size", ends.get(name, 0))
        if size < max(want, ends.get(name, 0)):
            problems.append(f"the shard file {name} ({writer}) is truncated: {size} bytes, {want} were written")
        elif name in expected and size != want:
            problems.append(f"the shard file {name} ({writer}) has changed: {size} bytes, {want} were written")
        elif name in expected and position % world_size == rank and _crc32(file) != expected[name]["crc32"]:
            problems.append(f"the shard file {name} ({writer}) is corrupted: its CRC-32 differs from the one saved")
    return problems


def _writer_of(name: str, info: dict | None) -> str:
    match = _SHARD_FILE.match(name)
    rank = info["rank"] if info else (int(match.group(1)) if match else None)
    return f"written by rank {rank}" if rank is not None else "written at save"


def raise_if_any(problems: list[str], path: Path) -> None:
    """Raise one `CheckpointError` on every rank if any rank has problems (collective when distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = all_gather_object(problems)
        problems = list(dict.fromkeys(problem for part in gathered for problem in part))
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"Cannot load the checkpoint {str(path)!r}:\n{listed}{more}")


@contextmanager
def reraised_as_checkpoint_error(what: str) -> Iterator[None]:
    """DCP raises one `CheckpointException` (a BaseException) on every rank with each failed rank's error; name
    them in a `CheckpointError` (the traceback of each stays attached as the cause)."""
    try:
        yield
    except CheckpointException as exception:
        failures = "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in sorted(exception.failures.items())
        )
        raise CheckpointError(f"{what} ({failures}).") from exception


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as stream:
        while chunk := stream.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
