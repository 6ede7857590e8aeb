"""The memory planner's picture: per pipeline stage (the ranks of a stage hold the same), a bar stacked by what the
memory holds, against the device's memory.

Owns the drawing only (`plot_memory`); the numbers are a `lightning_smp.memory.MemoryReport`'s. matplotlib is an
optional dependency (``pip install "lightning-smp[plot]"``), imported when a chart is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_smp.memory import MemoryReport, RankMemory

__all__ = ["plot_memory"]

# (label, colour, bytes of a stage's rank): bottom to top
_STACK = (
    ("parameters", "#4c72b0", lambda r: r.parameters),
    ("gradients", "#8da0cb", lambda r: r.gradients),
    ("fp32 masters + their gradients", "#55a868", lambda r: r.masters + r.master_gradients),
    ("optimizer state", "#a6d854", lambda r: r.optimizer_state),
    ("step buffer", "#937860", lambda r: r.step_buffer),
    ("activations x microbatches in flight", "#dd8452", lambda r: (r.activations or 0) * r.in_flight),
    ("recomputed / loaded back in backward", "#f2b880", lambda r: r.recompute),
)


def plot_memory(report: MemoryReport, path: str | Path) -> Path:
    """Draw ``report`` into ``path`` (PNG, SVG or PDF by its suffix); returns the path.

    Raises ``ModuleNotFoundError`` naming the install command when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            'drawing the memory chart needs matplotlib: pip install "lightning-smp[plot]" (or matplotlib itself).'
        ) from error
    ranks = report.ranks
    highest = max([rank.total for rank in ranks] + [report.device_memory or 0])
    unit, scale = _unit(highest)
    figure, axes = plt.subplots(figsize=(max(6.5, 1.4 * len(ranks) + 4.5), 4.2), dpi=120)
    positions = range(len(ranks))
    bottoms = [0.0] * len(ranks)
    for label, colour, size_of in _STACK:
        heights = [size_of(rank) / scale for rank in ranks]
        if any(heights):
            axes.bar(positions, heights, bottom=bottoms, color=colour, label=label, width=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    if report.device_memory is not None:
        axes.axhline(report.device_memory / scale, color="#c44e52", linestyle="--", linewidth=1.5)
        axes.annotate(
            f"device memory {report.device_memory / scale:.3g} {unit}",
            (0.01, report.device_memory / scale),
            xycoords=("axes fraction", "data"),
            xytext=(0, 4),
            textcoords="offset points",
            ha="left",
            color="#c44e52",
        )
    for position, rank in zip(positions, ranks, strict=True):
        note = "activations unknown" if rank.activations is None else f"{rank.total / scale:.3g} {unit}"
        axes.annotate(note, (position, bottoms[position]), xytext=(0, 3), textcoords="offset points", ha="center")
    axes.set_xticks(list(positions), [_label(rank) for rank in ranks])
    axes.set_ylabel(unit)
    axes.set_ylim(0, highest / scale * 1.18)
    axes.set_title(f"{report.layout}, {report.precision}", fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    axes.spines[["top", "right"]].set_visible(False)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path)
    plt.close(figure)
    return path


def _unit(count: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return unit, float(scale)
    return "B", 1.0


def _label(rank: RankMemory) -> str:
    shown = ",".join(map(str, rank.ranks[:4])) + (",..." if len(rank.ranks) > 4 else "")
    return f"stage {rank.stage}\nranks {shown}"
