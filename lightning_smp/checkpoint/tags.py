"""smp's tagged checkpoints: ``<folder>/<tag>_partial`` directories and a ``newest`` file naming the latest.

Owns that layout (for `smp.save_checkpoint` / `smp.resume_from_checkpoint`) and keeping only the newest few. Not
owned: the checkpoints themselves, which are ordinary ones (`saving.py`). The ``newest`` file is replaced by a
rename, so a reader never sees it half written.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_smp.checkpoint.storage import remove, staging_path
from lightning_smp.checkpoint.verification import META_FILENAME, CheckpointError, is_sharded_checkpoint

__all__ = ["record_newest", "tagged_path"]

_NEWEST = "newest"


def tagged_path(path: str | os.PathLike, tag: str | None = None) -> Path:
    """smp's layout: checkpoint ``tag`` of the folder ``path`` is ``<path>/<tag>_partial``; with no ``tag``, the one
    named in ``<path>/newest`` (written by `record_newest`)."""
    path = Path(path)
    if tag is None:
        try:
            tag = (path / _NEWEST).read_text().strip()
        except FileNotFoundError:
            raise CheckpointError(
                f"{str(path)!r} has no {_NEWEST!r} file naming its latest checkpoint; pass the tag, e.g. "
                "`smp.resume_from_checkpoint(path, tag='step_1000')`."
            ) from None
    return path / f"{tag}_partial"


def record_newest(path: str | os.PathLike, tag: str, *, keep: int | None = None) -> None:
    """After a tagged save (one rank): name ``tag`` in ``<path>/newest`` (atomically) and delete the oldest tagged
    checkpoints beyond ``keep``, as smp's ``num_kept_partial_checkpoints``."""
    path = Path(path)
    temporary = staging_path(path / _NEWEST)
    temporary.write_text(tag)
    os.replace(temporary, path / _NEWEST)
    if keep is not None:
        tagged = [p for p in path.glob("*_partial") if is_sharded_checkpoint(p) and p.name != f"{tag}_partial"]
        tagged.sort(key=lambda p: (p / META_FILENAME).stat().st_mtime)
        for old in tagged[: max(0, len(tagged) - (keep - 1))]:
            remove(old)
