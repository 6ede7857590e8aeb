"""The run the smp facade answers for: the record of the current or last run (`RunRecord`), which the running
`SMPStrategy` hands over in ``setup_environment`` (`start_run`) and ends in ``teardown`` (`end_run`, keeping its facts
and dropping its callables, so no process group, model or optimizer outlives the run here), `preview` of a layout
without a run, and smp's configuration calls (``smp.state``, ``smp.num_microbatches``, ...) that read it. A
script's run (``smp.init``) is started by `script`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.optim import Optimizer

from lightning_smp.config import SMPConfig
from lightning_smp.topology import rank_groups

if TYPE_CHECKING:
    from lightning_smp.topology import Topology

__all__ = [
    "AXES",
    "COLLECTIVES_AFTER_A_RUN",
    "RunRecord",
    "current",
    "end_run",
    "is_initialized",
    "is_tracing",
    "num_microbatches",
    "preview",
    "running",
    "start_run",
    "state",
]

# smp's axis names → our topology's (smp's dp includes the tp ranks; its rdp is our dp)
AXES = {"dp": "dp_tp", "rdp": "dp", "pp": "pp", "tp": "tp", "cp": "cp", "mp": "mp", "world": "world"}
_COUNTED = (*AXES, "local")  # what a record gives a rank and a size for


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
        ranks = {axis: topology.rank(ours) for axis, ours in AXES.items()}
        sizes = {axis: topology.size(ours) for axis, ours in AXES.items()}
        return cls(
            config=config,
            ranks=MappingProxyType({**ranks, "local": local_rank}),
            sizes=MappingProxyType({**sizes, "local": local_size}),
            group=lambda axis: topology.group(AXES[axis]),
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
    """Make ``record`` the run the facade answers for (the strategy calls it in ``setup_environment``,
    ``smp.init()`` for a script)."""
    global _record
    if _record.running:
        raise RuntimeError(
            "A run is already under way in this process (an smp script's smp.init(), or another Trainer's fit): use "
            "either an smp script or a Trainer in one process, not both, and one Trainer at a time."
        )
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
    groups = {axis: next(group for group in layout[ours] if 0 in group) for axis, ours in AXES.items()}
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


def running(caller: str, instead: str) -> RunRecord:
    """The running run's record; outside a run an error naming ``caller`` and, in ``instead``, what to do."""
    if not _record.running:
        raise RuntimeError(
            f"smp.{caller}() needs a running SMPStrategy: it works on the run's process groups, model or optimizers, "
            "which it reaches only while Trainer.fit/validate/test/predict runs. Call it inside the LightningModule's "
            f"hooks (configure_model, configure_optimizers, training_step, ...); {instead}. Ranks, sizes and "
            "smp.state.cfg answer outside a run too (from the last run, or as one process before any); in an smp "
            "script, call smp.init() first."
        )
    return _record


COLLECTIVES_AFTER_A_RUN = (
    "after fit returns, the Trainer's strategy still reaches the ranks (trainer.strategy.barrier(), "
    "trainer.strategy.broadcast(obj))"
)


def current() -> RunRecord:
    """The record the facade answers from: the running run's, else the last run's, else one process's."""
    return _record


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


def is_initialized() -> bool:
    """smp's ``smp.is_initialized()``: whether a run is under way (``smp.state.initialized``)."""
    return _record.running


def is_tracing() -> bool:
    """smp's ``smp.is_tracing()``: always False, as lightning_smp never traces the model."""
    return False


def num_microbatches() -> int:
    """smp's ``smp.num_microbatches()``: the run's ``microbatches`` (the last run's, or 1 before any)."""
    return _record.config.microbatches
