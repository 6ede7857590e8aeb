"""Python objects between ranks as smp sends them: `broadcast` over a `CommGroup`, `send` / `recv_from` a rank of a
`RankType`, `allgather`; each over the running run's process group of that axis.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_smp.smp.ranks import CommGroup, RankType, axis_group, axis_of

__all__ = [
    "allgather",
    "broadcast",
    "recv_from",
    "send",
]


def broadcast(obj: Any, group: CommGroup) -> None:
    """smp's ``smp.broadcast``: send the picklable ``obj`` to every other rank of ``group``, each of which takes it
    with ``smp.recv_from(<this rank in the group>, <the group's RankType>)`` (point to point, not a collective)."""
    process_group = axis_group(axis_of(group, CommGroup, "broadcast"), "broadcast")
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(process_group):
        if peer != me:
            dist.send_object_list([obj], dst=peer, group=process_group)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """smp's ``smp.send``: send the picklable ``obj`` to the rank ``dest_rank`` of ``rank_type``'s group; it
    takes it with ``smp.recv_from``."""
    process_group, peer = _peer(dest_rank, rank_type, "send")
    dist.send_object_list([obj], dst=peer, group=process_group)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """smp's ``smp.recv_from``: the object rank ``src_rank`` of ``rank_type``'s group sent with ``smp.send`` or
    ``smp.broadcast``."""
    process_group, peer = _peer(src_rank, rank_type, "recv_from")
    received: list[Any] = [None]
    dist.recv_object_list(received, src=peer, group=process_group)
    return received[0]


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """smp's ``smp.allgather``: every rank of ``group`` passes an object; each gets the list of them, in the
    group's rank order (a collective: every rank of the group calls it)."""
    process_group = axis_group(axis_of(group, CommGroup, "allgather"), "allgather")
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, obj, group=process_group)
    return gathered


def _peer(rank_in_group: int, rank_type: RankType, caller: str) -> tuple[dist.ProcessGroup, int]:
    """The process group of ``rank_type`` holding this rank, and the global rank of its member ``rank_in_group``."""
    process_group = axis_group(axis_of(rank_type, RankType, caller), caller)
    size = dist.get_world_size(process_group)
    if not isinstance(rank_in_group, int) or not 0 <= rank_in_group < size:
        raise ValueError(
            f"smp.{caller}: rank {rank_in_group!r} is not in this rank's {rank_type.name} group, which has ranks "
            f"0..{size - 1}; pass a rank within it (smp.{rank_type.value}_rank() numbers them)."
        )
    peer = dist.get_global_rank(process_group, rank_in_group)
    if peer == dist.get_rank():
        raise ValueError(
            f"smp.{caller}: rank {rank_in_group} of the {rank_type.name} group is this rank itself; pass another "
            "rank of the group."
        )
    return process_group, peer
