"""smp's ranks, sizes, process groups and barriers, answered from the run's record (`run`): ``dp`` counts
tensor-parallel ranks as data parallel (world / pp), ``rdp`` is the number of true model replicas (our data-parallel
degree), ``mp`` is pp × tp, ``cp`` the ranks that split one sequence. Ranks and sizes answer outside a run too;
groups and barriers need a running one.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp.context_parallel import sequence as cp_sequence
from lightning_smp.smp.run import COLLECTIVES_AFTER_A_RUN, current, running

__all__ = [
    "CommGroup",
    "RankType",
    "axis_group",
    "axis_of",
    "barrier",
    "cp_positions",
    "cp_rank",
    "cp_size",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "get_dp_process_group",
    "get_mp_process_group",
    "get_pp_process_group",
    "get_rdp_process_group",
    "get_tp_process_group",
    "get_world_process_group",
    "local_rank",
    "local_size",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "size",
    "tp_barrier",
    "tp_rank",
    "tp_size",
]


# Ranks and sizes answer from the run's record, running or last (one process before any run).


def rank() -> int:
    return current().ranks["world"]


def size() -> int:
    return current().sizes["world"]


def local_rank() -> int:
    return current().ranks["local"]


def local_size() -> int:
    return current().sizes["local"]


def _axis_rank(smp_axis: str) -> int:
    return current().ranks[smp_axis]


def _axis_size(smp_axis: str) -> int:
    return current().sizes[smp_axis]


def axis_group(smp_axis: str, caller: str | None = None) -> dist.ProcessGroup:
    """The process group of ``smp_axis`` holding this rank; ``caller`` names the facade call in the error raised
    outside a run (default: the group getter)."""
    group = running(caller or f"get_{smp_axis}_process_group", COLLECTIVES_AFTER_A_RUN).group
    assert group is not None  # a running record has its callables
    return group(smp_axis)


def _axis_barrier(smp_axis: str) -> None:
    dist.barrier(group=axis_group(smp_axis, f"{smp_axis}_barrier" if smp_axis != "world" else "barrier"))


def dp_rank() -> int:
    return _axis_rank("dp")


def dp_size() -> int:
    return _axis_size("dp")


def rdp_rank() -> int:
    return _axis_rank("rdp")


def rdp_size() -> int:
    return _axis_size("rdp")


def pp_rank() -> int:
    return _axis_rank("pp")


def pp_size() -> int:
    return _axis_size("pp")


def tp_rank() -> int:
    return _axis_rank("tp")


def tp_size() -> int:
    return _axis_size("tp")


def cp_rank() -> int:
    """This rank's index in its context-parallel group (smp v2's ``cp_rank``)."""
    return _axis_rank("cp")


def cp_size() -> int:
    """The context-parallel degree: ranks each sequence is split over (smp v2's ``cp_size``)."""
    return _axis_size("cp")


def cp_positions(local_length: int, device: torch.device | None = None) -> Tensor:
    """The global positions of this rank's ``local_length`` tokens, (local_length,): what a model that computes
    its own positions (a position embedding, rotary angles) uses in place of ``torch.arange(local_length)``. Under
    context parallelism each rank holds two chunks of every sequence (its head chunk r and tail chunk 2·cp−1−r);
    without it, ``arange(local_length)``. Hugging Face models need nothing: the strategy gives them position ids."""
    return cp_sequence.positions(local_length, cp=cp_size(), rank=cp_rank(), device=device)


def mp_rank() -> int:
    return _axis_rank("mp")


def mp_size() -> int:
    return _axis_size("mp")


def get_dp_process_group() -> dist.ProcessGroup:
    return axis_group("dp")


def get_rdp_process_group() -> dist.ProcessGroup:
    return axis_group("rdp")


def get_pp_process_group() -> dist.ProcessGroup:
    return axis_group("pp")


def get_tp_process_group() -> dist.ProcessGroup:
    return axis_group("tp")


def get_mp_process_group() -> dist.ProcessGroup:
    return axis_group("mp")


def get_world_process_group() -> dist.ProcessGroup:
    return axis_group("world")


def barrier(group: CommGroup | None = None) -> None:
    """smp's ``smp.barrier(group=smp.WORLD)``: wait for every rank of ``group``."""
    _axis_barrier("world" if group is None else axis_of(group, CommGroup, "barrier"))


def dp_barrier() -> None:
    _axis_barrier("dp")


def rdp_barrier() -> None:
    _axis_barrier("rdp")


def pp_barrier() -> None:
    _axis_barrier("pp")


def tp_barrier() -> None:
    _axis_barrier("tp")


def mp_barrier() -> None:
    _axis_barrier("mp")


class CommGroup(Enum):
    """smp's communication groups, also named ``smp.WORLD``, ``smp.MP_GROUP``, ``smp.DP_GROUP``, ..."""

    WORLD = "world"
    MP_GROUP = "mp"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    DP_GROUP = "dp"
    RDP_GROUP = "rdp"


class RankType(Enum):
    """How smp's ``send`` and ``recv_from`` read a rank: within which group of the calling rank."""

    WORLD_RANK = "world"
    MP_RANK = "mp"
    PP_RANK = "pp"
    TP_RANK = "tp"
    DP_RANK = "dp"
    RDP_RANK = "rdp"


WORLD, MP_GROUP, PP_GROUP, TP_GROUP, DP_GROUP, RDP_GROUP = CommGroup


def axis_of(value: Any, kind: type[Enum], caller: str) -> str:
    if not isinstance(value, kind):
        example = "smp.CommGroup.PP_GROUP (or smp.PP_GROUP)" if kind is CommGroup else "smp.RankType.PP_RANK"
        raise ValueError(
            f"smp.{caller} takes an smp.{kind.__name__}, e.g. {example}; got {value!r}. Pass one of its members: "
            f"{', '.join(member.name for member in kind)}."
        )
    return value.value
