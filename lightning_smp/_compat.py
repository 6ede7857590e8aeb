"""Every use of another library's private names, in one place: what we touch, why, and the version checked.

lightning_smp reaches into torch, Lightning and torchmetrics where they offer no public way to do what it needs
(Lightning's per-step SIGTERM broadcast, the step value Lightning logs for a torchmetrics ``Metric``, torch's
foreach kernels, a module's parameter table, ...). Each such use is a name here, with the version of the library
it was checked against; no other module of the package touches a private name of another library
(``tests/test_compat.py`` checks that, and checks each entry against the installed libraries, so an upgrade that
changes one fails there, by name, rather than somewhere inside a run). `CHECKED_VERSIONS` says, per library, the
versions the entries were checked on: the oldest and the newest that CI ran (setup.cfg declares the same ranges,
and test_compat fails first, naming the library, when an installed version is outside them). docs/contributing.md
says how to raise a bound: run both CI jobs at the new version, fix what fails here, bump the range here and in
setup.cfg together, record the run's versions in constraints.txt.

Three overrides of protected hooks stay in their subclasses, where Python puts them (the test checks that the
bases still have them): ``SMPStrategy._setup_model`` (``DDPStrategy``'s, to wrap in DDP over the data-parallel
group), the ``precision_plugin`` property's storage ``_precision_plugin`` (``Strategy``'s) and ``StandIn._apply``
(``nn.Module``'s, so that a stand-in follows the model's dtype casts).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import IO, Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd.graph import GradientEdge, _engine_run_backward
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
from torch.distributed.utils import _sync_module_states
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.serialization import config as serialization_config
from torchmetrics import Metric

__all__ = [
    "ATEN_TO_COPY",
    "CHECKED_VERSIONS",
    "HF_USE_KERNELS",
    "INITS_THAT_SKIP_META",
    "MODULE_TABLES",
    "REBUILD_TENSOR",
    "BatchNormBase",
    "HSDPMeshInfo",
    "ShardPlacementResult",
    "TorchDispatchMode",
    "accumulate_gradients",
    "after_closure",
    "buffer_table",
    "canonical_mask",
    "ddp_kwargs",
    "device_constructors",
    "dump_checkpoint",
    "flash_attention_cuda",
    "flash_attention_cuda_backward",
    "flash_attention_for_cpu",
    "flash_attention_for_cpu_backward",
    "flatten_dense_tensors",
    "flatten_mesh",
    "foreach_clamp_max_",
    "foreach_clamp_min_",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_zero_",
    "forward_redirection",
    "hf_attention_implementation",
    "hf_missing_keys_moved_by",
    "install_sigterm_hooks",
    "installed_version",
    "mark_sigterm_received",
    "module_table",
    "non_finite_check_and_unscale_",
    "none_or_dtype",
    "op_schema",
    "parameter_table",
    "replace_scheduler_methods",
    "replaced_log",
    "replaced_scaled_dot_product_attention",
    "route_last_checkpoint",
    "scheduler_state_without",
    "set_metric_step_value",
    "set_metric_update_count",
    "set_process_group_timeout",
    "stop_child_process_observer",
    "storage_key",
    "strategy_timeout",
    "sync_ddp_if_available",
    "sync_module_states",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unflatten_dense_tensors",
    "unflatten_mesh",
    "zip_file_writer",
]

CHECKED_VERSIONS = {
    "torch": ">=2.13,<2.14",
    "lightning": ">=2.6,<2.7",
    "torchmetrics": ">=1.4,<1.10",
    "transformers": ">=5.24,<5.26",
}
"""The versions of each library whose private names or defaults are used below, as the oldest and the newest CI
ran them; setup.cfg declares exactly these ranges (tests/test_compat.py checks both)."""


def installed_version(distribution: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# -- torch ---------------------------------------------------------------------------------------------------------

# The foreach kernels torch's own optimizers use (one launch per list, not per tensor); no public alias exists.
foreach_copy_ = torch._foreach_copy_
foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_
foreach_zero_ = torch._foreach_zero_
foreach_clamp_min_ = torch._foreach_clamp_min_
foreach_clamp_max_ = torch._foreach_clamp_max_
non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
"""``(grads, found_inf, inv_scale)``: multiplies by ``inv_scale`` and sets ``found_inf`` to 1 on any inf/nan,
with no host sync (what ``torch.amp.GradScaler`` runs)."""


def accumulate_gradients(
    roots: Sequence[Tensor | GradientEdge], grads: Sequence[Tensor], inputs: Sequence[Tensor], *, retain_graph: bool
) -> None:
    """``torch.autograd.backward(roots, grads, inputs=inputs, retain_graph=retain_graph)`` without its Python checks
    of each gradient against its root's shape and dtype (``_make_grads``; ~50 us a call on a 2-vCPU machine, where
    a split backward makes one call per layer and microbatch): for gradients of the right shape, as autograd itself
    produced them. The engine call below is what ``backward`` ends with."""
    _engine_run_backward(
        tuple(roots), tuple(grads), retain_graph, False, tuple(inputs), allow_unreachable=True, accumulate_grad=True
    )


# Flat buffers of many tensors (what DDP's bucketing and torch's coalesced collectives use).
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors

sync_module_states = _sync_module_states
"""Broadcast a module's parameters and buffers from ``src`` over a group, in buckets (what DDP runs at wrap)."""

# HSDPMeshInfo, ShardPlacementResult (imported above): what ``fully_shard(shard_placement_fn=...)`` returns to put a
# parameter on a mesh of its own (sharded data parallelism keeps a small parameter whole inside its unit, as smp's
# ``sdp_param_persistence_threshold`` did); documented with ``shard_placement_fn``, not exported.

set_process_group_timeout = _set_pg_timeout
"""``(timeout, group)``: the timeout of an existing group (DeviceMesh creates its groups with the default one)."""

BatchNormBase = _BatchNorm
"""The base of ``BatchNorm1d/2d/3d``, their lazy variants and ``SyncBatchNorm``."""

canonical_mask = F._canonical_mask
none_or_dtype = F._none_or_dtype
"""How ``nn.MultiheadAttention.forward`` normalises its masks (our tensor-parallel copy of it must agree)."""

# TorchDispatchMode (imported above) is documented, but importable only from a private module.
device_constructors = _device_constructors
"""The factory functions ``torch.device(...)`` as a context manager redirects (``torch.empty``, ``torch.randn``...)."""

ATEN_TO_COPY = torch.ops.aten._to_copy.default
"""The op behind ``Tensor.to`` with a copy (an aten op whose name starts with an underscore)."""

INITS_THAT_SKIP_META = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")
"""The ``torch.nn.init`` functions that return at once for meta tensors (they need values: rejection sampling, QR);
``trunc_normal_`` reaches its private helper, looked up in ``torch.nn.init`` at each call."""

flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""``(query, key, value, dropout_p, is_causal, *, attn_mask, scale)`` → ``(output, logsumexp)``: the fused attention
kernel ``F.scaled_dot_product_attention`` picks, whose meta version shows what it keeps for backward (the memory
planner counts it instead of the math fallback torch takes on the meta device)."""

flash_attention_for_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
"""``(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)`` → ``(grad_query,
grad_key, grad_value)``: the CPU flash kernel's backward, which takes the output and logsumexp of the whole row (a
ring of blocks passes the merged ones, so each block's gradients are its share of the whole attention's)."""

flash_attention_cuda = torch.ops.aten._scaled_dot_product_flash_attention
"""``(query, key, value, dropout_p, is_causal, return_debug_mask, *, scale)`` → ``(output, logsumexp, cum_seq_q,
cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)``: the CUDA flash kernel (torch 2.13)."""

flash_attention_cuda_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
"""``(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
philox_seed, philox_offset, *, scale)`` → ``(grad_query, grad_key, grad_value)``: its backward (torch 2.13)."""


@contextmanager
def replaced_scaled_dot_product_attention(replacement: Callable[..., Tensor]) -> Generator[None, None, None]:
    """``torch.nn.functional.scaled_dot_product_attention`` is ``replacement`` inside the block. It is a public
    function, but replacing it is reaching into torch: ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``),
    transformers' ``sdpa`` attention and models calling ``F.scaled_dot_product_attention`` look it up in
    ``torch.nn.functional`` at each call, so the replacement reaches all of them. torch 2.13's own
    ``context_parallel`` does the same (its ``_DispatchMode.MONKEY_PATCH``, the default); a ``TorchFunctionMode`` does
    not see the call inside ``F.multi_head_attention_forward``, which runs with the modes popped."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = replacement
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


MODULE_TABLES = ("_parameters", "_buffers", "_modules")
"""An ``nn.Module``'s three tables, as they appear in ``vars(module)``."""

REBUILD_TENSOR = torch._utils._rebuild_tensor_v3
"""``(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype)`` → a tensor viewing ``storage``:
what a ``torch.save`` file names to rebuild a tensor of any dtype from an untyped storage, and one of the functions
``torch.load(weights_only=True)`` allows (torch keeps loading files that name it). `checkpoint.torch_file` writes a
``torch.save`` file one tensor at a time with it and `zip_file_writer`: torch offers no public way to write its
archive a record at a time (``torch.save`` holds every storage until it writes them)."""


def zip_file_writer(stream: IO[bytes]) -> Any:
    """torch's own writer of the ``torch.save`` zip archive (records aligned for ``mmap=True`` loads, CRC-32s,
    zip64, the version records), writing to ``stream``: ``write_record(name, data, size)`` with ``data`` a
    storage or bytes, then ``write_end_of_file()``."""
    save = serialization_config.save
    return torch._C.PyTorchFileWriter(stream, save.compute_crc32, save.storage_alignment)


# tree_flatten, tree_unflatten, tree_map, tree_leaves (imported above): torch's pytree utilities over nested tuples,
# lists, dicts and namedtuples, public in all but their module's name.


def parameter_table(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The live table of ``module``'s own parameters, for code that replaces entries without ``__setattr__``'s
    checks (a meta parameter by its materialised value, a whole one by its shard, keeping every other name)."""
    return module._parameters


def buffer_table(module: nn.Module) -> dict[str, Tensor | None]:
    """The live table of ``module``'s own buffers (see `parameter_table`)."""
    return module._buffers


def module_table(module: nn.Module) -> dict[str, nn.Module | None]:
    """The live table of ``module``'s children (see `parameter_table`)."""
    return module._modules


def storage_key(storage: torch.UntypedStorage) -> int:
    """An integer that identifies a storage while it lives (its C++ pointer; ``data_ptr`` is 0 on meta)."""
    return storage._cdata


def op_schema(op: Any) -> Any:
    """An aten op's schema (``torch._C.FunctionSchema``: its arguments, alias annotations, mutability)."""
    return op._schema


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A ``DeviceMesh`` of ``mesh``'s dimensions flattened into one named ``name`` (slicing a flattened dimension
    from the root mesh is deprecated in torch 2.13, so we keep the flattened mesh ourselves)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A ``DeviceMesh`` with dimension ``dim`` split into ``sizes`` named ``names`` (torch has no public way to
    reshape a mesh's dimension into sub-dimensions that keeps its groups)."""
    return mesh._unflatten(dim, sizes, names)


# -- Lightning -----------------------------------------------------------------------------------------------------

sync_ddp_if_available = _sync_ddp_if_available
"""``(tensor, group, reduce_op)``: what ``DDPStrategy.reduce`` runs, over any group."""


BackwardSyncControl = _BackwardSyncControl
"""Fabric's hook behind ``fabric.no_backward_sync(model)``: a strategy sets its own as ``_backward_sync_control``."""


def set_backward_sync_control(strategy: Any, control: Any) -> None:
    """Give a Fabric strategy its ``fabric.no_backward_sync`` behaviour (a `BackwardSyncControl`)."""
    strategy._backward_sync_control = control


def strategy_timeout(strategy: Any) -> Any:
    """The process-group timeout a ``DDPStrategy`` (the Trainer's or Fabric's) was given (no public accessor)."""
    return strategy._timeout


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel`` (``find_unused_parameters``
    and the rest it was given)."""
    return strategy._ddp_kwargs


def forward_redirection(strategy: Any) -> Callable[..., Any]:
    """A strategy's ``_ForwardRedirection``: runs a LightningModule method as the wrapped model's forward, so that
    forward hooks (FSDP2's gathering) run around it."""
    return strategy._forward_redirection


def after_closure(precision: Any, model: pl.LightningModule, optimizer: Any) -> None:
    """What ``Precision`` runs after an optimizer's closure: ``on_before_optimizer_step`` and gradient clipping."""
    precision._after_closure(model, optimizer)


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The whole training state as ``Trainer.save_checkpoint`` would write it (``smp.save_checkpoint`` needs it
    without writing it)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def install_sigterm_hooks(
    trainer: pl.Trainer, *, on_signal: Callable[[int, Any], None], before_step: Callable[[], None]
) -> None:
    """Replace Lightning's SIGTERM handling for ``trainer``: ``on_signal`` instead of the handler that notes the
    signal and broadcasts inside it (``_SignalConnector._sigterm_notifier_fn``, registered after setup) and of the
    SLURM requeue signal's handler, which saves a checkpoint inside the handler and requeues
    (``_SignalConnector._slurm_sigusr_handler_fn``, registered under ``SLURMEnvironment(auto_requeue=True)``), and
    ``before_step`` instead of the blocking per-step broadcast of rank 0's flag
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``)."""
    trainer._signal_connector._sigterm_notifier_fn = on_signal
    trainer._signal_connector._slurm_sigusr_handler_fn = on_signal
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = before_step


def route_last_checkpoint(resolve: Callable[[pl.Trainer], Any]) -> None:
    """Have ``ckpt_path="last"`` name what ``resolve(trainer)`` returns (a path, or None: start fresh), unless it
    returns ``NotImplemented`` (then Lightning's own choice: only ``last*.ckpt`` files of ``ModelCheckpoint``s).
    Lightning resolves the name in ``_CheckpointConnector._parse_ckpt_path`` before any strategy hook runs, so the
    method is wrapped on the class, once; ``resolve`` decides by the trainer's strategy."""
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, "__wrapped_by_lightning_smp__", False):
        return

    def parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        if ckpt_path == "last":
            found = resolve(self.trainer)
            if found is not NotImplemented:
                return found
        return original(self, state_fn, ckpt_path, model_provided, model_connected)

    parse_ckpt_path.__wrapped_by_lightning_smp__ = True  # type: ignore[attr-defined]
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path


def mark_sigterm_received(trainer: pl.Trainer) -> None:
    """Set what ``trainer.received_sigterm`` reads (a read-only property): the loops stop after this batch."""
    trainer._signal_connector.received_sigterm = True


def stop_child_process_observer() -> None:
    """Stop Lightning's thread that SIGKILLs this process when a launched rank fails (``_ChildProcessObserver``,
    named "child-process-observer"), so that this process can report how the ranks ended before exiting."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "child-process-observer":
            thread._run = lambda: True  # type: ignore[attr-defined]


@contextmanager
def replaced_log(module: pl.LightningModule, log: Callable[..., None]) -> Generator[None, None, None]:
    """``module.log`` calls go to ``log`` while the body runs (an instance attribute shadowing the method)."""
    object.__setattr__(module, "log", log)
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


# -- torchmetrics --------------------------------------------------------------------------------------------------


def set_metric_step_value(metric: Metric, value: Any) -> None:
    """The value Lightning logs for ``self.log(name, metric)`` at a step: it reads ``metric._forward_cache`` (what
    the metric's last ``forward`` returned; lightning/pytorch/trainer/connectors/logger_connector/result.py)."""
    metric._forward_cache = value


def set_metric_update_count(metric: Metric, count: int) -> None:
    """``metric.update_count`` (read-only), for a metric whose state was set from another copy's ``metric_state``:
    with 0, ``compute`` warns that it runs before ``update``."""
    metric._update_count = count


# -- torch.optim.lr_scheduler --------------------------------------------------------------------------------------


def replace_scheduler_methods(
    scheduler: Any, *, step: Callable[..., None], state_dict: Callable[[], dict[str, Any]]
) -> tuple[Callable[..., None], Callable[[], dict[str, Any]]]:
    """Replace a scheduler's ``step`` and ``state_dict`` on the instance (Lightning calls ``scheduler.step()``
    itself); returns the originals."""
    originals = scheduler.step, scheduler.state_dict
    scheduler.step, scheduler.state_dict = step, state_dict
    return originals


def scheduler_state_without(state: dict[str, Any], replaced: tuple[str, ...]) -> dict[str, Any]:
    """A torch scheduler's ``state_dict`` (its ``__dict__``) without the instance attributes that replaced its
    methods (`replace_scheduler_methods`): functions, which a checkpoint must not hold."""
    return {key: value for key, value in state.items() if key not in replaced}


# -- transformers --------------------------------------------------------------------------------------------------


@contextmanager
def hf_missing_keys_moved_by(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Generator[bool, None, None]:
    """For the block, transformers' ``PreTrainedModel._move_missing_keys_from_meta_to_device`` (``from_pretrained``
    puts the keys a checkpoint lacks and the non-persistent buffers on the CPU with it, before initialising them)
    replaced by ``wrap(that method)``; yields False, replacing nothing, where transformers has no such method."""
    from transformers import modeling_utils  # the package imports its submodules lazily

    model_class = modeling_utils.PreTrainedModel
    moves = model_class.__dict__.get("_move_missing_keys_from_meta_to_device")
    if moves is None:
        yield False
        return
    model_class._move_missing_keys_from_meta_to_device = wrap(moves)
    try:
        yield True
    finally:
        model_class._move_missing_keys_from_meta_to_device = moves


HF_USE_KERNELS = "use_kernels"
"""``from_pretrained``'s keyword for Hugging Face hub kernels. transformers 5.25 turned them on by default (``None``
means on unless ``USE_HUB_KERNELS`` says no), so a model loaded under delayed initialisation was kernelized while on
the meta device; `delayed_init.huggingface` passes False."""


def hf_attention_implementation(model: nn.Module) -> str | None:
    """The attention implementation a transformers model runs (its config's ``_attn_implementation``: "sdpa",
    "eager", a registered name); transformers 5.25 offers ``set_attn_implementation`` but no public reader."""
    return getattr(model.config, "_attn_implementation", None)
