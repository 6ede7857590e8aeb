"""``smp.nn``: the tensor-parallel layers under the names smp code imports (``smp.nn.DistributedLinear``, ...).

Each is built whole, like its ``torch.nn`` parent, and split over the tensor-parallel ranks when training starts,
whether or not it is created under ``smp.tensor_parallelism()``. smp's norms are ``nn.LayerNorm`` here, kept whole
on every rank. smp's own fused transformer (``DistributedTransformer``, ``DistributedTransformerLMHead``,
``DistributedAttentionLayer``, ``DistributedTransformerOutputLayer``, with their own keyword names and tuple
inputs) and its ``DistributedModule`` base class are not reproduced: those names exist so that smp code imports,
and creating one raises, naming the torch layers to build from instead.
"""

from typing import Any

from torch import nn

from lightning_smp.tensor_parallel.attention import DistributedMultiheadAttention
from lightning_smp.tensor_parallel.linear import ColumnParallelLinear, DistributedLinear, RowParallelLinear
from lightning_smp.tensor_parallel.transformer import DistributedTransformerDecoderLayer, DistributedTransformerLayer
from lightning_smp.tensor_parallel.vocab import DistributedEmbedding, DistributedLMHead, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLMHead",
    "DistributedLayerNorm",
    "DistributedLinear",
    "DistributedModule",
    "DistributedMultiheadAttention",
    "DistributedTransformer",
    "DistributedTransformerDecoderLayer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
    "FusedLayerNorm",
    "RowParallelLinear",
    "vocab_parallel_cross_entropy",
]

DistributedLayerNorm = nn.LayerNorm
"""smp's ``DistributedLayerNorm``: ``nn.LayerNorm``, kept whole on every tensor-parallel rank (same arguments)."""
FusedLayerNorm = nn.LayerNorm
"""smp's re-export of apex's ``FusedLayerNorm``: ``nn.LayerNorm`` (same arguments)."""

_LAYERS = (
    "build the stack from nn.TransformerEncoderLayer (smp.nn.DistributedTransformerLayer is it, with torch's "
    "arguments: d_model=hidden_size, nhead=num_attention_heads, dim_feedforward=intermediate_size, "
    "dropout=hidden_dropout_prob, layer_norm_eps=layernorm_epsilon, norm_first=pre_layernorm, batch_first=True) in an "
    "nn.ModuleList created under smp.model_creation(tensor_parallelism=True), which splits every layer"
)


class _NotReproduced(nn.Module):
    """An smp.nn name lightning_smp does not reproduce: importing it works, creating (or subclassing) it raises."""

    instead: str = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"smp.nn.{type(self).__name__} is smp's own module, not reproduced in lightning_smp: {self.instead}."
        )


class DistributedTransformer(_NotReproduced):
    """smp's fused transformer stack (not reproduced)."""

    instead = _LAYERS


class DistributedTransformerLMHead(_NotReproduced):
    """smp's GPT-style model with embeddings and LM head (not reproduced)."""

    instead = (
        "build it from smp.nn.DistributedEmbedding (split along the vocabulary) for the tokens, nn.Embedding for "
        f"the positions, the layers ({_LAYERS}), and smp.nn.DistributedLMHead tied to the embedding (head.weight = "
        "embedding.weight), whose head.loss(logits, target) is the vocabulary-parallel cross entropy"
    )


class DistributedAttentionLayer(_NotReproduced):
    """smp's attention block (not reproduced)."""

    instead = (
        "use nn.MultiheadAttention (split by heads; smp.nn.DistributedMultiheadAttention is it), or a whole "
        f"layer: {_LAYERS}"
    )


class DistributedTransformerOutputLayer(_NotReproduced):
    """smp's feed-forward block (not reproduced)."""

    instead = (
        "use two nn.Linear layers split colwise then rowwise (smp.nn.ColumnParallelLinear, smp.nn.RowParallelLinear, "
        "or SMPStrategy(tensor_parallel_plan={'blocks.*.fc': 'colwise', 'blocks.*.proj': 'rowwise'}))"
    )


class DistributedModule(_NotReproduced):
    """smp's base class of distributed modules, registered with ``smp.tp_register`` (not reproduced)."""

    instead = (
        "modules are split by plan: name a custom module's layers in SMPStrategy(tensor_parallel_plan=...) "
        "(docs/tensor-parallelism.md, Plan styles) instead of registering a distributed version of it"
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise RuntimeError(
            f"class {cls.__name__}(smp.nn.DistributedModule) defines a distributed module the smp way, which "
            f"lightning_smp does not reproduce: {DistributedModule.instead}."
        )
