"""The smp v1 script door's run: ``smp.init()`` starts a run without a Trainer, as smp's did (or a Fabric loop's
strategy `attach`es its run, so that ``@smp.step`` pipelines run in a Fabric loop).

An smp v1 script (AWS's ``train_gpt_simple.py``, the BERT and MNIST examples, and their copies) runs unchanged but
for the import: ``smp.init()`` here joins the job's processes (torchrun's or mpirun's environment, or one process),
reads the config from its argument and ``SM_HP_MP_PARAMETERS`` as smp did, builds the run's `RunContext` (settings,
rank layout, reduction plan) and `PrecisionRules`, and hands the facade its `RunRecord`, so every rank, group and
collective call answers. The objects the script makes next find the run here: ``smp.DistributedModel`` (`model`)
splits the model and makes the step engine, ``smp.DistributedOptimizer`` re-points and wraps the optimizer, and
``@smp.step`` (`step`) runs the engine. Those are the same engine and rules the Trainer door uses: this module only
holds them for the script. A script run lasts until the process ends (its groups are freed at exit, as a
Trainer's are), and a Trainer cannot start in the same process.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_smp import checkpoint as checkpointing
from lightning_smp import fault_tolerance, model_setup
from lightning_smp.config import SMPConfig
from lightning_smp.engine import RunContext
from lightning_smp.mixed_precision import LossScaling, PrecisionRules
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.smp.run import RunRecord, current, start_run

if TYPE_CHECKING:
    from lightning_smp.smp.model import DistributedModel

__all__ = ["ScriptRun", "init", "script_run"]

_TIMEOUT = timedelta(minutes=10)  # as SMPStrategy's default: a rank stuck in a collective fails, not hangs
_MPI_ENVIRONMENT = {  # mpirun (Open MPI, as SageMaker launches smp jobs) → torch's variable names
    "RANK": "OMPI_COMM_WORLD_RANK",
    "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
    "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
    "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
}


@dataclass(eq=False)
class ScriptRun:
    """A script's run: the `RunContext` and `PrecisionRules` every door shares, this process's device, and what the
    script has made on it so far (its model and optimizers, for ``model.backward`` and the checkpoints)."""

    run: RunContext
    rules: PrecisionRules
    device: torch.device
    model: DistributedModel | None = None
    optimizers: list[Optimizer] = field(default_factory=list)
    failed: bool = False
    """Whether the script ended in an exception (then the process groups stay at exit: `fault_tolerance`)."""
    attached: bool = False
    """Started by another door (`attach`), whose own setup calls may build the model instead."""

    @property
    def builds_optimizers(self) -> bool:
        """Whether ``smp.DistributedOptimizer`` is this run's (after ``smp.init()``, or once
        ``smp.DistributedModel`` made the model of an attached run); else the door's record wraps it."""
        return not self.attached or self.model is not None

    @property
    def config(self) -> SMPConfig:
        return self.run.config

    @property
    def wrap_optimizer(self) -> Callable[..., MasterWeightOptimizer] | None:
        """The master-weight wrapper of an optimizer (``optimizer, **scaler_settings``); None where the rules
        leave optimizers as they are (fp32 with whole masters)."""
        if not self.rules.wraps_optimizers:
            return None
        return functools.partial(self.rules.wrap_optimizer, topology=self.run.topology)

    def optimizer_over_split_model(self, optimizer: Optimizer) -> Optimizer:
        """``optimizer`` (in place) over the split model's parameters: one the script built over the model before
        ``smp.DistributedModel`` split it is pointed at the split model's parameters of the same names, those this
        rank does not hold (another pipeline stage's) left out."""
        model = self._model("DistributedOptimizer")
        current = {id(param) for param in model.get_module().parameters()}
        if all(id(param) in current for group in optimizer.param_groups for param in group["params"]):
            return optimizer
        if optimizer.state:
            raise ValueError(
                "smp.DistributedOptimizer(optimizer) was given an optimizer that has stepped already, over "
                "parameters smp.DistributedModel has since replaced: build the optimizer after "
                "smp.DistributedModel(model), over model.parameters(), before its first step."
            )
        _, foreign = model_setup.repoint_optimizer(optimizer, model.names_before_split, model.get_module())
        if foreign:
            raise ValueError(
                f"smp.DistributedOptimizer: the optimizer updates {foreign[0]} that is not a parameter of the model "
                "given to smp.DistributedModel. Build the optimizer over model.parameters()."
            )
        return optimizer

    def loss_scaling(self) -> LossScaling:
        """What ``model.backward(loss)`` starts from (`PrecisionRules.loss_scaling`): the fp16 scale of the one
        scaled optimizer, or only the division by the microbatches."""
        scaled = [opt for opt in self.optimizers if isinstance(opt, MasterWeightOptimizer) and opt.loss_scaler]
        if len({id(opt.loss_scaler) for opt in scaled}) > 1:
            raise ValueError(
                "model.backward(loss) cannot tell which loss scale to use: there are several fp16 "
                "smp.DistributedOptimizers, each with its own scale. Use one optimizer with several param groups."
            )
        return PrecisionRules.loss_scaling(scaled[0] if scaled else None)

    def note_backward(self) -> None:
        """A step's backward has run: the masters' next unscale reads the gradients again."""
        for optimizer in self.optimizers:
            if isinstance(optimizer, MasterWeightOptimizer):
                optimizer.note_backward()

    def save_checkpoint(self, path: Path, user_content: Any) -> None:
        """``smp.save_checkpoint``: the model (fp32 masters), the optimizers and ``user_content``, sharded."""
        model = self._model("save_checkpoint")
        module = model.get_module()
        content = {
            "state_dict": checkpointing.model_state_dict(module, self.optimizers),
            "optimizer_states": [checkpointing.optimizer_state_dict(opt, module) for opt in self.optimizers],
            "user_content": user_content,
        }
        owned = model.engine.pipeline.owned_parameter_names() if model.engine.pipeline is not None else None
        checkpointing.save(content, path, module=module, run=self._describe(), owned=owned)

    def load_checkpoint(self, path: Path, strict: bool, load_optimizer_states: bool) -> Mapping[str, Any] | None:
        """``smp.resume_from_checkpoint``: ``path`` into the model and optimizers, whatever layout saved it."""
        checkpointing.wait_for_saves()
        return checkpointing.load(
            path,
            module=self._model("resume_from_checkpoint").get_module(),
            optimizers=self.optimizers,
            run=self._describe(),
            strict=strict,
            load_optimizer_states=load_optimizer_states,
        )

    def forget_process_groups(self) -> None:
        """At exit (`fault_tolerance.close_process_groups`): the pipeline's stages settle (no stage leaves before
        every stage has its last step's result), then the metrics' groups and the checkpoint writer's go, and the
        model and optimizers; the run's topology releases the groups its layers and pipeline look up."""
        if self.model is not None:
            if dist.is_initialized():
                self.model.engine.settle()
            self.model.forget_process_groups()
        checkpointing.forget_save_group()
        self.model, self.optimizers = None, []

    def _model(self, caller: str) -> DistributedModel:
        if self.model is None:
            raise RuntimeError(f"smp.{caller}() needs the model: wrap it with smp.DistributedModel(model) first.")
        return self.model

    def _describe(self) -> dict[str, Any]:
        return checkpointing.describe_run(
            topology=self.run.topology, config=self.config, precision=self.rules.precision_name
        )


_script: ScriptRun | None = None


def init(config: Mapping[str, Any] | None = None) -> None:
    """smp's ``smp.init(config)``: start the run of an smp v1 script on every process of the job.

    ``config`` is smp's ``parameters`` dict (``{"pipeline_parallel_degree": 2, "microbatches": 4, "fp16": True}``,
    smp's names and aliases such as ``partitions``); ``SM_HP_MP_PARAMETERS``, set by a SageMaker job, overrides it,
    as in smp. The processes are torchrun's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), mpirun's
    (``OMPI_COMM_WORLD_*``, with ``MASTER_ADDR`` and ``MASTER_PORT`` set), or this one process alone. On a GPU each
    process takes the device of its local rank (NCCL); on the CPU gloo.
    """
    if current().running:
        raise RuntimeError(
            "smp.init() was called while a run is under way (a Trainer's SMPStrategy, or an earlier smp.init()): "
            "call smp.init() once per process, and use either an smp script or a Trainer in one process, not both."
        )
    settings = SMPConfig.from_sources({}, smp_options={"enabled": True, "parameters": dict(config or {})})
    for line in [*settings.deprecated_settings(), *settings.inactive_settings()]:
        rank_zero_warn(line)
    device = _join_the_job()
    run = RunContext.start(settings, world_size=dist.get_world_size(), device_type=device.type, timeout=_TIMEOUT)
    script = _open(ScriptRun(run, PrecisionRules.of(settings, run.reduction), device))
    start_run(
        RunRecord.from_topology(
            run.topology,
            config=settings,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            local_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
            wrap_optimizer=None,  # smp.DistributedOptimizer asks the script run (`ScriptRun.wrap_optimizer`)
            save_checkpoint=script.save_checkpoint,
            load_checkpoint=script.load_checkpoint,
        )
    )


def attach(run: RunContext, rules: PrecisionRules, device: torch.device) -> ScriptRun:
    """Let ``smp.DistributedModel``, ``smp.DistributedOptimizer`` and ``@smp.step`` run on a run another door
    started (a Fabric loop: its strategy made the run and the facade's record), as they run after ``smp.init()``.
    Like a script's, it settles and frees its groups at exit unless the process is failing; the door may end it
    earlier with `detach`."""
    return _open(ScriptRun(run, rules, device, attached=True))


def detach() -> None:
    """The door's run ends (`attach`): the pipeline's stages settle, and the script run lets go of the model, the
    optimizers and the metrics' groups (the run's topology releases its groups at exit)."""
    global _script
    script, _script = _script, None
    if script is not None:
        script.forget_process_groups()


def script_run(caller: str) -> ScriptRun:
    """The script's run; before ``smp.init()`` an error naming ``caller``."""
    if _script is None:
        raise RuntimeError(
            f"smp.{caller}(...) needs smp.init() first: call smp.init(config) at the start of the script, on every "
            "process (under Lightning's Trainer the strategy splits the LightningModule instead: no "
            f"smp.{caller} there)."
        )
    return _script


def running_script() -> ScriptRun | None:
    """The script's run, or None (no ``smp.init()`` in this process)."""
    return _script


def _join_the_job() -> torch.device:
    """Join the job's default process group (launched by torchrun or mpirun, or this process alone) and pick this
    process's device."""
    for ours, mpi in _MPI_ENVIRONMENT.items():
        if ours not in os.environ and mpi in os.environ:
            os.environ[ours] = os.environ[mpi]
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" not in os.environ:  # one process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_TIMEOUT)
        return device
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            "smp.init() found WORLD_SIZE but not MASTER_ADDR and MASTER_PORT: use torchrun to launch the script "
            "(`torchrun --nproc-per-node=N script.py`), or with mpirun exporting both (`mpirun -x MASTER_ADDR=host "
            "-x MASTER_PORT=29500 ...`)."
        )
    dist.init_process_group(backend, timeout=_TIMEOUT)
    return device


def _open(script: ScriptRun) -> ScriptRun:
    """Make ``script`` the process's run: the smp calls find it, it settles and frees its groups at exit, and an
    exception that ends the process marks it failed (the hook is installed once per process)."""
    global _script, _failures_noted
    _script = script
    fault_tolerance.close_process_groups_at_exit(script, script.run.topology)
    if not _failures_noted:
        _failures_noted = True
        _note_failures()
    return script


_failures_noted = False


def _note_failures() -> None:
    """An exception that ends the process marks the current run failed, so the process groups are left to the
    launcher at exit (destroying them with collectives in flight on other ranks could block)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if _script is not None:
            _script.failed = True
        previous(kind, error, trace)

    sys.excepthook = hook
