"""`parallelize`: split a whole model over this rank's tensor-parallel group, following `plan_tensor_parallel`.

Called once per setup by the strategy, after ``configure_model`` built the whole model (the same on every rank, or
on the meta device for delayed initialisation: then the shards are meta tensors that remember their whole, and
the strategy materialises them later) and before precision conversion, DDP and the optimizers, which then see
only this rank's shards; under a topology of `ShapeOnlyGroup`s (the memory planner's) it splits without
communicating. It makes the
ranks of each tensor-parallel group agree first (parameters, buffers and the default generator of tp-rank 0,
so that an unseeded run still trains one consistent model), converts and slices each unit, and marks replicated
parameters on tp ranks > 0 as norm duplicates so the global gradient norm counts each value once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_smp._compat import flatten_dense_tensors, unflatten_dense_tensors
from lightning_smp.placement import mark_norm_duplicate
from lightning_smp.reduction import buckets
from lightning_smp.tensor_parallel.base import TensorParallel, TensorParallelModule
from lightning_smp.tensor_parallel.comm import ShapeOnlyGroup
from lightning_smp.tensor_parallel.plan import TensorParallelPlan, plan_tensor_parallel
from lightning_smp.tensor_parallel.rng import TensorParallelRNG, sync_default_generator, tensor_parallel_seed
from lightning_smp.tensor_parallel.shard import shard_of

if TYPE_CHECKING:
    from lightning_smp.config import SMPConfig
    from lightning_smp.topology import Topology

__all__ = ["apply_plan", "parallelize"]

log = logging.getLogger(__name__)

# Set on the root module by the first call: later calls (trainer.validate after fit) sync and warn only for news.
_DONE_ATTRIBUTE = "_smp_tp_parallelized"


def parallelize(
    model: nn.Module, *, topology: Topology, config: SMPConfig, plan: TensorParallelPlan | None = None
) -> nn.Module:
    """Split ``model`` in place over ``topology``'s "tp" group per ``config`` (or per ``plan``, made by
    `plan_tensor_parallel` for this model and degree); returns ``model``.

    Collective over the tensor-parallel group. Running it again (``trainer.validate`` after ``fit``) splits only
    what is new. With tensor_parallel_degree 1 it only checks ``config.tensor_parallel_plan`` against the model.
    """
    tp_size = topology.size("tp")
    if plan is None:
        plan = plan_tensor_parallel(
            model, tp_size=tp_size, patterns=config.tensor_parallel_plan, sequence_parallel=config.sequence_parallel
        )
    if tp_size == 1:
        return model
    first_call = _DONE_ATTRIBUTE not in model.__dict__
    model.__dict__[_DONE_ATTRIBUTE] = True
    group = topology.group("tp")
    if first_call or plan.units:
        _warn_about(plan, tp_size, sequence_parallel=config.sequence_parallel and first_call)
        if not isinstance(group, ShapeOnlyGroup):  # the memory planner's rank 0 alone has nobody to agree with
            # even with nothing to split the tp ranks must hold one model: they train on the same batches
            device = _collective_device(topology)
            _broadcast_unsharded_state(model, group, device)
            sync_default_generator(group, device)
    seed = tensor_parallel_seed(
        config.tensor_parallel_seed, tp_rank=topology.rank("tp"), tp_size=tp_size, pp_rank=topology.rank("pp")
    )
    tp = TensorParallel(owner=topology, rank=topology.rank("tp"), size=tp_size, rng=TensorParallelRNG(seed))
    apply_plan(plan, tp)
    _keep_transformer_encoders_off_nested_tensors(model)
    sharded = replicated = 0
    for param in model.parameters():
        if shard_of(param) is not None:
            sharded += param.numel()
            continue
        replicated += param.numel()
        if tp.rank > 0:
            mark_norm_duplicate(param, axis="tp")  # tp-rank 0 counts the replicated values in the global norm
    if isinstance(group, ShapeOnlyGroup):
        return model  # the memory planner's rehearsal: not a layout this process runs
    log.info(
        "lightning_smp tensor parallelism: split %d module(s) over tp=%d (%d layer(s) sequence-parallel); this rank "
        "holds %d sharded + %d replicated parameters",
        len(plan.units),
        tp_size,
        len(plan.sequence_layers),
        sharded,
        replicated,
    )
    return model


def apply_plan(plan: TensorParallelPlan, tp: TensorParallel) -> None:
    """Convert and slice every unit of ``plan`` for this rank of ``tp``; no collective (the memory planner runs it
    on a model on the meta device with a `ShapeOnlyGroup`)."""
    shared: dict[int, nn.Parameter] = {}
    for unit in plan.units:
        if type(unit.module) is not unit.target:
            unit.target.tp_convert(unit.module)
        unit.module._tp_distribute(tp.with_sequence(unit.sequence), shared)


def _warn_about(plan: TensorParallelPlan, tp_size: int, *, sequence_parallel: bool) -> None:
    if plan.kept_whole:
        listed = "; ".join(f"{label}: {reason}" for label, reason in plan.kept_whole)
        rank_zero_warn(
            f"tensor parallelism (tensor_parallel_degree={tp_size}) keeps {len(plan.kept_whole)} module(s) whole, "
            f"replicated on every tensor-parallel rank: {listed}. They train correctly but hold their full size on "
            "each rank; to split them, make the sizes divisible by the degree or stop sharing the weight."
        )
    if not plan.units and plan.created_tensor_parallel:
        rank_zero_warn(
            f"{plan.created_tensor_parallel} module(s) were created under smp.tensor_parallelism(), but none of them "
            "is a layer lightning_smp can split (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, "
            "nn.MultiheadAttention, nn.Embedding, or smp.nn modules), so nothing is split. Name the layers to split "
            "with SMPStrategy(tensor_parallel_plan={'path.to.fc': 'colwise', 'path.to.proj': 'rowwise'})."
        )
    elif not plan.units:
        rank_zero_warn(
            f"tensor_parallel_degree={tp_size} splits nothing in this model: no layer was created under "
            "smp.model_creation(tensor_parallelism=True) / smp.tensor_parallelism(), marked with "
            "smp.set_tensor_parallelism(), named in tensor_parallel_plan, or is an smp.nn layer, so every "
            "tensor-parallel rank holds and computes the whole model. Create the layers tensor-parallel, name them "
            "in SMPStrategy(tensor_parallel_plan=...), or set tensor_parallel_degree=1 to use the ranks for data "
            "parallelism."
        )
    if not sequence_parallel:
        return
    if plan.sequence_kept:
        listed = "; ".join(f"{label}: {reason}" for label, reason in plan.sequence_kept)
        rank_zero_warn(
            f"sequence_parallel=True: {len(plan.sequence_kept)} layer(s) keep whole sequences, since sequence "
            f"parallelism cannot run them: {listed}. They train correctly, with tensor parallelism alone."
        )
    if not plan.sequence_layers and not plan.sequence_kept:
        rank_zero_warn(
            "sequence_parallel=True changes nothing: no layer of the model is one lightning_smp runs "
            "sequence-parallel (a split nn.TransformerEncoderLayer / nn.TransformerDecoderLayer, or a decoder layer "
            "of a Hugging Face model split by its own plan). Set sequence_parallel=False to silence this."
        )


def _collective_device(topology: Topology) -> torch.device:
    device_type = topology.mesh.device_type
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


@torch.no_grad()
def _broadcast_unsharded_state(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """Copy tp-rank 0's parameters and buffers (those not sharded yet) to the other ranks of ``group``; tensors
    on the meta device (delayed initialisation) get their values when materialised, the same on every rank."""
    tensors = [p.data for p in model.parameters() if shard_of(p) is None] + list(model.buffers())
    tensors = [t for t in tensors if not t.is_meta]
    src = dist.get_global_rank(group, 0)
    for bucket in buckets(tensors):
        flat = flatten_dense_tensors(bucket).to(device)
        dist.broadcast(flat, src=src, group=group)
        for tensor, value in zip(bucket, unflatten_dense_tensors(flat, bucket), strict=True):
            tensor.copy_(value)


def _keep_transformer_encoders_off_nested_tensors(model: nn.Module) -> None:
    # nn.TransformerEncoder's inference path packs padded batches into nested tensors for torch's fused layer
    # kernels, which cannot run a split layer: keep it on the ordinary path.
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(
            isinstance(layer, TensorParallelModule) for layer in module.layers
        ):
            module.use_nested_tensor = False
