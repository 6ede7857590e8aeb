"""What a pipelined step hands back on every stage: the record the last stage keeps per microbatch, and the
`StepResults` a door gives the engine to pack and replay it.

Only the last stage runs the step to its end, so only it sees the outputs (and, under Lightning, the ``self.log``
calls and metric updates). The engine records each microbatch's output there with whatever the door's `capture`
saw (`StepRecord`), asks the door to `pack` the step's record once, sends the package to the other stages and asks
the door to `replay` it on each, so every rank returns the same result. Two kinds of results: `MicrobatchOutputs`
(the outputs per microbatch, in order: ``smp.step``'s ``StepOutput``) here, and the Lightning adapter's
`LightningResults` (`pipeline/lightning_results.py`: merged outputs, reduced logs, metric state).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from lightning_smp._compat import tree_map

__all__ = ["MicrobatchOutputs", "StepRecord", "StepResults", "detach"]


@dataclass
class StepRecord:
    """What the last stage's microbatches left, by microbatch index: each output (detached) and what the door's
    capture saw while it ran."""

    outputs: dict[int, Any] = field(default_factory=dict)
    captures: dict[int, Any] = field(default_factory=dict)

    def add(self, index: int, output: Any, capture: object) -> None:
        self.outputs[index] = detach(output)
        self.captures[index] = capture


class StepResults(Protocol):
    """How a door records, packs and replays a pipelined step's results (see the module's docstring)."""

    def capture(self, *, watch_metrics: bool) -> AbstractContextManager[Any]:
        """Entered around one microbatch's step; what it returns goes into the `StepRecord`. ``watch_metrics``: the
        step's last chunk (where the loss and the metrics are computed)."""
        ...

    def pack(self, record: StepRecord) -> Any:
        """The step's result from the last stage's record, as sent to the other stages (tensors, numbers, and
        containers of them)."""
        ...

    def replay(self, package: Any, *, updated_here: bool) -> Any:
        """What the step returns on this stage, from the package; ``updated_here``: on the last stage."""
        ...

    def gather(self, outputs: list[Any]) -> Any:
        """What a step without a pipeline returns from its microbatches' outputs (each rank ran them all)."""
        ...


class MicrobatchOutputs:
    """The step's outputs per microbatch, in microbatch order, on every stage (nothing else is captured)."""

    def capture(self, *, watch_metrics: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def pack(self, record: StepRecord) -> list[Any]:
        return [record.outputs[index] for index in sorted(record.outputs)]

    def replay(self, package: list[Any], *, updated_here: bool) -> list[Any]:
        return package

    def gather(self, outputs: list[Any]) -> list[Any]:
        return [detach(output) for output in outputs]


def detach(value: Any) -> Any:
    """``value`` with every tensor in it detached."""
    return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, value)
