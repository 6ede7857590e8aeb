"""A stage's backward in two parts, for zero-bubble schedules: the input gradient now, the weight gradients later.

`BackwardSplitter.backward_input` computes only the gradient of the stage's received activation (what the previous
stage waits for) and returns a `WeightGradients`, which computes the parameters' gradients when called: the
schedule's W action.
As torch's ``stage_backward_input`` / ``stage_backward_weight`` do (torch/distributed/pipelining/_backward.py,
torch 2.13), on autograd's graph: before the input pass, one walk of the graph finds the nodes on the activation's
path that a parameter's own path leads into (the "intermediates", e.g. a linear layer's matmul, where its weight and
bias meet the activation), and the outputs off that path; a pre-hook keeps the gradient each intermediate receives
in the input pass, which keeps the graph; the weight pass starts from those gradients and runs only the parameters'
side (the engine from the nodes' gradient edges with ``inputs=`` the parameters, which accumulates into ``.grad`` and
runs the parameters' hooks as a whole backward would), one group of parameters (a layer) after the other, in the
order the whole backward meets them. So no node computes the same gradient twice: the split costs no compute, but
it costs bookkeeping: the walk, a hook per intermediate, and one engine call per group where a whole backward makes
one per microbatch (the calls skip ``torch.autograd.backward``'s Python checks of the gradients, which cost as much
as the engine call on a small layer: `_compat.accumulate_gradients`). On one stage of `benchmarks/pipeline_bench.py`
(4 x Linear(512), 32 rows, one thread, 2-vCPU machine) both parts take 1.19-1.22x the CPU time of the whole
backward, 1.06-1.23x at width 1024 (`benchmarks/split_backward_cost.py`). Without an activation that needs a
gradient (the first stage) the input pass does nothing and the weight pass is the whole backward. Not owned: when
each part runs (the plan, `schedule.zero_bubble`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lightning_smp._compat import accumulate_gradients

__all__ = ["BackwardSplitter", "WeightGradients"]

_Grads = dict[int, Tensor]  # a node's received gradients, by output index


class _Group:
    """Parameters whose gradients all flow in through the same intermediate nodes, and what those received (and
    what the outputs off the activation's path above them are given)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []  # the intermediates, on the activation's path
        self.params: list[nn.Parameter] = []
        self.grads: dict[Node, _Grads] = {}  # the intermediates' and off-path outputs' gradients
        self.merged_into: _Group | None = None  # two groups found to share a node below them are one

    def root(self) -> _Group:
        group = self
        while group.merged_into is not None:
            group = group.merged_into
        return group

    def absorb(self, other: _Group) -> None:
        self.nodes += other.nodes
        self.params += other.params
        other.merged_into = self


class WeightGradients:
    """The weight-gradient part of a split backward: call it once to accumulate the parameters' ``.grad``."""

    def __init__(self, groups: list[_Group], whole: Callable[[], None] | None = None) -> None:
        self._groups = groups
        self._whole = whole

    def __call__(self) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            starts = [(GradientEdge(node, i), g) for node, grads in group.grads.items() for i, g in grads.items()]
            if not starts:
                continue
            # An intermediate that also lies below another (a layer applied twice) would get that one's gradient
            # again on the way down: each gets exactly what it received in the input pass. One intermediate (the
            # usual group: a layer's weight and bias meeting the activation at its matmul) needs no hook; an output
            # off the path sums its own gradient and those of the group's nodes above it, as in a whole backward.
            exact = []
            if len(group.nodes) > 1:
                exact = [
                    node.register_prehook(_replay(group.grads[node])) for node in group.nodes if node in group.grads
                ]
            try:
                accumulate_gradients(
                    [edge for edge, _ in starts], [g for _, g in starts], group.params, retain_graph=False
                )
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
        self._params = {get_gradient_edge(p).node: p for p in params if p.requires_grad}

    def backward_input(
        self, outputs: Sequence[Tensor], grads: Sequence[Tensor | None], inputs: Sequence[Tensor]
    ) -> WeightGradients:
        """Accumulate the gradients of ``outputs`` (given ``grads``, None for a scalar loss) into ``inputs``'
        ``.grad`` only, keeping what the parameters' gradients need; returns the call that computes those."""
        pairs = [(t, g) for t, g in zip(outputs, grads, strict=True) if t.requires_grad]
        outputs = [t for t, _ in pairs]
        seeds = [torch.ones_like(t) if g is None else g for t, g in pairs]  # None: a scalar loss
        inputs = [t for t in inputs if t.requires_grad]
        if not outputs:
            return WeightGradients([])
        if not inputs:  # nothing to send back: the weight pass is the whole backward
            return WeightGradients([], lambda: accumulate_gradients(outputs, seeds, (), retain_graph=False))
        roots = [get_gradient_edge(t) for t in outputs]
        children = _children([edge.node for edge in roots])
        on_input_path = _towards_roots([get_gradient_edge(t).node for t in inputs], _parents(children))
        groups = self._groups(children, on_input_path, roots, seeds)
        hooks = [node.register_prehook(_keep(group, node)) for group in groups for node in group.nodes]
        try:
            accumulate_gradients(outputs, seeds, inputs, retain_graph=True)
        finally:
            for hook in hooks:
                hook.remove()
        return WeightGradients(groups)

    def _groups(
        self,
        children: dict[Node, list[Node]],
        on_input_path: set[Node],
        roots: list[GradientEdge],
        seeds: list[Tensor],
    ) -> list[_Group]:
        """The groups of parameters below the intermediates, in the order the whole backward meets them: from each
        node on the activation's path (and each output off it), the parts of the graph off that path below it,
        walked once; a part reached from two intermediates (a parameter used twice) joins their groups. An output
        off the path gets no hook call in the input pass: its group starts from its given gradient."""
        owner: dict[Node, _Group] = {}
        found: list[_Group] = []
        off_path_roots = {edge.node for edge in roots} - on_input_path
        for node in children:  # breadth-first from the outputs
            if node in on_input_path:
                stack = [child for child in children[node] if child not in on_input_path]
                if not stack:
                    continue
                group = _Group()
                group.nodes.append(node)
            elif node in off_path_roots:
                stack, group = [node], _Group()
            else:
                continue
            while stack:
                child = stack.pop()
                if child in owner:
                    other = owner[child].root()
                    if other is not group:
                        other.absorb(group)
                        group = other
                    continue
                owner[child] = group
                param = self._params.get(child)
                if param is not None:
                    group.params.append(param)
                stack += children[child]
            if group.merged_into is None and group not in found:
                found.append(group)
        for edge, seed in zip(roots, seeds, strict=True):
            if edge.node in off_path_roots:
                owner[edge.node].root().grads.setdefault(edge.node, {})[edge.output_nr] = seed
        return [group for group in found if group.merged_into is None and group.params]


def _keep(group: _Group, node: Node) -> Callable[[tuple[Tensor | None, ...]], None]:
    def keep(grad_outputs: tuple[Tensor | None, ...]) -> None:
        group.grads[node] = {i: g for i, g in enumerate(grad_outputs) if g is not None}

    return keep


def _replay(grads: _Grads) -> Callable[[tuple[Tensor | None, ...]], tuple[Tensor | None, ...]]:
    def replay(grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return tuple(grads.get(i) for i in range(len(grad_outputs)))

    return replay


def _children(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node below ``roots``, breadth-first, with the nodes it hands its gradients to (the graph's edges)."""
    children: dict[Node, list[Node]] = {}
    queue = deque(roots)
    for root in roots:
        children.setdefault(root, [])
    while queue:
        node = queue.popleft()
        below = children[node] = [child for child, _ in node.next_functions if child is not None]
        for child in below:
            if child not in children:
                children[child] = []
                queue.append(child)
    return children


def _parents(children: dict[Node, list[Node]]) -> dict[Node, list[Node]]:
    """The same edges reversed: for every node, the nodes that hand it its gradient."""
    parents: dict[Node, list[Node]] = {node: [] for node in children}
    for node, below in children.items():
        for child in below:
            parents[child].append(node)
    return parents


def _towards_roots(starts: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The nodes from ``starts`` up to the roots (``starts`` included)."""
    seen = {node for node in starts if node in parents}
    queue = deque(seen)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen
