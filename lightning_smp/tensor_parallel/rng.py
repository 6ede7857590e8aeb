"""Random numbers inside tensor-parallel layers: Megatron's rule, reproducibly.

Dropout in a replicated region (after a row-parallel output, on the residual stream) must drop the same
elements on every tensor-parallel rank, or the replicas drift apart: it draws from the default generator, which
`sync_default_generator` makes equal across the group at setup. Dropout in a sharded region (on a column-parallel
output, on attention probabilities of this rank's heads) must be independent across ranks, or the shards would
share one mask pattern: it draws from `TensorParallelRNG`, a second stream seeded from ``tensor_parallel_seed``
and the rank, swapped in around the draw (Megatron's ``CudaRNGStatesTracker.fork``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TensorParallelRNG", "sync_default_generator", "tensor_parallel_seed"]

# Megatron's offset between the default seed and the model-parallel one (megatron/core/tensor_parallel/random.py).
_SEED_OFFSET = 2718


def tensor_parallel_seed(base: int, *, tp_rank: int, tp_size: int, pp_rank: int) -> int:
    """The seed of one rank's sharded-region stream: distinct for every (pipeline stage, tensor rank)."""
    return base + _SEED_OFFSET + tp_rank + tp_size * pp_rank


class TensorParallelRNG:
    """A generator state per device, swapped into the default generator by `fork` (no host-device sync)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._states: dict[str, torch.Tensor] = {}

    @contextmanager
    def fork(self, device: torch.device) -> Iterator[None]:
        """Draw from this stream inside the block; the default generator is left as it was."""
        if device.type == "meta":  # the memory planner's trace: no numbers are drawn
            yield
            return
        key = str(device)
        get_state, set_state = _accessors(device)
        state = self._states.get(key)
        if state is None:
            state = torch.Generator(device=device).manual_seed(self.seed).get_state()
        outside = get_state()
        set_state(state)
        try:
            yield
        finally:
            self._states[key] = get_state()
            set_state(outside)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "states": {key: state.clone() for key, state in self._states.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = state_dict["seed"]
        self._states = {key: state.clone() for key, state in state_dict["states"].items()}


def _accessors(device: torch.device) -> tuple[Any, Any]:
    if device.type == "cuda":
        return (lambda: torch.cuda.get_rng_state(device)), (lambda state: torch.cuda.set_rng_state(state, device))
    if device.type != "cpu":
        raise NotImplementedError(
            f"tensor-parallel dropout on {device.type!r} tensors is not supported; train on CPU or CUDA, or set "
            "dropout=0 inside tensor-parallel layers."
        )
    return torch.get_rng_state, torch.set_rng_state


def sync_default_generator(group: dist.ProcessGroup, device: torch.device) -> None:
    """Give every rank of ``group`` the default generator state of its first rank (collective).

    ``device`` is the one collectives run on (CUDA for NCCL); a CUDA ``device`` also syncs its generator.
    """
    src = dist.get_global_rank(group, 0)
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if device.type == "cuda":
        states.append(_accessors(device))
    for get_state, set_state in states:
        state = get_state().to(device)
        dist.broadcast(state, src=src, group=group)
        set_state(state.cpu())
