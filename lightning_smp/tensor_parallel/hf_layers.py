"""Tensor-parallel versions of the transformers layers that are not ``nn.Linear``: GPT-2's ``Conv1D`` and attention.

``transformers.pytorch_utils.Conv1D`` is a linear layer with a transposed weight ``(in, out)``, so its column split
cuts dim 1 and its row split dim 0. GPT-2's attention packs q, k and v into one ``Conv1D`` and splits its output
with ``split(self.split_size)``: `GPT2AttentionParallel` splits the heads (``c_attn`` in three blocks, ``c_proj`` by
rows) and sets ``split_size`` to the local width; the rest of its forward reshapes with ``-1`` heads and runs
unchanged, its attention dropout drawing from the rank's own stream (`rng.py`). Imported only when transformers
is (`hf_plan` asks for it), since the classes derive from its own.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.pytorch_utils import Conv1D
from typing_extensions import override

from lightning_smp.tensor_parallel.base import SequenceSplit, TensorParallel, TensorParallelModule
from lightning_smp.tensor_parallel.sequence import SequenceParallelDropout, gather_hidden
from lightning_smp.tensor_parallel.shard import ShardSpec

__all__ = ["LAYERS_BY_STYLE", "ColumnParallelConv1D", "GPT2AttentionParallel", "RowParallelConv1D"]


class ColumnParallelConv1D(TensorParallelModule, Conv1D):
    """``Conv1D`` split along its output features (``nf``); ``blocks`` > 1 keeps this rank's part of each of that
    many packed weights (GPT-2's ``c_attn``: q, k, v)."""

    tp_sequence_role: ClassVar[str | None] = "column"

    blocks: ClassVar[int] = 1

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(1, blocks=cls.blocks), "bias": ShardSpec(0, blocks=cls.blocks)}

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.nf % (cls.blocks * tp_size):
            return f"nf={module.nf} is not divisible by {cls.blocks} x tensor_parallel_degree={tp_size}"
        return None

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self._tp is None:
            return super().forward(x)
        x = self._tp.column_input(x)
        output = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)  # (N, nf/tp)
        return output.view(*x.shape[:-1], -1)


class _PackedQKVConv1D(ColumnParallelConv1D):
    blocks: ClassVar[int] = 3


class RowParallelConv1D(TensorParallelModule, Conv1D):
    """``Conv1D`` split along its input features (``nx``): this rank's input slice in, the whole output out."""

    tp_sequence_role: ClassVar[str | None] = "row"

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(0)}  # the bias is added once, after the reduction: replicated

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.nx % tp_size:
            return f"nx={module.nx} is not divisible by tensor_parallel_degree={tp_size}"
        return None

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self._tp is None:
            return super().forward(x)
        partial = torch.mm(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)  # (..., nf), partial
        return self._tp.row_output(partial) + self.bias


class GPT2AttentionParallel(TensorParallelModule, GPT2Attention):
    """GPT-2's self-attention split by heads: ``c_attn`` column-parallel over its q, k, v blocks, ``c_proj``
    row-parallel (one all-reduce forward, one backward). Cross-attention stays whole."""

    tp_sequence_role: ClassVar[str | None] = "block"

    _CHILDREN: ClassVar[dict[str, type[TensorParallelModule]]] = {
        "c_attn": _PackedQKVConv1D,
        "c_proj": RowParallelConv1D,
    }

    @override
    @classmethod
    def tp_shard_specs(cls, module: nn.Module) -> dict[str, ShardSpec]:
        return {
            f"{name}.{param}": spec
            for name, child_class in cls._CHILDREN.items()
            for param, spec in child_class.tp_shard_specs(getattr(module, name)).items()
        }

    @override
    @classmethod
    def tp_unsplittable(cls, module: nn.Module, tp_size: int) -> str | None:
        if module.is_cross_attention:
            return "it is a cross-attention (its q and k/v projections are separate layers)"
        if module.num_heads % tp_size:
            return f"num_heads={module.num_heads} is not divisible by tensor_parallel_degree={tp_size}"
        for name in cls._CHILDREN:
            if type(getattr(module, name)) not in (Conv1D, cls._CHILDREN[name]):
                return f"its {name} is a custom {type(getattr(module, name)).__name__}, not a Conv1D"
        return None

    @override
    @classmethod
    def tp_convert(cls, module: nn.Module) -> None:
        super().tp_convert(module)
        for name, child_class in cls._CHILDREN.items():
            child_class.tp_convert(getattr(module, name))

    draws_own_dropout: ClassVar[bool] = True  # a sequence-parallel layer around it leaves its dropouts alone

    @override
    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        if self._tp is not None and self._tp.sequence is not None:  # the hidden states arrive as a slice
            args, kwargs = gather_hidden(self, self._tp, args, kwargs)
        if self._tp is None or not self.training or self.attn_dropout.p == 0:
            return super().forward(*args, **kwargs)
        # The attention dropout acts on this rank's heads: it draws from the rank's own stream. The residual dropout
        # acts on the whole (replicated) output: it draws from the default generator, as on every other rank.
        resid_dropout = self.resid_dropout
        self.resid_dropout = nn.Identity()
        try:
            with self._tp.rng.fork(self.c_proj.weight.device):
                output, weights = super().forward(*args, **kwargs)
        finally:
            self.resid_dropout = resid_dropout
        return resid_dropout(output), weights

    @override
    def _tp_distribute(self, tp: TensorParallel, shared: dict[int, nn.Parameter]) -> None:
        sequence = tp.sequence
        if sequence is None:
            self.c_attn._tp_distribute(tp, shared)
            self.c_proj._tp_distribute(tp, shared)
        else:  # c_attn takes the hidden states `forward` gathered; c_proj and the residual dropout act on the slice
            self.c_attn._tp_distribute(tp.with_sequence(SequenceSplit(sequence.dim, input_whole=True)), shared)
            self.c_proj._tp_distribute(tp.with_sequence(SequenceSplit(sequence.dim)), shared)
            SequenceParallelDropout.tp_convert(self.resid_dropout)
            self.resid_dropout._tp_distribute(tp.with_sequence(SequenceSplit(sequence.dim)), shared)
        self.split_size = self.embed_dim // tp.size  # forward splits c_attn's (local) output into q, k, v with it
        self._tp = tp


LAYERS_BY_STYLE: dict[str, dict[type[nn.Module], type[TensorParallelModule]]] = {
    "auto": {GPT2Attention: GPT2AttentionParallel},
    "colwise": {Conv1D: ColumnParallelConv1D},
    "rowwise": {Conv1D: RowParallelConv1D},
}
"""Plan style -> transformers class -> the tensor-parallel class it becomes (as ``plan._BY_STYLE`` for torch's)."""
