"""A trunk of repeated layers measured from its first two: how the memory planner's trace covers the rest.

Owns whether a trunk's children repeat (`plan_cut`: the middle ones of one structure — module types, parameter and
buffer shapes and dtypes, checkpointing, tensor-parallel split — the first and the last free to differ, as sequence
parallelism's ends do), cutting a meta copy's trunk to the first two and such a last (`Cut.apply`), noting which
storages the first two take in and hand on (`Handoffs`) and extending what the traced ones keep to every child
(`extend`): a middle child k keeps what child 1 keeps, its own storages renamed, the storages child k-1 handed it
shared with child k-1 (counted once over a stage's children), those made outside the trunk (a mask made before it)
the same for all. Exact for the traced layers, and for the others where layers of one structure keep the same bytes
(`same_bytes` checks the first two where they are alike). Not owned: the trace (`activation_memory`), which traces
the whole trunk where this cannot apply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_smp import activation_checkpointing
from lightning_smp._compat import tree_leaves
from lightning_smp.tensor_parallel.plan import Unit

__all__ = ["Cut", "Handoffs", "extend", "extend_values", "plan_cut", "same_bytes"]

Saved = Mapping[str, Mapping[int, int]]  # bucket -> storage key -> bytes, as `activation_memory.SavedBytes` counts


@dataclass(frozen=True)
class Cut:
    """Which children of a trunk of ``children`` are traced: the first two, and the last where it differs from the
    middle ones (``last``)."""

    children: int
    last: bool
    first_alike: bool
    """Whether the first child has the middle ones' structure (then the first two must keep the same bytes)."""

    @property
    def kept(self) -> int:
        return 3 if self.last else 2

    def left_out(self, trunk: nn.Module) -> list[nn.Module]:
        """The children of ``trunk`` (the original) the trace leaves out."""
        return list(trunk.children())[2 : self.children - int(self.last)]

    def apply(self, trunk: nn.Module) -> None:
        """Cut ``trunk`` (an ``nn.Sequential`` / ``nn.ModuleList`` of a copy) to the traced children."""
        del trunk[2 : self.children - int(self.last)]  # type: ignore[index]


def plan_cut(trunk: nn.Module, *, name: str, units: Sequence[Unit]) -> Cut | None:
    """How to trace ``trunk`` (the build plan's, named ``name``; ``units``: the plan's tensor-parallel units) through
    fewer children, or None: fewer than four children (three with a last like the middle ones), a child registered
    twice, a checkpoint spanning several children, or middle children (all but the first and the last) that differ."""
    children = list(trunk.named_children())
    if len(children) < 3 or len(children) != len(trunk) or activation_checkpointing.spans_children(trunk):  # type: ignore[arg-type]
        return None
    structures = [_structure(child, f"{name}.{key}" if name else key, units) for key, child in children]
    middle = structures[1]
    if any(structure != middle for structure in structures[2:-1]):
        return None
    last = structures[-1] != middle
    if last and len(children) < 4:
        return None
    return Cut(len(children), last, first_alike=structures[0] == middle)


def _structure(module: nn.Module, name: str, units: Sequence[Unit]) -> tuple[Any, ...]:
    modules = tuple((key, type(sub), activation_checkpointing.is_marked(sub)) for key, sub in module.named_modules())
    parameters = tuple((key, p.shape, p.dtype, p.requires_grad) for key, p in module.named_parameters())
    buffers = tuple((key, b.shape, b.dtype) for key, b in module.named_buffers())
    split = tuple(
        (unit.name.removeprefix(name), unit.target, unit.sequence)
        for unit in units
        if unit.name == name or unit.name.startswith(f"{name}.")
    )
    return modules, parameters, buffers, split


class Handoffs:
    """The storages the first two children of a trunk take in (arguments, keyword arguments) and hand on (their
    outputs, in order), by the keys of ``key`` (`SavedBytes.key`), noted while `watching`."""

    def __init__(self, key: Callable[[Tensor], int]) -> None:
        self._key = key
        self.inputs: list[set[int]] = [set(), set()]
        self.outputs: list[list[int]] = [[], []]

    @contextmanager
    def watching(self, trunk: nn.Module) -> Iterator[None]:
        handles = []
        for index, child in enumerate(list(trunk.children())[:2]):

            def enter(_: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
                self.inputs[index] = set(self._keys((args, kwargs)))

            def leave(_: nn.Module, args: Any, output: Any, index: int = index) -> None:
                self.outputs[index] = self._keys(output)

            handles.append(child.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(child.register_forward_hook(leave))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _keys(self, tree: Any) -> list[int]:
        return [self._key(leaf) for leaf in tree_leaves(tree) if isinstance(leaf, Tensor)]


def same_bytes(saved: Saved, handoffs: Handoffs, cut: Cut) -> bool:
    """Whether the first two children hand on as many tensors and, where they are alike, keep storages of the same
    sizes: what child 1 shows of the middle ones holds only then."""
    if len(handoffs.outputs[0]) != len(handoffs.outputs[1]):
        return False
    return not cut.first_alike or sorted(saved.get("0", {}).values()) == sorted(saved.get("1", {}).values())


def extend(saved: Saved, handoffs: Handoffs, cut: Cut, *, after: str) -> dict[str, dict[int, int]]:
    """``saved`` of a trunk `Cut` to its traced children, as the whole trunk keeps it: bucket "0" and those outside the
    trunk as traced; bucket "k" of a middle child child 1's, with its own storages new for each k and the storages
    child 0 handed it those child k-1 handed on; the last child's (traced, or as a middle one) and ``after`` (the
    modules after the trunk) with what child 1 handed them handed by the child before the last. Storages new to a
    child get negative keys (no storage's)."""
    last = str(cut.kept - 1) if cut.last else None
    special = {"1", after, last}
    outside = {key for bucket, storages in saved.items() if bucket not in special for key in storages}
    outside |= handoffs.inputs[0] | handoffs.inputs[1]
    handed = {key: role for role, key in enumerate(handoffs.outputs[0]) if key not in handoffs.inputs[0]}
    outside -= handed.keys()
    handed_by_second = {key for key in handoffs.outputs[1] if key not in handoffs.inputs[1]}
    fresh: dict[tuple[int, int], int] = {}

    def rename(child: int, key: int) -> int:
        """``key`` (a storage child 1 keeps) as middle child ``child`` of the whole keeps it."""
        if key in handed:  # child 0's output: what the previous child hands on in the same place
            role = handed[key]
            return handoffs.outputs[0][role] if child == 1 else rename(child - 1, handoffs.outputs[1][role])
        if key in outside or child == 1:
            return key
        return fresh.setdefault((child, key), -1 - len(fresh))

    def after_middle(key: int) -> int:
        """``key`` (a storage the traced last child or the modules after the trunk keep) in the whole."""
        return rename(cut.children - 2, key) if key in handed_by_second or key in handed else key

    whole = {bucket: dict(storages) for bucket, storages in saved.items() if bucket not in special}
    middle_end = cut.children - int(cut.last)
    for child in range(1, middle_end if "1" in saved else 1):  # a child that keeps nothing has no bucket
        whole[str(child)] = {rename(child, key): size for key, size in saved["1"].items()}
    if cut.last and last in saved:
        whole[str(cut.children - 1)] = {after_middle(key): size for key, size in saved[last].items()}
    if after in saved:
        ending = after_middle if cut.last else (lambda key: rename(cut.children - 1, key))
        whole[after] = {ending(key): size for key, size in saved[after].items()}
    return whole


def extend_values(values: Mapping[str, int], cut: Cut) -> dict[str, int]:
    """A per-bucket figure of the cut trunk (the largest offloaded module's bytes, ...) for the whole trunk: a middle
    child's as child 1's."""
    last = str(cut.kept - 1) if cut.last else None
    whole = {bucket: value for bucket, value in values.items() if bucket != last}
    if "1" in values:
        whole.update({str(child): values["1"] for child in range(2, cut.children - int(cut.last))})
    if last is not None and last in values:
        whole[str(cut.children - 1)] = values[last]
    return whole
