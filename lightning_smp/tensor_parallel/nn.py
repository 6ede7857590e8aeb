"""``smp.nn``: the tensor-parallel layers under the names smp code imports (``smp.nn.DistributedLinear``, ...).

Each is built whole, like its ``torch.nn`` parent, and split over the tensor-parallel ranks when training starts,
whether or not it is created under ``smp.tensor_parallelism()``. smp's ``DistributedTransformer``,
``DistributedTransformerLMHead`` and ``DistributedAttentionLayer`` (smp's own fused transformer with its own
keyword names) are not reproduced: build from ``nn.TransformerEncoderLayer`` / `DistributedTransformerLayer`,
`DistributedEmbedding` and `DistributedLMHead` instead.
"""

from lightning_smp.tensor_parallel.attention import DistributedMultiheadAttention
from lightning_smp.tensor_parallel.linear import ColumnParallelLinear, DistributedLinear, RowParallelLinear
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
    "RowParallelLinear",
    "vocab_parallel_cross_entropy",
]
