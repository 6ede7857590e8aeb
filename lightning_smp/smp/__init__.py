"""The smp-compatible facade: ``from lightning_smp import smp`` gives SageMaker code the names it calls, inside a
Trainer's run and in an smp v1 script run as it is (``smp.init()``, ``smp.DistributedModel``, ``@smp.step``).

It answers from the record of the current or last run (`run.RunRecord`): the running `SMPStrategy` hands one
over in ``setup_environment`` (`start_run`) and ends it in ``teardown`` (`end_run`), which keeps its facts (ranks,
sizes, config) and drops its callables, so no process group, model or optimizer outlives the run here. Ranks, sizes
and ``smp.state.cfg`` therefore answer inside a run, after it (from the last run) and before any (as one process),
so a model built with them loads and runs without a Trainer; collectives and checkpoint helpers need a running one.
A script's ``smp.init()`` starts a record that lasts until the process ends (`script`). One module per concern:
`run` (the record, ``smp.state``), `ranks` (ranks, sizes, groups, barriers), `messages` (Python objects between
ranks), `creation` (building the model), `script` (a script's run), `model` (``DistributedModel``),
`step_function` (``@smp.step``), `optimizer`, `checkpoints`.
"""

from __future__ import annotations

from typing import Any

from lightning_smp.smp.checkpoints import load, resume_from_checkpoint, save, save_checkpoint
from lightning_smp.smp.creation import (
    delay_param_initialization,
    model_creation,
    partition,
    set_activation_checkpointing,
    set_partition,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)
from lightning_smp.smp.messages import CommGroup, RankType, allgather, broadcast, recv_from, send
from lightning_smp.smp.model import DistributedModel
from lightning_smp.smp.optimizer import DistributedOptimizer
from lightning_smp.smp.ranks import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    barrier,
    cp_positions,
    cp_rank,
    cp_size,
    dp_barrier,
    dp_rank,
    dp_size,
    get_dp_process_group,
    get_mp_process_group,
    get_pp_process_group,
    get_rdp_process_group,
    get_tp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_barrier,
    mp_rank,
    mp_size,
    pp_barrier,
    pp_rank,
    pp_size,
    rank,
    rdp_barrier,
    rdp_rank,
    rdp_size,
    size,
    tp_barrier,
    tp_rank,
    tp_size,
)
from lightning_smp.smp.run import (
    RunRecord,
    end_run,
    is_initialized,
    is_tracing,
    num_microbatches,
    preview,
    start_run,
    state,
)
from lightning_smp.smp.script import init
from lightning_smp.smp.step_function import StepOutput, step
from lightning_smp.tensor_parallel import nn
from lightning_smp.tensor_parallel.creation import set_tensor_parallelism

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
    "StepOutput",
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


def __getattr__(name: str) -> Any:
    # smp's names lightning_smp does not provide, with what replaces each (PEP 562)
    if name == "amp":
        raise AttributeError(
            "smp.amp is not provided by lightning_smp: fp16 with fp32 master weights and smp's loss scaling is "
            "SMPStrategy(fp16=True) (or strategy='smp_fp16'); remove the smp.amp calls."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
