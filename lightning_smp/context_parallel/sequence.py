"""Which part of every sequence a context-parallel rank holds: the causal head-tail balance, and the batch split.

Owns the layout (pure functions over ints and tensors): a sequence of length T is cut into 2·cp chunks and rank r
keeps chunks r and 2·cp−1−r, side by side, so that under causal attention every rank attends over the same number
of (query, key) pairs, as torch's and Megatron's load balancers do; the global positions of a rank's tokens
(`positions`); the split of a batch (`split_batch`) and its inverse for one tensor (`gather`). Not owned: the
attention over the split sequence (`ring`) or when a step splits (the strategy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

__all__ = ["check_length", "chunks", "gather", "positions", "split", "split_batch"]


def chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks of 2·cp that rank ``rank`` of ``cp`` holds: its head chunk and its tail chunk."""
    return rank, 2 * cp - 1 - rank


def check_length(length: int, cp: int, *, what: str = "the sequence") -> None:
    """Raise, naming the fix, unless ``length`` splits into 2·cp equal chunks (any length passes at cp = 1)."""
    if cp > 1 and length % (2 * cp):
        raise ValueError(
            f"{what} has length {length}, which context_parallel_degree={cp} cannot split: every sequence is cut into "
            f"2 × {cp} = {2 * cp} equal chunks (each rank a head and a tail chunk, for causal balance). Pad or cut the "
            f"sequences to a multiple of {2 * cp} (e.g. {length + (-length) % (2 * cp)}), or change "
            "context_parallel_degree."
        )


def positions(local_length: int, *, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """The global positions of rank ``rank``'s ``local_length`` tokens, (local_length,): its head chunk's, then its
    tail chunk's. With cp == 1, ``arange(local_length)``."""
    if local_length % 2 and cp > 1:
        raise ValueError(
            f"a context-parallel rank holds two equal chunks, but local_length={local_length} is odd; pass the length "
            "of this rank's part of the sequence (its batch's dim 1 during a step)."
        )
    if cp == 1:
        return torch.arange(local_length, device=device)
    size = local_length // 2
    head, tail = chunks(cp, rank)
    return torch.cat([torch.arange(i * size, (i + 1) * size, device=device) for i in (head, tail)])


def split(tensor: Tensor, *, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's chunks of ``tensor`` along ``dim``: (…, T, …) → (…, T/cp, …), head chunk then tail chunk."""
    check_length(tensor.shape[dim], cp)
    pieces = tensor.chunk(2 * cp, dim)
    head, tail = chunks(cp, rank)
    return torch.cat([pieces[head], pieces[tail]], dim)


def gather(local: Tensor, *, group: dist.ProcessGroup, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's chunks (the inverse of `split`; a collective over ``group``, no
    gradient): (…, T/cp, …) → (…, T, …)."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    ordered: list[Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        head, tail = chunks(cp, rank)
        ordered[head], ordered[tail] = part.chunk(2, dim)
    return torch.cat(ordered, dim)  # type: ignore[arg-type]


def split_batch(batch: Any, *, cp: int, rank: int) -> Any:
    """``batch`` with every tensor of 2 or more dims (inputs, labels, position ids: (B, T, …)) cut to this rank's
    chunks along dim 1; other values unchanged. A Hugging Face style ``attention_mask`` must hide nothing: the ring
    attends over whole sequences, and a padding mask would be dropped silently."""
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), Tensor):
        mask = batch["attention_mask"]
        if not bool(mask.all()):  # sync: once per step, on a small integer tensor
            raise ValueError(
                "the batch's attention_mask hides some tokens (padding), which context parallelism cannot honour: its "
                "attention runs over whole sequences. Pack sequences without padding (every attention_mask entry 1), "
                "drop the attention_mask, or train with context_parallel_degree=1."
            )

    def cut(tensor: Tensor) -> Tensor:
        return split(tensor, cp=cp, rank=rank) if tensor.dim() >= 2 else tensor

    return apply_to_collection(batch, Tensor, cut)
