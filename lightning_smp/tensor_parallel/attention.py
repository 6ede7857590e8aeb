"""Head-parallel ``nn.MultiheadAttention`` and the dropout of sharded regions.

`DistributedMultiheadAttention` is an ``nn.MultiheadAttention`` built whole; once distributed each rank keeps
``num_heads / tp`` heads: its rows of the q, k and v projections (column-parallel) and its columns of
``out_proj`` (row-parallel, one all-reduce). The sharded forward follows
``torch.nn.functional.multi_head_attention_forward`` step by step over the local heads (masks, ``is_causal``,
``key_padding_mask``, ``bias_k``/``bias_v``, ``add_zero_attn``, ``need_weights``), so its numbers are torch's
up to float reassociation in the reductions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_smp._compat import canonical_mask, none_or_dtype
from lightning_smp.tensor_parallel.base import TensorParallel, TensorParallelModule, WholeTensorParallelModule
from lightning_smp.tensor_parallel.comm import copy_to_region, gather_from_region, reduce_from_region
from lightning_smp.tensor_parallel.linear import RowParallelLinear
from lightning_smp.tensor_parallel.shard import ShardSpec

__all__ = ["DistributedMultiheadAttention", "TensorParallelDropout"]


class TensorParallelDropout(WholeTensorParallelModule, nn.Dropout):
    """``nn.Dropout`` for a sharded activation: draws from the rank's own stream (see `rng.py`)."""

    @override
    def forward(self, input: Tensor) -> Tensor:
        if self._tp is None or not self.training or self.p == 0:
            return super().forward(input)
        with self._tp.rng.fork(input.device):
            return super().forward(input)


class DistributedMultiheadAttention(TensorParallelModule, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` split by heads over the tensor-parallel ranks. Arguments as ``nn.MultiheadAttention``.

    Once distributed, ``_qkv_same_embed_dim`` reads False: torch's fused inference kernels (used by
    ``nn.TransformerEncoderLayer`` in eval mode) check it and would run on the local shard as if it were whole.
    """

    _packed_qkv: bool = True  # the layer's own record of whether q, k, v share ``in_proj_weight``

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        # Rows of q, k and v belong to heads; in_proj_* packs [q; k; v] along dim 0, hence 3 blocks.
        candidates = {
            "in_proj_weight": ShardSpec(0, blocks=3),
            "q_proj_weight": ShardSpec(0),
            "k_proj_weight": ShardSpec(0),
            "v_proj_weight": ShardSpec(0),
            "in_proj_bias": ShardSpec(0, blocks=3),
            "bias_k": ShardSpec(2),
            "bias_v": ShardSpec(2),
        }
        specs = {name: spec for name, spec in candidates.items() if getattr(module, name, None) is not None}
        specs.update(
            {f"out_proj.{name}": spec for name, spec in RowParallelLinear.tp_shard_specs(module.out_proj).items()}
        )
        return specs

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.num_heads % tp_size:
            return f"num_heads={module.num_heads} is not divisible by tensor_parallel_degree={tp_size}"
        plain = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear, RowParallelLinear)
        if type(module.out_proj) not in plain:
            return f"its out_proj is a custom {type(module.out_proj).__name__}"
        return None

    @override
    @classmethod
    def tp_convert(cls, module: nn.Module) -> None:
        super().tp_convert(module)
        RowParallelLinear.tp_convert(module.out_proj)

    @override
    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        self._packed_qkv = self._qkv_same_embed_dim
        super()._tp_distribute(tp, shared)
        self.out_proj._tp_distribute(tp, shared)
        self._qkv_same_embed_dim = False

    @override
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if self._tp is None:
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        is_batched = query.dim() == 3
        key_padding_mask = canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        attn_mask = canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if self.batch_first and is_batched:  # to (L, N, E), keeping which of q, k, v are the same tensor
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        output, weights = self._local_heads_forward(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
        if self.batch_first and is_batched:
            output = output.transpose(1, 0)
        return output, weights

    def _local_heads_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """``F.multi_head_attention_forward`` over this rank's heads; shapes are sequence-first."""
        tp = self._tp
        assert tp is not None
        is_batched = query.dim() == 3
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query has embedding dim {query.shape[-1]}, but this attention layer expects {self.embed_dim}."
            )
        q, k, v = self._in_projection(query, key, value, tp)  # (L, N, E/tp), (S, N, E/tp), (S, N, E/tp)
        tgt_len, bsz = q.shape[:2]  # L: the whole sequence, also when the query came as a slice of it
        heads = self.num_heads // tp.size
        head_dim = self.head_dim
        first_head = tp.rank * heads
        # `forward` has canonicalised both masks (float, -inf where masked), as nn.MultiheadAttention.forward does
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask."
            )
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # scaled_dot_product_attention applies the causal mask itself
        elif key_padding_mask is not None:
            is_causal = False  # the merged mask is no longer causal

        src_len = k.shape[0]
        if attn_mask is not None:
            attn_mask = _local_attn_mask(attn_mask, bsz, self.num_heads, first_head, heads, tgt_len, src_len)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)  # (N·H/tp, L, d)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)  # (N·H/tp, S, d)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src_len = k.size(1)
        if key_padding_mask is not None:
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0

        if need_weights:
            q_scaled = q * math.sqrt(1.0 / float(head_dim))
            if attn_mask is not None:
                weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                weights = torch.bmm(q_scaled, k.transpose(-2, -1))
            weights = F.softmax(weights, dim=-1)  # (N·H/tp, L, S)
            if dropout_p > 0.0:
                with tp.rng.fork(weights.device):
                    weights = F.dropout(weights, p=dropout_p)
            output = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, heads * head_dim)
            output = self.out_proj(output).view(-1, bsz, self.embed_dim)  # (L or L/tp, N, E)
            weights = weights.view(bsz, heads, tgt_len, src_len)
            if average_attn_weights:  # the mean over all heads: a sum over ranks of local sums
                weights = reduce_from_region(weights.sum(dim=1) / self.num_heads, tp.group)
            else:
                weights = gather_from_region(weights, tp.group, dim=1)
            if not is_batched:
                output, weights = output.squeeze(1), weights.squeeze(0)
            return output, weights

        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, heads, -1, src_len)
        q = q.view(bsz, heads, tgt_len, head_dim)
        k = k.view(bsz, heads, src_len, head_dim)
        v = v.view(bsz, heads, src_len, head_dim)
        if dropout_p > 0.0:
            with tp.rng.fork(q.device):
                output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        else:
            output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)  # (N, H/tp, L, d)
        output = self._out_projection(output).view(-1, bsz, self.embed_dim)  # (L, N, E), or (L/tp, N, E)
        if not is_batched:
            output = output.squeeze(1)
        return output, None

    def _out_projection(self, heads: Tensor) -> Tensor:
        """``out_proj`` (row-parallel) of the attention's output ``(N, H/tp, L, d)``, keeping that output for backward
        (which the attention keeps too) rather than its ``(L·N, E/tp)`` copy: 2 bytes per token and feature less."""
        proj = self.out_proj
        tp = proj.tp_context
        assert tp is not None
        output = tp.row_output(_HeadsLinear.apply(heads, proj.weight))  # (L·N or L/tp·N, E)
        return output + proj.bias if proj.bias is not None else output

    def _in_projection(self, query: Tensor, key: Tensor, value: Tensor, tp: TensorParallel) -> tuple[Tensor, ...]:
        """This rank's q, k, v: column-parallel projections of the whole inputs (one all-reduce backward each).
        Under sequence parallelism the query arrives as this rank's slice of the sequence (dim 0), gathered by the
        projection that takes it; a key or value that is not the query (cross-attention's memory) arrives whole."""
        group = tp.group
        if not self._packed_qkv:
            q_in = tp.column_input(query)
            k_in = q_in if key is query else copy_to_region(key, group)
            v_in = k_in if value is key else (q_in if value is query else copy_to_region(value, group))
            biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            return tuple(F.linear(x, w, b) for x, w, b in zip((q_in, k_in, v_in), weights, biases, strict=True))
        weight, bias = self.in_proj_weight, self.in_proj_bias
        local = weight.shape[0] // 3  # E/tp
        if query is key and key is value:  # self-attention: one matmul
            packed = tp.column_linear(query, weight, bias).unflatten(-1, (3, local))
            packed = packed.unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return packed[0], packed[1], packed[2]
        w_q, w_kv = weight.split([local, 2 * local])
        b_q, b_kv = bias.split([local, 2 * local]) if bias is not None else (None, None)
        q = tp.column_linear(query, w_q, b_q)
        if key is value and key is not query:  # encoder-decoder attention: k and v in one matmul
            kv = F.linear(copy_to_region(key, group), w_kv, b_kv).unflatten(-1, (2, local))
            kv = kv.unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return q, kv[0], kv[1]
        (w_k, w_v), (b_k, b_v) = w_kv.chunk(2), (b_kv.chunk(2) if b_kv is not None else (None, None))
        k_in, v_in = (tp.column_input(x) if x is query else copy_to_region(x, group) for x in (key, value))
        return q, F.linear(k_in, w_k, b_k), F.linear(v_in, w_v, b_v)


class _HeadsLinear(torch.autograd.Function):
    """``F.linear`` of the heads ``(N, H, L, d)`` laid out as ``(L·N, H·d)``, keeping the heads (not the copy the
    layout takes) for backward, which lays them out again."""

    @staticmethod
    def forward(ctx: Any, heads: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(heads, weight)
        return F.linear(_tokens_first(heads), weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        heads, weight = ctx.saved_tensors
        grad_heads = grad_weight = None
        if ctx.needs_input_grad[0]:
            batch, count, length, width = heads.shape
            grad_heads = grad.mm(weight).view(length, batch, count, width).permute(1, 2, 0, 3)
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().mm(_tokens_first(heads))
        return grad_heads, grad_weight


def _tokens_first(heads: Tensor) -> Tensor:
    """``(N, H, L, d)`` as ``(L·N, H·d)``, sequence-first (a copy)."""
    batch, count, length, width = heads.shape
    return heads.permute(2, 0, 1, 3).reshape(length * batch, count * width)


def _local_attn_mask(
    mask: Tensor, bsz: int, num_heads: int, first_head: int, heads: int, tgt_len: int, src_len: int
) -> Tensor:
    """The attention mask for this rank's heads, as 3-D ``(1 or N·H/tp, L, S)``."""
    if mask.dim() == 2:
        if mask.shape != (tgt_len, src_len):
            raise RuntimeError(f"The shape of the 2D attn_mask is {mask.shape}, but should be {(tgt_len, src_len)}.")
        return mask.unsqueeze(0)
    if mask.dim() == 3:
        expected = (bsz * num_heads, tgt_len, src_len)
        if mask.shape != expected:
            raise RuntimeError(f"The shape of the 3D attn_mask is {mask.shape}, but should be {expected}.")
        per_head = mask.view(bsz, num_heads, tgt_len, src_len)[:, first_head : first_head + heads]
        return per_head.reshape(bsz * heads, tgt_len, src_len)
    raise RuntimeError(f"attn_mask's dimension {mask.dim()} is not supported")
