"""What a model keeps for backward: the bytes autograd saves while one microbatch runs forward, counted, not guessed.

Owns the count (`SavedBytes`: through ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters
and buffers not at all, by where it was saved: before the trunk, in each trunk child, after it) and the trace the
memory planner runs (`trace_activations`): a copy of the model on the meta device (nothing is allocated), built by
the strategy's own `build.plan_and_apply` as tensor-parallel rank 0 of the layout holds it (a `ShapeOnlyTopology`:
collectives only shape tensors), with its activation checkpointing and offloading, in its training precision, runs
``training_step`` (or ``forward``) and backward on one microbatch. So any model is measured, with every layout
feature that changes what it keeps, its logits and its loss; a benchmark counts a live run with the same
`SavedBytes`. A trunk of identical layers is traced through its first two and extended to the rest
(`repeated_layers`; a trunk that is not, or whose two traced layers differ, is traced whole). On the meta device
``scaled_dot_product_attention`` would fall back to its math kernel, which keeps the attention probabilities: the
trace runs the fused kernel instead (keeping q, k, v, the output and the log-sum-exp, as torch's CPU and CUDA kernels
do). Not owned: which stage holds which child (`pipeline.partition`), the report (`memory`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_smp import activation_checkpointing, build, repeated_layers, smp
from lightning_smp._compat import flash_attention_for_cpu, tree_map
from lightning_smp.config import SMPConfig
from lightning_smp.context_parallel.sequence import check_length
from lightning_smp.pipeline.microbatch import split_batch
from lightning_smp.precision import SMPPrecision
from lightning_smp.repeated_layers import Cut, Handoffs
from lightning_smp.tensor_parallel import hf_plan

__all__ = ["ActivationTrace", "SavedBytes", "TraceError", "by_trunk_child", "example_batch", "trace_activations"]

BEFORE, AFTER, WHOLE = "before", "after", "whole"  # buckets besides the trunk children's ("0", "1", ...)


class TraceError(RuntimeError):
    """The model could not be traced on the meta device; the message says why and what to change."""


class SavedBytes:
    """Counts the bytes autograd saves for backward while active, each storage once (a view keeps its whole
    storage), leaving out ``exclude`` (parameters and buffers) and what inner hooks take over (checkpointed
    modules keep only their inputs, offloaded ones not even those). ``bucket`` names where the next saves go.

    It holds every counted storage until it is dropped: count one microbatch, read the totals, let it go.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._storages: dict[int, Any] = {}  # id -> storage, held so that an id is never reused while counting
        self._excluded = {self.key(tensor) for tensor in exclude}
        self.bucket = WHOLE
        self.saved: dict[str, dict[int, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unchanged)

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def total(self, buckets: Iterable[str] | None = None) -> int:
        """Bytes saved in ``buckets`` (all by default), a storage saved in several counted once."""
        chosen = self.saved if buckets is None else {b: self.saved.get(b, {}) for b in buckets}
        return sum({key: size for storages in chosen.values() for key, size in storages.items()}.values())

    def key(self, tensor: Tensor) -> int:
        """The key ``tensor``'s storage is counted under (the storage is held while this counter lives)."""
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor subclass without one storage: the tensor itself
            storage = tensor
        self._storages.setdefault(id(storage), storage)
        return id(storage)

    def _pack(self, tensor: Tensor) -> Tensor:
        key = self.key(tensor)
        if key not in self._excluded:
            storage = self._storages[key]
            size = storage.nbytes() if not isinstance(storage, Tensor) else tensor.numel() * tensor.element_size()
            self.saved.setdefault(self.bucket, {})[key] = size
        return tensor


def _unchanged(tensor: Tensor) -> Tensor:
    return tensor


@dataclass(frozen=True)
class ActivationTrace:
    """What one microbatch keeps for backward on one tensor-parallel rank, by bucket: ``"before"`` / ``"after"`` the
    trunk and each trunk child by its index (``"whole"`` when the model has no trunk to split)."""

    saved: Mapping[str, Mapping[int, int]]
    """Bucket -> storage -> bytes."""
    transient: Mapping[str, int]
    """Bucket -> bytes its backward adds for a moment: a checkpointed child's activations rebuilt, and with
    offloading the inputs loaded back ahead of it."""
    microbatch: str
    """The microbatch's shapes, for the report."""
    cut: Cut | None = None
    """The children of a repeated trunk the trace ran, the rest extended from them (`repeated_layers`); None when it
    ran every child."""

    def kept(self, buckets: Iterable[str] | None = None) -> int:
        """Bytes ``buckets`` (all by default) keep for backward, a storage saved in several counted once."""
        chosen = self.saved.values() if buckets is None else [self.saved.get(bucket, {}) for bucket in buckets]
        return sum({key: size for storages in chosen for key, size in storages.items()}.values())

    def peak_transient(self, buckets: Iterable[str] | None = None) -> int:
        """The most that backward adds at once in ``buckets`` (all by default)."""
        values = self.transient.values() if buckets is None else [self.transient.get(b, 0) for b in buckets]
        return max(values, default=0)


def trace_activations(
    model: nn.Module,
    batch: Any,
    *,
    config: SMPConfig,
    extrapolate: bool = True,
    built: build.BuildPlan | None = None,
) -> ActivationTrace:
    """Trace one microbatch of ``batch`` (one data-parallel replica's batch, as ``training_step`` gets it, split
    into ``config.microbatches``) through ``model`` as one rank of ``config``'s tensor-parallel degree holds it.
    With ``extrapolate`` a trunk of repeated layers is traced through its first two (and a last that differs) and
    extended to the rest (the same bytes, per bucket; `repeated_layers`); without, or where that cannot apply, the
    trunk runs whole.
    ``built`` is `build.plan` of ``model`` for ``config``'s layout, when the caller has it.

    Raises `TraceError`, saying why, when the model cannot run on the meta device (data-dependent code such as
    ``.item()``, a collective of its own) or has nothing to backpropagate; ``ValueError`` when the model cannot take
    ``config``'s layout (its own error, as the strategy would raise it).
    """
    microbatch = split_batch(_on_meta(batch), config.microbatches)[0]
    if built is None:
        built = build.plan(
            model, config=config, tp=config.tensor_parallel_degree, pp=1, sdp=config.sharded_data_parallel_degree
        )
    trunk = None if built.trunk is None else built.trunk[0]
    if extrapolate and built.trunk is not None:
        cut = repeated_layers.plan_cut(built.trunk[1], name=built.trunk[0], units=built.tensor_parallel.units)
        if cut is not None:
            try:
                return _trace_both(model, microbatch, config, trunk, cut=cut)
            except _NotRepeating:
                pass
            except TraceError:
                pass  # a model that cannot run a cut trunk (it indexes its layers, say): its whole trunk says why not
    return _trace_both(model, microbatch, config, trunk, cut=None)


class _NotRepeating(Exception):
    """The two traced children of a repeating trunk keep different bytes."""


def _trace_both(
    model: nn.Module, microbatch: Any, config: SMPConfig, trunk: str | None, *, cut: Cut | None
) -> ActivationTrace:
    # What a checkpointed child rebuilds in its backward is what it keeps without checkpointing.
    plain, host = _trace(model, microbatch, config, trunk, checkpoint=False, cut=cut)
    kept = plain
    if any(activation_checkpointing.is_marked(module) for module in model.modules()):
        kept, host = _trace(model, microbatch, config, trunk, checkpoint=True, cut=cut)
    transient = {bucket: max(0, _total(plain, [bucket]) - _total(kept, [bucket])) for bucket in plain}
    horizon = config.activation_loading_horizon + 1  # the layer backward is in, and those loaded ahead of it
    for bucket, largest in host.items():
        transient[bucket] = transient.get(bucket, 0) + horizon * largest
    return ActivationTrace(kept, transient, _shapes(microbatch), cut)


def _total(saved: Mapping[str, Mapping[int, int]], buckets: Iterable[str]) -> int:
    return sum({key: size for bucket in buckets for key, size in saved.get(bucket, {}).items()}.values())


def _trace(
    model: nn.Module,
    microbatch: Any,
    config: SMPConfig,
    trunk_name: str | None,
    *,
    checkpoint: bool,
    cut: Cut | None,
) -> tuple[dict[str, dict[int, int]], dict[str, int]]:
    """Run one microbatch forward and backward through a meta copy of ``model`` built as ``config`` lays it out
    (`build.plan_and_apply` under a `ShapeOnlyTopology`; with its activation checkpointing, or without), the trunk
    ``cut`` (repeating: `repeated_layers`) to the children it traces; per bucket, the storages saved on the device
    and the largest offloaded module's bytes, for the whole trunk."""
    left_out = [] if cut is None or trunk_name is None else cut.left_out(model.get_submodule(trunk_name))
    traced = _meta_copy(model, leave_out=left_out)
    traced.train()
    trunk = None if trunk_name is None else traced.get_submodule(trunk_name)
    if cut is not None:
        assert trunk is not None
        cut.apply(trunk)
    host = _HostCounter()
    if not checkpoint:  # as if nothing were marked: what the marked modules would keep
        activation_checkpointing.clear_marks(traced)
        config = dataclasses.replace(config, offload_activations=False)
    with _quiet():  # the run warns about its layout itself
        build.plan_and_apply(
            traced,
            topology=build.ShapeOnlyTopology.of(config),
            config=config,
            device=torch.device("meta"),
            offloader=host if config.offload_activations else None,  # type: ignore[arg-type]
        )
    if config.half_dtype is not None:  # as Lightning converts the strategy's model, after the split
        precision = SMPPrecision(config.half_dtype)
        precision.convert_module(traced)
        microbatch = precision.convert_input(microbatch)
    saved = SavedBytes(exclude=[*traced.parameters(), *traced.buffers()])
    handoffs = Handoffs(saved.key)
    watch = handoffs.watching(trunk) if cut is not None and trunk is not None else contextlib.nullcontext()
    with contextlib.ExitStack() as stack:
        for context in (saved, by_trunk_child(trunk, saved, host), watch, _quiet(), _fused_attention()):
            stack.enter_context(context)
        with torch.device("meta"), _layout(config):
            loss = _loss(traced, microbatch)
    if not isinstance(loss, Tensor) or not loss.requires_grad:
        raise TraceError(
            f"{type(model).__name__} gave {type(loss).__name__} to backpropagate, not a tensor that requires grad; "
            "training_step must return the loss (or a dict with 'loss'), as automatic optimization needs."
        )
    try:
        with torch.device("meta"), _fused_attention():
            loss.float().sum().backward()
    except Exception as error:
        raise TraceError(
            f"the backward of {type(model).__name__} failed on the meta device ({type(error).__name__}: "
            f"{_first_line(error)})"
        ) from error
    if cut is None:
        return saved.saved, host.largest
    alike = not cut.first_alike or host.largest.get("0") == host.largest.get("1")
    if not (alike and repeated_layers.same_bytes(saved.saved, handoffs, cut)):
        raise _NotRepeating
    whole = repeated_layers.extend(saved.saved, handoffs, cut, after=AFTER)
    return whole, repeated_layers.extend_values(host.largest, cut)


def _meta_copy(model: nn.Module, *, leave_out: Sequence[nn.Module] = ()) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are new tensors on the meta device (tied weights stay
    tied; nothing is allocated), with no Trainer or Fabric attached; ``leave_out`` modules become None in it."""
    memo: dict[int, Any] = {id(module): None for module in leave_out}
    kept = _modules_besides(model, memo.keys())
    for param in {id(p): p for module in kept for p in module.parameters(recurse=False)}.values():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in {id(b): b for module in kept for b in module.buffers(recurse=False)}.values():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    if isinstance(model, pl.LightningModule):
        if model.fabric is not None:
            memo[id(model.fabric)] = None
        else:
            with contextlib.suppress(RuntimeError):  # not attached to a Trainer
                memo[id(model.trainer)] = None
    try:
        return copy.deepcopy(model, memo)
    except Exception as error:
        raise TraceError(f"copying {type(model).__name__} failed ({type(error).__name__}: {error})") from error


def _modules_besides(model: nn.Module, leave_out: Iterable[int]) -> list[nn.Module]:
    """``model``'s modules, each once, but for those of ids ``leave_out`` and what only they hold."""
    seen = set(leave_out)
    found, stack = [], [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(module.children())
    return found


@contextmanager
def by_trunk_child(trunk: nn.Module | None, *counters: Any) -> Iterator[None]:
    """Point each of ``counters`` (a `SavedBytes`, ...) at the bucket of whatever runs: ``"before"`` the ``trunk``,
    the index of the child that runs, ``"after"`` its last child; nothing changes without a trunk."""
    if trunk is None:
        yield
        return
    children = list(trunk.children())

    def point(bucket: str) -> None:
        for counter in counters:
            counter.bucket = bucket

    point(BEFORE)

    def enter(index: int) -> Any:
        def hook(*_: Any) -> None:
            point(str(index))

        return hook

    def leave(index: int) -> Any:
        def hook(*_: Any) -> None:
            if index == len(children) - 1:
                point(AFTER)

        return hook

    handles = [child.register_forward_pre_hook(enter(i)) for i, child in enumerate(children)]
    handles += [child.register_forward_hook(leave(i)) for i, child in enumerate(children)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _HostCounter:
    """Stands in for the activation offloader in the trace: what a checkpointed module saves leaves the device;
    per bucket, the largest module's bytes are noted (backward loads it back, with the horizon's)."""

    def __init__(self) -> None:
        self.bucket = WHOLE
        self.largest: dict[str, int] = {}

    @contextmanager
    def offloading(self) -> Iterator[None]:
        sizes: list[int] = []

        def pack(tensor: Tensor) -> tuple[torch.Size, torch.dtype]:
            sizes.append(tensor.numel() * tensor.element_size())
            return tensor.shape, tensor.dtype

        def unpack(saved: tuple[torch.Size, torch.dtype]) -> Tensor:
            return torch.empty(saved[0], dtype=saved[1], device="meta")

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self.largest[self.bucket] = max(self.largest.get(self.bucket, 0), sum(sizes))


def example_batch(
    model: nn.Module,
    batch: Any,
    *,
    config: SMPConfig,
    micro_batch_size: int | None = None,
    sequence_length: int | None = None,
) -> Any:
    """The batch to trace: ``batch`` on the meta device, resized to ``micro_batch_size`` x ``microbatches`` samples
    (dim 0 of every tensor) of ``sequence_length`` (dim 1 of every tensor that has one); without ``batch``, token
    ids (``input_ids`` and ``labels``) for a Hugging Face transformers model when both sizes are given, else None.
    Under context parallelism, one rank's part of it: dim 1 of every tensor with two or more dims over cp (the ring
    keeps for backward what the fused kernel on that part keeps, and one logsumexp)."""
    cp = config.context_parallel_degree
    if batch is None:
        if micro_batch_size is None or sequence_length is None or not hf_plan.is_transformers_model(model):
            return None
        check_length(sequence_length, cp)
        shape = (micro_batch_size * config.microbatches, sequence_length // cp)
        ids = torch.empty(shape, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids}

    def resize(tensor: Any) -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        shape = list(tensor.shape)
        if shape and micro_batch_size is not None:
            shape[0] = micro_batch_size * config.microbatches
        if len(shape) > 1 and sequence_length is not None:
            shape[1] = sequence_length
        if len(shape) > 1 and cp > 1:
            check_length(shape[1], cp)
            shape[1] //= cp
        return torch.empty(shape, dtype=tensor.dtype, device="meta")

    return tree_map(resize, batch)


def _loss(model: nn.Module, microbatch: Any) -> Any:
    """What the strategy backpropagates for one microbatch: ``training_step``'s loss, or for a plain module its
    output's loss (``output.loss``, ``output["loss"]``), or the output itself."""
    try:
        if isinstance(model, pl.LightningModule):
            output = model.training_step(microbatch, 0)
        elif isinstance(microbatch, Mapping):
            output = model(**microbatch)
        elif isinstance(microbatch, tuple | list):
            output = model(*microbatch)
        else:
            output = model(microbatch)
    except Exception as error:
        raise TraceError(
            f"running {'training_step' if isinstance(model, pl.LightningModule) else 'forward'} of "
            f"{type(model).__name__} on the meta device failed ({type(error).__name__}: {_first_line(error)}). "
            "There tensors have shapes but no values and no process group: host reads (.item(), .tolist(), "
            "bool(tensor), printing) and collectives of your own (smp.get_tp_process_group()) cannot run; keep them "
            "out of the training step (a vocabulary-parallel loss: smp.nn.DistributedLMHead.loss)."
        ) from error
    if isinstance(output, Mapping):
        return output.get("loss")
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    return output


@contextmanager
def _fused_attention() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` on meta tensors as the fused kernel, which keeps q, k, v, the output and the
    log-sum-exp for backward: on the meta device torch would pick its math fallback, which keeps the probabilities.
    The function is swapped in ``torch.nn.functional`` for the block (torch's own ``multi_head_attention_forward``
    and checkpoints recomputing in backward look it up there); tensors on other devices go to torch's own."""
    original = F.scaled_dot_product_attention

    def fused(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not query.is_meta:
            return original(query, key, value, *args, **kwargs)
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = {**dict(zip(names, args, strict=False)), **kwargs}  # fewer key/value heads (enable_gqa) as they come
        return flash_attention_for_cpu(
            query, key, value, call.get("dropout_p", 0.0), call.get("is_causal", False),
            attn_mask=call.get("attn_mask"), scale=call.get("scale"),
        )[0]  # fmt: skip

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextmanager
def _layout(config: SMPConfig) -> Iterator[None]:
    """The smp facade answering ``smp.tp_size()`` and the like for ``config``'s layout (a running job answers for
    itself)."""
    if smp.state.initialized:
        yield
        return
    with smp.preview(config, world_size=config.replica_parallel_degree * config.sharded_data_parallel_degree):
        yield


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer, deprecations: not the user's run
        yield


def _on_meta(batch: Any) -> Any:
    return tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t, batch)


def _shapes(batch: Any) -> str:
    shapes = []
    tree_map(lambda t: shapes.append(tuple(t.shape)) if isinstance(t, Tensor) else None, batch)
    return ", ".join(str(shape) for shape in shapes) or "no tensors"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
