"""Attention over a sequence split across the context-parallel ranks: a ring of key/value blocks, or gathered ones.

Owns the math of blockwise attention: each rank holds the queries, keys and values of its two chunks (`sequence`);
it attends its queries to every rank's key/value block in turn, passed around the ring ("p2p") or all gathered at
once ("all_gather"), and merges the partial outputs by their logsumexp (out = Σ exp(lse_i − lse)·out_i, lse =
logsumexp_i lse_i, in fp32). Backward runs the same blocks again with the merged output and logsumexp, so each
block's gradients are its share of the whole attention's; key/value gradients travel back to their owner with
the blocks (ring) or are summed over the group (all_gather). Under causal attention the head-tail layout makes
every block either the rank's own (causal), all queries against the source's head chunk, or the rank's tail
queries against the whole source block, so every rank does the same work. Why our own: torch 2.13's
``context_parallel`` registers ring handlers for the CUDA kernels only and fails on CPU; the fused kernels used
here (`_compat`) return the logsumexp on both (the CUDA path is untested on this project's CPU machines).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp._compat import (
    flash_attention_cuda,
    flash_attention_cuda_backward,
    flash_attention_for_cpu,
    flash_attention_for_cpu_backward,
)

__all__ = ["Comm", "attention", "backward_block", "block", "forward_block"]

Comm = Literal["p2p", "all_gather"]

Rows = Literal["all", "tail"]
Cols = Literal["all", "head"]


def block(rank: int, source: int, *, causal: bool) -> tuple[Rows, Cols, bool]:
    """Which of rank ``rank``'s queries attend to which keys of rank ``source``'s block, and whether causally.

    With the head-tail layout (rank r holds chunks r and 2·cp−1−r), causal attention needs: the rank's own block,
    causally; an earlier rank's block (source < rank): every query against the source's head chunk only (its tail
    chunk lies after all of them); a later rank's block: the tail queries only, against the whole block (the head
    queries lie before all of it). Bidirectional attention needs every query against every key."""
    if not causal:
        return "all", "all", False
    if source == rank:
        return "all", "all", True
    if source < rank:
        return "all", "head", False
    return "tail", "all", False


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup,
    causal: bool,
    scale: float | None,
    comm: Comm,
) -> Tensor:
    """Attention of this rank's queries ``(B, H, T/cp, D)`` over the whole sequence's keys and values, whose blocks
    ``(B, Hkv, S/cp, D)`` every rank of ``group`` holds (grouped-query attention when Hkv divides H). ``causal``
    needs the head-tail layout of `sequence` and S == T."""
    return _BlockAttention.apply(query, key, value, group, causal, scale, comm)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        group: dist.ProcessGroup,
        causal: bool,
        scale: float | None,
        comm: Comm,
    ) -> Tensor:
        rank = dist.get_rank(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, T/cp, D)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # (B, H, T/cp)
        kv = torch.stack([k, v])  # (2, B, Hkv, S/cp, D)
        for source, kv_block in _blocks(kv, group, comm):
            forward_block(q, kv_block, out, lse, rows_cols=block(rank, source, causal=causal), scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.comm = group, causal, scale, comm
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, comm = ctx.group, ctx.causal, ctx.scale, ctx.comm
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, T/cp, D)
        kv = torch.stack([k, v])  # (2, B, Hkv, S/cp, D)
        # the gradients of each source's keys and values: the one travelling with the block (p2p), or all (gathered)
        grad_kv = torch.zeros((cp if comm == "all_gather" else 1, *kv.shape), dtype=torch.float32, device=q.device)
        ring = _GradientRing(group) if comm == "p2p" else None
        for step, (source, kv_block) in enumerate(_blocks(kv, group, comm)):
            start, width, dq, dk, dv = backward_block(
                grad_out, q, kv_block, out, lse, rows_cols=block(rank, source, causal=causal), scale=scale
            )
            grad_q[:, :, start:] += dq.float()
            slot = source if comm == "all_gather" else 0
            if ring is not None and step > 0:
                grad_kv[0] = ring.receive()  # the gradients so far of the block this step used
            grad_kv[slot, 0, :, :, :width] += dk.float()
            grad_kv[slot, 1, :, :, :width] += dv.float()
            if ring is not None:
                ring.send_on(grad_kv[0])  # to the rank that uses this block next; after the last step, its owner
        own = ring.receive() if ring is not None else _sum_to_owners(grad_kv, group)[rank]
        return grad_q.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


def forward_block(
    q: Tensor, kv_block: Tensor, out: Tensor, lse: Tensor, *, rows_cols: tuple[Rows, Cols, bool], scale: float | None
) -> None:
    """Attend the queries ``q`` (B, H, T/cp, D) to one source's ``kv_block`` (2, B, Hkv, S/cp, D) as `block` says,
    merging into the running fp32 ``out`` (B, H, T/cp, D) and ``lse`` (B, H, T/cp) in place."""
    rows, cols, causal = rows_cols
    start = q.shape[2] // 2 if rows == "tail" else 0
    width = kv_block.shape[3] // 2 if cols == "head" else kv_block.shape[3]
    k_cols, v_cols = kv_block[:, :, :, :width].unbind(0)
    part, part_lse = _attend(q[:, :, start:], _heads(k_cols, q), _heads(v_cols, q), causal, scale)
    merged = torch.logaddexp(lse[:, :, start:], part_lse)  # (B, H, rows)
    kept = (lse[:, :, start:] - merged).exp().unsqueeze(-1)
    out[:, :, start:] = out[:, :, start:] * kept + part.float() * (part_lse - merged).exp().unsqueeze(-1)
    lse[:, :, start:] = merged


def backward_block(
    grad_out: Tensor,
    q: Tensor,
    kv_block: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    rows_cols: tuple[Rows, Cols, bool],
    scale: float | None,
) -> tuple[int, int, Tensor, Tensor, Tensor]:
    """One source block's share of the gradients, from the merged ``out`` and ``lse``: (first query row, key
    columns, grad of those queries (B, H, rows, D), of those keys and values (B, Hkv, columns, D))."""
    rows, cols, causal = rows_cols
    start = q.shape[2] // 2 if rows == "tail" else 0
    width = kv_block.shape[3] // 2 if cols == "head" else kv_block.shape[3]
    k_cols, v_cols = kv_block[:, :, :, :width].unbind(0)
    dq, dk, dv = _attend_backward(
        grad_out[:, :, start:],
        q[:, :, start:],
        _heads(k_cols, q),
        _heads(v_cols, q),
        out[:, :, start:],
        lse[:, :, start:],
        causal,
        scale,
    )
    return start, width, dq, _kv_heads(dk, k_cols), _kv_heads(dv, v_cols)


def _blocks(kv: Tensor, group: dist.ProcessGroup, comm: Comm) -> Iterator[tuple[int, Tensor]]:
    """(source rank, its key/value block) for every rank of ``group``, this rank's first; with "p2p" the next block
    is already on its way while the caller computes with the current one."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    if comm == "all_gather":
        parts = [torch.empty_like(kv) for _ in range(cp)]
        dist.all_gather(parts, kv.contiguous(), group=group)
        for step in range(cp):
            source = (rank - step) % cp
            yield source, parts[source]
        return
    after, before = _neighbours(group)
    current = kv.contiguous()
    for step in range(cp):
        pending, buffer = [], None
        if step < cp - 1:
            buffer = torch.empty_like(current)
            pending = [dist.isend(current, dst=after, group=group), dist.irecv(buffer, src=before, group=group)]
        yield (rank - step) % cp, current
        for work in pending:
            work.wait()
        if buffer is not None:
            current = buffer


class _GradientRing:
    """The key/value gradients travelling with their blocks in backward: a block's gradients go to the rank that uses
    it next (the following rank), and after the last step to its owner, one hop further."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._after, self._before = _neighbours(group)
        self._pending: list[Any] = []
        self._buffer: Tensor | None = None

    def send_on(self, grads: Tensor) -> None:
        self._wait()
        outgoing = grads.clone()
        self._buffer = torch.empty_like(outgoing)
        self._pending = [
            dist.isend(outgoing, dst=self._after, group=self._group),
            dist.irecv(self._buffer, src=self._before, group=self._group),
        ]

    def receive(self) -> Tensor:
        self._wait()
        assert self._buffer is not None
        return self._buffer

    def _wait(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending = []


def _neighbours(group: dist.ProcessGroup) -> tuple[int, int]:
    """The global ranks after and before this one in ``group``'s ring."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    return dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)


def _sum_to_owners(grad_kv: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's gradients of every source's block, summed over ``group``: (cp, 2, B, Hkv, S/cp, D). Gloo has no
    ring reduce-scatter (`reduction.ReductionPlan.scatter_by_all_reduce`), so the CPU sums whole; a GPU
    reduce-scatters and fills only this rank's slot."""
    if grad_kv.device.type == "cpu":
        dist.all_reduce(grad_kv, group=group)
        return grad_kv
    rank = dist.get_rank(group)
    own = torch.empty_like(grad_kv[rank])
    dist.reduce_scatter_tensor(own, grad_kv, group=group)
    grad_kv[rank] = own
    return grad_kv


def _heads(kv: Tensor, q: Tensor) -> Tensor:
    """Keys or values ``(B, Hkv, S, D)`` repeated to the query's heads ``(B, H, S, D)`` (grouped-query attention:
    query head h reads key/value head h // (H / Hkv), as transformers' ``repeat_kv`` lays them out)."""
    groups = q.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _kv_heads(grad: Tensor, kv: Tensor) -> Tensor:
    """The gradient of repeated heads ``(B, H, S, D)`` summed back onto the key/value heads ``(B, Hkv, S, D)``."""
    groups = grad.shape[1] // kv.shape[1]
    return grad if groups == 1 else grad.unflatten(1, (kv.shape[1], groups)).sum(2)


def _attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    """One block: the fused kernel's output ``(B, H, L, D)`` and logsumexp ``(B, H, L)`` (fp32)."""
    if q.is_cuda:
        out, lse = flash_attention_cuda(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse.float()
    out, lse = flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
    return out, lse.float()


def _attend_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's gradients, given the merged output and logsumexp of its rows."""
    if q.is_cuda:  # untested here: the project's test machines have no GPU
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        return flash_attention_cuda_backward(
            grad, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty, scale=scale
        )
    return flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)
