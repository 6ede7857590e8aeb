"""Gradient reduction overlapped with backward: each bucket's collective starts as soon as its gradients are final.

Why: the pipeline engine's all-reduce over the data-parallel replicas and ZeRO-1's reduce-scatter used to start
after the whole backward, so the wire sat idle while the last backward ran and the backward's cores sat idle while
the bytes moved. DDP (and Megatron's distributed optimizer) instead launch a bucket's collective from gradient-ready
hooks while backward still runs; `ReadyBuckets` does the same for ours. A parameter's gradient is final when its
post-accumulate hook fires while the hooks are armed (`armed`: the caller arms them only around the last backward
that touches the parameter before the reduction, e.g. the last microbatch's); buckets launch strictly in index
order, a ready bucket waiting for the ones before it, so every rank issues the same collectives in the same order
whatever order its hooks fire in (a parameter with no gradient on one rank only delays its bucket to `finish`).
`finish` launches what is left and waits for everything. The numbers are those of the reduction run after
backward: the same collectives on the same gradients.

Owns when a bucket's collective starts and the wait. Not owned: what a bucket's collective is and where its result
goes (the ``launch`` callable: `pipeline/reduction.py`'s all-reduce, `master_shard.py`'s reduce-scatter), which
parameters form a bucket (`reduction.buckets`), when the last backward runs (the engine, the strategy).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

__all__ = ["Launched", "ReadyBuckets"]


@dataclass
class Launched:
    """A bucket's collective in flight: ``work`` to wait for (None: it ran synchronously), then ``complete`` puts
    the result where it belongs."""

    work: dist.Work | None
    complete: Callable[[], None]


class ReadyBuckets:
    """Launches ``launch(i)`` for bucket ``i`` of ``buckets`` (lists of parameters) once every parameter in it, and
    every bucket before it, is ready. One object per step's reduction: `armed` registers the hooks, `finish` ends.

    Args:
        buckets: the parameters, bucket by bucket in launch order (put first what backward finishes first: the
            parameters used last in forward).
        launch: starts bucket ``i``'s collective on its parameters' current gradients and returns it.
    """

    def __init__(self, buckets: Sequence[Sequence[Tensor]], launch: Callable[[int], Launched]) -> None:
        self._buckets = [list(bucket) for bucket in buckets]
        self._launch = launch
        self._bucket_of = {id(p): i for i, bucket in enumerate(self._buckets) for p in bucket}
        self._missing = [len(bucket) for bucket in self._buckets]
        self._ready: set[int] = set()
        self._next = 0  # the next bucket to launch
        self._launched: list[Launched] = []

    @property
    def launched(self) -> int:
        """How many buckets' collectives have started."""
        return self._next

    @contextmanager
    def armed(self) -> Generator[None, None, None]:
        """While the body runs, a parameter whose gradient accumulates is ready (its gradient is final)."""
        params = [p for bucket in self._buckets for p in bucket if p.requires_grad]
        handles = [p.register_post_accumulate_grad_hook(self.ready) for p in params]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def ready(self, param: Tensor) -> None:
        """``param``'s gradient is final: launch every bucket, in order, whose parameters all are."""
        index = self._bucket_of.get(id(param))
        if index is None:
            return
        if id(param) in self._ready:
            if index < self._next:
                raise RuntimeError(
                    f"a parameter of shape {tuple(param.shape)} received a gradient after its bucket's reduction "
                    "had started: it is used by two backward passes that were both taken as its last. Please report "
                    "this at lightning_smp's issue tracker with the model."
                )
            return
        self._ready.add(id(param))
        self._missing[index] -= 1
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._start(self._next)

    def launch_rest(self) -> None:
        """Start every bucket not started yet, in order (their parameters' gradients as they are now)."""
        while self._next < len(self._buckets):
            self._start(self._next)

    def finish(self) -> None:
        """Start what is left, wait for every collective and put each result in place."""
        self.launch_rest()
        launched, self._launched = self._launched, []
        for bucket in launched:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.complete()

    def _start(self, index: int) -> None:
        self._next = index + 1
        self._launched.append(self._launch(index))
