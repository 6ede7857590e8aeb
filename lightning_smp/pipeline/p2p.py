"""Moving values between pipeline stages: activations forward, their gradients back, the step's result out.

Owns the wire format. A value (a tensor, or any nesting of tuples / lists / dicts holding tensors) travels as
one uint8 message: its tensors' bytes (16-byte aligned) and a trailing flag byte. In steady state a microbatch
costs one message per direction: the receiver posts buffers of the expected size before the messages come, and
the flag says whether the layout still holds. This matters on gloo: every message costs a wake-up of the
receiver, about a millisecond on a loaded CPU, and a metadata message per microbatch doubled the count.

The expected layout of a link is fixed for a whole step: the layout of the link's last value of the previous
step (`begin_step` moves it on, on both sides, so sender and receiver agree without talking). A value of that
layout goes as it is; any other value (the link's first, or a changed shape) goes as a message of the expected
size flagged "changed", then its layout and itself on the link's layout tag (``tag + LAYOUT_TAG_OFFSET``), which
nobody posts ahead, so buffers already posted for the step never meet a message of another size.
Gradients need no layout (the receiver of an activation sends one gradient per tensor that required grad, in
order). Sends are non-blocking (`isend`, kept until `wait_sends`). Each link between chunks has its own tags
(2c for activations of chunk c -> c + 1, 2c + 1 for their gradients), so messages of different chunks sharing a
pair of ranks cannot be confused on gloo; the step's result travels from the last stage to each other stage as a
value on a link of its own (`runtime.py` picks the tag).

How far ahead receives are posted depends on the backend (`expect`). On gloo a posted receive costs the caller a
socket write (a "ready" note to the sender, whose data moves only then), so all the receives of a step are posted
when it starts, while the stage waits for its first input anyway. On NCCL a posted receive occupies the pair's
stream, and a send queued behind receives posted too far ahead could deadlock, so one receive is posted ahead.
"""

from __future__ import annotations

import pickle
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp._compat import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = ["LAYOUT_TAG_OFFSET", "NOTHING", "Transport"]

NOTHING: Any = object()
"""Sent instead of an activation when this rank's step did not reach its exit (the step did not use the trunk)."""

LAYOUT_TAG_OFFSET = 1 << 16
"""A link's layout tag is its tag plus this; the links' own tags stay below it."""

_ALIGN = 16


class _Slot:
    """Where a tensor sat in a nested value (a marker that no user value can be)."""

    def __reduce__(self) -> str:
        return "_SLOT"


_SLOT = _Slot()
_SAME, _CHANGED = 0, 1
_Layout = tuple  # ("nothing",) | ("tensor", dtype, shape, requires_grad) | ("tree", skeleton bytes, tensor metas)
_Link = tuple[int, int]  # (peer rank, tag)


class Transport:
    """Sends and receives between this rank and its neighbours in ``topology``'s pipeline group.

    Every rank calls `begin_step` at the start of each pipelined step, and a receiver announces with `expect`
    how many values each of its links brings in the step.

    Args:
        topology: the run, owner of the pipeline process group, which each send and receive looks up (the
            transport keeps no group: the run's end reaches it through the topology).
        device: where received tensors are created.
    """

    def __init__(self, topology: Topology, device: torch.device) -> None:
        self._topology = topology
        self._device = device
        self._ranks = dist.get_process_group_ranks(self._group())
        self._pending: list[tuple[dist.Work, Any]] = []
        # per link: the layout expected this step, and the layout of the last value it carried
        self._sent_expected: dict[_Link, _Layout] = {}
        self._sent_last: dict[_Link, _Layout] = {}
        self._received_expected: dict[_Link, _Layout] = {}
        self._received_last: dict[_Link, _Layout] = {}
        self._posted: dict[_Link, deque[tuple[dist.Work, Tensor]]] = {}
        self._to_post: dict[_Link, int] = {}

    def _group(self) -> dist.ProcessGroup:
        return self._topology.group("pp")  # looked up at each use: the topology owns it

    def peer(self, offset: int) -> int:
        """The global rank ``offset`` stages away, wrapping around (the last stage's next is the first)."""
        index = self._ranks.index(dist.get_rank())
        return self._ranks[(index + offset) % len(self._ranks)]

    def begin_step(self) -> None:
        """A new step: each link now expects the layout of the last value it carried."""
        unread = [link for link, posted in self._posted.items() if posted or self._to_post.get(link)]
        if unread:
            raise RuntimeError(
                f"a pipelined step began while receives of an earlier one were still expected (links {unread}): "
                "that step stopped part-way, on an error, and its messages may still be on their way. The pipeline "
                "cannot go on in this process; restart the script (in a notebook, the kernel)."
            )
        self._sent_expected = dict(self._sent_last)
        self._received_expected = dict(self._received_last)

    def expect(self, *, src: int, tag: int, count: int) -> None:
        """This step brings ``count`` values from ``src`` on ``tag``: post their receives (all of them now on
        gloo, one ahead elsewhere; see the module docstring). Values of an unknown layout need none."""
        link = (src, tag)
        if link not in self._received_expected:
            return
        self._to_post[link] = count
        for _ in range(count if self._device.type == "cpu" else 1):
            self._post(link)

    def send_activation(self, value: Any, *, dst: int, tag: int) -> list[Tensor]:
        """Send ``value``; returns the tensors in it that require grad (their gradients come back in order)."""
        layout, tensors = _describe(value)
        link = (dst, tag)
        expected = self._sent_expected.get(link)
        self._sent_last[link] = layout
        if layout == expected:
            self._isend(_pack(tensors, layout, self._device), dst, tag)
        else:
            if expected is not None:  # fills the receive posted for it
                self._isend(
                    _flagged(torch.empty(_size(expected), dtype=torch.uint8, device=self._device), _CHANGED), dst, tag
                )
            self._send_layout(layout, dst, tag + LAYOUT_TAG_OFFSET)
            self._isend(_pack(tensors, layout, self._device), dst, tag + LAYOUT_TAG_OFFSET)
        return [t for t in tensors if t.requires_grad]

    def recv_activation(self, *, src: int, requires_grad: bool, tag: int) -> tuple[Any, list[Tensor]]:
        """Receive an activation; returns it (`NOTHING` if none was sent) and its leaves that require grad."""
        link = (src, tag)
        expected = self._received_expected.get(link)
        if expected is not None:
            if not self._posted.get(link):
                self._post(link)
            work, buffer = self._posted[link].popleft()
            work.wait()
            if self._to_post.get(link):
                self._post(link)
            if int(buffer[-1]) == _SAME:  # sync: a byte, read once the message is here anyway
                self._received_last[link] = expected
                return _unpack(buffer, expected, requires_grad)
        layout = self._recv_layout(src, tag + LAYOUT_TAG_OFFSET)
        self._received_last[link] = layout
        buffer = self._recv((_size(layout) + 1,), torch.uint8, src, tag + LAYOUT_TAG_OFFSET)
        return _unpack(buffer, layout, requires_grad)

    def send_grads(self, leaves: list[Tensor], *, dst: int, tag: int) -> None:
        """Send the gradients of received ``leaves`` back (zeros for a leaf the step did not use)."""
        for leaf in leaves:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            self._isend(grad.contiguous(), dst, tag)

    def post_grads(self, outputs: list[Tensor], *, src: int, tag: int) -> list[tuple[dist.Work, Tensor]]:
        """Post the receives of the gradients of the sent ``outputs`` (one per tensor, in order); `wait_grads`
        returns them. Posting at send time lets them arrive while this rank computes."""
        posted = []
        for output in outputs:
            buffer = torch.empty(output.shape, dtype=output.dtype, device=self._device)
            posted.append((dist.irecv(buffer, src=src, group=self._group(), tag=tag), buffer))
        return posted

    @staticmethod
    def wait_grads(posted: list[tuple[dist.Work, Tensor]]) -> list[Tensor]:
        for work, _ in posted:
            work.wait()
        return [buffer for _, buffer in posted]

    def wait_sends(self) -> None:
        """Wait for every send of this step (and drop the buffers they kept alive)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def _post(self, link: _Link) -> None:
        """Post the receive of the link's next value, of the expected layout's size."""
        self._to_post[link] = max(self._to_post.get(link, 0) - 1, 0)
        buffer = torch.empty(_size(self._received_expected[link]) + 1, dtype=torch.uint8, device=self._device)
        work = dist.irecv(buffer, src=link[0], group=self._group(), tag=link[1])
        self._posted.setdefault(link, deque()).append((work, buffer))

    def _send_layout(self, layout: _Layout, dst: int, tag: int) -> None:
        described = pickle.dumps(layout)
        self._isend(torch.tensor([len(described)], dtype=torch.int64, device=self._device), dst, tag)
        self._isend(torch.frombuffer(bytearray(described), dtype=torch.uint8).to(self._device), dst, tag)

    def _recv_layout(self, src: int, tag: int) -> _Layout:
        length = int(self._recv((1,), torch.int64, src, tag))  # sync: the size of what comes next
        return pickle.loads(self._recv((length,), torch.uint8, src, tag).cpu().numpy().tobytes())

    def _isend(self, tensor: Tensor, dst: int, tag: int) -> None:
        work = dist.isend(tensor, dst=dst, group=self._group(), tag=tag)
        self._pending.append((work, tensor))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self._device)
        dist.recv(tensor, src=src, group=self._group(), tag=tag)
        return tensor


# -- layouts -------------------------------------------------------------------------------------------------------


def _describe(value: Any) -> tuple[_Layout, list[Tensor]]:
    if value is NOTHING:
        return ("nothing",), []
    if isinstance(value, Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.requires_grad), [value]
    leaves, spec = tree_flatten(value)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    # The value with a marker for each tensor, not its TreeSpec: unpickling a spec builds torch's deprecated
    # LeafSpec, which warns (torch >= 2.10) once per process.
    structure = pickle.dumps(tree_unflatten([_SLOT if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec))
    metas = tuple((t.dtype, tuple(t.shape), t.requires_grad) for t in tensors)
    return ("tree", structure, metas), tensors


def _metas(layout: _Layout) -> tuple[tuple[torch.dtype, tuple[int, ...], bool], ...]:
    if layout[0] == "nothing":
        return ()
    if layout[0] == "tensor":
        return (layout[1:],)
    return layout[2]


def _offsets(layout: _Layout) -> tuple[list[int], int]:
    offsets, end = [], 0
    for dtype, shape, _ in _metas(layout):
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + _numel(shape) * dtype.itemsize
    return offsets, end


def _size(layout: _Layout) -> int:
    return _offsets(layout)[1]


def _pack(tensors: list[Tensor], layout: _Layout, device: torch.device) -> Tensor:
    """The message carrying ``tensors`` laid out as ``layout``, flagged "same"."""
    offsets, size = _offsets(layout)
    if len(tensors) == 1 and offsets == [0]:
        return _flagged(tensors[0].detach().contiguous().reshape(-1).view(torch.uint8), _SAME)
    buffer = torch.zeros(size + 1, dtype=torch.uint8, device=device)
    for tensor, start in zip(tensors, offsets, strict=True):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[start : start + data.numel()].copy_(data)
    buffer[-1] = _SAME
    return buffer


def _unpack(buffer: Tensor, layout: _Layout, requires_grad: bool) -> Any:
    if layout[0] == "nothing":
        return NOTHING, []
    offsets, _ = _offsets(layout)
    tensors = []
    for (dtype, shape, grad), start in zip(_metas(layout), offsets, strict=True):
        tensor = buffer[start : start + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
        if grad and requires_grad and tensor.is_floating_point():
            tensor.requires_grad_(True)
        tensors.append(tensor)
    leaves_with_grad = [t for t in tensors if t.requires_grad]
    if layout[0] == "tensor":
        return tensors[0], leaves_with_grad
    leaves, spec = tree_flatten(pickle.loads(layout[1]))
    it = iter(tensors)
    return tree_unflatten([next(it) if leaf is _SLOT else leaf for leaf in leaves], spec), leaves_with_grad


def _flagged(buffer: Tensor, flag: int) -> Tensor:
    return torch.cat([buffer, torch.tensor([flag], dtype=torch.uint8, device=buffer.device)])


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
