"""Hugging Face ``from_pretrained`` inside ``deferred_init()``: the checkpoint's tensors become deferred tensors, read
when setup materialises the model, so that each rank reads only the parts it keeps.

transformers 5 builds the model on the meta device and copies the checkpoint in
(``core_model_loading.convert_and_load_state_dict_in_model``), renaming and converting tensors on the way, then
initialises what the checkpoint lacks. That logic is left as it is; for the block's duration only where tensors
come from and where they are put changes:

- ``transformers.modeling_utils.safe_open`` hands out deferred tensors (`lightning_smp.weight_files.SafetensorsTensor`
  sources) instead of memory-mapped ones, so every rename, conversion and dtype cast is recorded and replayed per
  rank (only casts and copies of a tensor: its rank's part is read directly);
- the missing keys and non-persistent buffers (a rotary table) that
  ``PreTrainedModel._move_missing_keys_from_meta_to_device`` puts on the CPU before initialising them are deferred
  too, so their initialisation is recorded, drawing from the generator as a single-device load does;
- loading runs in the calling thread (``HF_DEACTIVATE_ASYNC_LOAD``), where the recording is;
- hub kernels stay off (``use_kernels=False`` unless the caller passes it): transformers 5.25 turned them on by
  default, and ``kernelize`` on a model whose tensors are all on the meta device fails (and would download kernels
  at run time); ``use_kernels=True`` is refused with the way out, since kernelizing happens before each rank has
  materialised its part and no kernel is checked under a split layout;
- any other error of ``from_pretrained`` that names the meta device becomes one that names transformers' version,
  the versions lightning_smp was tested with, and the fix: a new default of a new release meeting delayed
  initialisation, as 5.25's kernels did.

The method is a private name of transformers 5, replaced through `lightning_smp._compat` (tests/test_compat.py and
tests/test_pretrained.py fail when it changes), and so is the kernels default (`_compat.HF_USE_KERNELS`).
Checkpoints in ``torch.save`` format (``pytorch_model.bin``) load as transformers loads them, whole on every rank.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import Tensor

from lightning_smp._compat import CHECKED_VERSIONS, HF_USE_KERNELS, hf_missing_keys_moved_by, installed_version
from lightning_smp.delayed_init.recording import add_loading_hook, cpu_as_deferred, deferred_from
from lightning_smp.weight_files import SafetensorsFile

__all__ = ["PretrainedLoadingError", "loading_deferred"]


class PretrainedLoadingError(RuntimeError):
    """``from_pretrained`` cannot run under delayed parameter initialisation as called (the message says why and
    what to do)."""


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
        stack.enter_context(_guarded_from_pretrained(modeling_utils.PreTrainedModel))
        yield


def _restore_variable(value: str | None) -> None:
    if value is None:
        os.environ.pop(_ASYNC_LOAD_VARIABLE, None)
    else:
        os.environ[_ASYNC_LOAD_VARIABLE] = value


@contextmanager
def _guarded_from_pretrained(model_class: type) -> Iterator[None]:
    """For the block, ``model_class.from_pretrained`` (every transformers model's, and what the ``Auto`` classes call)
    without hub kernels, and with our own error where the meta device meets a transformers default we do not know."""
    original = model_class.__dict__["from_pretrained"]
    load = original.__func__

    @functools.wraps(load)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get(HF_USE_KERNELS):
            raise PretrainedLoadingError(
                f"from_pretrained(..., {HF_USE_KERNELS}=True) under delayed parameter initialisation: Hugging Face "
                "hub kernels replace layers while every tensor is still on the meta device, before each rank holds "
                "its part of the model, and they are downloaded at run time; lightning_smp does not kernelize a "
                f"split model. Drop {HF_USE_KERNELS}=True (the model trains with transformers' PyTorch layers), or "
                "build the model without delayed_parameter_initialization on a layout without tensor or pipeline "
                "parallelism and kernelize it yourself."
            )
        kwargs[HF_USE_KERNELS] = False
        try:
            return load(cls, *args, **kwargs)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as error:
            if not re.search(r"\bmeta\b", str(error)):  # the meta device, not e.g. a file's "metadata"
                raise
            version, tested = installed_version("transformers"), CHECKED_VERSIONS["transformers"]
            raise PretrainedLoadingError(
                f"transformers {version}'s from_pretrained failed on the meta device under delayed parameter "
                f"initialisation ({type(error).__name__}: {error}). lightning_smp was tested with "
                f"transformers{tested}; a release outside that range may have a new default that does not expect a "
                f"model on the meta device. Install a tested version (pip install 'transformers{tested}', or pip "
                "install -c constraints.txt from lightning_smp's repository), or report the version in an issue."
            ) from error

    model_class.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        model_class.from_pretrained = original


def _deferring(move: Any) -> Any:
    """``PreTrainedModel._move_missing_keys_from_meta_to_device`` making deferred tensors where it makes CPU ones."""

    @functools.wraps(move)
    def moved(self: Any, *args: Any, **kwargs: Any) -> Any:
        with cpu_as_deferred():
            return move(self, *args, **kwargs)

    return moved


class _DeferredSafeOpen:
    """safetensors' ``safe_open`` as transformers' loading uses it, handing out deferred tensors."""

    def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu", **_: Any) -> None:
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
        return deferred_from(self._source)[index]


add_loading_hook(loading_deferred)
