"""lightning_smp: SageMaker-model-parallel-style training (smp v1) as a PyTorch Lightning strategy.

``import lightning_smp`` registers the strategy names (``smp``, ``smp_fp16``, ``smp_bf16`` and their fork-launched
variants for notebooks) with the Trainer and ``smp``, ``smp_fp16``, ``smp_bf16`` with Lightning Fabric, and shows
lightning_smp's own INFO lines on rank 0 (`_show_info_on_rank_zero`);
``from lightning_smp import smp`` gives the smp-compatible facade.
"""

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_smp import smp
from lightning_smp.checkpoint import consolidate_checkpoint, consolidated_state_dict, export_hf
from lightning_smp.config import SMPConfig
from lightning_smp.fabric import SMPFabricPrecision, SMPFabricStrategy, register_fabric_strategies
from lightning_smp.loss_scaler import DynamicLossScaler, StaticLossScaler
from lightning_smp.memory import estimate_memory, fitting_layouts
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.precision import SMPPrecision
from lightning_smp.strategy import SMPStrategy, register_strategies
from lightning_smp.version import __version__ as __version__
from lightning_smp.weights import load_weights

__all__ = [
    "DynamicLossScaler",
    "MasterWeightOptimizer",
    "SMPConfig",
    "SMPFabricPrecision",
    "SMPFabricStrategy",
    "SMPPrecision",
    "SMPStrategy",
    "StaticLossScaler",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "estimate_memory",
    "export_hf",
    "fitting_layouts",
    "load_weights",
    "smp",
]


class _RankZeroInfo(logging.Filter):
    """Lets INFO and DEBUG records through on global rank 0 only (as Lightning's rank_zero_info), warnings on all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or getattr(rank_zero_only, "rank", 0) == 0


def _show_info_on_rank_zero() -> None:
    """Show lightning_smp's INFO lines (the layout, what tensor parallelism split, what was materialised) on rank 0
    by default, the way ``lightning.pytorch`` shows its own setup lines: the logger at INFO with a stderr handler of
    its own when the root logger has none (a logging configuration of the user's takes over otherwise)."""
    logger = logging.getLogger(__name__)
    logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers():
        handler = logging.StreamHandler()
        handler.addFilter(_RankZeroInfo())
        logger.addHandler(handler)
        logger.propagate = False


_show_info_on_rank_zero()
register_strategies()
register_fabric_strategies()
