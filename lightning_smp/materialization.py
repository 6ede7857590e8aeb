"""Materialise what this rank keeps of a model planned on the meta device: the last step of *plan, then apply*.

Owns turning the meta tensors left in a model after tensor parallelism and the pipeline have planned and pruned
it (`tensor_parallel.parallelize`, `pipeline.build_engine`) into real ones: a parameter kept whole is replayed
whole; a tensor-parallel shard is replayed from the whole tensor it was cut from and cut (`slice_shard`), so
every value equals what a single-device eager build with the same seed gives. The recording and replay are
`delayed_init`'s, one whole tensor at a time, so a rank's peak is what it keeps plus about one tensor.
It does not decide what a rank keeps; placeholders for what it drops hold no tensors and are left alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_smp.delayed_init import is_deferred, materialize
from lightning_smp.placement import TPShard
from lightning_smp.tensor_parallel.shard import ShardSpec, shard_of, slice_shard, take_meta_whole

__all__ = ["has_meta_tensors", "materialize_kept"]

log = logging.getLogger(__name__)


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (built for delayed initialisation)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize_kept(model: nn.Module, *, device: torch.device) -> None:
    """Replace, in place, every meta parameter and buffer of ``model`` by its real value on ``device`` (a shard by
    its cut of the whole). Parameters stay ``nn.Parameter`` with their ``requires_grad`` and the attributes set on
    them (tensor-parallel placement, norm marks); tied parameters stay tied."""
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    olds: list[Tensor] = []
    wanted: list[tuple[Tensor, Callable[[Tensor], Tensor]]] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for is_parameter, tensors in ((True, module._parameters), (False, module._buffers)):
            for local_name, tensor in tensors.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in owners:
                    owners[id(tensor)] = []
                    olds.append(tensor)
                    wanted.append(_source(f"{module_name}.{local_name}" if module_name else local_name, tensor))
                owners[id(tensor)].append((module, local_name, is_parameter))
    values = materialize(wanted, device=device)
    for old, value in zip(olds, values, strict=True):
        if isinstance(old, nn.Parameter):
            value = nn.Parameter(value, requires_grad=old.requires_grad)
            value.__dict__.update(old.__dict__)
        for module, local_name, is_parameter in owners[id(old)]:
            (module._parameters if is_parameter else module._buffers)[local_name] = value
    log.info(
        "lightning_smp: materialised %d tensors (%d bytes) on %s", len(values), sum(_bytes(v) for v in values), device
    )


def _source(name: str, tensor: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """The deferred tensor to replay for ``tensor`` and the cut that gives ``tensor``'s value from it."""
    whole = take_meta_whole(tensor)
    shard = shard_of(tensor)
    if whole is not None and shard is not None:
        return whole, functools.partial(_cut, shard=shard)
    if is_deferred(tensor):
        return tensor, _whole
    raise ValueError(
        f"{name} is on the meta device but was not created inside delayed initialisation, so its values are "
        "unknown. Build the model inside `configure_model` or `trainer.init_module(empty_init=True)` with "
        "SMPStrategy(delayed_parameter_initialization=True), or create it on a real device."
    )


def _cut(value: Tensor, *, shard: TPShard) -> Tensor:
    return slice_shard(value, ShardSpec(shard.dim, shard.blocks), shard.index, shard.parts)


def _whole(value: Tensor) -> Tensor:
    return value


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
