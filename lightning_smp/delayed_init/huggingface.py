"""Hugging Face ``from_pretrained`` inside ``deferred_init()``: the checkpoint's tensors become deferred tensors, read
when setup materialises the model, so that each rank reads only the parts it keeps.

transformers 5 builds the model on the meta device and copies the checkpoint in
(``core_model_loading.convert_and_load_state_dict_in_model``), renaming and converting tensors on the way, then
initialises what the checkpoint lacks. That logic is left as it is; for the block's duration only where tensors
come from and where they are put changes:

- ``transformers.modeling_utils.safe_open`` hands out deferred tensors (`lightning_smp.weights.SafetensorsTensor`
  sources) instead of memory-mapped ones, so every rename, conversion and dtype cast is recorded and replayed per
  rank (only casts and copies of a tensor: its rank's part is read directly);
- the missing keys and non-persistent buffers (a rotary table) that
  ``PreTrainedModel._move_missing_keys_from_meta_to_device`` puts on the CPU before initialising them are deferred
  too, so their initialisation is recorded, drawing from the generator as a single-device load does;
- loading runs in the calling thread (``HF_DEACTIVATE_ASYNC_LOAD``), where the recording is.

The method is a private name of transformers 5, replaced through `lightning_smp._compat` (tests/test_compat.py and
tests/test_pretrained.py fail when it changes).
Checkpoints in ``torch.save`` format (``pytorch_model.bin``) load as transformers loads them, whole on every rank.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import Tensor

from lightning_smp._compat import hf_missing_keys_moved_by

__all__ = ["loading_deferred"]

_ASYNC_LOAD_VARIABLE = "HF_DEACTIVATE_ASYNC_LOAD"


@contextmanager
def loading_deferred() -> Iterator[None]:
    """While a ``deferred_init()`` block is open: transformers' ``from_pretrained`` records where each tensor comes
    from instead of reading it (a no-op when transformers is not imported)."""
    if "transformers" not in sys.modules:
        yield
        return
    from transformers import modeling_utils  # the package imports its submodules lazily

    with ExitStack() as stack:
        moved = stack.enter_context(hf_missing_keys_moved_by(_deferring))
        if not callable(getattr(modeling_utils, "safe_open", None)) or not moved:
            yield  # another transformers: from_pretrained under delayed initialisation fails naming the tensor
            return
        stack.callback(setattr, modeling_utils, "safe_open", modeling_utils.safe_open)
        modeling_utils.safe_open = _DeferredSafeOpen
        stack.callback(_restore_variable, os.environ.get(_ASYNC_LOAD_VARIABLE))
        os.environ[_ASYNC_LOAD_VARIABLE] = "1"
        yield


def _restore_variable(value: str | None) -> None:
    if value is None:
        os.environ.pop(_ASYNC_LOAD_VARIABLE, None)
    else:
        os.environ[_ASYNC_LOAD_VARIABLE] = value


def _deferring(move: Any) -> Any:
    """``PreTrainedModel._move_missing_keys_from_meta_to_device`` making deferred tensors where it makes CPU ones."""
    from lightning_smp.delayed_init.recording import cpu_as_deferred

    @functools.wraps(move)
    def moved(self: Any, *args: Any, **kwargs: Any) -> Any:
        with cpu_as_deferred():
            return move(self, *args, **kwargs)

    return moved


class _DeferredSafeOpen:
    """safetensors' ``safe_open`` as transformers' loading uses it, handing out deferred tensors."""

    def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu", **_: Any) -> None:
        from lightning_smp.weights import SafetensorsFile

        self._file = SafetensorsFile(filename)

    def __enter__(self) -> _DeferredSafeOpen:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self._file.tensors)

    def metadata(self) -> dict[str, str] | None:
        return self._file.metadata

    def get_slice(self, key: str) -> _DeferredSlice:
        return _DeferredSlice(self._file.tensors[key])

    def get_tensor(self, key: str) -> Tensor:
        return self.get_slice(key)[...]


class _DeferredSlice:
    """safetensors' lazy slice of one tensor: indexing it gives a deferred tensor (a view of the whole one)."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def get_shape(self) -> list[int]:
        return list(self._source.shape)

    def get_dtype(self) -> str:
        return self._source.code

    def __getitem__(self, index: Any) -> Tensor:
        from lightning_smp.delayed_init.recording import deferred_from

        return deferred_from(self._source)[index]
