"""The random generators a checkpoint carries per rank: torch, Python, NumPy, CUDA and the tensor-parallel stream.

Owns capturing and restoring them. Not owned: whether a load restores them (`loading.py` does only when the layout
is unchanged, since a rank's stream means nothing in another layout) or the tensor-parallel stream itself
(`tensor_parallel/rng.py`). Saved as one object per rank, so dropout masks continue exactly across a resume.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from lightning_smp.tensor_parallel.base import TensorParallelModule
from lightning_smp.tensor_parallel.rng import TensorParallelRNG

__all__ = ["rng_states", "set_rng_states"]


def rng_states(module: nn.Module) -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    tensor_parallel = _tensor_parallel_rng(module)
    if tensor_parallel is not None:
        states["tensor_parallel"] = tensor_parallel.state_dict()
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any], module: nn.Module) -> None:
    torch.set_rng_state(states["torch"])
    tensor_parallel = _tensor_parallel_rng(module)
    if tensor_parallel is not None and "tensor_parallel" in states:
        tensor_parallel.load_state_dict(states["tensor_parallel"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


def _tensor_parallel_rng(module: nn.Module) -> TensorParallelRNG | None:
    """The dropout stream of this rank's sharded regions (one per rank, shared by its tensor-parallel layers:
    their ``tp_context.rng``), or None without tensor parallelism."""
    for layer in module.modules():
        if isinstance(layer, TensorParallelModule) and layer.tp_context is not None:
            return layer.tp_context.rng
    return None
