"""Context parallelism: one sequence split across ranks, attention over the whole of it (docs/long-context.md).

`sequence` owns the layout (each rank a head and a tail chunk, for causal balance) and the batch split, `ring` the
blockwise attention (a ring of key/value blocks or gathered ones, merged by logsumexp), `attention` where a model's
attention meets it (``F.scaled_dot_product_attention`` during a step, Hugging Face's attention interface). The
cp axis itself is the topology's; when a step splits and attends this way is the strategy's.
"""

from lightning_smp.context_parallel.attention import (
    HF_ATTENTION,
    SplitSequenceAttention,
    attending_over_split_sequences,
    prepare_hugging_face,
)
from lightning_smp.context_parallel.sequence import check_length, gather, positions, split, split_batch

__all__ = [
    "HF_ATTENTION",
    "SplitSequenceAttention",
    "attending_over_split_sequences",
    "check_length",
    "gather",
    "positions",
    "prepare_hugging_face",
    "split",
    "split_batch",
]
