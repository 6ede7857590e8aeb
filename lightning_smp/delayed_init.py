"""Delayed (meta-device) initialisation whose values are bit-identical to an eager CPU build with the same seed.

Owns recording the aten ops that give a model built on the meta device its parameter and buffer values, and replaying
them per tensor when a rank materialises what it keeps (the strategy decides what: it passes the cuts). Recording
rather than ``to_empty()`` + ``reset_parameters()``, because only the ops the constructors ran (deep copies,
``post_init`` re-initialisation, the generator state each random op drew from) reproduce an eager build; each tensor
is rebuilt whole, cut and freed (Megatron's CPU initialisation), so the peak is what a rank keeps plus one tensor.

What a custom module needs to be materialisable
------------------------------------------------
Build it inside ``deferred_init()`` (the strategy does this for ``delayed_parameter_initialization=True`` and for
``configure_model`` / ``trainer.init_module(empty_init=True)``). Anything a constructor does with tensors is recorded
and replayed: ``nn.init.*``, in-place ops on parameters or on slices of them, buffers computed from ``torch.arange``
and arithmetic, ``copy.deepcopy``, ``torch.manual_seed``, generators passed to random ops, and real CPU tensors
(``torch.tensor([...])`` constants stay real) copied into parameters. These are not possible, because a deferred
tensor has no data until it is materialised:

- reading a value while building (``.item()``, ``.tolist()``, ``float(t)``, ``if t.any():``, ``torch.nonzero``,
  boolean-mask indexing): compute it from Python numbers instead, or build that module outside ``deferred_init()``
  and pass it in; the error names the op;
- changing parameters after ``deferred_init()`` has exited and before materialisation: such changes are not
  recorded, so do them inside the ``with`` block (or after materialisation). Views taken afterwards (slices,
  ``.t()``, ``nn.Parameter(view)``) stay deferred and materialise to the view of the value; copies do not;
- tensors made on the meta device by hand (``device="meta"``, inside or outside the block) or in an earlier block:
  they are not recorded, and materialising a parameter or buffer computed from one raises an error naming it;
- ``orthogonal_``, ``dirac_`` and ``sparse_`` reached other than as ``torch.nn.init.<name>`` or through Hugging
  Face's ``transformers.initialization`` (a copy bound before the block, e.g. ``from torch.nn.init import
  orthogonal_``): torch skips meta tensors in them, so call them through ``torch.nn.init`` (``trunc_normal_`` is
  seen however it is reached).

Parameters, buffers and tensors a module keeps as plain attributes (directly or in a dict or list, as torchmetrics
keeps metric states) are materialised. Random values come from the default CPU generator (or the generator passed
to the op), exactly as an eager CPU build draws them, and the generator ends where the eager build leaves it. Inside
the block the default device still reads as the CPU (so Hugging Face's ``post_init`` initialises); factories without
``device=`` make meta tensors, while ``torch.tensor([...])`` constants and tensors made with an explicit real
``device=`` stay real and are left as they are.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from lightning_smp._compat import (
    ATEN_TO_COPY,
    INITS_THAT_SKIP_META,
    MODULE_TABLES,
    TorchDispatchMode,
    buffer_table,
    device_constructors,
    op_schema,
    parameter_table,
    storage_key,
    tree_flatten,
    tree_unflatten,
)

__all__ = ["deferred_init", "is_deferred", "materialize", "materialize_module"]

_aten = torch.ops.aten

# In-place ops that write every element of ``self`` without reading it: when ``self`` covers its whole storage, the
# storage's earlier value is not needed (this is what lets ``post_init`` re-initialisation replay alone).
_OVERWRITES_SELF = frozenset(
    {
        _aten.fill_.Scalar,
        _aten.fill_.Tensor,
        _aten.zero_.default,
        _aten.normal_.default,
        _aten.uniform_.default,
        _aten.random_.default,
        getattr(_aten.random_, "from"),
        _aten.random_.to,
        _aten.exponential_.default,
        _aten.bernoulli_.float,
        _aten.bernoulli_.Tensor,
        _aten.cauchy_.default,
        _aten.log_normal_.default,
        _aten.geometric_.default,
        _aten.copy_.default,
    }
)
# Ops whose output equals their input when the layouts agree: replay shares the input's storage instead of copying,
# so the N deep copies of an ``nn.TransformerEncoder`` layer cost no memory until one of them is written.
_COPIES = frozenset({_aten.clone.default, ATEN_TO_COPY, _aten.lift_fresh_copy.default})
# The ``torch.nn.init`` functions that skip meta tensors (`INITS_THAT_SKIP_META`) are swapped for recording wrappers
# inside deferred_init(); ``trunc_normal_`` is reached through its helper, which it looks up at each call, so that
# copies of ``trunc_normal_`` bound elsewhere (Hugging Face's) are seen too.
_DATA_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_META = torch.device("meta")
_CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class _Ref:
    """A deferred tensor as an op argument: a view of storage ``sid`` as it stood after op ``version`` wrote it."""

    sid: int
    version: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int  # of the whole storage

    @staticmethod
    def of(tensor: Tensor, sid: int, version: int) -> _Ref:
        return _Ref(
            sid=sid,
            version=version,
            dtype=tensor.dtype,
            size=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            offset=tensor.storage_offset(),
            nbytes=tensor.untyped_storage().nbytes(),
        )

    @property
    def node(self) -> tuple[int, int]:
        return (self.sid, self.version)

    def covers_storage(self) -> bool:
        """Whether writing every element of this view writes every byte of its storage."""
        numel = 1
        for size in self.size:
            numel *= size
        if self.offset != 0 or numel * self.dtype.itemsize != self.nbytes:
            return False
        expected = 1
        for size, stride in sorted((d for d in zip(self.size, self.stride, strict=True) if d[0] != 1), key=_stride):
            if stride != expected:
                return False
            expected *= size
        return True

    def view(self, storage: torch.UntypedStorage) -> Tensor:
        return torch.empty(0, dtype=self.dtype, device=_CPU).set_(storage, self.offset, self.size, self.stride)


def _stride(dim: tuple[int, int]) -> int:
    return dim[1]


@dataclass(frozen=True, slots=True)
class _Const:
    """A real tensor an op read, copied when the op ran (the caller may change the original afterwards)."""

    value: Tensor


class _Generator:
    """Where a random op's generator argument was; replay passes a generator restored to the recorded state."""


@dataclass(slots=True)
class _Op:
    index: int
    func: Callable[..., Any]  # an aten op, or an initialiser recorded whole (see INITS_THAT_SKIP_META)
    flat_args: list[Any]  # leaves of (args, kwargs): _Ref, _Const, _Generator or plain values
    spec: Any
    reads: frozenset[tuple[int, int]]  # value nodes (sid, version) the op needs
    writes: dict[int, _Ref]  # sid -> the view written in place
    fresh: list[tuple[int, _Ref]]  # (index among the flat outputs, the new storage's layout)
    rng_state: Tensor | None  # state of the generator the op drew from, before it drew


@dataclass(slots=True)
class _Recording:
    """The ops of one ``deferred_init()`` block and the storages they made."""

    ops: list[_Op] = field(default_factory=list)
    last_write: dict[int, int] = field(default_factory=dict)  # sid -> index of the op that last wrote it
    # meta storages made outside this block, by StorageImpl address: (keeps the address, sid)
    untracked: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)
    next_sid: int = 0


# Meta storages known to some recording, by StorageImpl address. The weak reference keeps the address from being
# reused while the entry exists; entries whose storage died are pruned when a block starts or materialisation runs.
_STORAGES: dict[int, tuple[StorageWeakRef, _Recording, int]] = {}
_ACTIVE = threading.local()


def _prune() -> None:
    for key in [key for key, (ref, _, _) in _STORAGES.items() if ref.expired()]:
        del _STORAGES[key]


def _lookup(tensor: Tensor) -> tuple[_Recording, int] | None:
    entry = _STORAGES.get(storage_key(tensor.untyped_storage()))
    if entry is None or entry[0].expired():
        return None
    return entry[1], entry[2]


class _Recorder(TorchDispatchMode):
    """Runs every op that touches a meta tensor on meta, and records it so that it can be replayed for real."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self._recording = recording

    def _new_sid(self) -> int:
        self._recording.next_sid += 1
        return self._recording.next_sid - 1

    def _input_sid(self, tensor: Tensor) -> int:
        found = _lookup(tensor)
        if found is not None and found[0] is self._recording:
            return found[1]
        # A meta tensor made elsewhere (device="meta" by hand, or an earlier deferred_init() block): its values are
        # unknown here. Materialising anything computed from it raises.
        storage = tensor.untyped_storage()
        if storage_key(storage) not in self._recording.untracked:
            sid = self._new_sid()
            self._recording.untracked[storage_key(storage)] = (StorageWeakRef(storage), sid)
            self._recording.last_write[sid] = -1
        return self._recording.untracked[storage_key(storage)][1]

    def _is_untracked(self, tensor: Tensor) -> bool:
        return storage_key(tensor.untyped_storage()) in self._recording.untracked

    def _output_sid(self, tensor: Tensor) -> int:
        storage = tensor.untyped_storage()
        sid = self._new_sid()
        _STORAGES[storage_key(storage)] = (StorageWeakRef(storage), self._recording, sid)
        return sid

    def _ref(self, tensor: Tensor, sid: int) -> _Ref:
        return _Ref.of(tensor, sid, self._recording.last_write.get(sid, -1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        if getattr(_ACTIVE, "paused", False) or not any(_on_meta(leaf) for leaf in flat):
            return func(*args, **kwargs)  # real tensors only (or a meta tensor asked for by hand): run it as eagerly
        metas = [leaf for leaf in flat if _is_meta_tensor(leaf)]
        if metas and not any(_lookup(leaf) is not None for leaf in metas):
            return func(*args, **kwargs)  # only meta tensors made by hand: as eagerly, a meta op that draws nothing
        if torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
            raise RuntimeError(
                f"deferred_init(): {func} needs the values of a deferred (meta) tensor while the model is being built "
                "(.item(), .tolist(), float(t), a Python `if` on a tensor, nonzero or boolean-mask indexing), and "
                "deferred tensors have no values until they are materialised. Compute that value from Python numbers "
                "instead, or build this module outside deferred_init() and pass it in."
            )
        written = _written_arguments(func, args, kwargs)
        for leaf in written:
            if isinstance(leaf, Tensor) and not leaf.is_meta:
                raise RuntimeError(
                    f"deferred_init(): {func} writes into a real {leaf.device} tensor from a deferred (meta) tensor, "
                    "whose values do not exist yet. Make that tensor inside deferred_init() too (without device=), "
                    "or compute it after materialisation."
                )
        rng_state = self._draw(func, flat, spec)

        refs = [self._ref(leaf, self._input_sid(leaf)) if _is_meta_tensor(leaf) else None for leaf in flat]
        writes = {
            ref.sid: ref for leaf, ref in zip(flat, refs, strict=True) if ref is not None and _same(leaf, written)
        }
        reads = {ref.node for ref in refs if ref is not None}
        for sid, ref in writes.items():
            others_read_it = sum(r is not None and r.sid == sid for r in refs) > 1
            if (func in _OVERWRITES_SELF and ref.covers_storage() and not others_read_it) or _is_out(func, sid, refs):
                reads.discard(ref.node)

        meta_args, meta_kwargs = tree_unflatten([_to_meta(leaf) for leaf in flat], spec)
        try:
            out = func(*meta_args, **meta_kwargs)
        except NotImplementedError as error:
            raise RuntimeError(
                f"deferred_init(): {func} cannot run on the meta device ({error}). Build the module that calls it "
                "outside deferred_init() and pass it in, or compute that tensor with other ops."
            ) from error

        refs_by_leaf = {id(leaf): ref for leaf, ref in zip(flat, refs, strict=True) if ref is not None}
        recorded_kwargs = _explicit_dtype(func, kwargs, out)
        if recorded_kwargs is not kwargs:
            flat, spec = tree_flatten((args, recorded_kwargs))
        recorded_args = [refs_by_leaf[id(leaf)] if _is_meta_tensor(leaf) else _record_leaf(leaf) for leaf in flat]
        index = len(self._recording.ops)
        flat_out, _ = tree_flatten(out)
        fresh = []
        for position, leaf in enumerate(flat_out):
            if _is_meta_tensor(leaf) and _lookup(leaf) is None and not self._is_untracked(leaf):
                sid = self._output_sid(leaf)
                self._recording.last_write[sid] = index
                fresh.append((position, self._ref(leaf, sid)))
        if writes or fresh:  # otherwise a view or a metadata query: nothing to replay
            for sid in writes:
                self._recording.last_write[sid] = index
            self._recording.ops.append(
                _Op(index, func, recorded_args, spec, frozenset(reads), writes, fresh, rng_state)
            )
        return out

    def record_call(self, function: Callable[..., Any], tensor: Tensor, args: tuple, kwargs: dict) -> Tensor:
        """Record ``function(tensor, *args, **kwargs)``, an initialiser that fills ``tensor`` in place and needs real
        values to do so, as one op; advance its generator by running it on a real scratch tensor."""
        ref = self._ref(tensor, self._input_sid(tensor))
        generators = [leaf for leaf in (*args, *kwargs.values()) if isinstance(leaf, torch.Generator)]
        state = (generators[0] if generators else torch.default_generator).get_state()
        with _paused():
            function(_scratch(tensor), *args, **kwargs)
        flat, spec = tree_flatten(((ref, *args), kwargs))
        index = len(self._recording.ops)
        reads = frozenset() if ref.covers_storage() else frozenset({ref.node})
        recorded = [_record_leaf(leaf) if not isinstance(leaf, _Ref) else leaf for leaf in flat]
        self._recording.ops.append(_Op(index, function, recorded, spec, reads, {ref.sid: ref}, [], state))
        self._recording.last_write[ref.sid] = index
        return tensor

    def _draw(self, func, flat: list[Any], spec) -> Tensor | None:
        """For a random op: the state of the generator it draws from, before it draws; and advance that generator as
        the eager op would, by running the op on real scratch tensors of the same shapes and strides."""
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return None
        generators = [leaf for leaf in flat if isinstance(leaf, torch.Generator)]
        state = (generators[0] if generators else torch.default_generator).get_state()
        scratch_args, scratch_kwargs = tree_unflatten([_scratch(leaf) for leaf in flat], spec)
        func(*scratch_args, **scratch_kwargs)
        return state


def _explicit_dtype(func, kwargs: dict, out: Any) -> dict:
    """``kwargs`` with ``dtype=`` set to the output's when the op left it to the default dtype, so that replay gives
    the dtype the build did whatever the default dtype is then (precision plugins change it around model creation)."""
    takes_dtype = any(argument.name == "dtype" and argument.kwarg_only for argument in op_schema(func).arguments)
    if not takes_dtype or kwargs.get("dtype") is not None or not isinstance(out, Tensor):
        return kwargs
    return {**kwargs, "dtype": out.dtype}


def _on_meta(leaf: Any) -> bool:
    return _is_meta_tensor(leaf) or (isinstance(leaf, torch.device) and leaf.type == "meta")


def _is_meta_tensor(leaf: Any) -> bool:
    return isinstance(leaf, Tensor) and leaf.is_meta


def _same(leaf: Any, written: list[Any]) -> bool:
    return any(leaf is other for other in written)


def _written_arguments(func, args, kwargs) -> list[Any]:
    """The tensors an op writes in place (``self`` of ``mul_``, ``out=``), from its schema's alias annotations."""
    written = []
    for position, argument in enumerate(op_schema(func).arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        positional = not argument.kwarg_only and position < len(args)
        value = args[position] if positional else kwargs.get(argument.name)
        written.extend(value if isinstance(value, list | tuple) else [value])
    return [value for value in written if isinstance(value, Tensor)]


def _is_out(func, sid: int, refs: list[_Ref | None]) -> bool:
    """``out=`` arguments are written without being read; an ``out=`` view that covers its storage needs no past."""
    if not op_schema(func).is_mutable or not any(argument.is_out for argument in op_schema(func).arguments):
        return False
    matching = [ref for ref in refs if ref is not None and ref.sid == sid]
    return len(matching) == 1 and matching[0].covers_storage()


def _record_leaf(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return _Const(leaf.detach().clone(memory_format=torch.preserve_format))
    if isinstance(leaf, torch.Generator):
        return _Generator()
    if isinstance(leaf, torch.device):
        return _CPU  # replay runs on the CPU: its generator is the one an eager CPU build draws from
    return leaf


def _to_meta(leaf: Any) -> Any:
    if isinstance(leaf, Tensor) and not leaf.is_meta:
        return leaf.to(_META)
    if isinstance(leaf, torch.device):
        return _META
    return leaf


def _scratch(leaf: Any) -> Any:
    if _is_meta_tensor(leaf):
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=_CPU).fill_(1)
    if isinstance(leaf, torch.device):
        return _CPU
    return leaf


@contextmanager
def _paused() -> Iterator[None]:
    """Run ops as they would run outside deferred_init() (scratch runs, meta tensors asked for by hand)."""
    _ACTIVE.paused = True
    try:
        yield
    finally:
        _ACTIVE.paused = False


def _recorded_call(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a ``torch.nn.init`` initialiser that does nothing to meta tensors), recorded for deferred ones."""

    @functools.wraps(function)
    def recorded(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder = getattr(_ACTIVE, "recorder", None)
        if recorder is None or getattr(_ACTIVE, "paused", False) or not _is_meta_tensor(tensor):
            return function(tensor, *args, **kwargs)
        return recorder.record_call(function, tensor, args, kwargs)

    return recorded


class _MetaFactories(TorchFunctionMode):
    """Puts tensors that factories (``torch.empty``, ``torch.randn``, ...) make without a ``device=`` on the meta
    device, as ``torch.device("meta")`` would, except ``torch.tensor``-like constructors from data (their data would
    be lost: they stay real CPU constants). Unlike ``torch.device("meta")`` the default device still reads as the
    CPU, so code that skips initialisation under a meta default (Hugging Face's ``init_weights``) still runs it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in device_constructors() and func not in _DATA_CONSTRUCTORS and not getattr(_ACTIVE, "paused", False):
            if kwargs.get("device") is None:
                kwargs["device"] = _META
            elif torch.device(kwargs["device"]).type == "meta":  # asked for by hand: a meta tensor, as eagerly
                with _paused():
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def deferred_init() -> Iterator[None]:
    """Modules (and tensors) created inside are meta tensors; every op that gives their parameters and buffers their
    values is recorded, random ops with the generator state they drew from; afterwards the default CPU generator
    stands where an eager build would have left it.

    Nested blocks join the outer one. Materialise with :func:`materialize_module` or :func:`materialize`.
    """
    if getattr(_ACTIVE, "recorder", None) is not None:
        yield
        return
    _prune()
    recorder = _Recorder(_Recording())
    _ACTIVE.recorder = recorder
    try:
        with _recording_initialisers(), _MetaFactories(), recorder:
            yield
    finally:
        _ACTIVE.recorder = None


@contextmanager
def _recording_initialisers() -> Iterator[None]:
    """Swap the initialisers torch skips for meta tensors for recording wrappers, in ``torch.nn.init`` and in the
    table of them Hugging Face's ``transformers.initialization`` bound at import."""
    tables = [vars(torch.nn.init)]
    huggingface = sys.modules.get("transformers.initialization")
    if huggingface is not None and isinstance(getattr(huggingface, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(huggingface.TORCH_INIT_FUNCTIONS)
    originals = [(table, name, table[name]) for table in tables for name in INITS_THAT_SKIP_META if name in table]
    try:
        for table, name, function in originals:
            table[name] = _recorded_call(function)
        yield
    finally:
        for table, name, function in originals:
            table[name] = function


def is_deferred(tensor: Tensor) -> bool:
    """Whether ``tensor`` was made inside :func:`deferred_init` and can be materialised."""
    if not _is_meta_tensor(tensor):
        return False
    found = _lookup(tensor)
    return found is not None


def materialize(wanted: Sequence[tuple[Tensor, Callable[[Tensor], Tensor]]], *, device: torch.device) -> list[Tensor]:
    """For each (deferred tensor, cut): cut(value an eager build gives the tensor) as a new real tensor on device
    (contiguous, not a view of the whole). Replays the recorded ops in order; each whole value lives only until its
    last use; the same tensor may appear several times with different cuts (tied weights). A tensor that cannot be
    materialised raises a clear error naming it and the fix."""
    return _materialize([(f"wanted[{i}]", tensor, cut) for i, (tensor, cut) in enumerate(wanted)], torch.device(device))


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
    values = _materialize(entries, torch.device(device))
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
    for tables in (parameter_table, buffer_table):
        for prefix, submodule in modules:
            table = tables(submodule)
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


def _materialize(entries: list[tuple[str, Tensor, Callable[[Tensor], Tensor]]], device: torch.device) -> list[Tensor]:
    if getattr(_ACTIVE, "recorder", None) is not None:
        raise RuntimeError(
            "materialize() was called inside deferred_init(); leave the `with deferred_init():` block first, so "
            "that every op that gives the tensors their values has been recorded."
        )
    _prune()
    by_recording: dict[int, tuple[_Recording, list[tuple[int, _Ref, Callable[[Tensor], Tensor], str]]]] = {}
    for position, (name, tensor, cut) in enumerate(entries):
        recording, sid = _checked(name, tensor)
        ref = _Ref.of(tensor, sid, recording.last_write[sid])
        by_recording.setdefault(id(recording), (recording, []))[1].append((position, ref, cut, name))
    results: list[Tensor | None] = [None] * len(entries)
    for recording, targets in by_recording.values():
        _Replay(recording, targets, device, results).run()
    return results  # type: ignore[return-value]


def _checked(name: str, tensor: Tensor) -> tuple[_Recording, int]:
    if not isinstance(tensor, Tensor) or not tensor.is_meta:
        where = tensor.device if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(
            f"{name} is not a deferred tensor (it is on {where}): only tensors made inside deferred_init() can be "
            "materialised. Leave real tensors as they are."
        )
    found = _lookup(tensor)
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

    def __init__(self, recording: _Recording, targets, device: torch.device, results: list[Tensor | None]) -> None:
        self._ops = recording.ops
        self._untracked = {sid for _, sid in recording.untracked.values()}
        self._device = device
        self._results = results
        self._groups: dict[tuple[int, int], list[tuple[int, _Ref, Callable[[Tensor], Tensor], str]]] = {}
        for target in targets:
            self._groups.setdefault(target[1].node, []).append(target)
        self._closures = {node: self._closure(node, group[0][3]) for node, group in self._groups.items()}
        self._uses: dict[tuple[int, int], int] = dict.fromkeys(self._groups, 1)
        for index in set().union(*self._closures.values()):
            for node in self._ops[index].reads:
                self._uses[node] = self._uses.get(node, 0) + 1
        self._live: dict[tuple[int, int], _Slot] = {}
        self._done: set[int] = set()

    def _closure(self, node: tuple[int, int], name: str) -> set[int]:
        """The indices of the ops that the value node depends on."""
        needed: set[int] = set()
        stack = [node]
        while stack:
            sid, version = stack.pop()
            if sid in self._untracked:
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

    def run(self) -> None:
        # Targets that share their first op (the copies of one source) are made one after the other.
        for node in sorted(self._groups, key=lambda n: (min(self._closures[n]), n[1])):
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
                self._results[position] = torch.empty(piece.shape, dtype=piece.dtype, device=self._device).copy_(piece)
            self._use(node)

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
    def _run(self, op: _Op) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        for sid, ref in op.writes.items():
            if ref.node not in op.reads:  # written without being read: a new storage, the past is not needed
                storages[sid] = torch.empty(ref.nbytes, dtype=torch.uint8, device=_CPU).untyped_storage()
                continue
            slot = self._live[ref.node]
            # Writing in place would change a value something else still needs: write into a copy.
            storages[sid] = slot.storage if slot.pending == 1 else _copy(slot.storage)
        for sid, version in op.reads:
            if sid not in storages:
                storages[sid] = self._live[(sid, version)].storage

        if op.func in _COPIES and self._share(op):
            for node in op.reads:
                self._use(node)
            return

        flat = [
            leaf.view(storages[leaf.sid])
            if isinstance(leaf, _Ref)
            else leaf.value
            if isinstance(leaf, _Const)
            else _restored(op.rng_state)
            if isinstance(leaf, _Generator)
            else leaf
            for leaf in op.flat_args
        ]
        args, kwargs = tree_unflatten(flat, op.spec)
        if op.rng_state is not None and not any(isinstance(leaf, _Generator) for leaf in op.flat_args):
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
                laid_out = torch.empty(ref.nbytes, dtype=torch.uint8, device=_CPU).untyped_storage()
                ref.view(laid_out).copy_(value)
                value = ref.view(laid_out)
            self._bind((ref.sid, op.index), _Slot(value.untyped_storage(), 0))

    def _share(self, op: _Op) -> bool:
        """A copy whose output has its input's layout shares the input's storage (copied only if later written)."""
        sources = [leaf for leaf in op.flat_args if isinstance(leaf, _Ref)]
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
    return torch.empty(0, dtype=torch.uint8, device=_CPU).set_(storage).clone().untyped_storage()


def _restored(state: Tensor | None) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state)
    return generator
