"""Replay: materialising deferred tensors from a recording, one whole value at a time.

Owns turning (deferred tensor, cut) requests into real tensors: the ops each value depends on are replayed in
recorded order, each whole value lives only until its last use, and a copy shares its source's storage until one of
them is written. Not owned: what was recorded (`recording.py`), nor which cut a rank keeps (the caller's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_smp.delayed_init.recording import (
    ACTIVE,
    COPIES,
    CPU,
    MODULE_TABLES,
    Const,
    GeneratorArg,
    Op,
    Recording,
    Ref,
    SourceRead,
    is_deferred,
    lookup,
    prune,
)
from lightning_smp.placement import Cut

__all__ = ["materialize", "materialize_module"]


def materialize(
    wanted: Sequence[tuple[Tensor, Callable[[Tensor], Tensor]]],
    *,
    device: torch.device,
    on_done: Callable[[Tensor], None] | None = None,
) -> list[Tensor]:
    """For each (deferred tensor, cut): cut(value an eager build gives the tensor) as a new real tensor on device
    (contiguous, not a view of the whole). Replays the recorded ops in order; each whole value lives only until its
    last use; the same tensor may appear several times with different cuts (tied weights). A tensor that cannot be
    materialised raises a clear error naming it and the fix. ``on_done`` is called with each result when it is made.

    A value read from a `Source` (``deferred_from``) with only copies and dtype casts applied to it is not made
    whole when its cut is a `lightning_smp.placement.Cut`: the source reads just the cut (a file, only those bytes).
    """
    entries = [(f"wanted[{i}]", tensor, cut) for i, (tensor, cut) in enumerate(wanted)]
    return _materialize(entries, torch.device(device), on_done)


def materialize_module(
    module: nn.Module,
    *,
    device: torch.device,
    cut: Callable[[str, Tensor], Callable[[Tensor], Tensor] | None] | None = None,
) -> None:
    """In place: every deferred parameter/buffer (by qualified name) replaced by its value or cut(...)(value); a
    None cut drops nothing but means keep whole; parameters stay nn.Parameter with requires_grad as before;
    tied parameters stay tied.

    A tensor shared by several names (tied weights) is cut once, with the cut for the name ``named_parameters()``
    gives it first. Deferred tensors kept as plain attributes of a submodule, directly or in a dict or list
    attribute (torchmetrics' metric states, constants a constructor keeps), are materialised too.
    """
    places: dict[int, list[tuple[dict | list, Any]]] = {}  # tensor -> where it is held: (container, key)
    entries: list[tuple[str, Tensor, Callable[[Tensor], Tensor]]] = []
    for name, container, key, tensor in _deferred_places(module):
        if id(tensor) not in places:
            chosen = cut(name, tensor) if cut is not None else None
            entries.append((name, tensor, chosen if chosen is not None else _whole))
            places[id(tensor)] = []
        places[id(tensor)].append((container, key))
    values = _materialize(entries, torch.device(device), None)
    for (_, old, _), value in zip(entries, values, strict=True):
        if isinstance(old, nn.Parameter):
            value = nn.Parameter(value, requires_grad=old.requires_grad)
            value.__dict__.update(old.__dict__)  # attributes code set on the parameter (e.g. Hugging Face's flags)
        for container, key in places[id(old)]:
            container[key] = value


def _deferred_places(module: nn.Module) -> Iterator[tuple[str, dict | list, Any, Tensor]]:
    """(qualified name, container, key, tensor) for the meta tensors a module holds: every meta parameter and buffer
    first (in ``named_parameters()`` / ``named_buffers()`` order), then the deferred tensors among plain attributes
    and their dict or list items (a meta attribute made by hand is the module's own business and stays)."""
    modules = list(module.named_modules(remove_duplicate=False))
    for table_name in MODULE_TABLES[:2]:
        for prefix, submodule in modules:
            table = getattr(submodule, table_name)
            for key, tensor in table.items():
                if isinstance(tensor, Tensor) and tensor.is_meta:
                    yield _qualified(prefix, key), table, key, tensor
    for prefix, submodule in modules:
        attributes = vars(submodule)
        for key, value in list(attributes.items()):
            if key in MODULE_TABLES:
                continue
            if isinstance(value, Tensor) and is_deferred(value):
                yield _qualified(prefix, key), attributes, key, value
            elif isinstance(value, dict | list):
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for item_key, item in list(items):
                    if isinstance(item, Tensor) and is_deferred(item):
                        yield f"{_qualified(prefix, key)}[{item_key!r}]", value, item_key, item


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _whole(value: Tensor) -> Tensor:
    return value


def _materialize(
    entries: list[tuple[str, Tensor, Callable[[Tensor], Tensor]]],
    device: torch.device,
    on_done: Callable[[Tensor], None] | None,
) -> list[Tensor]:
    if getattr(ACTIVE, "recorder", None) is not None:
        raise RuntimeError(
            "materialize() was called inside deferred_init(); leave the `with deferred_init():` block first, so "
            "that every op that gives the tensors their values has been recorded."
        )
    prune()
    by_recording: dict[int, tuple[Recording, list[tuple[int, Ref, Callable[[Tensor], Tensor], str]]]] = {}
    for position, (name, tensor, cut) in enumerate(entries):
        recording, sid = _checked(name, tensor)
        ref = Ref.of(tensor, sid, recording.last_write[sid])
        by_recording.setdefault(id(recording), (recording, []))[1].append((position, ref, cut, name))
    results: list[Tensor | None] = [None] * len(entries)
    for recording, targets in by_recording.values():
        _Replay(recording, targets, device, results, on_done).run()
    return results  # type: ignore[return-value]


def _checked(name: str, tensor: Tensor) -> tuple[Recording, int]:
    if not isinstance(tensor, Tensor) or not tensor.is_meta:
        where = tensor.device if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(
            f"{name} is not a deferred tensor (it is on {where}): only tensors made inside deferred_init() can be "
            "materialised. Leave real tensors as they are."
        )
    found = lookup(tensor)
    if found is None:
        raise ValueError(
            f"{name} (shape {tuple(tensor.shape)}) is a meta tensor made outside deferred_init() (device='meta' by "
            "hand, or a copy or conversion made after the block: copy.deepcopy, module.half(), .to()), so its "
            "values are unknown. Build the module that owns it, and copy or convert it, inside `with "
            "deferred_init():` (without device='meta'), or make the copy after materialisation."
        )
    return found


@dataclass(slots=True)
class _Slot:
    """A real CPU storage holding one or more value nodes (several when a copy shares its source's storage)."""

    storage: torch.UntypedStorage
    pending: int  # uses still to come, over all nodes bound to this slot


class _Replay:
    """Replays one recording for a set of targets, one target's ops at a time, so that a whole value is alive only
    from the op that makes it to its last use (a value needed later and overwritten earlier is copied first)."""

    def __init__(
        self,
        recording: Recording,
        targets,
        device: torch.device,
        results: list[Tensor | None],
        on_done: Callable[[Tensor], None] | None,
    ) -> None:
        self._ops = recording.ops
        self._device = device
        self._results = results
        self._on_done = on_done
        self._groups: dict[tuple[int, int], list[tuple[int, Ref, Callable[[Tensor], Tensor], str]]] = {}
        for target in targets:
            self._groups.setdefault(target[1].node, []).append(target)
        self._closures = {node: self._closure(node, group[0][3]) for node, group in self._groups.items()}
        # Values read from a source through copies and casts only, and needed by nothing else: read as cut.
        self._direct = {node: chain for node in self._groups if (chain := self._source_chain(node)) is not None}
        elsewhere = {
            read
            for node in self._groups
            if node not in self._direct
            for i in self._closures[node]
            for read in self._ops[i].reads
        }
        for node in [node for node, chain in self._direct.items() if _outputs(chain) & elsewhere]:
            del self._direct[node]
        for node in self._direct:
            self._closures[node] = {self._direct[node][0].index}  # for the order only: nothing of it is replayed
        self._uses: dict[tuple[int, int], int] = dict.fromkeys(set(self._groups) - set(self._direct), 1)
        for index in set().union(*(c for node, c in self._closures.items() if node not in self._direct)):
            for node in self._ops[index].reads:
                self._uses[node] = self._uses.get(node, 0) + 1
        self._live: dict[tuple[int, int], _Slot] = {}
        self._done: set[int] = set()

    def _closure(self, node: tuple[int, int], name: str) -> set[int]:
        """The indices of the ops that the value node depends on."""
        needed: set[int] = set()
        stack = [node]
        while stack:
            _, version = stack.pop()
            if version == -1:  # the storage's value from before this block: unknown
                raise ValueError(
                    f"{name} is computed from a meta tensor made outside its deferred_init() block (by hand with "
                    "device='meta', or in an earlier block), whose values are unknown here. Create that tensor in "
                    "the same `with deferred_init():` block (without device='meta')."
                )
            if version in needed:
                continue
            needed.add(version)
            stack.extend(self._ops[version].reads)
        return needed

    def _source_chain(self, node: tuple[int, int]) -> list[Op] | None:
        """The ops from a source read to ``node`` when they are only copies and dtype casts of it and every target
        of ``node`` asks for a `Cut` of the whole storage; else None."""
        if not all(isinstance(cut, Cut) and _plain(ref) for _, ref, cut, _ in self._groups[node]):
            return None
        chain: list[Op] = []
        while node[1] >= 0:
            op = self._ops[node[1]]
            chain.append(op)
            if isinstance(op.func, SourceRead):
                return chain[::-1]
            source = _copied_from(op, node[0])
            if source is None:
                return None
            node = source
        return None

    def run(self) -> None:
        # Targets that share their first op (the copies of one source) are made one after the other.
        for node in sorted(self._groups, key=lambda n: (min(self._closures[n]), n[1])):
            if node in self._direct:
                self._read_direct(node)
                continue
            for index in sorted(self._closures[node] - self._done):
                self._run(self._ops[index])
                self._done.add(index)
            slot = self._live[node]
            for position, ref, cut, name in self._groups[node]:
                piece = cut(ref.view(slot.storage))
                if not isinstance(piece, Tensor):
                    raise TypeError(
                        f"the cut for {name} returned {type(piece).__name__}, not a tensor; make it return a tensor "
                        "(e.g. a slice of the value it is given)"
                    )
                self._store(position, torch.empty(piece.shape, dtype=piece.dtype, device=self._device).copy_(piece))
            self._use(node)

    @torch.no_grad()
    def _read_direct(self, node: tuple[int, int]) -> None:
        """Each target's cut read from the source, then copied and cast as the recorded ops did to the whole."""
        read, *casts = self._direct[node]
        for position, _, cut, name in self._groups[node]:
            piece = read.func.source.read(cut)
            if tuple(piece.shape) != cut.shape:
                raise RuntimeError(
                    f"{name}: its source read a {tuple(piece.shape)} piece for a {cut.shape} cut; a Source's "
                    "read(cut) must return exactly cut.shape"
                )
            for op in casts:
                piece = _cast_like(op, piece)
            self._store(position, piece.to(self._device))

    def _store(self, position: int, value: Tensor) -> None:
        self._results[position] = value
        if self._on_done is not None:
            self._on_done(value)

    def _use(self, node: tuple[int, int]) -> None:
        slot = self._live[node]
        slot.pending -= 1
        self._uses[node] -= 1
        if self._uses[node] == 0:
            del self._live[node]

    def _bind(self, node: tuple[int, int], slot: _Slot) -> None:
        """Keep ``slot`` as the value of ``node`` while uses of the node are still to come."""
        uses = self._uses.get(node, 0)
        if uses:
            slot.pending += uses
            self._live[node] = slot

    @torch.no_grad()
    def _run(self, op: Op) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        for sid, ref in op.writes.items():
            if ref.node not in op.reads:  # written without being read: a new storage, the past is not needed
                storages[sid] = torch.empty(ref.nbytes, dtype=torch.uint8, device=CPU).untyped_storage()
                continue
            slot = self._live[ref.node]
            # Writing in place would change a value something else still needs: write into a copy.
            storages[sid] = slot.storage if slot.pending == 1 else _copy(slot.storage)
        for sid, version in op.reads:
            if sid not in storages:
                storages[sid] = self._live[(sid, version)].storage

        if op.func in COPIES and self._share(op):
            for node in op.reads:
                self._use(node)
            return

        flat = [
            leaf.view(storages[leaf.sid])
            if isinstance(leaf, Ref)
            else leaf.value
            if isinstance(leaf, Const)
            else _restored(op.rng_state)
            if isinstance(leaf, GeneratorArg)
            else leaf
            for leaf in op.flat_args
        ]
        args, kwargs = tree_unflatten(flat, op.spec)
        if op.rng_state is not None and not any(isinstance(leaf, GeneratorArg) for leaf in op.flat_args):
            with torch.random.fork_rng(devices=[]):  # it drew from the default generator
                torch.set_rng_state(op.rng_state)
                out = op.func(*args, **kwargs)
        else:
            out = op.func(*args, **kwargs)

        for node in op.reads:
            self._use(node)
        for sid in op.writes:
            self._bind((sid, op.index), _Slot(storages[sid], 0))
        flat_out, _ = tree_flatten(out)
        for position, ref in op.fresh:
            value = flat_out[position]
            if (tuple(value.stride()), value.storage_offset(), value.untyped_storage().nbytes()) != (
                ref.stride,
                ref.offset,
                ref.nbytes,
            ):  # lay it out as the meta kernel did: later ops address it by that layout
                laid_out = torch.empty(ref.nbytes, dtype=torch.uint8, device=CPU).untyped_storage()
                ref.view(laid_out).copy_(value)
                value = ref.view(laid_out)
            self._bind((ref.sid, op.index), _Slot(value.untyped_storage(), 0))

    def _share(self, op: Op) -> bool:
        """A copy whose output has its input's layout shares the input's storage (copied only if later written)."""
        sources = [leaf for leaf in op.flat_args if isinstance(leaf, Ref)]
        if len(op.fresh) != 1 or len(sources) != 1:
            return False
        source, (_, out) = sources[0], op.fresh[0]
        if (source.dtype, source.size, source.stride, source.offset, source.nbytes) != (
            out.dtype,
            out.size,
            out.stride,
            out.offset,
            out.nbytes,
        ):
            return False
        self._bind(out.node, self._live[source.node])
        return True


def _copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    return torch.empty(0, dtype=torch.uint8, device=CPU).set_(storage).clone().untyped_storage()


def _restored(state: Tensor | None) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def _plain(ref: Ref) -> bool:
    """Whether ``ref`` is its whole storage, laid out contiguously (a cut of it is a cut of the storage)."""
    expected, strides = 1, []
    for size in reversed(ref.size):
        strides.append(expected)
        expected *= size
    return ref.offset == 0 and expected * ref.dtype.itemsize == ref.nbytes and ref.stride == tuple(reversed(strides))


def _copied_from(op: Op, sid: int) -> tuple[int, int] | None:
    """The value node ``op`` copies into storage ``sid`` (a copy, a dtype cast or ``copy_`` of a same-shaped plain
    value over a whole plain storage), or None when it computes anything else."""
    refs = [leaf for leaf in op.flat_args if isinstance(leaf, Ref)]
    if op.func in COPIES and len(refs) == 1 and len(op.fresh) == 1 and op.fresh[0][1].sid == sid:
        source, out = refs[0], op.fresh[0][1]
    elif op.func is torch.ops.aten.copy_.default and len(refs) == 2 and refs[0].sid == sid and not op.fresh:
        out, source = refs
        if op.reads != {source.node}:
            return None
    else:
        return None
    if any(isinstance(leaf, Const) for leaf in op.flat_args) or source.size != out.size:
        return None
    return source.node if _plain(source) and _plain(out) else None


def _cast_like(op: Op, piece: Tensor) -> Tensor:
    """What ``op`` (see `_copied_from`) makes of ``piece`` instead of the whole value."""
    if op.func is torch.ops.aten.copy_.default:
        target = op.flat_args[0]
        return torch.empty(piece.shape, dtype=target.dtype).copy_(piece)
    args, kwargs = tree_unflatten([piece if isinstance(leaf, Ref) else leaf for leaf in op.flat_args], op.spec)
    return op.func(*args, **kwargs)


def _outputs(chain: list[Op]) -> set[tuple[int, int]]:
    """The value nodes the ops of a source chain make."""
    return {(ref.sid, op.index) for op in chain for ref in [*(out for _, out in op.fresh), *op.writes.values()]}
