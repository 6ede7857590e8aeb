"""The smp-compatible facade: ``from lightning_smp import smp`` gives SageMaker code the names it calls.

It owns nothing but the record of the current or last run (`RunRecord`): the running `SMPStrategy` hands one over
in ``setup_environment`` (`start_run`) and ends it in ``teardown`` (`end_run`), which keeps its facts (ranks, sizes,
config) and drops its callables, so no process group, model or optimizer outlives the run here. Ranks, sizes and
``smp.state.cfg`` therefore answer inside a run, after it (from the last run) and before any (as one process), so
a model built with them loads and runs without a Trainer; collectives and checkpoint helpers need a running one.
Rank names follow smp: ``dp`` counts tensor-parallel ranks as data parallel (world / pp), ``rdp`` is the number
of true model replicas (our data-parallel degree), ``mp`` is pp × tp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_smp import activation_checkpointing as _activation_checkpointing
from lightning_smp import checkpoint as _checkpoint
from lightning_smp.config import SMPConfig
from lightning_smp.context_parallel import sequence as cp_sequence
from lightning_smp.delayed_init import deferred_init
from lightning_smp.pipeline import partition as _placement
from lightning_smp.tensor_parallel import creation as _tp_creation
from lightning_smp.tensor_parallel import nn
from lightning_smp.tensor_parallel.creation import set_tensor_parallelism
from lightning_smp.topology import rank_groups

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = [
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "CommGroup",
    "DistributedModel",
    "DistributedOptimizer",
    "RankType",
    "RunRecord",
    "allgather",
    "barrier",
    "broadcast",
    "cp_positions",
    "cp_rank",
    "cp_size",
    "delay_param_initialization",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "end_run",
    "get_dp_process_group",
    "get_mp_process_group",
    "get_pp_process_group",
    "get_rdp_process_group",
    "get_tp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "is_tracing",
    "load",
    "local_rank",
    "local_size",
    "model_creation",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "nn",
    "num_microbatches",
    "partition",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "preview",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "send",
    "set_activation_checkpointing",
    "set_partition",
    "set_tensor_parallelism",
    "size",
    "start_run",
    "state",
    "step",
    "tensor_parallelism",
    "tp_barrier",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
]

# smp's axis names → our topology's (smp's dp includes the tp ranks; its rdp is our dp)
_AXES = {"dp": "dp_tp", "rdp": "dp", "pp": "pp", "tp": "tp", "cp": "cp", "mp": "mp", "world": "world"}
_COUNTED = (*_AXES, "local")  # what a record gives a rank and a size for


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRecord:
    """A run as the smp facade sees it: this rank's place in it, its config, and the few things the facade does
    through it. The strategy builds one with `from_topology` and hands it over with `start_run`; `end_run` keeps
    only the facts (the callables go, and with them every reference to the run's process groups)."""

    config: SMPConfig
    """The run's config, ``smp.state.cfg``."""
    ranks: Mapping[str, int]
    """This rank's index on each smp axis ("world", "local", "dp", "rdp", "pp", "tp", "cp", "mp")."""
    sizes: Mapping[str, int]
    """The number of ranks on each of those axes."""
    group: Callable[[str], dist.ProcessGroup] | None = None
    """The process group of an smp axis holding this rank; None once the run has ended."""
    wrap_optimizer: Callable[..., Optimizer] | None = None
    """The precision plugin's master-weight wrapper (``optimizer, **scaler_settings``); None in fp32."""
    save_checkpoint: Callable[[Path, Any], None] | None = None
    """Writes the run's whole training state and a user's content to a path (every rank its own part)."""
    load_checkpoint: Callable[[Path, bool, bool], Mapping[str, Any] | None] | None = None
    """Loads a path into the running model and optimizers (``path, strict, load_optimizer_states``) and returns
    the checkpoint's content; None while the optimizers do not exist yet."""

    @classmethod
    def from_topology(
        cls,
        topology: Topology,
        *,
        config: SMPConfig,
        local_rank: int,
        local_size: int,
        wrap_optimizer: Callable[..., Optimizer] | None,
        save_checkpoint: Callable[[Path, Any], None],
        load_checkpoint: Callable[[Path, bool, bool], Mapping[str, Any] | None],
    ) -> RunRecord:
        """The record of a running job laid out as ``topology`` (smp's axis names mapped onto ours)."""
        ranks = {axis: topology.rank(ours) for axis, ours in _AXES.items()}
        sizes = {axis: topology.size(ours) for axis, ours in _AXES.items()}
        return cls(
            config=config,
            ranks=MappingProxyType({**ranks, "local": local_rank}),
            sizes=MappingProxyType({**sizes, "local": local_size}),
            group=lambda axis: topology.group(_AXES[axis]),
            wrap_optimizer=wrap_optimizer,
            save_checkpoint=save_checkpoint,
            load_checkpoint=load_checkpoint,
        )

    @property
    def running(self) -> bool:
        return self.group is not None


_ONE_PROCESS = RunRecord(
    config=SMPConfig(),
    ranks=MappingProxyType(dict.fromkeys(_COUNTED, 0)),
    sizes=MappingProxyType(dict.fromkeys(_COUNTED, 1)),
)
_record = _ONE_PROCESS


def start_run(record: RunRecord) -> None:
    """Make ``record`` the run the facade answers for (the strategy calls it in ``setup_environment``)."""
    global _record
    _record = record


def end_run() -> None:
    """The run has ended (the strategy calls it in ``teardown``): keep its ranks, sizes and config, which the
    facade answers from until the next run starts, and drop everything that reaches its groups, model and
    optimizers."""
    global _record
    _record = RunRecord(config=_record.config, ranks=_record.ranks, sizes=_record.sizes)


@contextmanager
def preview(config: SMPConfig | Mapping[str, Any], *, world_size: int) -> Generator[None, None, None]:
    """Answer as rank 0 of a job of ``config`` (an `SMPConfig`, or `SMPStrategy`'s keyword arguments as a dict) over
    ``world_size`` processes (one node) without starting one: every rank and size, and ``smp.state.cfg``;
    collectives and checkpoint helpers raise as outside a run. The memory planner's command (``lightning-smp
    estimate``) builds a LightningModule's ``configure_model`` under it, so that
    ``smp.model_creation(tensor_parallelism=smp.tp_size() > 1)`` builds the model of the planned layout."""
    global _record
    if _record.running:
        raise RuntimeError("smp.preview() inside a running SMPStrategy: the run already answers; remove the preview.")
    config = SMPConfig.of(config)
    dp = config.data_parallel_degree(world_size)
    layout = rank_groups(
        config.placement_order,
        dp=dp,
        pp=config.pipeline_parallel_degree,
        tp=config.tensor_parallel_degree,
        cp=config.context_parallel_degree,
    )
    groups = {axis: next(group for group in layout[ours] if 0 in group) for axis, ours in _AXES.items()}
    previous = _record
    _record = RunRecord(
        config=config,
        ranks=MappingProxyType({**{axis: group.index(0) for axis, group in groups.items()}, "local": 0}),
        sizes=MappingProxyType({**{axis: len(group) for axis, group in groups.items()}, "local": world_size}),
    )
    try:
        yield
    finally:
        _record = previous


def _running(caller: str, instead: str) -> RunRecord:
    """The running run's record; outside a run an error naming ``caller`` and, in ``instead``, what to do."""
    if not _record.running:
        raise RuntimeError(
            f"smp.{caller}() needs a running SMPStrategy: it works on the run's process groups, model or optimizers, "
            "which it reaches only while Trainer.fit/validate/test/predict runs. Call it inside the LightningModule's "
            f"hooks (configure_model, configure_optimizers, training_step, ...); {instead}. Ranks, sizes and "
            "smp.state.cfg answer outside a run too (from the last run, or as one process before any)."
        )
    return _record


_COLLECTIVES_AFTER_A_RUN = (
    "after fit returns, the Trainer's strategy still reaches the ranks (trainer.strategy.barrier(), "
    "trainer.strategy.broadcast(obj))"
)


def __getattr__(name: str) -> Any:
    # smp's names lightning_smp does not provide, with what replaces each (PEP 562)
    if name == "amp":
        raise AttributeError(
            "smp.amp is not provided by lightning_smp: fp16 with fp32 master weights and smp's loss scaling is "
            "SMPStrategy(fp16=True) (or strategy='smp_fp16'); remove the smp.amp calls."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- configuration -------------------------------------------------------------------------------------------


class _State:
    """smp's ``smp.state``: ``smp.state.cfg`` is the run's config (``.fp16``, ``.microbatches``, ...): the running
    one's, else the last one's, else the default `SMPConfig`."""

    @property
    def cfg(self) -> SMPConfig:
        return _record.config

    @property
    def initialized(self) -> bool:
        """Whether a run is under way (the collectives and checkpoint helpers work)."""
        return _record.running


state = _State()


def init(config: Mapping[str, Any] | None = None) -> None:
    """smp.init has no job under Lightning: the strategy initialises everything from its own config."""
    raise RuntimeError(
        "smp.init() is not needed with lightning_smp: pass the same parameters to the strategy instead, e.g. "
        "Trainer(strategy=lightning_smp.SMPStrategy.from_smp_options(smp_options)) or "
        "SMPStrategy(pipeline_parallel_degree=..., microbatches=...), and remove the smp.init() call."
    )


def is_initialized() -> bool:
    """smp's ``smp.is_initialized()``: whether a run is under way (``smp.state.initialized``)."""
    return _record.running


def is_tracing() -> bool:
    """smp's ``smp.is_tracing()``: always False, as lightning_smp never traces the model."""
    return False


def num_microbatches() -> int:
    """smp's ``smp.num_microbatches()``: the run's ``microbatches`` (the last run's, or 1 before any)."""
    return _record.config.microbatches


def DistributedModel(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """smp wrapped the model itself; under Lightning the strategy wraps the LightningModule."""
    raise RuntimeError(
        "smp.DistributedModel(...) is not needed with lightning_smp: SMPStrategy splits and wraps the "
        "LightningModule's layers when training starts. Build the model in the LightningModule (in `configure_model`, "
        "under smp.model_creation(...) if you used it) and remove the smp.DistributedModel call."
    )


def step(function: Any = None, **kwargs: Any) -> Any:
    """smp's ``@smp.step`` ran its body per microbatch; ``training_step`` does that under lightning_smp."""
    raise RuntimeError(
        "@smp.step is not needed with lightning_smp: put the step's body in the LightningModule's training_step "
        "(and validation_step / test_step), which runs once per microbatch on every rank as @smp.step did, and "
        "return the loss instead of calling model.backward(loss)."
    )


# -- ranks and groups ----------------------------------------------------------------------------------------


# Ranks and sizes answer from the run's record, running or last (one process before any run).


def rank() -> int:
    return _record.ranks["world"]


def size() -> int:
    return _record.sizes["world"]


def local_rank() -> int:
    return _record.ranks["local"]


def local_size() -> int:
    return _record.sizes["local"]


def _axis_rank(smp_axis: str) -> int:
    return _record.ranks[smp_axis]


def _axis_size(smp_axis: str) -> int:
    return _record.sizes[smp_axis]


def _axis_group(smp_axis: str, caller: str | None = None) -> dist.ProcessGroup:
    """The process group of ``smp_axis`` holding this rank; ``caller`` names the facade call in the error raised
    outside a run (default: the group getter)."""
    group = _running(caller or f"get_{smp_axis}_process_group", _COLLECTIVES_AFTER_A_RUN).group
    assert group is not None  # a running record has its callables
    return group(smp_axis)


def _axis_barrier(smp_axis: str) -> None:
    dist.barrier(group=_axis_group(smp_axis, f"{smp_axis}_barrier" if smp_axis != "world" else "barrier"))


def dp_rank() -> int:
    return _axis_rank("dp")


def dp_size() -> int:
    return _axis_size("dp")


def rdp_rank() -> int:
    return _axis_rank("rdp")


def rdp_size() -> int:
    return _axis_size("rdp")


def pp_rank() -> int:
    return _axis_rank("pp")


def pp_size() -> int:
    return _axis_size("pp")


def tp_rank() -> int:
    return _axis_rank("tp")


def tp_size() -> int:
    return _axis_size("tp")


def cp_rank() -> int:
    """This rank's index in its context-parallel group (smp v2's ``cp_rank``)."""
    return _axis_rank("cp")


def cp_size() -> int:
    """The context-parallel degree: ranks each sequence is split over (smp v2's ``cp_size``)."""
    return _axis_size("cp")


def cp_positions(local_length: int, device: torch.device | None = None) -> Tensor:
    """The global positions of this rank's ``local_length`` tokens, (local_length,): what a model that computes
    its own positions (a position embedding, rotary angles) uses in place of ``torch.arange(local_length)``. Under
    context parallelism each rank holds two chunks of every sequence (its head chunk r and tail chunk 2·cp−1−r);
    without it, ``arange(local_length)``. Hugging Face models need nothing: the strategy gives them position ids."""
    return cp_sequence.positions(local_length, cp=cp_size(), rank=cp_rank(), device=device)


def mp_rank() -> int:
    return _axis_rank("mp")


def mp_size() -> int:
    return _axis_size("mp")


def get_dp_process_group() -> dist.ProcessGroup:
    return _axis_group("dp")


def get_rdp_process_group() -> dist.ProcessGroup:
    return _axis_group("rdp")


def get_pp_process_group() -> dist.ProcessGroup:
    return _axis_group("pp")


def get_tp_process_group() -> dist.ProcessGroup:
    return _axis_group("tp")


def get_mp_process_group() -> dist.ProcessGroup:
    return _axis_group("mp")


def get_world_process_group() -> dist.ProcessGroup:
    return _axis_group("world")


def barrier(group: CommGroup | None = None) -> None:
    """smp's ``smp.barrier(group=smp.WORLD)``: wait for every rank of ``group``."""
    _axis_barrier("world" if group is None else _axis_of(group, CommGroup, "barrier"))


def dp_barrier() -> None:
    _axis_barrier("dp")


def rdp_barrier() -> None:
    _axis_barrier("rdp")


def pp_barrier() -> None:
    _axis_barrier("pp")


def tp_barrier() -> None:
    _axis_barrier("tp")


def mp_barrier() -> None:
    _axis_barrier("mp")


# -- python objects between ranks --------------------------------------------------------------------------------


class CommGroup(Enum):
    """smp's communication groups, also named ``smp.WORLD``, ``smp.MP_GROUP``, ``smp.DP_GROUP``, ..."""

    WORLD = "world"
    MP_GROUP = "mp"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    DP_GROUP = "dp"
    RDP_GROUP = "rdp"


class RankType(Enum):
    """How smp's ``send`` and ``recv_from`` read a rank: within which group of the calling rank."""

    WORLD_RANK = "world"
    MP_RANK = "mp"
    PP_RANK = "pp"
    TP_RANK = "tp"
    DP_RANK = "dp"
    RDP_RANK = "rdp"


WORLD, MP_GROUP, PP_GROUP, TP_GROUP, DP_GROUP, RDP_GROUP = CommGroup


def broadcast(obj: Any, group: CommGroup) -> None:
    """smp's ``smp.broadcast``: send the picklable ``obj`` to every other rank of ``group``, each of which takes it
    with ``smp.recv_from(<this rank in the group>, <the group's RankType>)`` (point to point, not a collective)."""
    process_group = _axis_group(_axis_of(group, CommGroup, "broadcast"), "broadcast")
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(process_group):
        if peer != me:
            dist.send_object_list([obj], dst=peer, group=process_group)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """smp's ``smp.send``: send the picklable ``obj`` to the rank ``dest_rank`` of ``rank_type``'s group; it
    takes it with ``smp.recv_from``."""
    process_group, peer = _peer(dest_rank, rank_type, "send")
    dist.send_object_list([obj], dst=peer, group=process_group)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """smp's ``smp.recv_from``: the object rank ``src_rank`` of ``rank_type``'s group sent with ``smp.send`` or
    ``smp.broadcast``."""
    process_group, peer = _peer(src_rank, rank_type, "recv_from")
    received: list[Any] = [None]
    dist.recv_object_list(received, src=peer, group=process_group)
    return received[0]


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """smp's ``smp.allgather``: every rank of ``group`` passes an object; each gets the list of them, in the
    group's rank order (a collective: every rank of the group calls it)."""
    process_group = _axis_group(_axis_of(group, CommGroup, "allgather"), "allgather")
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, obj, group=process_group)
    return gathered


def _axis_of(value: Any, kind: type[Enum], caller: str) -> str:
    if not isinstance(value, kind):
        example = "smp.CommGroup.PP_GROUP (or smp.PP_GROUP)" if kind is CommGroup else "smp.RankType.PP_RANK"
        raise ValueError(
            f"smp.{caller} takes an smp.{kind.__name__}, e.g. {example}; got {value!r}. Pass one of its members: "
            f"{', '.join(member.name for member in kind)}."
        )
    return value.value


def _peer(rank_in_group: int, rank_type: RankType, caller: str) -> tuple[dist.ProcessGroup, int]:
    """The process group of ``rank_type`` holding this rank, and the global rank of its member ``rank_in_group``."""
    process_group = _axis_group(_axis_of(rank_type, RankType, caller), caller)
    size = dist.get_world_size(process_group)
    if not isinstance(rank_in_group, int) or not 0 <= rank_in_group < size:
        raise ValueError(
            f"smp.{caller}: rank {rank_in_group!r} is not in this rank's {rank_type.name} group, which has ranks "
            f"0..{size - 1}; pass a rank within it (smp.{rank_type.value}_rank() numbers them)."
        )
    peer = dist.get_global_rank(process_group, rank_in_group)
    if peer == dist.get_rank():
        raise ValueError(
            f"smp.{caller}: rank {rank_in_group} of the {rank_type.name} group is this rank itself; pass another "
            "rank of the group."
        )
    return process_group, peer


# -- model creation ------------------------------------------------------------------------------------------


@contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Generator[None, None, None]:
    """Modules created inside are distributed over the tensor-parallel ranks (the innermost context wins)."""
    with _tp_creation.scope(enabled, tp_config):
        yield


@contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tp_config: Any
) -> Generator[None, None, None]:
    """smp's ``model_creation``: create parameters in ``dtype`` and, optionally, tensor-parallel."""
    previous_dtype = torch.get_default_dtype()
    with _tp_creation.scope(tensor_parallelism, tp_config):
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


@contextmanager
def delay_param_initialization(enabled: bool = True) -> Generator[None, None, None]:
    """smp's ``smp.delay_param_initialization``: modules created inside get no memory (meta tensors whose
    initialisation is recorded) until the strategy sets the model up and materialises, per rank, only what the rank
    keeps, with the values an eager build with the same seed gives (`delayed_init`). Works in ``configure_model``
    and in ``__init__``; ``enabled=False`` builds as usual."""
    if not enabled:
        yield
        return
    with deferred_init():
        yield


# -- pipeline placement ----------------------------------------------------------------------------------------


def partition(index: int) -> contextlib.AbstractContextManager[None]:
    """smp's ``with smp.partition(i):``: modules created inside run on pipeline stage ``i`` (read when
    ``auto_partition=False``). Works before the run starts, e.g. in ``__init__``."""
    return _placement.partition(index)


def set_partition(module: torch.nn.Module, index: int) -> None:
    """smp's ``smp.set_partition(module, i)``: run ``module`` (a child of the pipelined trunk) on stage ``i``."""
    _placement.set_partition(module, index)


# -- memory --------------------------------------------------------------------------------------------------------


def set_activation_checkpointing(
    module: torch.nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False, strategy: str = "each"
) -> None:
    """smp's ``smp.set_activation_checkpointing``: ``module`` recomputes its forward in backward instead of keeping
    its activations; for an ``nn.Sequential``, ``strategy`` ("each", "group_N", "contiguous") groups its children.
    Works before the run starts, e.g. in ``__init__``; applied when the strategy sets the model up."""
    _activation_checkpointing.set_activation_checkpointing(module, preserve_rng_state, pack_args_as_tuple, strategy)


def tp_register(dist_module: Any, init_hook: Any = None, forward_hook: Any = None, return_hook: Any = None) -> Any:
    """smp's ``@smp.tp_register(smp.nn.DistributedX)`` paired a custom module with one of smp's distributed modules;
    lightning_smp splits modules by plan instead."""
    raise RuntimeError(_TP_REGISTER_INSTEAD.format(call="smp.tp_register"))


def tp_register_with_module(module_cls: Any, dist_module: Any, *args: Any, **kwargs: Any) -> None:
    """smp's ``smp.tp_register_with_module``: see `tp_register`."""
    raise RuntimeError(_TP_REGISTER_INSTEAD.format(call="smp.tp_register_with_module"))


_TP_REGISTER_INSTEAD = (
    "{call}() is not needed with lightning_smp: modules are split by plan, not by registered smp.nn modules. Name "
    "the custom module's layers in SMPStrategy(tensor_parallel_plan={{'blocks.*.fc': 'colwise', 'blocks.*.proj': "
    "'rowwise'}}) (docs/tensor-parallelism.md, Plan styles), or build it from torch layers lightning_smp splits by "
    "itself (nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.Embedding) under "
    "smp.model_creation(tensor_parallelism=True); then remove the {call} call."
)


# -- optimizer -----------------------------------------------------------------------------------------------


_SMP_SCALING = MappingProxyType({"static_loss_scale": 1.0, "dynamic_loss_scale": False, "dynamic_loss_args": None})
"""smp.DistributedOptimizer's loss-scale defaults."""
_NOT_GIVEN: Any = object()


def DistributedOptimizer(
    optimizer: Optimizer,
    static_loss_scale: float | None = _NOT_GIVEN,
    dynamic_loss_scale: bool = _NOT_GIVEN,
    dynamic_loss_args: Mapping[str, Any] | None = _NOT_GIVEN,
) -> Optimizer:
    """smp's optimizer wrapper, with smp's defaults (``static_loss_scale=1.0``, ``dynamic_loss_scale=False``).

    With ``fp16`` or ``bf16`` set on the strategy it returns the `MasterWeightOptimizer` that the strategy would
    otherwise build (``optimizer.optimizer`` is the inner one; Lightning does not wrap it again); in fp32 it
    returns ``optimizer`` unchanged. In fp16, when smp's defaults for the settings not given replace loss scaling
    configured otherwise on the strategy (its default is dynamic), it warns: pass them here, or return the plain
    optimizer from ``configure_optimizers`` and let the strategy wrap it with its own.
    """
    run = _running("DistributedOptimizer", "build optimizers in configure_optimizers")
    if run.wrap_optimizer is None:  # fp32
        return optimizer
    given = {"static_loss_scale": static_loss_scale, "dynamic_loss_scale": dynamic_loss_scale}
    given = {**given, "dynamic_loss_args": dynamic_loss_args}
    given = {name: value for name, value in given.items() if value is not _NOT_GIVEN}
    settings = {**_SMP_SCALING, **given}
    if run.config.fp16:
        _warn_if_defaults_override(run.config, settings, given)
    return run.wrap_optimizer(
        optimizer,
        dynamic_loss_scale=settings["dynamic_loss_scale"],
        static_loss_scale=1.0 if settings["static_loss_scale"] is None else settings["static_loss_scale"],
        dynamic_loss_args=dict(settings["dynamic_loss_args"] or {}),
    )


def _warn_if_defaults_override(config: SMPConfig, settings: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Warn when smp.DistributedOptimizer's defaults (for the settings not ``given``) make another loss scaler than
    the strategy's ``config`` would with the same ``given`` settings."""
    configured = {name: getattr(config, name) for name in _SMP_SCALING}
    if _scaler(settings) == _scaler({**configured, **given}):
        return
    taken = ", ".join(f"{name}={settings[name]!r}" for name in _SMP_SCALING if name not in given)
    kind, value = _scaler(configured)
    strategy = f"dynamic, {value or 'smp defaults'}" if kind == "dynamic" else f"static, scale {value}"
    rank_zero_warn(
        f"smp.DistributedOptimizer(optimizer) takes smp's defaults for what it was not given ({taken}), which replace "
        f"the strategy's loss scaling ({strategy}); with a static scale of 1 small fp16 gradients underflow to zero. "
        "Pass the loss-scale arguments to smp.DistributedOptimizer (e.g. dynamic_loss_scale=True), or return the "
        "plain optimizer from configure_optimizers and let the strategy wrap it with its own settings."
    )


def _scaler(settings: Mapping[str, Any]) -> tuple[str, Any]:
    """The loss scaler ``settings`` make: ("dynamic", its args) or ("static", its scale)."""
    if settings["dynamic_loss_scale"]:
        return "dynamic", dict(settings["dynamic_loss_args"] or {})
    return "static", 1.0 if settings["static_loss_scale"] is None else float(settings["static_loss_scale"])


# -- checkpoints -----------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str,
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """smp's ``save_checkpoint``: the run's full training state to ``<path>/<tag>_partial``, named in
    ``<path>/newest``; call it on every rank. ``user_content`` comes back from `resume_from_checkpoint`.

    It is the strategy's sharded checkpoint (model, fp32 masters, optimizer, loss scaler, loops), so it loads
    under any layout, which smp's partial checkpoints could not; ``partial=False`` writes the same (use
    ``lightning_smp.consolidate_checkpoint`` for one file). ``model`` and ``optimizer`` are the strategy's.
    """
    run = _running("save_checkpoint", "after fit returns, `trainer.save_checkpoint(path)` writes the same checkpoint")
    assert run.save_checkpoint is not None and run.group is not None  # a running record has its callables
    run.save_checkpoint(_checkpoint.tagged_path(path, tag), user_content)
    if run.ranks["world"] == 0:
        _checkpoint.record_newest(path, tag, keep=num_kept_partial_checkpoints)
    dist.barrier(group=run.group("world"))


def save(obj: Any, f: Any, partial: bool = True, **kwargs: Any) -> None:
    """smp's ``smp.save`` wrote ``obj`` per rank (``partial``) or once; lightning_smp saves the run's state itself."""
    raise RuntimeError(_SAVE_INSTEAD.format(call="smp.save"))


def load(f: Any, partial: bool = True, **kwargs: Any) -> Any:
    """smp's ``smp.load``: see `save`."""
    raise RuntimeError(_SAVE_INSTEAD.format(call="smp.load"))


_SAVE_INSTEAD = (
    "{call}() is not provided by lightning_smp: save the training state with trainer.save_checkpoint(path) or "
    "smp.save_checkpoint(path, tag) (sharded, loadable under any layout), make one file of it with "
    "lightning_smp.consolidate_checkpoint(path), and save other objects with torch.save / torch.load on the ranks "
    "you choose (e.g. `if smp.rank() == 0:`)."
)


def resume_from_checkpoint(
    path: str,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    **_: Any,
) -> Any:
    """smp's ``resume_from_checkpoint``: load checkpoint ``tag`` (default: the newest) of ``path`` into the running
    model and optimizers, whatever layout saved it; returns its ``user_content``. Call it on every rank once the
    model and optimizers exist (``on_fit_start`` or later). Loops and LR schedulers resume with Lightning's
    ``trainer.fit(model, ckpt_path=...)`` on the same directory, which is the way to resume a whole run.
    """
    target = _checkpoint.tagged_path(path, tag)
    load = _record.load_checkpoint
    loaded = load(target, strict, load_optimizer) if load is not None else None
    if loaded is None:
        raise RuntimeError(
            "smp.resume_from_checkpoint() loads into the running model and optimizers: call it inside the "
            "LightningModule's `on_fit_start` (or later), or resume the whole run (loops and schedulers too) with "
            f"`trainer.fit(model, ckpt_path={str(target)!r})`."
        )
    return loaded.get("user_content")
