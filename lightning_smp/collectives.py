"""Which way an all-gather or a reduce-scatter runs: the backend's own collective, or a stand-in cheaper on gloo.

Owns the one choice, by the tensors' device (`native`): on a GPU (NCCL) tensor parallelism's all-gathers and
reduce-scatters (sequence parallelism's) are NCCL's ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` and
ZeRO-1 reduce-scatters its buckets asynchronously during backward; CPU tensors (gloo) take stand-ins that cost less
there: point-to-point exchanges (`tensor_parallel.comm`), and for ZeRO-1 a whole all-reduce
(`reduction.ReductionPlan.scatter_by_all_reduce`). So a CPU test would never run the code a GPU cluster runs.
`native_on_cpu` makes CPU tensors take the backend's own collectives too for the block: gloo implements both
collectives and their asynchronous work handles (torch 2.13, fp32, fp16 and bf16), so the tests run that code on
gloo. A context variable rather than a parameter threaded through every layer: it is a test's choice, not a run's,
and the code that reads it reads nothing else of the kind. Not owned: the collectives themselves (their callers').
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "native", "native_on_cpu", "reduce_scatter_single"]

_NATIVE_ON_CPU: ContextVar[bool] = ContextVar("lightning_smp_native_collectives_on_cpu", default=False)

# torch 2.13 renamed the single-tensor collectives; older versions (>= 2.5, this package's floor) have the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def native(device: torch.device | str) -> bool:
    """Whether all-gathers and reduce-scatters of tensors on ``device`` (a device or its type) run as the backend's
    own collectives: everywhere but on the CPU, and there too inside `native_on_cpu`."""
    device_type = device if isinstance(device, str) else device.type
    return device_type != "cpu" or _NATIVE_ON_CPU.get()


@contextmanager
def native_on_cpu() -> Iterator[None]:
    """Run CPU tensors' all-gathers and reduce-scatters as gloo's own collectives in the block, as NCCL runs GPU
    tensors' (for tests: the branches a GPU cluster takes, on gloo). A run decides its reduction at setup
    (`reduction.plan_reduction`): enter the block before ``trainer.fit``."""
    token = _NATIVE_ON_CPU.set(True)
    try:
        yield
    finally:
        _NATIVE_ON_CPU.reset(token)
