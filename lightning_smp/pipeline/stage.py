"""One rank's stage of the trunk: placeholders for the children other stages hold, and the routing of each
child's call while a pipelined step runs.

Owns what happens when the user's code runs the trunk on this rank: children before this call's chunk pass
their input through (they are computed elsewhere), the chunk's first child takes the activation received from
the previous stage instead of its local input, and after the chunk's last child a non-final chunk leaves the
user's step through `StageExit` (a BaseException, so ``except Exception`` in user code does not swallow it),
carrying the output to send. It also checks, as the children run, that the trunk really is sequential: each
child takes the previous child's output as its first argument, and no extra argument needs a gradient (a skip
connection that would cross a stage boundary). Outside a pipelined step every owned child runs normally.
Not owned: sending, receiving and the schedule (`runtime.py`), the plan (`partition.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_smp.pipeline.p2p import NOTHING
from lightning_smp.pipeline.partition import PartitionPlan

__all__ = ["StageExit", "TrunkRouter", "check_chain", "check_no_skip_connection"]


class StageExit(BaseException):
    """Raised after the last child of a non-final chunk: the step's work on this rank is done."""

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline stage finished its chunk")
        self.output = output


class _Placeholder(nn.Module):
    """Stands in for a trunk child held by another stage: no parameters, passes its first input through."""

    def __init__(self, index: int, name: str, router: TrunkRouter) -> None:
        super().__init__()
        self._index = index
        self._held_name = name
        object.__setattr__(self, "_router", router)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._router._route(self._index, None, args, kwargs)

    def extra_repr(self) -> str:
        return f"{self._held_name} runs on another pipeline stage"


@dataclass
class _Call:
    """State of one run of the user's step through one chunk."""

    entry: int
    exit: int | None
    received: Any
    next_index: int = 0
    last_output: Any = NOTHING
    reached_entry: bool = False
    finished: bool = False
    input_leaves: list[Tensor] = field(default_factory=list)


class TrunkRouter:
    """Installs this rank's stage into ``trunk`` (in place) and routes the children's calls during a step.

    Args:
        trunk: the nn.Sequential / nn.ModuleList being pipelined; children other stages hold are replaced by
            placeholders, so their parameters leave this rank.
        plan: the partition.
        stage: this rank's pipeline stage.
    """

    def __init__(self, trunk: nn.Module, plan: PartitionPlan, stage: int) -> None:
        self._plan = plan
        self._stage = stage
        self._call: _Call | None = None
        owned = set(plan.owned(stage))
        for index, child in enumerate(list(trunk.children())):
            name = plan.children[index].name
            if index in owned:
                original = child.forward
                child.forward = _RoutedForward(self, index, original)  # instance attribute: state_dict unchanged
            else:
                trunk[index] = _Placeholder(index, name, self)

    @property
    def stage(self) -> int:
        return self._stage

    @contextmanager
    def run(self, chunk: int, received: Any = NOTHING) -> Generator[_Call, None, None]:
        """Route the trunk through ``chunk`` while the body runs the user's step; ``received`` is the
        activation from the previous chunk (none for chunk 0)."""
        chunk_range = self._plan.chunk_range(chunk)
        is_last = chunk == self._plan.num_chunks - 1
        call = _Call(entry=chunk_range.start, exit=None if is_last else chunk_range[-1], received=received)
        self._call = call
        try:
            yield call
        finally:
            self._call = None

    def _route(self, index: int, forward: Callable[..., Any] | None, args: tuple, kwargs: dict) -> Any:
        call = self._call
        if call is None:  # outside a pipelined step (ModelSummary, user code): owned children run as usual
            return forward(*args, **kwargs) if forward is not None else _first(args, index, self._plan)
        name = self._plan.children[index].name
        if index != call.next_index:
            raise RuntimeError(
                f"trunk child {name!r} ran out of order (expected child {call.next_index} next) or twice in one "
                "step. A pipelined trunk must run each child once per step, in order; run this container once per "
                "training_step, or name another with pipeline_module='...'."
            )
        activation = check_chain(name, index, args, call.last_output)
        call.next_index = index + 1
        if index < call.entry:
            output = activation  # computed by an earlier stage
        else:
            if forward is None:
                raise RuntimeError(f"internal error: stage {self._stage} was asked to compute {name!r}")
            if index == call.entry:
                call.reached_entry = True
                if call.received is not NOTHING:
                    args = (call.received, *args[1:])
                elif index > 0:
                    raise RuntimeError(
                        f"stage {self._stage} reached trunk child {name!r}, but on the previous stage this step "
                        "did not run the trunk. A pipelined step must run the trunk for every microbatch, or for "
                        "none (the same code path on every rank)."
                    )
            check_no_skip_connection(name, args[1:], kwargs)
            output = forward(*args, **kwargs)
        call.last_output = output
        if index == call.exit:
            call.finished = True
            raise StageExit(output)
        if index == len(self._plan.children) - 1:
            call.finished = True
        return output


class _RoutedForward:
    """The ``forward`` of an owned trunk child: asks the router, which calls the real forward when due."""

    def __init__(self, router: TrunkRouter, index: int, forward: Callable[..., Any]) -> None:
        self._router = router
        self._index = index
        self._forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._router._route(self._index, self._forward, args, kwargs)


def _first(args: tuple, index: int, plan: PartitionPlan) -> Any:
    return _first_argument(plan.children[index].name, args)


def _first_argument(name: str, args: tuple) -> Any:
    if not args:
        raise RuntimeError(
            f"trunk child {name!r} was called without a positional argument; pipelined children take the "
            "activation as their first positional argument: `x = block(x, mask=mask)`."
        )
    return args[0]


def check_chain(name: str, index: int, args: tuple, previous_output: Any) -> Any:
    """The activation a trunk child got (its first argument); raises unless it is the previous child's output."""
    activation = _first_argument(name, args)
    if index > 0 and activation is not previous_output:
        raise RuntimeError(
            f"trunk child {name!r} did not get the previous child's output as its first argument. Between "
            "pipeline stages only that output travels, so the trunk must be a chain: `x = block(x, ...)` with "
            "nothing applied to x between children. Move code between children into the blocks, or name "
            "another container with pipeline_module='...'."
        )
    return activation


def check_no_skip_connection(name: str, args: tuple, kwargs: dict) -> None:
    """Raises if an extra input of a trunk child (beyond the activation) needs a gradient."""
    if not torch.is_grad_enabled():
        return
    for value in (*args, *kwargs.values()):
        for tensor in _tensors(value):
            if tensor.requires_grad:
                raise RuntimeError(
                    f"trunk child {name!r} received an extra input that requires grad (a skip connection, or an "
                    "activation computed outside the trunk). Only the first argument travels between pipeline "
                    "stages, so such an input would be cut at a stage boundary. Pass it inside the first argument "
                    "(e.g. a tuple (x, skip) that every block returns), compute it without grad, or keep the skip "
                    "inside one block."
                )


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
