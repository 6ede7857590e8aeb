"""SMPFabricStrategy: the Lightning Fabric strategy on the same run, build and precision rules as the Trainer's.

It owns a Fabric run's lifecycle: constructor settings become one `SMPConfig`; once the process group exists it
starts the `RunContext` (layout, groups, reduction plan) and hands the `smp` facade its run record; ``fabric.setup``
splits the model (`build.plan_and_apply`: tensor parallelism, activation checkpointing, FSDP2 shards, delayed
initialisation), casts it (`PrecisionRules`), wraps it in DDP only where the `ReductionPlan` says DDP reduces (else
makes the replicas start equal itself), re-points the optimizers built over the unsplit model at the split
model's parameters by name and wraps them in `MasterWeightOptimizer` (fp16/bf16 masters, ZeRO-1 shares);
``fabric.clip_gradients`` clips the masters, ``fabric.save`` / ``fabric.load`` write and read the sharded
checkpoints every door shares (`checkpoint`). It extends Fabric's `DDPStrategy`, whose launching and process-group
setup it keeps. Pipeline parallelism needs a step that owns forward and backward per microbatch, which a Fabric loop
does not have: ``fabric.setup`` refuses it, and the run is attached to the smp script door (`smp.script.attach`) so
that ``smp.DistributedModel``, ``smp.DistributedOptimizer`` and an ``@smp.step`` function run the pipeline in the
same loop, and ``fabric.save`` / ``fabric.load`` take that model. Context parallelism is refused (the Trainer's step
splits the sequences).
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_smp import checkpoint as checkpointing
from lightning_smp import model_setup, tp_batches
from lightning_smp import smp as smp_facade
from lightning_smp._compat import BackwardSyncControl, ddp_kwargs, set_backward_sync_control, strategy_timeout
from lightning_smp.checkpoint.verification import RECORD
from lightning_smp.config import SMPConfig
from lightning_smp.delayed_init import deferred_init
from lightning_smp.engine import RunContext
from lightning_smp.fabric.batches import train_on_group_batches
from lightning_smp.fabric.precision import SMPFabricPrecision
from lightning_smp.grad_vote import clip_grad_norm_counted
from lightning_smp.materialization import has_meta_tensors
from lightning_smp.mixed_precision import PrecisionRules
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.smp import script as smp_script
from lightning_smp.smp.model import DistributedModel
from lightning_smp.tensor_parallel.rng import sync_default_generator
from lightning_smp.topology import Topology

log = logging.getLogger(__name__)

__all__ = ["SMPFabricStrategy", "register_fabric_strategies"]

_SETTINGS = frozenset(SMPConfig.__dataclass_fields__)
_KEYS = "lightning_smp_fabric"  # a Fabric checkpoint's record of which of its keys held the model and optimizers
_RESERVED = frozenset({"state_dict", "optimizer_states", RECORD, _KEYS})  # keys the checkpoint itself uses


class SMPFabricStrategy(DDPStrategy):
    """SageMaker-model-parallel-style training in a Lightning Fabric loop: data and tensor parallelism, sharded
    data parallelism, ZeRO-1, delayed initialisation, fp16/bf16 with fp32 master weights and loss scaling.

    ``settings`` are `SMPConfig`'s (smp v1's parameters, as `SMPStrategy` takes them); ``smp_options`` takes
    SageMaker's dict as pasted; ``SM_HP_MP_PARAMETERS`` overrides both, as in smp.

    Example::

        fabric = L.Fabric(devices=2, strategy="smp_fp16")
        fabric = L.Fabric(devices=4, strategy=SMPFabricStrategy(tensor_parallel_degree=2, fp16=True))
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
    """

    def __init__(
        self,
        *,
        smp_options: dict[str, Any] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=10),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        **settings: Any,
    ) -> None:
        unknown = sorted(set(settings) - _SETTINGS)
        if unknown:
            near = {name: difflib.get_close_matches(name, _SETTINGS, n=1) for name in unknown}
            hints = ", ".join(f"{name!r}" + (f" (did you mean {m[0]!r}?)" if m else "") for name, m in near.items())
            raise ValueError(
                f"SMPFabricStrategy got unknown setting(s) {hints}; pass SMPConfig's names (see "
                "docs/configuration.md), or SageMaker's dict as smp_options=..."
            )
        self._config = SMPConfig.from_sources(settings, smp_options=smp_options)
        for line in [*self._config.deprecated_settings(), *self._config.inactive_settings()]:
            log.warning(line)
        self._own_precision = SMPFabricPrecision(PrecisionRules.of(self._config))
        self._run: RunContext | None = None  # from setup_environment
        self._model: nn.Module | None = None  # the split model, from setup_module
        self._optimizers: list[MasterWeightOptimizer | Optimizer] = []  # set up, in order
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
        )
        set_backward_sync_control(self, _SMPBackwardSyncControl())

    @property
    def config(self) -> SMPConfig:
        return self._config

    @property
    def run(self) -> RunContext:
        """The run's settings, rank layout and gradient-reduction plan."""
        if self._run is None:
            raise RuntimeError(
                "The run (and `strategy.topology`) exists once Fabric has launched: call `fabric.launch()` first."
            )
        return self._run

    @property
    def topology(self) -> Topology:
        return self.run.topology

    @property
    def split_model(self) -> nn.Module | None:
        """This rank's part of the set-up model (inside Fabric's and DDP's wrappers); None before ``fabric.setup``."""
        return self._model

    # -- precision: the strategy owns it ---------------------------------------------------------------------

    @property
    @override
    def precision(self) -> SMPFabricPrecision:
        return self._own_precision

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric hands every strategy its default fp32 `Precision()`; ours is chosen by the strategy's settings.
        if precision is None or type(precision) is Precision:
            return
        if not isinstance(precision, SMPFabricPrecision):
            requested = getattr(precision, "precision", type(precision).__name__)
            raise ValueError(
                f"SMPFabricStrategy chooses the precision itself, but Fabric was also given precision={requested!r}."
                " Remove `precision=` from `L.Fabric(...)` and pick the strategy instead: strategy='smp_fp16' (fp16"
                " parameters, fp32 master weights, loss scaling), 'smp_bf16' or 'smp' (fp32), or"
                " SMPFabricStrategy(fp16=True) / SMPFabricStrategy(bf16=True)."
            )
        self._own_precision = precision

    # -- environment and layout ------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        run = self._run = RunContext.start(
            self._config, world_size=self.world_size, device_type=self.root_device.type, timeout=strategy_timeout(self)
        )
        self.precision.start_run(run)
        smp_script.attach(run, self.precision.rules, self.root_device)  # @smp.step: pipelines in a Fabric loop
        wraps = self.precision.rules.dtype is not None
        smp_facade.start_run(
            smp_facade.RunRecord.from_topology(
                run.topology,
                config=run.config,
                local_rank=self.local_rank,
                local_size=self.num_processes,
                wrap_optimizer=functools.partial(self._wrap, topology=run.topology) if wraps else None,
                save_checkpoint=self._save_for_smp,
                load_checkpoint=self._load_for_smp,
            )
        )

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``; with ``empty_init=True`` or ``delayed_parameter_initialization=True`` the
        modules are created on the meta device and their initialisation recorded (`delayed_init`): setup then
        materialises only what each rank keeps, with the values a single-device build gives."""
        if not (empty_init or self._config.delayed_parameter_initialization):
            return super().module_init_context(empty_init)
        # Every rank records the same initial values, so that each can materialise its part of one model.
        sync_default_generator(dist.group.WORLD, self.root_device)
        stack = ExitStack()
        stack.enter_context(deferred_init())
        return stack

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # smp's data parallelism: with prescaled_batch=False each tensor-parallel rank reads its own shard too (smp's
        # dp = rdp x tp), with True the ranks of a tensor-parallel group read one.
        axis = tp_batches.sampler_axis(self._config.prescaled_batch)
        return {"num_replicas": self.topology.size(axis), "rank": self.topology.rank(axis)}

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Fabric moves the model before `setup_module`; a model on the meta device (delayed initialisation) cannot
        # move, and is materialised on the device by `setup_module`.
        if not has_meta_tensors(module):
            module.to(self.root_device)

    # -- setup ----------------------------------------------------------------------------------------------

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """``fabric.setup(model, optimizer)``: the optimizers were built over the unsplit model; tensor parallelism,
        FSDP2 and materialisation replace parameters, so each optimizer is re-pointed at the split model's
        parameters of the same names before it is wrapped."""
        names = model_setup.parameter_names(module)
        for optimizer in optimizers:
            _refuse_stepped(optimizer)
        wrapped = self.setup_module(module)
        for optimizer in optimizers:
            _repoint(optimizer, names, module)
        return wrapped, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Split ``module`` for this rank, cast it, and wrap it where DDP reduces (`model_setup.set_up_model`)."""
        topology = self.topology
        _refuse_unsupported_layout(topology)
        set_up = model_setup.set_up_model(
            module, run=self.run, rules=self.precision.rules, device=self.root_device, ddp_kwargs=ddp_kwargs(self)
        )
        if topology.tp > 1 and not self._config.prescaled_batch:
            train_on_group_batches(module, topology=topology)
        self._model = module
        return set_up.forward

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``optimizer`` (over the split model's parameters) with fp32 masters where the precision rules want them."""
        if self._model is None:
            raise RuntimeError(
                "Set up the model before its optimizers: `fabric.setup(model, optimizer)`, or "
                "`fabric.setup_module(model)` then `fabric.setup_optimizers(optimizer)`."
            )
        _refuse_foreign_params(optimizer, self._model)
        if self.precision.rules.wraps_optimizers and not isinstance(optimizer, MasterWeightOptimizer):
            optimizer = self._wrap(optimizer, topology=self.topology)
        self._optimizers.append(optimizer)
        return optimizer

    def _wrap(self, optimizer: Optimizer, *, topology: Topology, **scaler_settings: Any) -> MasterWeightOptimizer:
        return self.precision.wrap_optimizer(optimizer, topology=topology, **scaler_settings)

    # -- gradients ------------------------------------------------------------------------------------------

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global norm over every rank, counting replicated values once; an fp16 step that overflowed
        returns -1 and is skipped by ``optimizer.step()`` (as smp's ``clip_master_grads``)."""
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer.clip_master_grads(max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(
                f"fabric.clip_gradients(norm_type={norm_type}) is not supported in fp32 under SMPFabricStrategy; use "
                "norm_type=2 (the global L2 norm over every rank)."
            )
        return clip_grad_norm_counted(list(self.precision.main_params(optimizer)), max_norm, topology=self.topology)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.clip_master_grads_by_value(clip_val)
        else:
            super().clip_gradients_value(module, optimizer, clip_val)

    # -- checkpoints: every rank saves and loads its own part (lightning_smp/checkpoint/) -------------------------

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save(path, state)``: a sharded checkpoint directory (every rank writes its part), which loads
        under any other layout. The set-up model is always saved; ``state``'s optimizers by parameter name, with
        their masters and loss scale; other objects with a ``state_dict`` as that, the rest as it is (the same on
        every rank: rank 0 writes it)."""
        if storage_options is not None or filter:
            raise TypeError(
                "SMPFabricStrategy writes sharded checkpoints itself and takes no `storage_options` or `filter`; "
                "remove them from `fabric.save(...)`."
            )
        model = self._model_()
        content: dict[str, Any] = {}
        keys: dict[str, Any] = {"model": None, "optimizers": []}
        optimizers = []
        for key, value in state.items():
            if key in _RESERVED:
                raise ValueError(f"fabric.save: the key {key!r} is the checkpoint's own; rename it in the state.")
            value = _plain(value)
            if isinstance(value, nn.Module):
                _refuse_other_module(value, model)
                keys["model"] = key
            elif isinstance(value, Optimizer):
                optimizers.append(value)
                keys["optimizers"].append(key)
            else:
                content[key] = value.state_dict() if _stateful(value) else value
        content[_KEYS] = keys
        content["state_dict"] = checkpointing.model_state_dict(model, optimizers)
        content["optimizer_states"] = [checkpointing.optimizer_state_dict(opt, model) for opt in optimizers]
        checkpointing.save(
            content,
            self.broadcast(path),  # every rank writes its part into rank 0's path
            module=model,
            run=self._checkpoint_run(),
            owned=self._owned(),
            asynchronous=self._config.async_checkpoint,
        )

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load(path, state)``: a checkpoint of any layout (`fabric.save`'s, the Trainer's, a consolidated
        file) into the set-up model (always) and ``state``'s optimizers and objects; returns what ``state`` did not
        take."""
        if isinstance(state, nn.Module | Optimizer):
            raise TypeError(
                "fabric.load(path, model_or_optimizer) reads a raw state dict, which SMPFabricStrategy does not "
                "write; pass a dict instead: fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        checkpointing.wait_for_saves()
        state = {} if state is None else state
        optimizers = [value for value in map(_plain, state.values()) if isinstance(value, Optimizer)]
        content = checkpointing.load(
            self.broadcast(path),
            module=self._model_(),
            optimizers=optimizers,
            run=self._checkpoint_run(),
            strict=strict,
            weights_only=weights_only,
            load_optimizer_states=bool(optimizers),
        )
        for key in _RESERVED:
            content.pop(key, None)
        missing = [key for key, value in state.items() if key not in content and not _is_loaded(_plain(value))]
        if strict and missing:
            raise KeyError(
                f"The requested state contains the key {missing[0]!r}, which the checkpoint lacks. Remove it from "
                "the state, or pass `strict=False` to `fabric.load`."
            )
        for key, value in list(state.items()):
            if _is_loaded(_plain(value)) or key not in content:
                continue
            if _stateful(value):
                value.load_state_dict(content.pop(key))
            else:
                state[key] = content.pop(key)
        return content

    def _save_for_smp(self, path: Path, user_content: Any) -> None:
        """``smp.save_checkpoint``: the model, the optimizers set up, and ``user_content``."""
        state = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(self._all_optimizers())}
        self.save_checkpoint(path, {"model": self._model_(), **state, "user_content": user_content})

    def _load_for_smp(self, path: Path, strict: bool, load_optimizer_states: bool) -> Mapping[str, Any] | None:
        """``smp.resume_from_checkpoint``: ``path`` into the model and optimizers; None before they exist."""
        script = smp_script.running_script()
        if self._model is None and (script is None or script.model is None):
            return None
        optimizers = self._all_optimizers() if load_optimizer_states else []
        state = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(optimizers)}
        return self.load_checkpoint(path, {"model": self._model_(), **state}, strict=strict)

    def _checkpoint_run(self) -> dict[str, Any]:
        return checkpointing.describe_run(
            topology=self.topology, config=self._config, precision=str(self.precision.precision)
        )

    def _model_(self) -> nn.Module:
        """The model checkpoints hold: the one ``fabric.setup`` split, or ``smp.DistributedModel``'s."""
        if self._model is not None:
            return self._model
        script = smp_script.running_script()
        if script is not None and script.model is not None:
            return script.model.get_module()
        raise RuntimeError(
            "fabric.save / fabric.load need the model set up first: call `fabric.setup(model, optimizer)` (or "
            "smp.DistributedModel(model)) before."
        )

    def _owned(self) -> set[str] | None:
        """Under a pipeline, the parameters whose copy on this stage is the trained one (a checkpoint takes each
        from its owner); None: every parameter this rank holds."""
        script = smp_script.running_script()
        if self._model is None and script is not None and script.model is not None:
            pipeline = script.model.engine.pipeline
            return pipeline.owned_parameter_names() if pipeline is not None else None
        return None

    def _all_optimizers(self) -> list[Optimizer]:
        """The optimizers ``fabric.setup`` wrapped and ``smp.DistributedOptimizer``'s, in order."""
        script = smp_script.running_script()
        return [*self._optimizers, *(script.optimizers if script is not None else [])]

    @override
    def teardown(self) -> None:
        checkpointing.wait_for_saves()  # an asynchronous save in flight is published before the run ends
        smp_facade.end_run()
        smp_script.detach()
        self._model, self._optimizers = None, []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_fabric_strategies(strategy_registry)


class _SMPBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: DDP's ``no_sync`` where DDP reduces; elsewhere the reduction waits for the
    optimizer step already (ZeRO-1), or there is none (one replica), or FSDP2 reduces every backward."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return nullcontext()


def _refuse_unsupported_layout(topology: Topology) -> None:
    if topology.pp > 1:
        raise ValueError(
            f"pipeline_parallel_degree={topology.pp}: a pipeline needs a step that owns forward and backward of every "
            "microbatch, which `model(x)` then `fabric.backward(loss)` cannot drive. Use smp's API in the Fabric loop "
            "instead of fabric.setup: `model = smp.DistributedModel(model)`, `optimizer = smp.DistributedOptimizer("
            "optimizer)`, and an @smp.step function calling model.backward(loss) (docs/fabric.md)."
        )
    if topology.cp > 1:
        raise ValueError(
            f"context_parallel_degree={topology.cp} is not supported under Fabric (the step splits the sequences); "
            "set context_parallel_degree=1, or train with the Trainer (SMPStrategy)."
        )


def _refuse_stepped(optimizer: Optimizer) -> None:
    if optimizer.state:
        raise ValueError(
            "The optimizer passed to `fabric.setup` has state already (it has stepped); SMPFabricStrategy rebuilds its "
            "parameters over the split model, where that state would not belong. Build the optimizer fresh, or load "
            "its state after setup with `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
        )


def _repoint(optimizer: Optimizer, names: dict[int, list[str]], split: nn.Module) -> None:
    """Point ``optimizer``'s param groups at ``split``'s parameters of the same names as the ones it was built
    over (`model_setup.repoint_optimizer`); every one must be found (Fabric has no pipeline stages to leave out)."""
    elsewhere, foreign = model_setup.repoint_optimizer(optimizer, names, split)
    lost = [*elsewhere, *(f"{shape} not in the model" for shape in foreign)]
    if lost:
        raise ValueError(
            f"{len(lost)} parameter(s) the optimizer was built over have no parameter of the same name in the split "
            f"model ({', '.join(lost[:3])}). Call `model = fabric.setup_module(model)`, then build the optimizer over "
            "`model.parameters()` and call `optimizer = fabric.setup_optimizers(optimizer)`."
        )


def _refuse_foreign_params(optimizer: Optimizer, model: nn.Module) -> None:
    own = {id(param) for param in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for param in group["params"] if id(param) not in own)
    if foreign:
        raise ValueError(
            f"The optimizer updates {foreign} parameter(s) that the set-up model does not hold (it was built over the "
            "model before `fabric.setup_module` split it). Build the optimizer over the set-up model's "
            "`model.parameters()`, then call `fabric.setup_optimizers(optimizer)`; or pass both to `fabric.setup`."
        )


def _refuse_other_module(module: nn.Module, model: nn.Module) -> None:
    if module is not model:
        raise ValueError(
            "fabric.save / fabric.load under SMPFabricStrategy hold one model, the one set up with `fabric.setup`; "
            "remove the other module from the state, or save it with torch.save."
        )


def _plain(value: Any) -> Any:
    """The module inside DDP, or inside ``smp.DistributedModel``; anything else as it is."""
    if isinstance(value, DistributedModel):
        return value.get_module()
    return value.module if isinstance(value, DistributedDataParallel) else value


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _is_loaded(value: Any) -> bool:
    """Whether `checkpoint.load` itself restores ``value`` (the model and the optimizers)."""
    return isinstance(value, nn.Module | Optimizer)


# name, description, init params
_PRESETS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("smp", "smp-style data and tensor parallelism in fp32", {}),
    ("smp_fp16", "smp-style fp16: fp16 params, fp32 master weights, dynamic loss scaling", {"fp16": True}),
    ("smp_bf16", "smp-style bf16: bf16 params, fp32 master weights", {"bf16": True}),
)


def register_fabric_strategies(registry: Any = STRATEGY_REGISTRY) -> None:
    """Register the ``smp*`` strategy names with Lightning Fabric (done on ``import lightning_smp``)."""
    for name, description, init_params in _PRESETS:
        if name not in registry:
            registry.register(name, SMPFabricStrategy, description=description, **init_params)
