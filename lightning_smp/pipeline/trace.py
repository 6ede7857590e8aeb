"""One forward of the whole model on ``example_input_array`` before it is split: what the cost model measures,
and the trunk's chain checked at setup rather than at the first step.

Owns the measuring pass smp ran before partitioning (its "tracing"): for each trunk child, the forward FLOPs
(``torch.utils.flop_counter``) and the bytes of its output (the activation its stage keeps for backward), both
on the example batch; and the checks `stage.py` applies while training (each child takes the previous child's output, no
extra input needs a gradient), so a trunk that cannot be cut fails when the Trainer starts. It runs only when the
LightningModule sets ``example_input_array`` (Lightning's convention, as ModelSummary uses it); without it the
cost model counts parameters and the checks run at the first step. Not owned: the cost model itself
(`partition.py`), which receives these numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_smp._compat import tree_leaves
from lightning_smp.pipeline.microbatch import batch_size
from lightning_smp.pipeline.partition import ChildCost
from lightning_smp.pipeline.stage import check_chain, check_no_skip_connection

__all__ = ["measure_children"]


def measure_children(
    module: nn.Module, trunk: nn.Module, children: Sequence[ChildCost], example: Any
) -> tuple[ChildCost, ...]:
    """``children`` with their forward FLOPs per sample and their output bytes on the example batch, from one
    forward of ``module`` on ``example`` (called as Lightning's ModelSummary does: ``module(*example)`` for a
    tuple, ``module(**example)`` for a dict, else ``module(example)``). Gradients are on, so that a skip connection
    shows; no parameter changes."""
    samples = batch_size(example) or 1
    flops: dict[int, float] = {}
    activations: dict[int, int] = {}
    state: dict[str, Any] = {"previous": None, "next": 0, "counter": None}
    handles = []
    for index, child in enumerate(trunk.children()):
        name = children[index].name

        def before(_: nn.Module, args: tuple, kwargs: dict, index: int = index, name: str = name) -> None:
            if index != state["next"]:
                raise RuntimeError(
                    f"trunk child {name!r} ran out of order (expected child {state['next']} next) when the model ran "
                    "example_input_array; a pipelined trunk must run each child once, in order."
                )
            check_chain(name, index, args, state["previous"])
            check_no_skip_connection(name, args[1:], kwargs)
            state["counter"] = FlopCounterMode(display=False)
            state["counter"].__enter__()

        def after(_: nn.Module, args: tuple, kwargs: dict, output: Any, index: int = index) -> None:
            state["counter"].__exit__(None, None, None)
            flops[index] = state["counter"].get_total_flops() / samples
            activations[index] = sum(t.numel() * t.element_size() for t in tree_leaves(output) if isinstance(t, Tensor))
            state["previous"], state["next"] = output, index + 1

        handles.append(child.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(child.register_forward_hook(after, with_kwargs=True))
    was_training = module.training
    module.eval()  # no dropout draws, no batch-norm statistics updated
    try:
        with torch.enable_grad():
            if isinstance(example, tuple):
                module(*example)
            elif isinstance(example, dict):
                module(**example)
            else:
                module(example)
    finally:
        for handle in handles:
            handle.remove()
        module.train(was_training)
    if len(flops) != len(children):
        raise RuntimeError(
            f"running example_input_array went through {len(flops)} of the {len(children)} trunk children; the "
            "model's forward must run the whole trunk, in order, once."
        )
    return tuple(
        replace(cost, flops=flops[index], activation_bytes=activations[index]) for index, cost in enumerate(children)
    )
