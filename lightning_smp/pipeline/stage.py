"""One rank's stage: placeholders for the trunk children and the outside modules other stages hold, and the
routing of each trunk child's call while a pipelined step runs.

Owns what happens when the user's code runs the trunk on this rank: children before this call's chunk pass
their input through (they are computed elsewhere), the chunk's first child takes the activation received from
the previous stage instead of its local input, and after the chunk's last child a non-final chunk leaves the
user's step through `StageExit` (a BaseException, so ``except Exception`` in user code does not swallow it),
carrying the output to send. It also checks, as the children run, that the trunk really is sequential: each
child takes the previous child's output as its first argument, and no extra argument needs a gradient (a skip
connection that would cross a stage boundary). Outside a pipelined step every owned child runs normally.
A module outside the trunk that this stage does not hold (`OutsidePlan`) becomes a `StandIn`: the code before the
trunk still runs on every stage (smp's semantics), but on a later stage its modules return cheap placeholders
(zeros of the right shape, found by running the module on the meta device) where the first stage computes; the
trunk's first child of the stage takes the received activation instead. Not owned: sending, receiving and the
schedule (`runtime.py`), the plan (`partition.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_smp._compat import tree_leaves, tree_map
from lightning_smp.pipeline.p2p import NOTHING
from lightning_smp.pipeline.partition import OutsidePlan, PartitionPlan

__all__ = ["StageExit", "StandIn", "TrunkRouter", "check_chain", "check_no_skip_connection", "hold_outside"]


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

    def _check_outside_call(self, name: str, holder: int, *, before: bool) -> None:
        """Raise if a stand-in for the module ``name`` runs on the wrong side of the trunk in a pipelined step."""
        call = self._call
        if call is None or before != (call.next_index > 0):
            return
        side, ran = ("before", "once the trunk had started") if before else ("after", "before the trunk")
        where = self._plan.stages - 1 if before else 0
        raise RuntimeError(
            f"{name!r} is placed {side} the pipelined trunk {self._plan.trunk!r}, so only pipeline stage {holder} "
            f"holds it, but it ran {ran} on stage {self._stage}. lightning_smp places the modules outside the trunk "
            "by their registration order in __init__: register it on the side of the trunk where it runs or, in a "
            f"model you cannot edit, place it there before setup: smp.set_partition(model.{name}, {where})."
        )

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


class StandIn(nn.Module):
    """Stands in for a module outside the trunk that another stage holds (`OutsidePlan`).

    It keeps the parameters of the module that this stage holds anyway (a tied weight, under its original
    names) and a copy of the module on the meta device (no memory), which it runs on its inputs to learn the
    output's shape and dtype; it returns zeros of that shape on its inputs' device (real ones, not an expanded
    scalar, so that code writing into them in place, ``x += pos``, still runs).
    Called at the wrong side of the trunk during a pipelined step (placed after the trunk but run before it, or
    the reverse) it raises: the placement follows the registration order, or ``smp.set_partition``.
    """

    def __init__(
        self, module: nn.Module, *, name: str, holder: int, before: bool, router: TrunkRouter, held: set[int]
    ) -> None:
        super().__init__()
        for param_name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in held:
                _register_parameter(self, param_name, param)
        self._held_name = name
        self._holder = holder
        self._before = before
        object.__setattr__(self, "_router", router)  # not a submodule
        object.__setattr__(self, "_shapes", _on_meta(module))  # not a submodule: no state, no conversion

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._router._check_outside_call(self._held_name, self._holder, before=self._before)
        try:
            with torch.no_grad():
                shapes = self._shapes(*tree_map(_meta_like, args), **tree_map(_meta_like, kwargs))
        except Exception as error:
            raise RuntimeError(
                f"{self._held_name!r} runs on pipeline stage {self._holder} only; on stage {self._router.stage} "
                "lightning_smp runs it on the meta device to give the code around it a placeholder of the right "
                f"shape, which failed ({type(error).__name__}: {error}). Keep data-dependent code (.item(), "
                "bool(tensor)) out of the modules outside the trunk, or move this module into the trunk."
            ) from error
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        device = inputs[0].device if inputs else torch.device("cpu")

        def placeholder(value: Any) -> Any:
            if isinstance(value, Tensor) and value.is_meta:
                return torch.zeros(value.shape, dtype=value.dtype, device=device)
            return value

        return tree_map(placeholder, shapes)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> StandIn:
        # Follow the model's casts (precision conversion): the placeholders take the dtype the module would give.
        super()._apply(fn, recurse)
        self._shapes._apply(lambda t: t.to(fn(torch.zeros((), dtype=t.dtype)).dtype))
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "_shapes" not in self.__dict__:  # private, or not built yet (copy, pickle)
                raise
        value = getattr(self.__dict__["_shapes"], name, None)
        if value is not None and not isinstance(value, Tensor | nn.Module):
            return value  # a setting of the module (e.g. embedding_dim): the same on every stage
        raise AttributeError(
            f"{self._held_name!r} lives on pipeline stage {self._holder} only, but stage {self._router.stage} used "
            f"its attribute {name!r}. If a weight is shared with a module on the other side of the trunk (an "
            "embedding reused by the output head), register it in both, e.g. `self.head.weight = self.wte.weight`, "
            "and both stages hold it, kept in sync."
        )

    def extra_repr(self) -> str:
        return f"{self._held_name} runs on pipeline stage {self._holder}"


def hold_outside(root: nn.Module, outside: OutsidePlan, router: TrunkRouter) -> None:
    """Replace, in place, the modules outside the trunk that ``router``'s stage does not hold by `StandIn`s."""
    dropped = outside.dropped(router.stage)
    held = {
        id(param)
        for name, param in root.named_parameters(remove_duplicate=False)
        if not any(name.startswith(f"{module}.") for module in dropped)
    }
    for name in dropped:
        parent_name, _, leaf = name.rpartition(".")
        parent = root.get_submodule(parent_name)
        before = name in outside.before
        holder = 0 if before else outside.stages - 1
        stand_in = StandIn(
            parent.get_submodule(leaf), name=name, holder=holder, before=before, router=router, held=held
        )
        parent.register_module(leaf, stand_in)


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<name>`` (dotted: in empty container modules created on the way)."""
    *path, leaf = name.split(".")
    for part in path:
        if part not in dict(module.named_children()):
            module.register_module(part, nn.Module())
        module = module.get_submodule(part)
    module.register_parameter(leaf, param)


def _on_meta(module: nn.Module) -> nn.Module:
    """``module`` itself, its parameters and buffers replaced by meta tensors of their shapes and dtypes (new
    objects: a weight it shares with another module stays untouched), without tensor-parallel contexts."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(sub, name, nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False))
        for name, buffer in list(sub.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(sub, name, torch.empty_like(buffer, device="meta"))
        forget_context = getattr(sub, "tp_forget_context", None)
        if forget_context is not None:
            forget_context()  # the whole-layer forward: no collective on meta tensors
    return module


def _meta_like(value: Any) -> Any:
    return value.to("meta") if isinstance(value, Tensor) else value


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
