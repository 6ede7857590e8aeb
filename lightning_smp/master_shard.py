"""This rank's fp32 master weights (`WholeMasters`).

Owns where the masters and their fp32 grads live, how the model's grads get into them, how updated masters get
back into the model, and the translation between what the inner optimizer updates and whole model parameters
(checkpoints). Not owned: the order of an update and the overflow/norm vote (`optimizer.py`, `grad_vote.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_smp.placement import placement_of

__all__ = ["HALF_DTYPES", "WholeMasters"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


class WholeMasters:
    """Every master on this rank: half-precision parameters get fp32 copies in one flat buffer (param-shaped views,
    so unscale, overflow check and norm are one kernel each); fp32 parameters are their own masters."""

    def __init__(self, params: Sequence[Tensor], device: torch.device) -> None:
        self.half_params = [p for p in params if p.dtype in HALF_DTYPES]
        self.own_params = [p for p in params if p.dtype not in HALF_DTYPES]
        self._flat_master = torch.empty(sum(p.numel() for p in self.half_params), dtype=torch.float32, device=device)
        self._flat_grad = torch.zeros_like(self._flat_master)
        master_views = _views(self._flat_master, self.half_params)
        self._grad_views = _views(self._flat_grad, self.half_params)
        with torch.no_grad():
            if self.half_params:
                torch._foreach_copy_(master_views, self.half_params)
        self.masters: list[Tensor] = []
        for view, grad in zip(master_views, self._grad_views, strict=True):
            master = nn.Parameter(view)
            master.grad = grad
            self.masters.append(master)
        self._norm_counts = [placement_of(p).counts_in_norm for p in self.half_params + self.own_params]
        self._grads_detached = False  # some masters had their grad set to None for one step (unused params)

    @property
    def params(self) -> list[Tensor]:
        return self.half_params + self.own_params

    def optimized(self) -> dict[int, Tensor]:
        """id(model parameter) → the tensor the inner optimizer updates in its place."""
        return {id(p): m for p, m in zip(self.half_params, self.masters, strict=True)} | {
            id(p): p for p in self.own_params
        }

    def master_params(self) -> list[Tensor]:
        return [*self.masters, *self.own_params]

    def read_grads(self) -> None:
        """Copy the half grads of the latest backward, still scaled, into the fp32 master grads."""
        half_grads = [p.grad for p in self.half_params]
        if any(g is None for g in half_grads):
            # Unused parameters keep no gradient, like in the fp32 run: torch optimizers skip a param whose
            # grad is None, so the master has none either for this step (restored in `after_step`). Its slot in
            # the flat buffer is zeroed so a stale value counts neither for overflow nor for the norm.
            present, missing = [], []
            self._grads_detached = True
            for master, grad, view in zip(self.masters, half_grads, self._grad_views, strict=True):
                master.grad = None if grad is None else view
                (missing if grad is None else present).append((view, grad))
            torch._foreach_zero_([view for view, _ in missing])
            if present:
                torch._foreach_copy_([view for view, _ in present], [grad for _, grad in present])
        elif half_grads:
            torch._foreach_copy_(self._grad_views, half_grads)

    def all_half_grads(self) -> list[Tensor] | None:
        """The half grads, when every half parameter has one (the fused fast path reads them directly)."""
        grads = [p.grad for p in self.half_params]
        return None if any(g is None for g in grads) else grads

    def grads(self) -> list[Tensor]:
        """Every fp32 grad the update reads: the flat master grad (one kernel) and the fp32 params' own grads."""
        own = [p.grad for p in self.own_params if p.grad is not None]
        return ([self._flat_grad] if self.half_params else []) + own

    def counted_grads(self) -> list[Tensor]:
        """The grads that count in the global norm: all of them (one flat kernel) unless some are duplicates."""
        if all(self._norm_counts):
            return self.grads()
        grads = [master.grad for master in self.masters] + [p.grad for p in self.own_params]
        return [g for g, counts in zip(grads, self._norm_counts, strict=True) if counts and g is not None]

    def write_params(self) -> None:
        """Copy the masters into the half-precision parameters."""
        if self.half_params:
            torch._foreach_copy_(self.half_params, self.masters)

    def after_step(self) -> None:
        if self._grads_detached:
            for master, view in zip(self.masters, self._grad_views, strict=True):
                master.grad = view
            self._grads_detached = False

    def whole_masters(self) -> list[tuple[Tensor, Tensor]]:
        """Each model parameter with its fp32 master (itself when already fp32); the masters themselves."""
        return [*zip(self.half_params, self.masters, strict=True), *((p, p) for p in self.own_params)]

    def load_whole_masters(self, values: dict[int, Tensor]) -> None:
        """Set the masters from whole fp32 values by id(model parameter) (a master passed as its own value is
        skipped), then the half-precision parameters from the masters."""
        for param, master in self.whole_masters():
            value = values.get(id(param))
            if value is not None and value is not master:
                master.copy_(value)
        self.write_params()

    def state_by_param(self, inner_state: dict[Tensor, Any]) -> list[tuple[Tensor, dict[str, Any]]]:
        return [(p, dict(inner_state[m])) for p, m in self.whole_masters() if inner_state.get(m)]

    def state_of_optimized(self, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Whole per-parameter states by id(model parameter) → states by id(the tensor the optimizer updates)."""
        return {id(m): states[id(p)] for p, m in self.whole_masters() if id(p) in states}


def _offsets(params: Sequence[Tensor]) -> list[int]:
    offsets, offset = [], 0
    for param in params:
        offsets.append(offset)
        offset += param.numel()
    return offsets


def _views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    return [flat[o : o + p.numel()].view_as(p) for o, p in zip(_offsets(params), params, strict=True)]
