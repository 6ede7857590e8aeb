"""SMPStrategy: the Lightning strategy that runs an smp-configured job, and its registered names.

It owns the run's lifecycle and hands each concern to its module: constructor arguments become one `SMPConfig`;
once the process group exists it builds the `Topology`, hands the `smp` facade its run record, has the model
split for this rank (`build`: tensor parallelism, activation checkpointing, the pipeline stage, sharded data
parallelism, materialisation), whose pipeline engine then runs every step and settles the stages at the end of each
loop; it owns the precision plugin (Lightning would otherwise replace
it, see reference/lightning-2.6.md), samples data and feeds each step the batch its tensor-parallel
group trains on as ``prescaled_batch`` says (`tp_batches`), reduces logged values over the replicas,
saves and loads sharded checkpoints (`checkpoint`), saves and exits at the step every rank agreed on after a
scheduler's signal (`preemption`), continues a resumed epoch at its batch (`data_position`), ends every rank on a
failure and frees the process groups at exit after a success (`fault_tolerance`). It extends `DDPStrategy`
because launching, process-group setup and bucketed, backward-overlapped gradient all-reduce are DDP's; with one
replica, under pipeline parallelism (whose engine all-reduces itself) or with sharded optimizer state (whose
optimizer reduce-scatters), it skips the DDP wrapper. Longer than our ~600-line mark because it implements
Lightning's whole strategy surface (environment, precision, setup, steps, checkpoints, errors and teardown, one
section each); each hook hands its work to the module named above, and the step itself is `engine.StepEngine`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from os import PathLike
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_smp import (
    build,
    context_parallel,
    data_position,
    fault_tolerance,
    preemption,
    tp_batches,
)
from lightning_smp import checkpoint as checkpointing
from lightning_smp import smp as smp_facade
from lightning_smp._compat import (
    ddp_kwargs,
    dump_checkpoint,
    forward_redirection,
    route_last_checkpoint,
    strategy_timeout,
    sync_ddp_if_available,
    sync_module_states,
)
from lightning_smp.config import SMPConfig
from lightning_smp.delayed_init import deferred_init
from lightning_smp.engine import RunContext, StepEngine
from lightning_smp.materialization import has_meta_tensors
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.pipeline import PipelineEngine
from lightning_smp.pipeline.lightning_results import LightningResults
from lightning_smp.pipeline.microbatch import split_batch
from lightning_smp.placement import placements_kept
from lightning_smp.precision import SMPPrecision
from lightning_smp.tensor_parallel.rng import sync_default_generator
from lightning_smp.topology import Topology

log = logging.getLogger(__name__)

__all__ = ["SMPStrategy", "register_strategies"]

_SETTINGS = frozenset(field.name for field in dataclasses.fields(SMPConfig))


def _records_given_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """``SMPStrategy.__init__`` learns which settings its caller gave, with their values, not only the values its
    parameters hold: a setting given explicitly wins over ``smp_options``, even when it equals the default
    (`SMPConfig.from_sources`). The keyword parameters stay explicit, so that LightningCLI and IDEs see each one."""

    @functools.wraps(init)
    def init_recording_given(self: SMPStrategy, **kwargs: Any) -> None:
        self._given_settings = {name: value for name, value in kwargs.items() if name in _SETTINGS}
        init(self, **kwargs)

    return init_recording_given


class SMPStrategy(DDPStrategy):
    """SageMaker-model-parallel-style training in Lightning: data parallelism with fp16/bf16 master weights.

    Every smp v1 parameter is a keyword argument (see `SMPConfig` for each one's meaning); ``smp_options`` takes
    SageMaker's ``smp_options`` dict as pasted. The ``SM_HP_MP_PARAMETERS`` environment variable, set by a
    SageMaker job, overrides both, as in smp.

    Example::

        Trainer(devices=2, strategy="smp_fp16")
        Trainer(strategy=SMPStrategy(fp16=True, dynamic_loss_args={"scale_window": 1000, "delayed_shift": 2}))
        Trainer(strategy=SMPStrategy.from_smp_options({"enabled": True, "parameters": {"fp16": True}}))
    """

    strategy_name = "smp"

    @_records_given_keywords
    def __init__(
        self,
        *,
        pipeline_parallel_degree: int = 1,
        tensor_parallel_degree: int = 1,
        context_parallel_degree: int = 1,
        microbatches: int = 1,
        pipeline: str = "interleaved",
        optimize: str = "speed",
        placement_strategy: str = "cluster",
        auto_partition: bool = True,
        default_partition: int | None = None,
        memory_weight: float = 0.8,
        active_microbatches: int | None = None,
        ddp: bool = False,
        ddp_port: int | None = None,
        ddp_dist_backend: str = "auto",
        horovod: bool = False,
        contiguous: bool = True,
        deterministic_server: bool = False,
        offload_activations: bool = False,
        activation_loading_horizon: int = 4,
        fp16: bool = False,
        bf16: bool = False,
        fp16_params: bool = False,
        shard_optimizer_state: bool = False,
        sharded_data_parallel_degree: int = 1,
        sdp_reduce_bucket_size: int = 500_000_000,
        sdp_param_persistence_threshold: int = 1_000_000,
        sdp_max_live_parameters: int = 1_000_000_000,
        sdp_hierarchical_allgather: bool = True,
        sdp_gradient_clipping: float = 1.0,
        prescaled_batch: bool = False,
        delayed_parameter_initialization: bool = False,
        skip_tracing: bool = False,
        tensor_parallel_seed: int = 0,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = True,
        dynamic_loss_args: dict[str, Any] | None = None,
        pipeline_module: str | None = None,
        partition: list[int] | None = None,
        virtual_stages: int = 1,
        tensor_parallel_plan: dict[str, str] | None = None,
        cp_comm_type: str = "p2p",
        sequence_parallel: bool = False,
        async_checkpoint: bool = False,
        smp_options: dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=10),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
    ) -> None:
        self._config = SMPConfig.from_sources(self._given_settings, smp_options=smp_options)
        for line in [*self._config.deprecated_settings(), *self._config.inactive_settings()]:
            rank_zero_warn(line)
        self._run: RunContext | None = None  # the settings, layout and reduction plan, from setup_environment
        self._engine: StepEngine | None = None  # runs every step of the model, from setup
        self._results: LightningResults | None = None  # a pipelined step's outputs, logs and metrics on every stage
        self._sigterm = fault_tolerance.SchedulerSignal()
        self._grad_sync_blocked = False
        self._data_positioned = False  # whether this fit's training loader was set at the resumed batch
        route_last_checkpoint(_newest_checkpoint_for_smp)  # `ckpt_path="last"`: the newest complete checkpoint
        self.failed = False
        """Whether the last fit/validate/test ended in an exception (then the process groups stay at exit)."""
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
        )

    @classmethod
    def from_smp_options(cls, smp_options: dict[str, Any], **kwargs: Any) -> SMPStrategy:
        """Build from SageMaker's ``smp_options`` (``{"enabled": True, "parameters": {...}}``) as pasted."""
        return cls(smp_options=smp_options, **kwargs)

    @property
    def config(self) -> SMPConfig:
        return self._config

    @property
    def run(self) -> RunContext:
        """The run's settings, rank layout and gradient-reduction plan."""
        if self._run is None:
            raise RuntimeError(
                "The run (and `strategy.topology`) exists once the strategy's `setup_environment` has run: use it "
                "inside the run (in a LightningModule hook), not before `trainer.fit` starts."
            )
        return self._run

    @property
    def topology(self) -> Topology:
        return self.run.topology

    @property
    def pipeline(self) -> PipelineEngine | None:
        """This rank's pipeline engine (its partition ``plan``, ``owned_parameter_names()``); None without
        pipeline parallelism or before ``setup``."""
        return self._engine.pipeline if self._engine is not None else None

    # -- precision: the strategy owns it ---------------------------------------------------------------------

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = SMPPrecision(
                self._config.half_dtype,
                dynamic_loss_scale=self._config.dynamic_loss_scale,
                static_loss_scale=self._config.static_loss_scale,
                dynamic_loss_args=dict(self._config.dynamic_loss_args or {}),
                clip_norm=self._config.sdp_gradient_clipping if self._config.sharded_data_parallel_degree > 1 else None,
            )
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning hands every strategy its default fp32 `Precision()`; ours is chosen by the strategy's config.
        if precision_plugin is None or type(precision_plugin) is Precision:
            return
        if not isinstance(precision_plugin, SMPPrecision):
            requested = getattr(precision_plugin, "precision", type(precision_plugin).__name__)
            raise MisconfigurationException(
                f"SMPStrategy chooses the precision itself, but the Trainer was also given precision={requested!r}"
                f" ({type(precision_plugin).__name__}). Remove `precision=` from the Trainer and pick the strategy"
                " instead: strategy='smp_fp16' (fp16 parameters, fp32 master weights, loss scaling), 'smp_bf16' or"
                " 'smp' (fp32), or SMPStrategy(fp16=True) / SMPStrategy(bf16=True)."
            )
        self._precision_plugin = precision_plugin

    # -- environment and layout ------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        preemption.check_torchelastic_restarts()
        super().setup_environment()
        run = self._run = RunContext.start(
            self._config,
            world_size=self.world_size,
            device_type=self.root_device.type,
            timeout=strategy_timeout(self),
        )
        plugin = self.precision_plugin
        if isinstance(plugin, SMPPrecision):
            plugin.start_run(run)
        smp_facade.start_run(
            smp_facade.RunRecord.from_topology(
                run.topology,
                config=run.config,
                local_rank=self.local_rank,
                local_size=self.num_processes,
                wrap_optimizer=plugin.wrap_optimizer if getattr(plugin, "dtype", None) is not None else None,
                save_checkpoint=self._save_for_smp,
                load_checkpoint=self._load_for_smp,
            )
        )
        self.failed = False
        fault_tolerance.close_process_groups_at_exit(self, run.topology)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``configure_model`` and ``trainer.init_module()`` build here. With ``empty_init=True`` or
        ``delayed_parameter_initialization=True`` the modules are created on the meta device and their
        initialisation is recorded (`delayed_init`); setup materialises only what each rank keeps, with the
        values a single-device build with the same seed gives."""
        if not (empty_init or self._config.delayed_parameter_initialization):
            with super().tensor_init_context(empty_init):
                yield
            return
        if self._run is not None:
            # Every rank records the same initial values, so each can materialise its own part of one model (an
            # eager build is made equal by broadcasts at setup, which a model on the meta device cannot have).
            sync_default_generator(dist.group.WORLD, self.root_device)
        with deferred_init(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # The model is whole here (built in `configure_model`, same init on every rank), or on the meta device
        # (delayed initialisation); parallelise it before Lightning converts its precision, moves it and builds the
        # optimizers over what each rank keeps.
        self.model = self._parallelize(self.model)
        if self.topology.cp > 1:
            context_parallel.prepare_hugging_face(self.model)
        self._data_positioned = False
        _reduce_metrics_over_replicas(self.model, self.topology)
        self._sigterm.install(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
            return
        # DDPStrategy.setup broadcasts rank 0's module over the whole job before evaluating, which would overwrite
        # other pipeline stages' and tensor-parallel shards' weights: only data-parallel replicas share weights.
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        _sync_over_replicas(self.model, self.topology)
        self.setup_precision_plugin()

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Split the model for this rank (`lightning_smp.build`: plan, then apply) and make the engine of its
        steps (a later fit/validate reuses the pipeline engine)."""
        if self.topology.pp > 1 and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "pipeline_parallel_degree > 1 runs forward and backward of every microbatch inside the step, which "
                "needs automatic optimization; remove `self.automatic_optimization = False` (with one optimizer) or "
                "set pipeline_parallel_degree=1."
            )
        run = self.run
        pipeline = build.plan_and_apply(
            model,
            topology=run.topology,
            config=run.config,
            device=self.root_device,
            engine=self.pipeline,
            reduction=run.reduction,
        )
        microbatches = self._config.microbatches if pipeline is not None else 1
        self._engine = StepEngine(self.run, pipeline, functools.partial(_split_batch, microbatches=microbatches))
        self._results = LightningResults(self.lightning_module)
        return model

    @override
    def model_to_device(self) -> None:
        # Under sharding FSDP2 has put the shards and buffers on the device; `Module.to` would swap each DTensor
        # parameter for a new object, dropping its placement (the norm bookkeeping) and FSDP2's reference.
        if not self.run.reduction.sharded_parameters:
            super().model_to_device()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # smp's data parallelism: with prescaled_batch=False each tensor-parallel rank reads its own shard too (smp's
        # dp = rdp x tp), with True the ranks of a tensor-parallel group read one; pipeline stages read the same.
        axis = tp_batches.sampler_axis(self._config.prescaled_batch)
        return {"num_replicas": self.topology.size(axis), "rank": self.topology.rank(axis)}

    @override
    def configure_ddp(self) -> None:
        # The reduction plan says who reduces (`lightning_smp.reduction`): DDP wraps only when it is DDP's job.
        # Where the pipeline engine all-reduces or the optimizer reduce-scatters, DDP's other job, making the
        # replicas start equal, is done here; FSDP2 syncs as it shards, and one replica has nothing to sync.
        if self.run.reduction.wraps_ddp:
            super().configure_ddp()
        elif self.run.reduction.syncs_replicas_at_setup:
            _sync_over_replicas(self.model, self.topology)

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DistributedDataParallel(
                module=model,
                device_ids=device_ids,
                process_group=self.topology.group(self.run.reduction.axis),
                **ddp_kwargs(self),
            )

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """Reduce over the data-parallel replicas by default: tensor and pipeline ranks hold copies of the same
        samples' values, so including them would count each sample several times. Under context parallelism the
        replicas' context-parallel ranks too: each holds its part of the sequences (a loss's mean over them is the
        mean over the whole sequences)."""
        if not isinstance(tensor, Tensor):
            return tensor
        return sync_ddp_if_available(
            tensor, group or self.topology.group(self.topology.replica_axis), reduce_op=reduce_op
        )

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Every rank votes (ModelCheckpoint asks for all=True): `reduce` alone would count data-parallel replicas.
        votes = self.reduce(
            torch.tensor(int(decision), device=self.root_device), group=dist.group.WORLD, reduce_op="sum"
        )
        return bool(votes == self.world_size) if all else bool(votes)

    # -- steps ----------------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._engine_().training_step(
            self._step_function("training_step"),
            args,
            kwargs,
            results=self._results_(),
            scale_loss=self.precision_plugin.loss_scaling(
                self.optimizers[0] if self.optimizers else None,
                accumulation=self.lightning_module.trainer.accumulate_grad_batches,
            ),
            sync=not self._grad_sync_blocked,
        )
        self._log_loss_scale()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", args, kwargs)

    def _evaluation_step(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._engine_().evaluation_step(
            self._step_function(name), args, kwargs, results=self._results_(), name=name
        )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        engine = self._engine_()
        if engine.pipeline is None:
            # Activation checkpointing recomputes attention during backward: it must run over the split sequence too.
            with self._reduce_during_backward(optimizer), engine.attention("backward"):
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule ran every microbatch's backward inside training_step (as DeepSpeed's engine does); the
        # gradients it kept aside join `.grad` here, after Lightning's zero_grad, and are all-reduced.
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        engine.finish_backward(sync=not self._grad_sync_blocked)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _reduce_during_backward(self, optimizer: Any) -> AbstractContextManager[None]:
        """ZeRO-1's reduce-scatter overlapped with the backward before a step: armed where that backward is the last
        before the optimizer takes the grads on every replica alike (automatic optimization, whose loop hands
        ``backward`` the optimizer itself, and not a micro-step Lightning's gradient accumulation blocks). Not under
        pipeline parallelism: the engine holds the grads aside during its schedule; its step reduces them whole."""
        last = not self._grad_sync_blocked and self.lightning_module.automatic_optimization
        if last and isinstance(optimizer, MasterWeightOptimizer):
            return optimizer.reduce_during_backward()
        return nullcontext()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or self._data_positioned:
            return dataloader
        self._data_positioned = True  # once per fit: the first training loader, after the restore
        return data_position.position_resumed(trainer, dataloader)

    @override
    def on_train_end(self) -> None:
        """No stage leaves a loop before every stage has its last step's result (see `PipelineEngine.settle`)."""
        if self._engine is not None:
            self._engine.settle()

    on_validation_end = on_test_end = on_predict_end = on_train_end  # every loop ends the same way

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # accumulating: DDP, the pipeline engine and ZeRO-1 reduce at the last micro-step
        self._grad_sync_blocked = True
        try:
            if self.pipeline is None:
                with super().block_backward_sync():
                    yield
            else:
                yield
        finally:
            self._grad_sync_blocked = False

    def _unpipelined_step(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.run.reduction.sharded_parameters:
            return getattr(super(), name)(*args, **kwargs)
        # FSDP2 gathers the root unit's parameters in the LightningModule's forward hooks: run the step as its
        # forward (Lightning's forward redirection; the model is the LightningModule itself, not a wrapper).
        with self._step_context(name)():
            return forward_redirection(self)(self.model, self.lightning_module, name, *args, **kwargs)

    def _step_function(self, name: str) -> Callable[..., Any]:
        """The LightningModule's ``name`` step for the engine: per microbatch under the precision plugin's context
        with a pipeline; without one, through the DDP or FSDP2 wrapper (`_unpipelined_step`)."""
        if self.pipeline is None:
            return lambda *args, **kwargs: self._unpipelined_step(name, args, kwargs)
        module, context = self.lightning_module, self._step_context(name)

        def step(*args: Any, **kwargs: Any) -> Any:
            with context():
                return getattr(module, name)(*args, **kwargs)

        return step

    def _engine_(self) -> StepEngine:
        if self._engine is None:
            raise RuntimeError(
                "The step engine exists once the strategy's `setup` has run: steps run inside `trainer.fit`, "
                "`validate`, `test` or `predict`; call them there."
            )
        return self._engine

    def _results_(self) -> LightningResults:
        assert self._results is not None  # made with the engine
        return self._results

    def _step_context(self, name: str) -> Any:
        """The precision plugin's context manager for the ``name`` step."""
        plugin = self.precision_plugin
        return {
            "training_step": plugin.train_step_context,
            "validation_step": plugin.val_step_context,
            "test_step": plugin.test_step_context,
            "predict_step": plugin.predict_step_context,
        }[name]

    def _log_loss_scale(self) -> None:
        """Show the loss scale and the skipped-step count (device tensors: Lightning reads them when it logs)."""
        plugin = self.precision_plugin
        module = self.lightning_module
        if not isinstance(plugin, SMPPrecision) or module is None:
            return
        scaled = [opt for opt in plugin.master_weight_optimizers if opt.scale_tensor is not None]
        show_in_bar = module.trainer.progress_bar_callback is not None
        for index, optimizer in enumerate(scaled):
            suffix = "" if len(scaled) == 1 else f"_{index}"
            # Lightning turns progress-bar metrics into numbers after every batch (a host sync), so the scale goes
            # to the bar only when there is a bar to show it.
            module.log(
                f"loss_scale{suffix}", optimizer.scale_tensor, prog_bar=show_in_bar, on_step=True, on_epoch=False
            )
            module.log(f"skipped_steps{suffix}", optimizer.skipped_steps, on_step=True, on_epoch=False)

    # -- checkpoints: every rank saves and loads its own part (lightning_smp/checkpoint/) -------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints load into the fp32 master weights and the optimizers, which exist once `setup` has run.
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return checkpointing.model_state_dict(self.lightning_module, self.optimizers)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return checkpointing.optimizer_state_dict(optimizer, self.lightning_module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "SMPStrategy writes sharded checkpoints itself and takes no `storage_options`; remove them from "
                "`trainer.save_checkpoint(...)`."
            )
        path = self.broadcast(filepath)  # every rank writes its part into rank 0's path
        owned = self.pipeline.owned_parameter_names() if self.pipeline is not None else None
        checkpointing.save(
            checkpoint,
            path,
            module=self.lightning_module,
            run=self._checkpoint_run(),
            owned=owned,
            asynchronous=self._config.async_checkpoint,
        )

    @override
    def load_checkpoint(self, checkpoint_path: str | PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        checkpointing.wait_for_saves()
        module = self.lightning_module
        return checkpointing.load(
            self.broadcast(checkpoint_path),
            module=module,
            optimizers=self.optimizers,
            run=self._checkpoint_run(),
            strict=module.strict_loading,
            weights_only=weights_only,
        )

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # `load_checkpoint` restores the optimizers itself; a consolidated file holds no optimizer state, and the
        # optimizers then start fresh rather than Lightning refusing the file.
        return False

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # `load_checkpoint` has loaded the weights already, into the masters too

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # `load_checkpoint` has loaded the optimizer states already, by parameter name

    @override
    def remove_checkpoint(self, filepath: str | PathLike) -> None:
        if self.is_global_zero:
            checkpointing.remove(filepath)

    def _save_for_smp(self, path: Path, user_content: Any) -> None:
        """``smp.save_checkpoint``: the whole training state, as `Trainer.save_checkpoint` writes it, plus
        ``user_content``."""
        content = dump_checkpoint(self.lightning_module.trainer)
        content["user_content"] = user_content
        self.save_checkpoint(content, path)

    def _load_for_smp(self, path: Path, strict: bool, load_optimizer_states: bool) -> dict[str, Any] | None:
        """``smp.resume_from_checkpoint``: load ``path`` into the model and optimizers; None before they exist."""
        if not self.optimizers:
            return None
        return checkpointing.load(
            path,
            module=self.lightning_module,
            optimizers=self.optimizers,
            run=self._checkpoint_run(),
            strict=strict,
            load_optimizer_states=load_optimizer_states,
        )

    def _checkpoint_run(self) -> dict[str, Any]:
        return checkpointing.describe_run(
            topology=self.topology, config=self._config, precision=str(self.precision_plugin.precision)
        )

    # -- errors and teardown ---------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.failed = True
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if isinstance(exception, SIGTERMException) and self._sigterm.stopped and trainer.state.fn == TrainerFn.FITTING:
            # every rank is here, at the step the ranks agreed on: save, requeue, exit code 75
            preemption.preempted(trainer, exception, requeue=self._sigterm.requeue)
        notes = []
        if "Expected to have finished reduction in the prior iteration" in str(exception):
            notes.append(
                "HINT: some parameters of your LightningModule were not used to produce the loss. If that is "
                "intended, pass `SMPStrategy(find_unused_parameters=True)`."
            )
        notes += fault_tolerance.explain_failure(
            exception,
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=strategy_timeout(self),
            launcher=self.launcher,
        )
        if notes and isinstance(exception, Exception):  # SystemExit (e.g. SIGTERM) keeps its exit code
            message = exception.args[0] if exception.args else str(exception)
            exception.args = ("\n".join([str(message), *notes]), *exception.args[1:])

    @override
    def teardown(self) -> None:
        if not self.failed:
            checkpointing.wait_for_saves()  # an asynchronous save in flight is published before the run ends
        smp_facade.end_run()
        module = self.lightning_module if self.lightning_module is not None else torch.nn.Module()
        with placements_kept(module), _meta_left_in_place(module):
            super().teardown()  # moves the model to the CPU: DTensor parameters lose attributes, meta ones fail

    def forget_process_groups(self) -> None:
        """At interpreter exit (`fault_tolerance.close_process_groups`, before the groups are destroyed): drop what
        this strategy holds that reaches its process groups besides the run's topology (the step engine, the SIGTERM
        vote in flight, the checkpoint writer's group, the metrics' groups). The topology itself then releases the
        groups, for every layer, transport, optimizer and the precision plugin of its run at once."""
        if self.model is not None:
            fault_tolerance.forget_metric_groups(self.model)
        self._sigterm.forget_vote()
        checkpointing.forget_save_group()
        self._engine = self._results = None
        self._run = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_strategies(strategy_registry)


def _split_batch(args: tuple, kwargs: dict, *, microbatches: int) -> list[tuple[tuple, dict]]:
    """A Lightning step's arguments as ``microbatches`` microbatches: its batch (``args[0]``) split, the rest (the
    batch index) handed to each whole."""
    if microbatches == 1:
        return [(args, kwargs)]
    return [((batch, *args[1:]), kwargs) for batch in split_batch(args[0], microbatches)]


def _reduce_metrics_over_replicas(model: torch.nn.Module, topology: Topology) -> None:
    """Make torchmetrics sync over the data-parallel group, as `SMPStrategy.reduce` does: by default a ``Metric``
    syncs over the whole job, where tensor/pipeline ranks would count the same samples again."""
    axis = topology.replica_axis
    if topology.size(axis) == topology.world_size:
        return
    for module in model.modules():
        if isinstance(module, Metric) and module.process_group is None:
            module.process_group = topology.group(axis)


def _sync_over_replicas(model: torch.nn.Module, topology: Topology) -> None:
    """Broadcast the first data-parallel replica's parameters and buffers to the others (what DDP does); under
    context parallelism to the replicas' context-parallel ranks too (they hold the same parameters)."""
    axis = topology.replica_axis
    if topology.size(axis) > 1 and topology.sdp == 1:  # sharded: `sharded_data_parallel.shard` syncs, then shards
        sync_module_states(model, topology.group(axis), 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=set())


# name, description, init params
_PRESETS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("smp", "smp-style data parallelism in fp32", {}),
    ("smp_fp16", "smp-style fp16: fp16 params, fp32 master weights, dynamic loss scaling", {"fp16": True}),
    ("smp_bf16", "smp-style bf16: bf16 params, fp32 master weights", {"bf16": True}),
    ("smp_fork", "`smp` launched by forking (notebooks)", {"start_method": "fork"}),
    ("smp_notebook", "`smp` launched by forking (notebooks)", {"start_method": "fork"}),
    ("smp_fp16_fork", "`smp_fp16` launched by forking (notebooks)", {"fp16": True, "start_method": "fork"}),
    ("smp_bf16_fork", "`smp_bf16` launched by forking (notebooks)", {"bf16": True, "start_method": "fork"}),
)


def _newest_checkpoint_for_smp(trainer: pl.Trainer) -> Any:
    """What ``ckpt_path="last"`` names for a trainer with this strategy (`preemption.newest_complete_checkpoint`);
    Lightning's own choice for any other."""
    if not isinstance(trainer.strategy, SMPStrategy):
        return NotImplemented
    return preemption.newest_complete_checkpoint(trainer)


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Register the ``smp*`` strategy names with Lightning (done on ``import lightning_smp``)."""
    for name, description, init_params in _PRESETS:
        if name not in registry:
            registry.register(name, SMPStrategy, description=description, **init_params)


@contextmanager
def _meta_left_in_place(module: torch.nn.Module) -> Generator[None, None, None]:
    """Lightning's teardown moves the model to the CPU. A model whose setup failed before it was materialised
    (delayed initialisation) still has meta tensors, which cannot move: it is left where it is, so that the
    setup's own error is the one the user sees, not "Cannot copy out of meta tensor"."""
    if not has_meta_tensors(module):
        yield
        return
    module.cpu = lambda: module  # the instance attribute hides the method for this teardown
    try:
        yield
    finally:
        del module.cpu
