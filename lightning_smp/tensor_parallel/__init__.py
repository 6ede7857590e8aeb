"""Tensor parallelism (Megatron-style): layers split over the ranks of a tensor-parallel group, and the automatic
split of a whole model.

Owns the distributed layers (``linear``, ``vocab``, ``attention``, ``transformer``, ``replicated``, and
``hf_layers`` for transformers' GPT-2), sequence parallelism (``sequence``: the layers whose norms, dropouts and
residual adds hold a slice of the sequence), their collectives (``comm``), the shard bookkeeping (``shard``), dropout
streams (``rng``), which modules were created tensor-parallel (``creation``), the pure decision of what to split
(``plan``, reading a Hugging Face model's own plan through ``hf_plan``) and its execution (``parallelize``). It
does not own the process groups (``topology.py``), the gradient all-reduce over data-parallel replicas (the
strategy) or the master weights (``optimizer.py``).

Why explicit collectives and not DTensor: a model is built whole and each rank keeps plain-tensor shards, so the
fp16 master-weight optimizer keeps its flat fp32 buffers and ``torch._foreach_*`` kernels (which take plain
tensors), DDP buckets the shards like any parameter, and each layer's forward shows its communication: one
all-reduce per attention block and per MLP forward, one per block backward (Shoeybi et al. 2019). DTensor
parameters would need their own optimizer path and redistribution rules for every op in torch's layers.
"""

from lightning_smp.placement import TPShard
from lightning_smp.tensor_parallel.attention import DistributedMultiheadAttention, TensorParallelDropout
from lightning_smp.tensor_parallel.base import SequenceSplit, TensorParallel, TensorParallelModule
from lightning_smp.tensor_parallel.comm import (
    ShapeOnlyGroup,
    copy_to_region,
    gather_from_region,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
    scatter_to_region,
    split_sequence,
)
from lightning_smp.tensor_parallel.creation import set_tensor_parallelism
from lightning_smp.tensor_parallel.linear import (
    ColumnParallelLinear,
    DistributedLinear,
    GatheredColumnParallelLinear,
    PackedColumnParallelLinear,
    RowParallelLinear,
)
from lightning_smp.tensor_parallel.parallelize import apply_plan, parallelize
from lightning_smp.tensor_parallel.plan import TensorParallelPlan, plan_tensor_parallel
from lightning_smp.tensor_parallel.shard import ShardSpec, gather_shards, merge_shards, shard_of, slice_shard
from lightning_smp.tensor_parallel.transformer import DistributedTransformerDecoderLayer, DistributedTransformerLayer
from lightning_smp.tensor_parallel.vocab import DistributedEmbedding, DistributedLMHead, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "DistributedEmbedding",
    "DistributedLMHead",
    "DistributedLinear",
    "DistributedMultiheadAttention",
    "DistributedTransformerDecoderLayer",
    "DistributedTransformerLayer",
    "GatheredColumnParallelLinear",
    "PackedColumnParallelLinear",
    "RowParallelLinear",
    "SequenceSplit",
    "ShapeOnlyGroup",
    "ShardSpec",
    "TPShard",
    "TensorParallel",
    "TensorParallelDropout",
    "TensorParallelModule",
    "TensorParallelPlan",
    "apply_plan",
    "copy_to_region",
    "gather_from_region",
    "gather_sequence",
    "gather_shards",
    "merge_shards",
    "parallelize",
    "plan_tensor_parallel",
    "reduce_from_region",
    "reduce_scatter_sequence",
    "scatter_to_region",
    "set_tensor_parallelism",
    "shard_of",
    "slice_shard",
    "split_sequence",
    "vocab_parallel_cross_entropy",
]
