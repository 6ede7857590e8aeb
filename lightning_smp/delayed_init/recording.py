"""Recording: what ``deferred_init()`` keeps of the ops that give a model built on the meta device its values.

Owns the block itself (meta factories, the dispatch mode that runs every op touching a deferred tensor on meta and
records it, the initialisers torch skips for meta tensors) and the recording's data: each op with its arguments as
references to value versions of deferred storages (`Ref`), copies of the real tensors it read (`Const`) and the
generator state a random op drew from. The replay (`replay.py`) reads these types; they are this package's
internal interface, not the user's (see the package docstring).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from lightning_smp._compat import (
    ATEN_TO_COPY,
    INITS_THAT_SKIP_META,
    TorchDispatchMode,
    device_constructors,
    op_schema,
    storage_key,
    tree_flatten,
    tree_unflatten,
)
from lightning_smp.placement import Cut

__all__ = [
    "ACTIVE",
    "COPIES",
    "CPU",
    "Const",
    "GeneratorArg",
    "Op",
    "Recording",
    "Ref",
    "Source",
    "SourceRead",
    "cpu_as_deferred",
    "deferred_from",
    "deferred_init",
    "is_deferred",
    "lookup",
    "prune",
]

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
COPIES = frozenset({_aten.clone.default, ATEN_TO_COPY, _aten.lift_fresh_copy.default})
# The ``torch.nn.init`` functions that skip meta tensors (`INITS_THAT_SKIP_META`) are swapped for recording wrappers
# inside deferred_init(); ``trunc_normal_`` is reached through its helper, which it looks up at each call, so that
# copies of ``trunc_normal_`` bound elsewhere (Hugging Face's) are seen too.
_DATA_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
# ``*_like`` factories and the factory each becomes inside `cpu_as_deferred` when asked for the CPU
_LIKE_FACTORIES = {torch.empty_like: torch.empty, torch.zeros_like: torch.zeros, torch.ones_like: torch.ones}
_META = torch.device("meta")
CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Ref:
    """A deferred tensor as an op argument: a view of storage ``sid`` as it stood after op ``version`` wrote it."""

    sid: int
    version: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int  # of the whole storage

    @staticmethod
    def of(tensor: Tensor, sid: int, version: int) -> Ref:
        return Ref(
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
        return torch.empty(0, dtype=self.dtype, device=CPU).set_(storage, self.offset, self.size, self.stride)


def _stride(dim: tuple[int, int]) -> int:
    return dim[1]


@dataclass(frozen=True, slots=True)
class Const:
    """A real tensor an op read, copied when the op ran (the caller may change the original afterwards)."""

    value: Tensor


class GeneratorArg:
    """Where a random op's generator argument was; replay passes a generator restored to the recorded state."""


@dataclass(slots=True)
class Op:
    index: int
    func: Callable[..., Any]  # an aten op, or an initialiser recorded whole (see INITS_THAT_SKIP_META)
    flat_args: list[Any]  # leaves of (args, kwargs): Ref, Const, GeneratorArg or plain values
    spec: Any
    reads: frozenset[tuple[int, int]]  # value nodes (sid, version) the op needs
    writes: dict[int, Ref]  # sid -> the view written in place
    fresh: list[tuple[int, Ref]]  # (index among the flat outputs, the new storage's layout)
    rng_state: Tensor | None  # state of the generator the op drew from, before it drew


@dataclass(slots=True)
class Recording:
    """The ops of one ``deferred_init()`` block and the storages they made."""

    ops: list[Op] = field(default_factory=list)
    last_write: dict[int, int] = field(default_factory=dict)  # sid -> index of the op that last wrote it
    # meta storages made outside this block, by StorageImpl address: (keeps the address, sid)
    untracked: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)
    next_sid: int = 0


# Meta storages known to some recording, by StorageImpl address. The weak reference keeps the address from being
# reused while the entry exists; entries whose storage died are pruned when a block starts or materialisation runs.
_STORAGES: dict[int, tuple[StorageWeakRef, Recording, int]] = {}
ACTIVE = threading.local()


def prune() -> None:
    for key in [key for key, (ref, _, _) in _STORAGES.items() if ref.expired()]:
        del _STORAGES[key]


def lookup(tensor: Tensor) -> tuple[Recording, int] | None:
    entry = _STORAGES.get(storage_key(tensor.untyped_storage()))
    if entry is None or entry[0].expired():
        return None
    return entry[1], entry[2]


class _Recorder(TorchDispatchMode):
    """Runs every op that touches a meta tensor on meta, and records it so that it can be replayed for real."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self._recording = recording

    def _new_sid(self) -> int:
        self._recording.next_sid += 1
        return self._recording.next_sid - 1

    def _input_sid(self, tensor: Tensor) -> int:
        found = lookup(tensor)
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

    def _adopt(self, tensor: Tensor) -> None:
        """``tensor``'s storage is written whole by an op of this block: a meta storage made elsewhere (by hand, or
        in an earlier block) is known from here on, as this block's; its earlier values stay unknown."""
        entry = self._recording.untracked.pop(storage_key(tensor.untyped_storage()), None)
        if entry is not None:
            _STORAGES[storage_key(tensor.untyped_storage())] = (entry[0], self._recording, entry[1])

    def _output_sid(self, tensor: Tensor) -> int:
        storage = tensor.untyped_storage()
        sid = self._new_sid()
        _STORAGES[storage_key(storage)] = (StorageWeakRef(storage), self._recording, sid)
        return sid

    def _ref(self, tensor: Tensor, sid: int) -> Ref:
        return Ref.of(tensor, sid, self._recording.last_write.get(sid, -1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        if getattr(ACTIVE, "paused", False) or not any(_on_meta(leaf) for leaf in flat):
            return func(*args, **kwargs)  # real tensors only (or a meta tensor asked for by hand): run it as eagerly
        metas = [leaf for leaf in flat if _is_meta_tensor(leaf)]
        if metas and not any(lookup(leaf) is not None for leaf in metas):
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
        targets = {
            ref.sid: (ref, leaf)
            for leaf, ref in zip(flat, refs, strict=True)
            if ref is not None and _same(leaf, written)
        }
        writes = {sid: ref for sid, (ref, _) in targets.items()}
        reads = {ref.node for ref in refs if ref is not None}
        for sid, (ref, leaf) in targets.items():
            others_read_it = sum(r is not None and r.sid == sid for r in refs) > 1
            if (func in _OVERWRITES_SELF and ref.covers_storage() and not others_read_it) or _is_out(func, sid, refs):
                reads.discard(ref.node)
                self._adopt(leaf)

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
            if _is_meta_tensor(leaf) and lookup(leaf) is None and not self._is_untracked(leaf):
                sid = self._output_sid(leaf)
                self._recording.last_write[sid] = index
                fresh.append((position, self._ref(leaf, sid)))
        if writes or fresh:  # otherwise a view or a metadata query: nothing to replay
            for sid in writes:
                self._recording.last_write[sid] = index
            self._recording.ops.append(Op(index, func, recorded_args, spec, frozenset(reads), writes, fresh, rng_state))
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
        recorded = [_record_leaf(leaf) if not isinstance(leaf, Ref) else leaf for leaf in flat]
        self._recording.ops.append(Op(index, function, recorded, spec, reads, {ref.sid: ref}, [], state))
        self._recording.last_write[ref.sid] = index
        return tensor

    def record_source(self, source: Source) -> Tensor:
        """A new deferred tensor made by one op that reads ``source``."""
        with _paused():
            out = torch.empty(tuple(source.shape), dtype=source.dtype, device=_META)
        sid, index = self._output_sid(out), len(self._recording.ops)
        self._recording.last_write[sid] = index
        _, spec = tree_flatten(((), {}))
        fresh = [(0, self._ref(out, sid))]
        self._recording.ops.append(Op(index, SourceRead(source), [], spec, frozenset(), {}, fresh, None))
        return out

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


def _is_out(func, sid: int, refs: list[Ref | None]) -> bool:
    """``out=`` arguments are written without being read; an ``out=`` view that covers its storage needs no past."""
    if not op_schema(func).is_mutable or not any(argument.is_out for argument in op_schema(func).arguments):
        return False
    matching = [ref for ref in refs if ref is not None and ref.sid == sid]
    return len(matching) == 1 and matching[0].covers_storage()


def _record_leaf(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return Const(leaf.detach().clone(memory_format=torch.preserve_format))
    if isinstance(leaf, torch.Generator):
        return GeneratorArg()
    if isinstance(leaf, torch.device):
        return CPU  # replay runs on the CPU: its generator is the one an eager CPU build draws from
    return leaf


def _to_meta(leaf: Any) -> Any:
    if isinstance(leaf, Tensor) and not leaf.is_meta:
        return leaf.to(_META)
    if isinstance(leaf, torch.device):
        return _META
    return leaf


def _scratch(leaf: Any) -> Any:
    if _is_meta_tensor(leaf):
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=CPU).fill_(1)
    if isinstance(leaf, torch.device):
        return CPU
    return leaf


@contextmanager
def _paused() -> Iterator[None]:
    """Run ops as they would run outside deferred_init() (scratch runs, meta tensors asked for by hand)."""
    ACTIVE.paused = True
    try:
        yield
    finally:
        ACTIVE.paused = False


def _recorded_call(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a ``torch.nn.init`` initialiser that does nothing to meta tensors), recorded for deferred ones."""

    @functools.wraps(function)
    def recorded(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder = getattr(ACTIVE, "recorder", None)
        if recorder is None or getattr(ACTIVE, "paused", False) or not _is_meta_tensor(tensor):
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
        if func in _LIKE_FACTORIES and getattr(ACTIVE, "cpu_deferred", False) and _is_cpu(kwargs.get("device", "meta")):
            like, rest = args[0], {key: value for key, value in kwargs.items() if key not in ("device", "dtype")}
            return _LIKE_FACTORIES[func](like.shape, dtype=kwargs.get("dtype") or like.dtype, device=_META, **rest)
        if func in device_constructors() and func not in _DATA_CONSTRUCTORS and not getattr(ACTIVE, "paused", False):
            if kwargs.get("device") is None or (getattr(ACTIVE, "cpu_deferred", False) and _is_cpu(kwargs["device"])):
                kwargs["device"] = _META
            elif torch.device(kwargs["device"]).type == "meta":  # asked for by hand: a meta tensor, as eagerly
                with _paused():
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def _is_cpu(device: Any) -> bool:
    return torch.device(device).type == "cpu"


@contextmanager
def cpu_as_deferred() -> Iterator[None]:
    """Inside a ``deferred_init()`` block, factories asked for the CPU (``device="cpu"``) make deferred tensors too:
    for library code that places tensors it creates on the CPU explicitly (Hugging Face moving a model's missing
    keys off the meta device before initialising them)."""
    previous = getattr(ACTIVE, "cpu_deferred", False)
    ACTIVE.cpu_deferred = True
    try:
        yield
    finally:
        ACTIVE.cpu_deferred = previous


class Source(Protocol):
    """Where a tensor's values come from other than the ops of a block: a tensor of a checkpoint file."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self, cut: Cut | None) -> Tensor:
        """The whole value (``cut`` None) or only ``cut`` of it, as a new contiguous CPU tensor."""
        ...


@dataclass(frozen=True, slots=True)
class SourceRead:
    """The recorded op that makes a deferred tensor from a `Source`: replayed, it reads the whole value."""

    source: Source

    def __call__(self) -> Tensor:
        return self.source.read(None)


def deferred_from(source: Source) -> Tensor:
    """A deferred tensor whose value is ``source``'s (nothing is read now); inside a ``deferred_init()`` block.
    Materialised, it is read then, and only the part a rank keeps when nothing but copies and dtype casts were
    applied to it (see `replay`)."""
    recorder = getattr(ACTIVE, "recorder", None)
    if recorder is None:
        raise RuntimeError("deferred_from() makes a deferred tensor: call it inside a `with deferred_init():` block.")
    return recorder.record_source(source)


@contextmanager
def deferred_init() -> Iterator[None]:
    """Modules (and tensors) created inside are meta tensors; every op that gives their parameters and buffers their
    values is recorded, random ops with the generator state they drew from; afterwards the default CPU generator
    stands where an eager build would have left it.

    Nested blocks join the outer one. Materialise with :func:`materialize_module` or :func:`materialize`.
    """
    if getattr(ACTIVE, "recorder", None) is not None:
        yield
        return
    prune()
    recorder = _Recorder(Recording())
    ACTIVE.recorder = recorder
    try:
        with _recording_initialisers(), _loading_hooks_entered(), _MetaFactories(), recorder:
            yield
    finally:
        ACTIVE.recorder = None


_LOADING_HOOKS: list[Callable[[], AbstractContextManager[None]]] = []


def add_loading_hook(hook: Callable[[], AbstractContextManager[None]]) -> None:
    """Have every ``deferred_init()`` block enter ``hook()``: a library's adapter that makes the values it reads from
    files deferred too (`delayed_init.huggingface` registers Hugging Face's ``from_pretrained`` so)."""
    _LOADING_HOOKS.append(hook)


@contextmanager
def _loading_hooks_entered() -> Iterator[None]:
    with ExitStack() as stack:
        for hook in _LOADING_HOOKS:
            stack.enter_context(hook())
        yield


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
    found = lookup(tensor)
    return found is not None
