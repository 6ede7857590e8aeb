"""Vocabulary-parallel embedding, LM head and cross entropy: no rank ever holds full-vocabulary logits.

`DistributedEmbedding` keeps rows ``[r·V/tp, (r+1)·V/tp)`` of the table; each rank looks up the ids it owns,
writes zeros for the others, and one all-reduce assembles the embeddings. `DistributedLMHead` is the matching
column-parallel projection: each rank computes the logits of its own vocabulary slice, and
`vocab_parallel_cross_entropy` reduces three per-token numbers (max, target logit, sum of exponentials) over the
group instead of gathering ``(tokens, V)`` logits. The two may share one weight (both split it by rows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp.tensor_parallel.base import TensorParallelModule
from lightning_smp.tensor_parallel.comm import all_reduce_, gather_from_region, reduce_from_region
from lightning_smp.tensor_parallel.linear import ColumnParallelLinear
from lightning_smp.tensor_parallel.shard import ShardSpec

__all__ = ["DistributedEmbedding", "DistributedLMHead", "vocab_parallel_cross_entropy"]


class DistributedEmbedding(TensorParallelModule, nn.Embedding):
    """``nn.Embedding`` split along the vocabulary (``num_embeddings``); input ids and output are whole.

    Args: as ``nn.Embedding``. ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` keep the layer whole, since
    they act on the table as a whole.
    """

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(0)}

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.num_embeddings % tp_size:
            return f"num_embeddings={module.num_embeddings} is not divisible by tensor_parallel_degree={tp_size}"
        for option, default in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(module, option) != default:
                return f"{option}={getattr(module, option)!r} needs the whole table"
        return None

    @override
    def forward(self, input: Tensor) -> Tensor:
        if self._tp is None:
            return super().forward(input)
        rows = self.weight.shape[0]
        start = self._tp.rank * rows
        local = input - start
        foreign = (local < 0) | (local >= rows)  # ids another rank owns
        padding_idx = None
        if self.padding_idx is not None and 0 <= self.padding_idx - start < rows:
            padding_idx = self.padding_idx - start
        embedded = F.embedding(local.masked_fill(foreign, 0), self.weight, padding_idx)  # (..., D), partial
        return reduce_from_region(embedded.masked_fill(foreign.unsqueeze(-1), 0.0), self._tp.group)


class DistributedLMHead(ColumnParallelLinear):
    """The output projection of a language model, split along the vocabulary, with its loss.

    ``head(hidden)`` returns this rank's logits slice ``(..., vocab_size / tp)`` once distributed (the whole
    logits before); ``head.loss(logits, target)`` is the cross entropy either way, never gathering the
    vocabulary. To tie it with a `DistributedEmbedding`, assign ``head.weight = embedding.weight``.

    Args:
        in_features: the model width.
        vocab_size: the number of classes (rows of the weight).
        bias: whether the projection has a bias (default False, as in GPT-2).
    """

    def __init__(self, in_features: int, vocab_size: int, bias: bool = False, **factory: Any) -> None:
        super().__init__(in_features, vocab_size, bias=bias, gather_output=False, **factory)

    def loss(self, logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
        """Cross entropy of ``logits`` (this head's output) against class ids ``target``, computed in fp32."""
        if self._tp is None:
            return F.cross_entropy(
                logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction=reduction
            )
        return vocab_parallel_cross_entropy(
            logits, target, group=self._tp.group, ignore_index=ignore_index, reduction=reduction
        )

    def gather(self, logits: Tensor) -> Tensor:
        """The whole-vocabulary logits (for sampling or metrics; costs ``tp`` times the memory)."""
        return logits if self._tp is None else gather_from_region(logits, self._tp.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over vocabulary-split logits (Megatron's ``_VocabParallelCrossEntropy``)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, group: dist.ProcessGroup, ignore_index: int) -> Tensor:
        # logits: (N, V/tp) this rank's slice; target: (N,) global class ids
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        rows = logits.shape[-1]
        start = group.rank() * rows
        max_logit = logits.max(dim=-1).values  # (N,)
        all_reduce_(max_logit, group, op=dist.ReduceOp.MAX)
        shifted = logits - max_logit.unsqueeze(-1)
        local = target - start
        foreign = (local < 0) | (local >= rows)
        local = local.masked_fill(foreign, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)  # (N,)
        exp = shifted.exp_()  # (N, V/tp), reuses `shifted`
        sum_exp = exp.sum(dim=-1)
        reduced = torch.stack([target_logit, sum_exp])  # one all-reduce for both: (2, N)
        all_reduce_(reduced, group)
        target_logit, sum_exp = reduced[0], reduced[1]
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, foreign, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, None, None, None]:
        softmax, local, foreign, ignored = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~foreign).to(grad.dtype)
        grad.mul_((grad_loss * (~ignored).to(grad_loss.dtype)).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    group: dist.ProcessGroup,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy`` over logits whose last dim is split across ``group`` in rank order.

    ``logits``: ``(..., V/tp)`` this rank's slice; ``target``: ``(...)`` class ids in ``[0, V)`` or
    ``ignore_index``. ``reduction``: "mean" (over targets that are not ignored, as ``F.cross_entropy``), "sum" or
    "none" (shape of ``target``). Computed in fp32; the gradient has the dtype of ``logits``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is invalid; choose 'mean', 'sum' or 'none'.")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} and target of shape {tuple(target.shape)} do not match: the "
            "logits need one more (vocabulary) dim than the target."
        )
    per_token = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), target.flatten(), group, ignore_index)
    if reduction == "none":
        return per_token.view(target.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (target != ignore_index).sum()
