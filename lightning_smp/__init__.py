"""lightning_smp: SageMaker-model-parallel-style training (smp v1) as a PyTorch Lightning strategy.

``import lightning_smp`` registers the strategy names (``smp``, ``smp_fp16``, ``smp_bf16`` and their fork-launched
variants for notebooks); ``from lightning_smp import smp`` gives the smp-compatible facade.
"""

from lightning_smp import smp
from lightning_smp.checkpoint import consolidate_checkpoint, consolidated_state_dict, export_hf
from lightning_smp.config import SMPConfig
from lightning_smp.loss_scaler import DynamicLossScaler, StaticLossScaler
from lightning_smp.memory import estimate_memory, fitting_layouts
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.precision import SMPPrecision
from lightning_smp.strategy import SMPStrategy, register_strategies
from lightning_smp.weights import load_weights

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScaler",
    "MasterWeightOptimizer",
    "SMPConfig",
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

register_strategies()
