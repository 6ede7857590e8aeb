"""Splitting a batch into microbatches and merging the per-microbatch results back: pure functions.

Owns the rules of smp's step semantics for data: every tensor (with at least one dimension) anywhere in a nested
batch is split on dim 0 into equal pieces, everything else is handed whole to each microbatch; outputs come back
as the mean of 0-dim floating tensors (the loss), the concatenation of tensors with a batch dimension (the
predictions), per key / per position for containers. It does not own communication or the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["batch_size", "merge_outputs", "reduce_values", "split_batch"]


def split_batch(batch: Any, microbatches: int) -> list[Any]:
    """``batch`` as ``microbatches`` pieces, splitting dim 0 of every tensor in any nesting of
    dicts, lists, tuples and named tuples (views, no copy). Other leaves are shared by every piece.

    Raises ``ValueError`` naming both numbers when a tensor's dim 0 is not divisible by ``microbatches``.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if microbatches == 1:
        return [batch]
    _check_divisible(batch, microbatches, path="batch")
    return [_take(batch, index, microbatches) for index in range(microbatches)]


def batch_size(batch: Any) -> int | None:
    """Dim 0 of the first tensor (with a dimension) found in ``batch``, or None."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    for item in _children(batch):
        size = batch_size(item)
        if size is not None:
            return size
    return None


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """One output from the per-microbatch outputs of a step, in microbatch order.

    0-dim floating tensors and Python floats: the mean (the reported loss is the mean over microbatches, which
    equals the loss of the whole batch for a mean-reduced loss on equal pieces); 0-dim integer tensors and Python
    ints: the sum (counts); tensors with a dimension: concatenated on dim 0 (predictions, in order); dicts, lists,
    tuples: merged per key / position; ``None``: ``None``; anything else: the last microbatch's value.
    """
    if not outputs:
        raise ValueError("merge_outputs needs at least one output")
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            stacked = torch.stack([o.detach() if o.requires_grad else o for o in outputs])
            return stacked.mean(0) if stacked.is_floating_point() else stacked.sum(0)
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, bool):
        return outputs[-1]
    if isinstance(first, float):
        return sum(outputs) / len(outputs)
    if isinstance(first, int):
        return sum(outputs)
    if isinstance(first, Mapping):
        merged = {key: merge_outputs([o[key] for o in outputs]) for key in first}
        return merged if type(first) is dict else _rebuild_mapping(first, merged)
    if _is_namedtuple(first):
        return type(first)(*(merge_outputs([o[i] for o in outputs]) for i in range(len(first))))
    if isinstance(first, list | tuple):
        return type(first)(merge_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return outputs[-1]


_REDUCERS: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": lambda t: t.mean(0),
    "sum": lambda t: t.sum(0),
    "max": lambda t: t.max(0).values,
    "min": lambda t: t.min(0).values,
}


def reduce_values(values: Sequence[Any], reduce_fx: str | Callable[..., Any]) -> Any:
    """One value from those logged under one name by each microbatch, with the log call's ``reduce_fx``.

    For "mean" (Lightning's default) this is what the whole batch would have logged for a per-sample mean;
    values that cannot be reduced (objects, unknown reductions) keep the last microbatch's, as Lightning's
    ``on_step`` value would.
    """
    if len(values) == 1:
        return values[0]
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    reducer = _REDUCERS.get({"avg": "mean", "amax": "max", "amin": "min"}.get(name, name))
    if reducer is None:
        return values[-1]
    if all(isinstance(v, Tensor) for v in values):
        stacked = torch.stack([v.detach() for v in values])
        return reducer(stacked if stacked.is_floating_point() else stacked.double())
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return reducer(torch.tensor([float(v) for v in values], dtype=torch.float64)).item()
    return values[-1]


def _check_divisible(batch: Any, microbatches: int, *, path: str) -> None:
    if isinstance(batch, Tensor):
        if batch.dim() > 0 and batch.shape[0] % microbatches:
            size = batch.shape[0]
            lower = size - size % microbatches
            hint = f"{lower} or {lower + microbatches}" if lower else f"{microbatches}"
            raise ValueError(
                f"{path} has {size} samples on dim 0, which microbatches={microbatches} does not divide. Use a "
                f"batch size that is a multiple of {microbatches} (e.g. {hint}; `drop_last=True` in the "
                f"DataLoader drops a smaller last batch), or change microbatches to a divisor of {size}."
            )
        return
    for key, item in _items(batch):
        _check_divisible(item, microbatches, path=f"{path}[{key!r}]")


def _take(batch: Any, index: int, microbatches: int) -> Any:
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            return batch
        size = batch.shape[0] // microbatches
        return batch[index * size : (index + 1) * size]
    if isinstance(batch, Mapping):
        taken = {key: _take(value, index, microbatches) for key, value in batch.items()}
        return taken if type(batch) is dict else _rebuild_mapping(batch, taken)
    if _is_namedtuple(batch):
        return type(batch)(*(_take(item, index, microbatches) for item in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_take(item, index, microbatches) for item in batch)
    return batch


def _rebuild_mapping(original: Mapping[str, Any], values: dict[str, Any]) -> Mapping[str, Any]:
    try:
        return type(original)(values)  # OrderedDict, defaultdict-free mappings, BatchEncoding-like dicts
    except TypeError:
        return values


def _items(batch: Any) -> list[tuple[Any, Any]]:
    if isinstance(batch, Mapping):
        return list(batch.items())
    if isinstance(batch, list | tuple):
        return list(enumerate(batch))
    return []


def _children(batch: Any) -> list[Any]:
    return [item for _, item in _items(batch)]


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")
