"""The data position on resume: a fit resumed mid-epoch continues the epoch at the batch its checkpoint reached.

Lightning restores a loader with ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``) itself, but
restarts an ordinary ``DataLoader`` at the epoch's first batch. Owns positioning that one: a map-style loader with a
deterministic sampler (Lightning's ``DistributedSampler``, or a ``SequentialSampler``) skips the consumed indices,
as the Hugging Face Trainer does, loading none of them; any other gets a warning saying which batches repeat.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler, SequentialSampler

__all__ = ["SkipFirst", "position_resumed", "position_train_dataloader"]


class SkipFirst(Sampler):
    """``sampler``'s indices without the first ``count`` of its next pass; later passes are whole. Its length and
    ``set_epoch`` are the wrapped sampler's (Lightning counts the epoch's batches from the saved index on)."""

    def __init__(self, sampler: Sampler, count: int) -> None:
        self.sampler, self.count = sampler, count

    def __iter__(self) -> Iterator[Any]:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.sampler), count, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)


def position_resumed(trainer: pl.Trainer, dataloader: object) -> object:
    """The training ``dataloader`` of a fit resumed from a checkpoint (restored before the loader is set up),
    positioned at the batch its epoch had reached (`position_train_dataloader`); any other, as it is."""
    # the batches the checkpoint's step had trained on: ``processed`` (``completed`` lags by one in a checkpoint
    # saved at a batch's end, as ModelCheckpoint saves, until Lightning's loop catches it up after this hook)
    consumed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    length = len(dataloader) if hasattr(dataloader, "__len__") else None
    if trainer.ckpt_path is None or (length is not None and consumed >= length):
        return dataloader  # a fresh fit, or a checkpoint saved at an epoch's end
    return position_train_dataloader(dataloader, consumed, epoch=trainer.current_epoch)


def position_train_dataloader(dataloader: object, consumed: int, *, epoch: int) -> object:
    """Have the training ``dataloader`` (as Lightning processed it, its distributed sampler in place) start at batch
    ``consumed`` of its next pass, the batches of the resumed epoch that the checkpoint's step had trained on.
    Returns the loader (the same object). Nothing to do at an epoch's start or for a resumable loader; a loader
    that cannot be positioned is returned as it is, with a warning."""
    if consumed <= 0 or _is_resumable(dataloader):
        return dataloader
    reason = _why_not_positionable(dataloader)
    if reason is not None:
        rank_zero_warn(
            f"lightning_smp: resuming in the middle of epoch {epoch}, after its first {consumed} batches, but the "
            f"train dataloader cannot be positioned there ({reason}): it starts the epoch again from its first "
            f"batch, so those {consumed} batches are trained on twice and the epoch's last {consumed} are not. Use a "
            "map-style DataLoader with Lightning's distributed sampler (the default), or torchdata's "
            "StatefulDataLoader."
        )
        return dataloader
    batch_sampler = dataloader.batch_sampler
    batch_sampler.sampler = SkipFirst(batch_sampler.sampler, consumed * batch_sampler.batch_size)
    return dataloader


def _is_resumable(dataloader: object) -> bool:
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def _why_not_positionable(dataloader: object) -> str | None:
    if not isinstance(dataloader, DataLoader):
        return f"a {type(dataloader).__name__}, not a torch DataLoader"
    if isinstance(dataloader.dataset, IterableDataset):
        return "an iterable-style dataset"
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler:
        return f"its batch sampler is a {type(batch_sampler).__name__}, not torch's BatchSampler"
    if not isinstance(batch_sampler.sampler, DistributedSampler | SequentialSampler):
        return f"its sampler, a {type(batch_sampler.sampler).__name__}, may not repeat its order"
    return None
