"""Reading a device value on the host without stalling the device stream, for decisions taken one step late.

Owns one idea: on CUDA, copy a 0-dim tensor into pinned host memory with a non-blocking copy and record an event;
read it later, when the event says it has landed (waiting, if at all, only for the work that produced it). On
CPU it is a plain read. The optimizer reads its skip flag this way and the SIGTERM agreement its vote, so that
neither puts a host sync into every training step.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HostMirror"]


class HostMirror:
    """A device→host copy of a 0-dim tensor that does not stall the stream."""

    def __init__(self, device: torch.device) -> None:
        is_cuda = device.type == "cuda"
        self._host = torch.zeros((), pin_memory=is_cuda)
        self._event = torch.cuda.Event() if is_cuda else None

    def capture(self, value: Tensor) -> None:
        self._host.copy_(value, non_blocking=True)
        if self._event is not None:
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def read(self) -> float:
        if self._event is not None:
            self._event.synchronize()  # sync: waits for the step that produced the value, not for later work
        return self._host.item()
