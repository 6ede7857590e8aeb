"""Materialise what this rank keeps of a model planned on the meta device: the last step of *plan, then apply*.

Owns which part of each whole tensor a rank holds (`cut_of`: its tensor-parallel piece and, under sharded data
parallelism, its rows of that) and turning the meta tensors left in a model after the build has split, pruned and
sharded it (`lightning_smp.build`) into real ones on the training device. Every value is what a single-device
build gives: a tensor's recorded initialisation is replayed whole and cut, or its checkpoint file is read, only the
cut (`delayed_init`, `weights`), one tensor at a time, so a rank's peak is what it keeps plus about one tensor.
Progress goes to rank 0's log; host memory freed on the way goes back to the system. It does not decide what a rank
keeps; placeholders for what it drops hold no tensors and are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_smp._compat import buffer_table, parameter_table
from lightning_smp.delayed_init import is_deferred, materialize
from lightning_smp.placement import Cut, placement_of
from lightning_smp.progress import Progress
from lightning_smp.tensor_parallel.shard import take_meta_whole

__all__ = ["Pending", "cut_of", "has_meta_tensors", "materialize_kept", "pending_values"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pending:
    """Where a meta tensor's value comes from: the deferred whole tensor, and the cut of it this rank keeps (before
    sharded data parallelism takes its rows)."""

    whole: Tensor
    cut: Cut


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (built for delayed initialisation)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def cut_of(tensor: Tensor) -> Cut:
    """The part of its whole tensor that ``tensor`` holds on this rank: its tensor-parallel piece (`Placement`) and,
    for a sharded-data-parallel (FSDP2) parameter, this rank's rows of that piece."""
    placement = placement_of(tensor)
    cut = Cut.of_shard(placement.global_shape, placement.tp_shard)
    return _rows(cut, tensor) if isinstance(tensor, DTensor) else cut


def pending_values(model: nn.Module) -> dict[str, Pending]:
    """The source of every meta parameter and buffer of ``model``, by each of its names; to be taken before
    sharded data parallelism replaces the parameters (a tensor-parallel piece's whole is remembered only on the
    piece, `take_meta_whole`)."""
    found: dict[int, Pending] = {}
    pending = {}
    for name, tensor in _named_tensors(model):
        if not tensor.is_meta:
            continue
        if id(tensor) not in found:
            whole = take_meta_whole(tensor)
            if whole is None and not is_deferred(tensor):
                raise ValueError(
                    f"{name} is on the meta device but was not created inside delayed initialisation, so its values "
                    "are unknown. Build the model inside `configure_model` or `trainer.init_module(empty_init=True)` "
                    "with SMPStrategy(delayed_parameter_initialization=True), or create it on a real device."
                )
            placement = placement_of(tensor)
            found[id(tensor)] = Pending(
                tensor if whole is None else whole, Cut.of_shard(placement.global_shape, placement.tp_shard)
            )
        pending[name] = found[id(tensor)]
    return pending


def materialize_kept(model: nn.Module, *, device: torch.device, pending: Mapping[str, Pending] | None = None) -> None:
    """Replace, in place, every meta parameter and buffer of ``model`` by its real value on ``device``: its cut of
    the whole (``pending``, taken by `pending_values` before the model was sharded; by default taken now).
    Parameters stay ``nn.Parameter`` with their ``requires_grad`` and the attributes set on them (placement, norm
    marks); an FSDP2 parameter stays a DTensor, holding its rows; tied parameters stay tied."""
    if pending is None:
        pending = pending_values(model)
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    olds: list[Tensor] = []
    wanted: list[tuple[Tensor, Cut]] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for is_parameter, tensors in ((True, parameter_table(module)), (False, buffer_table(module))):
            for local_name, tensor in tensors.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in owners:
                    source = pending[f"{module_name}.{local_name}" if module_name else local_name]
                    owners[id(tensor)] = []
                    olds.append(tensor)
                    wanted.append(
                        (source.whole, _rows(source.cut, tensor) if isinstance(tensor, DTensor) else source.cut)
                    )
                owners[id(tensor)].append((module, local_name, is_parameter))
    total = sum(_numel(cut.shape) * whole.dtype.itemsize for whole, cut in wanted)
    with Progress("materialising the model", total) as progress:
        values = materialize(wanted, device=device, on_done=lambda value: progress.advance(_nbytes(value)))
    for old, value in zip(olds, values, strict=True):
        if isinstance(old, DTensor):
            value = DTensor.from_local(
                value, old.device_mesh, old.placements, shape=old.shape, stride=old.stride(), run_check=False
            )
        if isinstance(old, nn.Parameter):
            value = nn.Parameter(value, requires_grad=old.requires_grad)
            value.__dict__.update(old.__dict__)
        for module, local_name, is_parameter in owners[id(old)]:
            (parameter_table(module) if is_parameter else buffer_table(module))[local_name] = value
    del olds, wanted, values
    log.info("lightning_smp: materialised %d bytes on %s", total, device)
    _return_freed_host_memory()


def _rows(cut: Cut, tensor: DTensor) -> Cut:
    """``cut`` narrowed to the rows this rank holds of an FSDP2 parameter (dim-0 shards, ``torch.chunk``'s split)."""
    start, stop = 0, cut.shape[0] if cut.shape else 0
    coordinate = tensor.device_mesh.get_coordinate()
    assert coordinate is not None, "a rank outside the parameter's mesh"
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            assert placement.dim == 0, "FSDP2 shards parameters along dim 0"
            chunk = -(-(stop - start) // tensor.device_mesh.size(mesh_dim))
            start = min(start + coordinate[mesh_dim] * chunk, stop)
            stop = min(start + chunk, stop)
    return cut.rows(start, stop)


def _named_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _return_freed_host_memory() -> None:
    """Give the host memory freed while materialising (each whole tensor replayed and cut) back to the system: glibc
    keeps freed blocks of a few MiB in its heap for reuse, which would stay in the process's resident memory for the
    whole run. ``malloc_trim(0)`` returns them; other C libraries return theirs on their own."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
