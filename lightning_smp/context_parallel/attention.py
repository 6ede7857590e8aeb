"""Where a model's attention meets the split sequence: the attention every step of context parallelism runs.

Owns `SplitSequenceAttention`, which stands in for ``F.scaled_dot_product_attention`` during a step (the strategy
installs it through `_compat.replaced_scaled_dot_product_attention`, as torch's own ``context_parallel`` patches
it): ``nn.MultiheadAttention`` and the ``nn.Transformer*Layer``s (through ``F.multi_head_attention_forward``), our
tensor-parallel attention, and hand-written models calling ``F.scaled_dot_product_attention`` reach the ring of
`ring` that way. Hugging Face models get an attention implementation of their ``AttentionInterface`` that calls it
(whatever they were built with, ``sdpa`` or ``eager``), their right global position ids and, for a causal LM's
``labels``, the labels shifted over the whole sequence (`prepare_hugging_face`). Masks the ring cannot honour
(padding, arbitrary patterns), attention dropout and models without attention raise, naming the fix.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lightning_smp._compat import hf_attention_implementation, replaced_scaled_dot_product_attention
from lightning_smp.context_parallel import ring, sequence

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["HF_ATTENTION", "SplitSequenceAttention", "attending_over_split_sequences", "prepare_hugging_face"]

HF_ATTENTION = "lightning_smp_context_parallel"
"""The name of our implementation in transformers' ``AttentionInterface``."""

_IGNORE_INDEX = -100  # transformers' label of a position without a target


class SplitSequenceAttention:
    """``F.scaled_dot_product_attention`` over a sequence split across the ranks of ``topology``'s context-parallel
    group (`sequence`'s layout): the same arguments, the ring's (or gathered keys') result. ``calls`` counts the
    attention it ran. The group is looked up through the run's topology, its owner, at each call."""

    def __init__(self, topology: Topology, comm: ring.Comm) -> None:
        self.topology, self.comm, self.calls = topology, comm, 0

    @property
    def group(self) -> dist.ProcessGroup:
        """The context-parallel process group."""
        return self.topology.group("cp")

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        causal = bool(is_causal)
        if attn_mask is not None:
            if not _is_causal_mask(attn_mask, query.shape[-2], key.shape[-2]):
                raise ValueError(
                    f"an attention mask of shape {tuple(attn_mask.shape)} reached attention under context "
                    "parallelism, which runs over whole sequences split across ranks and honours no mask but the "
                    "causal one. Pass is_causal=True instead of a causal mask, drop padding masks (pack sequences "
                    "without padding), or train with context_parallel_degree=1."
                )
            causal = True
        if dropout_p > 0.0:
            raise ValueError(
                f"attention dropout (dropout_p={dropout_p}) is not supported under context parallelism; set the "
                "attention's dropout to 0 (e.g. nn.MultiheadAttention(dropout=0.0), a Hugging Face config's "
                "attention_dropout=0.0) or train with context_parallel_degree=1."
            )
        if causal and query.shape[-2] != key.shape[-2]:
            raise ValueError(
                f"causal attention of {query.shape[-2]} queries over {key.shape[-2]} keys under context parallelism: "
                "the ring's causal layout needs queries and keys of one sequence (self-attention)."
            )
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(
                f"{query.shape[-3]} query heads cannot share {key.shape[-3]} key/value heads evenly; give the model a "
                "number of key/value heads that divides its query heads."
            )
        self.calls += 1
        batched = query.dim() == 4
        if not batched:  # (H, L, D)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        out = ring.attention(query, key, value, group=self.group, causal=causal, scale=scale, comm=self.comm)
        return out if batched else out.squeeze(0)  # (B, H, T/cp, D)


@contextmanager
def attending_over_split_sequences(
    topology: Topology, comm: ring.Comm, *, check: str | None = None
) -> Generator[SplitSequenceAttention, None, None]:
    """`SplitSequenceAttention` over ``topology``'s context-parallel group standing in for
    ``F.scaled_dot_product_attention`` inside the block. ``check`` names a step that must run attention: if the block
    ran none, it raises (the model would train on each rank's chunks as if they were whole sequences)."""
    attention = SplitSequenceAttention(topology, comm)
    # In evaluation without grad, nn.MultiheadAttention and nn.TransformerEncoderLayer take torch's fused "fast
    # path", which attends without F.scaled_dot_product_attention (over this rank's chunks only): turned off here.
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with replaced_scaled_dot_product_attention(attention):
            yield attention
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    if check is not None and attention.calls == 0:
        raise ValueError(
            f"context_parallel_degree={topology.cp}, but the model's {check} ran no attention "
            "lightning_smp can split: it reaches nn.MultiheadAttention, nn.Transformer*Layer, "
            "F.scaled_dot_product_attention and Hugging Face models. Use F.scaled_dot_product_attention "
            "(is_causal=True for causal attention), or set context_parallel_degree=1."
        )


def _is_causal_mask(mask: Tensor, queries: int, keys: int) -> bool:
    """Whether ``mask`` (bool: True attends; float: added, -inf hides) is the causal mask of this rank's tokens
    (its local shape), i.e. what a model builds from its local length and the ring reads as ``is_causal``."""
    if queries != keys or mask.shape[-2:] != (queries, keys) or any(size != 1 for size in mask.shape[:-2]):
        return False
    plain = mask.reshape(queries, keys)
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    if plain.dtype == torch.bool:
        return bool(torch.equal(plain, allowed))  # sync: once per attention call with a mask
    return bool(torch.equal(torch.isneginf(plain), ~allowed) and not plain[allowed].any())


def _hugging_face_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-interface signature over our ring during a step of context parallelism, and over
    transformers' own ``sdpa`` outside one (e.g. generation after training): (B, H, T, D) in, (B, T, H, D) out.
    transformers builds no mask for an implementation it does not know, so causality comes from the module, as its
    ``sdpa`` takes it; a padding mask is not honoured (``set_attn_implementation("sdpa")`` before generating with
    one)."""
    if not isinstance(F.scaled_dot_product_attention, SplitSequenceAttention):
        kwargs.pop("is_causal", None)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs
        )
    if attention_mask is not None:
        raise ValueError(
            "a Hugging Face attention mask reached attention under context parallelism, which honours no mask but "
            "the causal one; pack sequences without padding and drop the attention_mask."
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(HF_ATTENTION, _hugging_face_attention)


def prepare_hugging_face(model: nn.Module) -> int:
    """Make every outermost Hugging Face model in ``model`` attend through `SplitSequenceAttention` and take this
    rank's global position ids (and a causal LM's labels shifted over the whole sequence) during a step of context
    parallelism; returns how many it prepared. Calling it again changes nothing."""
    prepared = 0
    for module in _outermost_hugging_face(model):
        if hf_attention_implementation(module) != HF_ATTENTION:
            module.set_attn_implementation(HF_ATTENTION)
            module.register_forward_pre_hook(_global_positions_and_labels, with_kwargs=True)
        prepared += 1
    return prepared


def _outermost_hugging_face(model: nn.Module) -> list[PreTrainedModel]:
    found: list[PreTrainedModel] = []
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and id(module) not in inner:
            found.append(module)
            inner.update(id(sub) for sub in module.modules())
    return found


def _global_positions_and_labels(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """During a step of context parallelism (our attention installed): the position ids of this rank's tokens, and
    a causal LM's ``labels`` shifted over the whole sequence as ``shift_labels`` (a local shift would pair each
    chunk's last token with the wrong target)."""
    attention = F.scaled_dot_product_attention
    if not isinstance(attention, SplitSequenceAttention):
        return None
    group = attention.group
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        return None
    if kwargs.get("position_ids") is None:
        local = sequence.positions(tokens.shape[1], cp=cp, rank=rank, device=tokens.device)  # (T/cp,)
        kwargs["position_ids"] = local.unsqueeze(0).expand(tokens.shape[0], -1)  # (B, T/cp)
    labels = kwargs.get("labels")
    if labels is not None and kwargs.get("shift_labels") is None and type(module).__name__.endswith("ForCausalLM"):
        whole = sequence.gather(labels, group=group)  # (B, T)
        shifted = F.pad(whole[:, 1:], (0, 1), value=_IGNORE_INDEX)  # position t's target is token t + 1
        kwargs["shift_labels"] = sequence.split(shifted, cp=cp, rank=rank)  # (B, T/cp)
    return args, kwargs
