"""A pipelined step's gradients, held aside from ``.grad`` between the schedule and Lightning's backward call.

Why: the schedule runs every microbatch's backward inside ``training_step``, and Lightning zeroes the gradients
between ``training_step`` and ``backward`` (``optimizer.zero_grad`` comes after the step function under automatic
optimization with accumulation). So the step's gradients are taken out of ``.grad`` when the schedule ends (the
gradients of earlier accumulation steps put back) and added to it at Lightning's backward call, as DeepSpeed's
engine defers its own. Not owned: reducing them (`reduction.py`).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager

from torch import Tensor, nn

__all__ = ["HeldGradients"]


class HeldGradients:
    """Collects one step's gradients (`collect`) and hands them to ``.grad`` (`release`)."""

    def __init__(self) -> None:
        self._held: list[tuple[nn.Parameter, Tensor | None]] | None = None

    @contextmanager
    def collect(self, params: Sequence[nn.Parameter]) -> Generator[None, None, None]:
        """While the body runs, ``params`` start from no gradient; what they have at its end is held, and their
        earlier gradients are back in ``.grad`` (on an error too, where nothing is held)."""
        saved = [p.grad for p in params]
        for param in params:
            param.grad = None
        try:
            yield
            self._held = [(p, p.grad) for p in params]
        finally:
            for param, grad in zip(params, saved, strict=True):
                param.grad = grad

    def release(self) -> bool:
        """Add the held gradients to ``.grad``; False when nothing was held (no pipelined step since the last)."""
        if self._held is None:
            return False
        held, self._held = self._held, None
        for param, grad in held:
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        return True
