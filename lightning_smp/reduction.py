"""Who reduces the gradients over the data-parallel replicas: one plan, decided once, and the buckets it reduces in.

Owns the decision (`plan_reduction`, pure: the strategy, the pipeline engine and the precision plugin read its
`ReductionPlan` instead of asking the config again) and the one bucketing rule every coalesced collective of the
package uses (`buckets`, `backward_buckets`, `start_all_reduce`, `all_reduce_`). Four mechanisms, one per run:
DDP's bucketed all-reduce overlapped with backward (plain data parallelism), the pipeline engine's all-reduce,
started bucket by bucket during the schedule's last backwards (several backward passes per step, which DDP would
reduce each; `overlap.ReadyBuckets`), ZeRO-1's reduce-scatter into each replica's share of the masters, started
bucket by bucket during the backward before a step (`master_shard.ShardedMasters`), FSDP2's own reduce-scatter
(sharded data parallelism). Not owned: running them (DDP and FSDP2 are torch's; the engine's in
`pipeline/reduction.py`; ZeRO-1's in `master_shard.py`), the tied weights' reduction over the first and last
stages (a pipeline concern, always the engine's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp import collectives
from lightning_smp._compat import flatten_dense_tensors, foreach_copy_, unflatten_dense_tensors
from lightning_smp.overlap import Launched

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = [
    "BUCKET_BYTES",
    "Mechanism",
    "ReductionPlan",
    "all_reduce_",
    "backward_buckets",
    "buckets",
    "plan_reduction",
    "start_all_reduce",
]

Mechanism = Literal["none", "ddp", "pipeline", "reduce_scatter", "fsdp2"]

BUCKET_BYTES = 25 * 2**20
"""The size of one coalesced collective's flat buffer (a tensor larger than this is a bucket of its own): DDP's
default ``bucket_cap_mb=25``, small enough that the first buckets' collectives start while backward still runs
(`overlap.ReadyBuckets`), large enough that a collective's fixed cost is paid rarely."""


@dataclass(frozen=True)
class ReductionPlan:
    """How one run's gradients reach agreement over the data-parallel replicas (``topology.group(axis)``: "dp", or
    "dp_cp" under context parallelism, whose ranks hold the same parameters and train on parts of one batch).

    ``mechanism``: ``"none"`` (one replica), ``"ddp"`` (`DistributedDataParallel` wraps the model),
    ``"pipeline"`` (the pipeline engine all-reduces at the last step of an accumulation), ``"reduce_scatter"``
    (ZeRO-1: the optimizer's masters take each replica's share), ``"fsdp2"`` (sharded data parallelism).
    """

    mechanism: Mechanism = "none"
    replicas: int = 1
    axis: str = "dp"
    bucket_bytes: int = BUCKET_BYTES
    scatter_by_all_reduce: bool = False
    """ZeRO-1 on gloo (CPU): each replica's share taken from a whole all-reduce rather than a reduce-scatter. Gloo's
    ``reduce_scatter_tensor`` is no ring reduce-scatter: on two CPU ranks it took 21 ms for 8.4 MB where
    ``all_reduce`` took 11 ms (docs/benchmarks.md, "ZeRO-1 step time"); the sums are the same for two replicas
    and differ only in rounding order beyond. NCCL's reduce-scatter moves half the bytes, and is kept (and gloo's,
    inside `collectives.native_on_cpu`)."""

    @property
    def wraps_ddp(self) -> bool:
        """Whether the strategy wraps the model in DDP."""
        return self.mechanism == "ddp"

    @property
    def engine_reduces(self) -> bool:
        """Whether the pipeline engine all-reduces the gradients over the replicas."""
        return self.mechanism == "pipeline"

    @property
    def shards_masters(self) -> bool:
        """Whether the optimizer keeps only this replica's share of the masters and reduce-scatters into it."""
        return self.mechanism == "reduce_scatter"

    @property
    def sharded_parameters(self) -> bool:
        """Whether the parameters are FSDP2's shards (which are then the masters)."""
        return self.mechanism == "fsdp2"

    @property
    def syncs_replicas_at_setup(self) -> bool:
        """Whether the strategy makes the replicas start equal itself (DDP and FSDP2 do it when they wrap)."""
        return self.mechanism in ("pipeline", "reduce_scatter")


def plan_reduction(config: SMPConfig, topology: Topology) -> ReductionPlan:
    """The run's `ReductionPlan`: FSDP2 under sharded data parallelism; nothing with one replica; otherwise ZeRO-1's
    reduce-scatter with sharded optimizer state, the engine's all-reduce under pipeline parallelism, else DDP."""
    axis = topology.replica_axis  # under context parallelism dp x cp: the cp ranks hold the same parameters
    replicas = topology.size(axis)
    if config.sharded_data_parallel_degree > 1:
        mechanism: Mechanism = "fsdp2"
    elif replicas == 1:
        mechanism = "none"
    elif config.shard_optimizer_state:
        mechanism = "reduce_scatter"
    elif topology.pp > 1:
        mechanism = "pipeline"
    else:
        mechanism = "ddp"
    scatter_by_all_reduce = mechanism == "reduce_scatter" and not collectives.native(topology.mesh.device_type)
    return ReductionPlan(mechanism=mechanism, replicas=replicas, axis=axis, scatter_by_all_reduce=scatter_by_all_reduce)


def buckets(tensors: Sequence[Tensor], *, max_bytes: float = BUCKET_BYTES) -> list[list[Tensor]]:
    """``tensors`` grouped by device and dtype, in order, into lists of at most ``max_bytes`` (or one tensor each):
    one flat buffer, so one collective, per list."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for tensor in tensors:
        kind = (tensor.device, tensor.dtype)
        lists = by_kind.setdefault(kind, [[]])
        nbytes = tensor.numel() * tensor.element_size()
        if lists[-1] and sizes[kind] + nbytes > max_bytes:
            lists.append([])
            sizes[kind] = 0
        lists[-1].append(tensor)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    return [bucket for lists in by_kind.values() for bucket in lists if bucket]


def backward_buckets(params: Sequence[Tensor], *, max_bytes: float = BUCKET_BYTES) -> list[list[Tensor]]:
    """``params`` in `buckets` of at most ``max_bytes``, taken in reverse (forward uses the parameters roughly in
    their order, so backward finishes the last ones first), the buckets ordered by when their last parameter is
    reached in that reverse order: bucket 0 is the first whose gradients are all final (`overlap.ReadyBuckets`)."""
    backward = list(reversed(params))
    position = {id(p): i for i, p in enumerate(backward)}
    return sorted(buckets(backward, max_bytes=max_bytes), key=lambda bucket: max(position[id(p)] for p in bucket))


def start_all_reduce(tensors: Sequence[Tensor], group: dist.ProcessGroup, *, divide_by: int = 1) -> Launched:
    """Start summing ``tensors`` (one bucket) over ``group`` as one flat collective, divided by ``divide_by`` first
    (DDP averages that way: the sum of the quotients, in the tensors' dtype); completing it writes the sums back."""
    flat = flatten_dense_tensors(tensors)
    if divide_by > 1:
        flat.div_(divide_by)
    work = dist.all_reduce(flat, group=group, async_op=True)
    return Launched(work, lambda: foreach_copy_(tensors, list(unflatten_dense_tensors(flat, tensors))))


def all_reduce_(
    tensors: Sequence[Tensor], group: dist.ProcessGroup, *, divide_by: int = 1, max_bytes: int = BUCKET_BYTES
) -> None:
    """Sum ``tensors`` over ``group`` in place, one flat bucket (`buckets`) per collective (`start_all_reduce`),
    waited for before the next."""
    for bucket in buckets(tensors, max_bytes=max_bytes):
        launched = start_all_reduce(bucket, group, divide_by=divide_by)
        launched.work.wait()
        launched.complete()
