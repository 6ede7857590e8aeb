"""Activation offloading (smp's ``offload_activations``, ``activation_loading_horizon``): where the inputs a
checkpointed module keeps for its recomputation wait between its forward and its backward; which modules are
checkpointed is `activation_checkpointing`'s. Built on ``torch.autograd.graph.saved_tensors_hooks`` around each
checkpoint, through which ``torch.utils.checkpoint`` saves exactly those inputs: they go to host memory (pinned on a
GPU) as the forward ends. ``save_on_cpu`` would load each only when backward asks, on the compute stream, stalling
it; here up to ``horizon`` modules are loaded ahead on a side stream, so on a GPU the copies overlap the backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["ActivationOffloader"]


class ActivationOffloader:
    """Keeps the tensors saved inside `offloading` in host memory until backward needs them.

    Each checkpointed forward runs inside its own `offloading`; backward then uses the offloaded modules in reverse
    order. When it unpacks one, the ``horizon`` modules that precede it (those backward reaches next) are loaded
    back too, so at most ``horizon`` modules' inputs wait on the device ahead of their backward.
    """

    def __init__(self, horizon: int) -> None:
        self._horizon = horizon
        self._waiting: list[weakref.ref[_OffloadedModule]] = []  # forward order, not yet used by backward
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def modules_on_device(self) -> int:
        """Offloaded modules whose inputs are loaded back and not yet used by backward: the one backward is on and
        the ``horizon`` loaded ahead of it, at most."""
        return sum(module.loaded is not None for module in self._alive())

    @contextmanager
    def offloading(self) -> Iterator[None]:
        """Run one checkpointed forward: the tensors autograd saves inside it go to host memory."""
        module = _OffloadedModule()
        self._waiting = [weakref.ref(waiting) for waiting in self._alive()]  # forget graphs dropped unused
        self._waiting.append(weakref.ref(module))
        with torch.autograd.graph.saved_tensors_hooks(module.pack, self._unpack):
            yield

    def _alive(self) -> list[_OffloadedModule]:
        # A module dies with the saved tensors of its graph: after its backward, or when the graph is dropped.
        return [module for module in (ref() for ref in self._waiting) if module is not None]

    def _unpack(self, handle: tuple[_OffloadedModule, int]) -> Tensor:
        module, index = handle
        if module.loaded is None or module.loaded[index] is None:  # not loaded ahead (or a second backward)
            module.load(self._side_stream)
        self._load_ahead_of(module)
        tensor = module.take(index)
        if module.loaded is None:  # backward has all of this module's inputs: it no longer waits
            self._waiting = [weakref.ref(waiting) for waiting in self._alive() if waiting is not module]
        return tensor

    def _load_ahead_of(self, module: _OffloadedModule) -> None:
        """Load the modules that ran just before ``module`` until ``horizon`` of them wait on the device."""
        waiting = self._alive()
        position = next((i for i, candidate in enumerate(waiting) if candidate is module), None)
        if position is None:
            return  # a second backward through a retained graph: load on demand only
        ahead = sum(candidate.loaded is not None for candidate in waiting if candidate is not module)
        for earlier in reversed(waiting[:position]):
            if ahead >= self._horizon:
                return
            if earlier.loaded is None:
                earlier.load(self._side_stream)
                ahead += 1

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]


class _OffloadedModule:
    """What one checkpointed forward saved: host copies, and device copies while its backward is near."""

    def __init__(self) -> None:
        self.host: list[Tensor] = []
        self.devices: list[torch.device] = []
        self.loaded: list[Tensor | None] | None = None  # device copies not yet handed to backward
        self._ready: list[torch.cuda.Event | None] = []  # per device copy: its load finished (CUDA)

    def pack(self, tensor: Tensor) -> tuple[_OffloadedModule, int]:
        cuda = tensor.device.type == "cuda"
        host = torch.empty_like(tensor, device="cpu", pin_memory=cuda)  # the same strides: the same kernels
        host.copy_(tensor, non_blocking=cuda)  # on the compute stream: a load waits for it (see `load`)
        if cuda:  # keep the device memory until the copy has read it, whichever stream allocated it
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        self.host.append(host)
        self.devices.append(tensor.device)
        return self, len(self.host) - 1

    def load(self, side_stream: Callable[[torch.device], torch.cuda.Stream]) -> None:
        self.loaded, self._ready = [], []
        for host, device in zip(self.host, self.devices, strict=True):
            if device.type != "cuda":
                self.loaded.append(host.to(device))  # the host copy itself when the device is the CPU
                self._ready.append(None)
                continue
            stream = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the offloading copy is done by then
            with torch.cuda.stream(stream):
                self.loaded.append(host.to(device, non_blocking=True))
            self._ready.append(stream.record_event())

    def take(self, index: int) -> Tensor:
        """Hand a loaded tensor to backward (and forget it: backward owns it now)."""
        assert self.loaded is not None
        tensor, ready = self.loaded[index], self._ready[index]
        assert tensor is not None
        self.loaded[index] = None
        if ready is not None:
            compute = torch.cuda.current_stream(tensor.device)
            compute.wait_event(ready)
            tensor.record_stream(compute)  # allocated on the side stream, used on this one
        if all(loaded is None for loaded in self.loaded):
            self.loaded = None
        return tensor
