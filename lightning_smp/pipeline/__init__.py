"""Pipeline parallelism with smp's step semantics: the user's step runs per microbatch on every rank, and the
model's sequential trunk is cut between stages.

Planning is pure (`partition`, `layout`: where every parameter lives, `schedule`, `microbatch`); execution consumes
the plans (`stage` routes the trunk's children on this rank, `p2p` moves activations and gradients, `runtime` drives
a step, handing its gradients to `held_gradients` and `reduction` and its outputs, logs and metrics to `results`).
The strategy builds one `PipelineEngine` per run with `build_engine`; users place modules with ``smp.partition`` /
``smp.set_partition``.
"""

from lightning_smp.pipeline.microbatch import merge_outputs, split_batch
from lightning_smp.pipeline.partition import PartitionPlan, find_trunk, plan_partition
from lightning_smp.pipeline.runtime import PipelineEngine, build_engine
from lightning_smp.pipeline.schedule import Action, simulate

__all__ = [
    "Action",
    "PartitionPlan",
    "PipelineEngine",
    "build_engine",
    "find_trunk",
    "merge_outputs",
    "plan_partition",
    "simulate",
    "split_batch",
]
