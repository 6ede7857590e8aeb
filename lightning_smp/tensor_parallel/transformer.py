"""Tensor-parallel ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` (Megatron's layer split).

The layer keeps torch's own forward (its training path, with every option: ``norm_first``, activation,
``batch_first``, masks, ``is_causal``); only its children change class: the attention blocks become head-parallel,
``linear1`` column-parallel, ``linear2`` row-parallel, and ``dropout`` (between them, on the sharded hidden
activation) draws from the rank's own stream. Norms and the residual dropouts stay replicated. The activation
must be elementwise (torch's "relu" / "gelu", or any elementwise callable).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from typing_extensions import override

from lightning_smp.tensor_parallel.attention import DistributedMultiheadAttention, TensorParallelDropout
from lightning_smp.tensor_parallel.base import SequenceSplit, TensorParallel, TensorParallelModule
from lightning_smp.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from lightning_smp.tensor_parallel.sequence import SequenceParallelLayer
from lightning_smp.tensor_parallel.shard import ShardSpec

__all__ = ["DistributedTransformerDecoderLayer", "DistributedTransformerLayer"]

# child name -> (tensor-parallel class, the torch class it converts)
_CHILDREN: dict[str, tuple[type[TensorParallelModule], type[nn.Module]]] = {
    "self_attn": (DistributedMultiheadAttention, nn.MultiheadAttention),
    "multihead_attn": (DistributedMultiheadAttention, nn.MultiheadAttention),
    "linear1": (ColumnParallelLinear, nn.Linear),
    "dropout": (TensorParallelDropout, nn.Dropout),
    "linear2": (RowParallelLinear, nn.Linear),
}


class _TransformerLayerParallel(SequenceParallelLayer):
    """What the encoder and the decoder layer share: the split is decided child by child."""

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        specs: dict[str, ShardSpec] = {}
        for name, (parallel_cls, _) in _CHILDREN.items():
            child = getattr(module, name, None)
            if child is not None:
                specs.update({f"{name}.{p}": spec for p, spec in parallel_cls.tp_shard_specs(child).items()})
        return specs

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        for name, (parallel_cls, torch_cls) in _CHILDREN.items():
            child = getattr(module, name, None)
            if child is None:
                continue
            if type(child) not in (torch_cls, parallel_cls):
                return f"its {name} is a custom {type(child).__name__}, not an {torch_cls.__name__}"
            reason = parallel_cls.tp_unsplittable(child, tp_size)
            if reason is not None:
                return f"{name}.{reason}"
        return None

    @override
    @classmethod
    def tp_convert(cls, module: nn.Module) -> None:
        super().tp_convert(module)
        for name, (parallel_cls, _) in _CHILDREN.items():
            child = getattr(module, name, None)
            if child is not None and not isinstance(child, parallel_cls):
                parallel_cls.tp_convert(child)

    @override
    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        for name in _CHILDREN:
            child = getattr(self, name, None)
            if child is not None:
                child._tp_distribute(tp.with_sequence(_child_sequence(name, tp.sequence)), shared)
        self._tp = tp
        if tp.sequence is not None:
            self._sequence_setup(tp)


def _child_sequence(name: str, layer: SequenceSplit | None) -> SequenceSplit | None:
    """How a child meets the sequence split of its layer: the attention blocks work sequence-first inside (dim 0),
    ``linear1`` gathers the layer's slice, ``linear2`` reduce-scatters back to it; the sharded dropout between them
    acts on whole sequences."""
    if layer is None or name == "dropout":
        return None
    return SequenceSplit(0 if name in ("self_attn", "multihead_attn") else layer.dim)


# smp.nn.DistributedTransformerLayer's own keyword arguments, refused with the torch ones to pass instead
_SMP_LAYER_KEYWORDS = frozenset(
    {
        "num_attention_heads",
        "attention_head_size",
        "hidden_size",
        "intermediate_size",
        "attention_dropout_prob",
        "hidden_dropout_prob",
        "layernorm_epsilon",
        "initializer_range",
        "use_normal_initialization",
        "causal_mask_size",
        "add_cross_attention",
        "pre_layernorm",
        "post_layernorm",
    }
)


class DistributedTransformerLayer(_TransformerLayerParallel, nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer``, same arguments and numerics, split over the tensor-parallel ranks whether or
    not it is created under ``smp.tensor_parallelism()`` (smp's ``DistributedTransformerLayer``; its own keyword
    names are refused with the torch ones to pass instead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        smp_keywords = sorted(_SMP_LAYER_KEYWORDS.intersection(kwargs))
        if smp_keywords:
            raise TypeError(
                f"DistributedTransformerLayer got smp's keyword arguments {smp_keywords}; in lightning_smp it is "
                "nn.TransformerEncoderLayer split over the tensor-parallel ranks and takes torch's: pass "
                "d_model=hidden_size, nhead=num_attention_heads, dim_feedforward=intermediate_size, "
                "dropout=hidden_dropout_prob, layer_norm_eps=layernorm_epsilon, norm_first=pre_layernorm, "
                "batch_first=True, and call it as layer(hidden_states, src_mask=mask, is_causal=...) instead of "
                "layer((hidden_states, attention_mask))."
            )
        super().__init__(*args, **kwargs)
        type(self).tp_convert(self)


class DistributedTransformerDecoderLayer(_TransformerLayerParallel, nn.TransformerDecoderLayer):
    """``nn.TransformerDecoderLayer``, same arguments and numerics, split over the tensor-parallel ranks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        type(self).tp_convert(self)
