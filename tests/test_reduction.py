"""The one plan of who reduces gradients over the replicas, and the one bucketing rule (pure: no processes)."""

from types import SimpleNamespace

import pytest
import torch

from lightning_smp import collectives
from lightning_smp.config import SMPConfig
from lightning_smp.reduction import backward_buckets, buckets, plan_reduction


def _topology(*, dp: int, pp: int = 1, device_type: str = "cpu") -> SimpleNamespace:
    mesh = SimpleNamespace(device_type=device_type)
    return SimpleNamespace(pp=pp, mesh=mesh, replica_axis="dp", size=lambda axis: {"dp": dp, "pp": pp}[axis])


@pytest.mark.parametrize(
    ("settings", "dp", "pp", "mechanism"),
    [
        ({}, 1, 1, "none"),
        ({}, 2, 1, "ddp"),
        ({"pipeline_parallel_degree": 2}, 2, 2, "pipeline"),
        ({"pipeline_parallel_degree": 2}, 1, 2, "none"),
        ({"shard_optimizer_state": True}, 2, 1, "reduce_scatter"),
        ({"shard_optimizer_state": True, "pipeline_parallel_degree": 2}, 2, 2, "reduce_scatter"),
        ({"shard_optimizer_state": True}, 1, 1, "none"),
        ({"sharded_data_parallel_degree": 2}, 2, 1, "fsdp2"),
    ],
)
def test_one_mechanism_per_run(settings, dp, pp, mechanism):
    plan = plan_reduction(SMPConfig(**settings), _topology(dp=dp, pp=pp))
    assert plan.mechanism == mechanism
    assert plan.replicas == dp
    # exactly one of the four reduces, or none with one replica
    owners = [plan.wraps_ddp, plan.engine_reduces, plan.shards_masters, plan.sharded_parameters]
    assert sum(owners) == (mechanism != "none")
    assert plan.syncs_replicas_at_setup == (mechanism in ("pipeline", "reduce_scatter"))
    # ZeRO-1 takes its share from an all-reduce on gloo (CPU), a reduce-scatter on NCCL
    assert plan.scatter_by_all_reduce == (mechanism == "reduce_scatter")
    assert not plan_reduction(SMPConfig(**settings), _topology(dp=dp, pp=pp, device_type="cuda")).scatter_by_all_reduce


def test_buckets_keep_order_per_dtype_and_cap_bytes():
    a, b, c = torch.zeros(4), torch.zeros(4, dtype=torch.float16), torch.zeros(4)
    d = torch.zeros(100)
    assert [[id(t) for t in bucket] for bucket in buckets([a, b, c], max_bytes=32)] == [[id(a), id(c)], [id(b)]]
    # a full bucket closes; a tensor larger than the cap is a bucket of its own
    split = buckets([a, c, d, a], max_bytes=16)
    assert [[t.numel() for t in bucket] for bucket in split] == [[4], [4], [100], [4]]
    assert len(buckets([a, c, d], max_bytes=float("inf"))) == 1


def test_backward_buckets_put_first_the_bucket_backward_finishes_first():
    # forward order: a half layer, then two fp32 layers; backward finishes the last fp32 layer first
    half, first, last = torch.zeros(4, dtype=torch.float16), torch.zeros(4), torch.zeros(4)
    assert [[id(t) for t in b] for b in backward_buckets([half, first, last], max_bytes=16)] == [
        [id(last)],
        [id(first)],
        [id(half)],
    ]
    # one bucket per dtype: the fp32 one is complete before the half one
    assert [[id(t) for t in b] for b in backward_buckets([half, first, last])] == [[id(last), id(first)], [id(half)]]


def test_zero1_reduce_scatters_on_gloo_inside_native_on_cpu_as_on_nccl():
    sharded = SMPConfig(shard_optimizer_state=True)
    with collectives.native_on_cpu():
        assert not plan_reduction(sharded, _topology(dp=2)).scatter_by_all_reduce
        assert collectives.native("cpu") and collectives.native(torch.device("cpu"))
    assert plan_reduction(sharded, _topology(dp=2)).scatter_by_all_reduce  # the block ended: gloo's all-reduce
    assert not collectives.native("cpu") and collectives.native("cuda")


@pytest.mark.parametrize(
    ("settings", "pp", "mechanism"), [({}, 1, "ddp"), ({"pipeline_parallel_degree": 2}, 2, "pipeline")]
)
def test_context_parallel_ranks_reduce_as_replicas(settings, pp, mechanism):
    # one data-parallel replica split over two context-parallel ranks: the same parameters, gradients of two halves
    sizes = {"dp": 1, "dp_cp": 2, "pp": pp}
    topology = SimpleNamespace(pp=pp, mesh=SimpleNamespace(device_type="cpu"), replica_axis="dp_cp", size=sizes.get)
    plan = plan_reduction(SMPConfig(context_parallel_degree=2, **settings), topology)
    assert (plan.mechanism, plan.replicas, plan.axis) == (mechanism, 2, "dp_cp")
