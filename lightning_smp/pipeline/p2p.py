"""Point-to-point transport between pipeline stages: activations forward, their gradients back.

Owns the wire format. An activation (a tensor, or any nesting of tuples / lists / dicts holding tensors) goes as
a fixed-size int64 header, then — only for nested values — the pickled structure, then one message per tensor.
A single tensor, the common case, costs two messages: on a loaded CPU every extra message adds a wake-up of the
receiver, so the shape rides in the header instead of a separate metadata exchange. Gradients need no header:
the receiver of an activation sends back one gradient per tensor that required grad, in order.
Sends are non-blocking (`isend`, the works are kept until `wait_sends`), receives block; each link between
chunks uses its own tags (2c for activations of chunk c -> c+1, 2c + 1 for their gradients), so messages of
different chunks sharing a rank pair cannot be confused on gloo.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["NOTHING", "Transport"]

NOTHING: Any = object()
"""Sent instead of an activation when this rank's step did not reach its exit (the step did not use the trunk)."""

_HEADER = 64
_KIND_NOTHING, _KIND_TENSOR, _KIND_TREE = 0, 1, 2
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class Transport:
    """Sends and receives between this rank and its neighbours in ``group`` (the pipeline group).

    Args:
        group: the pipeline process group.
        device: where received tensors are created.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self._group = group
        self._device = device
        self._ranks = dist.get_process_group_ranks(group)
        self._pending: list[tuple[dist.Work, Any]] = []

    def peer(self, offset: int) -> int:
        """The global rank ``offset`` stages away, wrapping around (the last stage's next is the first)."""
        index = self._ranks.index(dist.get_rank())
        return self._ranks[(index + offset) % len(self._ranks)]

    def send_activation(self, value: Any, *, dst: int, tag: int) -> list[Tensor]:
        """Send ``value``; returns the tensors in it that require grad (their gradients come back in order)."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        if value is NOTHING:
            self._isend(header.to(self._device), dst, tag)
            return []
        if isinstance(value, Tensor) and value.dim() <= _HEADER - 4:
            header[:4] = torch.tensor([_KIND_TENSOR, _dtype_code(value), value.requires_grad, value.dim()])
            header[4 : 4 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
            self._isend(header.to(self._device), dst, tag)
            self._isend(value.detach().contiguous(), dst, tag)
            return [value] if value.requires_grad else []
        leaves, spec = tree_flatten(value)
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        meta = pickle.dumps(
            (
                spec,
                [None if isinstance(leaf, Tensor) else leaf for leaf in leaves],
                [(_dtype_code(t), tuple(t.shape), t.requires_grad) for t in tensors],
            )
        )
        header[:2] = torch.tensor([_KIND_TREE, len(meta)])
        self._isend(header.to(self._device), dst, tag)
        self._isend(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self._device), dst, tag)
        for tensor in tensors:
            self._isend(tensor.detach().contiguous(), dst, tag)
        return [t for t in tensors if t.requires_grad]

    def recv_activation(self, *, src: int, requires_grad: bool, tag: int) -> tuple[Any, list[Tensor]]:
        """Receive an activation; returns it (`NOTHING` if none was sent) and its leaves that require grad."""
        received_header = self._recv((_HEADER,), torch.int64, src, tag)
        header = received_header.tolist()  # sync: the receiver needs the shapes before it can post the data
        kind = header[0]
        if kind == _KIND_NOTHING:
            return NOTHING, []
        if kind == _KIND_TENSOR:
            dtype, grad, ndim = _DTYPES[header[1]], bool(header[2]), header[3]
            tensor = self._recv(tuple(header[4 : 4 + ndim]), dtype, src, tag)
            leaf = _as_leaf(tensor, grad and requires_grad)
            return leaf, [leaf] if leaf.requires_grad else []
        meta = self._recv((header[1],), torch.uint8, src, tag).cpu()
        spec, leaves, tensor_meta = pickle.loads(meta.numpy().tobytes())
        received = []
        for code, shape, grad in tensor_meta:
            received.append(_as_leaf(self._recv(shape, _DTYPES[code], src, tag), grad and requires_grad))
        it = iter(received)
        leaves = [next(it) if leaf is None else leaf for leaf in leaves]
        return tree_unflatten(leaves, spec), [t for t in received if t.requires_grad]

    def send_grads(self, leaves: list[Tensor], *, dst: int, tag: int) -> None:
        """Send the gradients of received ``leaves`` back (zeros for a leaf the step did not use)."""
        for leaf in leaves:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            self._isend(grad.contiguous(), dst, tag)

    def recv_grads(self, outputs: list[Tensor], *, src: int, tag: int) -> list[Tensor]:
        """Receive the gradients of the sent ``outputs``, one per tensor, in order."""
        return [self._recv(tuple(t.shape), t.dtype, src, tag) for t in outputs]

    def wait_sends(self) -> None:
        """Wait for every send of this step (and drop the buffers they kept alive)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def _isend(self, tensor: Tensor, dst: int, tag: int) -> None:
        work = dist.isend(tensor, dst=dst, group=self._group, tag=tag)
        self._pending.append((work, tensor))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self._device)
        dist.recv(tensor, src=src, group=self._group, tag=tag)
        return tensor


def _as_leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    return tensor.requires_grad_(True) if requires_grad and tensor.is_floating_point() else tensor


def _dtype_code(tensor: Tensor) -> int:
    try:
        return _CODE[tensor.dtype]
    except KeyError:
        raise ValueError(
            f"a pipeline activation has dtype {tensor.dtype}, which lightning_smp cannot send between stages; "
            f"use one of {', '.join(map(str, _DTYPES))}."
        ) from None
