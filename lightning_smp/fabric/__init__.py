"""The Lightning Fabric door: `SMPFabricStrategy` and its precision plugin, on the same run context, build path,
precision rules and checkpoints as the Trainer's `SMPStrategy` and the smp facade.

``import lightning_smp`` registers ``smp``, ``smp_fp16`` and ``smp_bf16`` in Fabric's strategy registry, so
``L.Fabric(strategy="smp_fp16", devices=N)`` works. See docs/fabric.md.
"""

from lightning_smp.fabric.precision import SMPFabricPrecision
from lightning_smp.fabric.strategy import SMPFabricStrategy, register_fabric_strategies

__all__ = ["SMPFabricPrecision", "SMPFabricStrategy", "register_fabric_strategies"]
