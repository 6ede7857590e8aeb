"""A stage's backward in two parts, for zero-bubble schedules: the input gradient now, the weight gradients later.

`BackwardSplitter.backward_input` computes only the gradient of the stage's received activation (what the previous
stage waits for) and returns a `WeightGradients`, which computes the parameters' gradients when called: the
schedule's W action.
As torch's ``stage_backward_input`` / ``stage_backward_weight`` do (torch/distributed/pipelining/_backward.py,
torch 2.13), on autograd's public graph API: before the input pass, each parameter's path up to the outputs is
followed to the first nodes where it meets the activation's path (the "intermediates", e.g. a linear layer's
matmul) or reaches an output; a pre-hook keeps the gradient each intermediate receives in the input pass, which
keeps the graph; the weight pass starts from those gradients and runs only the parameters' side
(``torch.autograd.backward`` from the nodes' gradient edges with ``inputs=`` the parameters, which accumulates
into ``.grad`` and runs the parameters' hooks as a whole backward would). So no node computes the same gradient
twice: the split costs a walk of the graph, not compute. Without an activation that needs a gradient (the first
stage) the input pass does nothing and the weight pass is the whole backward. Not owned: when each part runs (the
plan, `schedule.zero_bubble`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["BackwardSplitter", "WeightGradients"]

_Grads = dict[int, Tensor]  # a node's received gradients, by output index


class _Group:
    """Parameters whose gradients all flow in through the same intermediate nodes, and what those received."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.params: list[nn.Parameter] = []
        self.grads: dict[Node, _Grads] = {}

    def absorb(self, other: _Group) -> None:
        self.nodes += [node for node in other.nodes if node not in self.nodes]
        self.params += other.params


class WeightGradients:
    """The weight-gradient part of a split backward: call it once to accumulate the parameters' ``.grad``."""

    def __init__(self, groups: list[_Group], whole: Callable[[], None] | None = None) -> None:
        self._groups = groups
        self._whole = whole

    def __call__(self) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            starts = [(GradientEdge(node, i), g) for node in group.nodes for i, g in group.grads.get(node, {}).items()]
            if not starts:
                continue
            # A node that also lies below another of the group's nodes would get that one's gradient again on the
            # way down: each node gets exactly what it received in the input pass.
            exact = [node.register_prehook(_replay(group.grads[node])) for node in group.nodes if node in group.grads]
            try:
                torch.autograd.backward([edge for edge, _ in starts], [g for _, g in starts], inputs=group.params)
            finally:
                for handle in exact:
                    handle.remove()
        whole, self._whole = self._whole, None
        if whole is not None:
            whole()


class BackwardSplitter:
    """Splits the backwards of one stage's step; made once per step for the stage's ``params`` (their gradient
    accumulators are looked up once, not per microbatch)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self._params = [(p, get_gradient_edge(p).node) for p in params if p.requires_grad]

    def backward_input(
        self, outputs: Sequence[Tensor], grads: Sequence[Tensor | None], inputs: Sequence[Tensor]
    ) -> WeightGradients:
        """Accumulate the gradients of ``outputs`` (given ``grads``, None for a scalar loss) into ``inputs``'
        ``.grad`` only, keeping what the parameters' gradients need; returns the call that computes those."""
        pairs = [(t, g) for t, g in zip(outputs, grads, strict=True) if t.requires_grad]
        outputs, grads = [t for t, _ in pairs], [g for _, g in pairs]
        inputs = [t for t in inputs if t.requires_grad]
        if not outputs:
            return WeightGradients([])
        if not inputs:  # nothing to send back: the weight pass is the whole backward
            return WeightGradients([], lambda: torch.autograd.backward(outputs, grads))
        roots = [get_gradient_edge(t) for t in outputs]
        parents = _parents([edge.node for edge in roots])
        on_input_path = _towards_roots([get_gradient_edge(t).node for t in inputs], parents, stop=set())
        boundary = on_input_path | {edge.node for edge in roots}
        group_of: dict[Node, _Group] = {}
        for param, node in self._params:
            if node not in parents:
                continue  # not used for these outputs
            meets = _towards_roots([node], parents, stop=boundary) & boundary
            group = _Group()
            for found in {id(group_of[n]): group_of[n] for n in meets if n in group_of}.values():
                group.absorb(found)
            group.absorb(_single(sorted(meets, key=id), param))
            for n in group.nodes:
                group_of[n] = group
        groups = list({id(g): g for g in group_of.values()}.values())
        for edge, grad in zip(roots, grads, strict=True):  # an output off the activation's path gets no hook call
            if edge.node not in on_input_path and edge.node in group_of:
                group_of[edge.node].grads.setdefault(edge.node, {})[edge.output_nr] = _seed(grad, edge, outputs)
        hooks = [node.register_prehook(_keep(group, node)) for group in groups for node in group.nodes]
        try:
            torch.autograd.backward(outputs, grads, inputs=inputs, retain_graph=True)
        finally:
            for hook in hooks:
                hook.remove()
        return WeightGradients(groups)


def _single(nodes: list[Node], param: nn.Parameter) -> _Group:
    group = _Group()
    group.nodes, group.params = nodes, [param]
    return group


def _seed(grad: Tensor | None, edge: GradientEdge, outputs: list[Tensor]) -> Tensor:
    """The gradient an output's node starts from: the given one, or ones for a scalar loss."""
    if grad is not None:
        return grad
    output = next(t for t in outputs if get_gradient_edge(t) == edge)
    return torch.ones_like(output)


def _keep(group: _Group, node: Node) -> Callable[[tuple[Tensor | None, ...]], None]:
    def keep(grad_outputs: tuple[Tensor | None, ...]) -> None:
        group.grads[node] = {i: g for i, g in enumerate(grad_outputs) if g is not None}

    return keep


def _replay(grads: _Grads) -> Callable[[tuple[Tensor | None, ...]], tuple[Tensor | None, ...]]:
    def replay(grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return tuple(grads.get(i) for i in range(len(grad_outputs)))

    return replay


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """For every node below ``roots``: the nodes that hand it its gradient (the graph's edges, reversed)."""
    parents: dict[Node, list[Node]] = {root: [] for root in roots}
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _towards_roots(starts: list[Node], parents: dict[Node, list[Node]], *, stop: set[Node]) -> set[Node]:
    """The nodes from ``starts`` up to the roots (``starts`` included); one in ``stop`` is kept but not passed."""
    seen = {node for node in starts if node in parents}
    queue = deque(node for node in seen if node not in stop)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in seen:
                seen.add(parent)
                if parent not in stop:
                    queue.append(parent)
    return seen
