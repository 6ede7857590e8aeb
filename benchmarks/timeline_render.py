"""What `pipeline_timeline.py` measured, as something to look at: a Chrome trace a user opens in Perfetto, and a
picture of one step per rank.

Both read the events `pipeline_timeline.py` records on each rank: ``(label, start, end, microbatch)`` in
wall-clock seconds (one clock: the ranks run on one machine), where ``F`` / ``B`` are a stage's forward and
backward of a microbatch, ``STEP`` the whole training step, and the rest the transport's calls made inside or
between them. A rank idles while it waits for a message (``recv_activation``, ``wait_grads``, ``share``): those
calls are drawn over the forward or backward that made them, so what is left of a bar is compute.

- `write_chrome_trace`: every event after warm-up as a trace-event JSON (``{"traceEvents": [...]}``, complete
  events, one track per rank). Open it at https://ui.perfetto.dev (or ``chrome://tracing``).
- `plot_step`: one step, one lane per rank, each lane that rank's own step on the common clock (a later stage
  starts and ends later): forward (blue) and backward (orange) bars labelled with their microbatch, the waits
  hatched grey over them, each lane's idle share of its step in its label. Needs matplotlib.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Event = tuple[str, float, float, Any]  # label, start (s), end (s), microbatch or None

WAITS = ("recv_activation", "wait_grads", "share")  # a rank waiting for another: idle
_CATEGORY = {"F": "forward", "B": "backward", "STEP": "step", **dict.fromkeys(WAITS, "wait")}
_COLOURS = {"F": "#4C72B0", "B": "#DD8452"}


def step_window(events: Sequence[Event], step: int) -> tuple[float, float]:
    """Start and end (seconds) of training step ``step`` on one rank: from its start to the next one's."""
    starts = [start for label, start, _, _ in events if label == "STEP"]
    return starts[step], starts[step + 1]


def write_chrome_trace(per_rank: Mapping[int, Sequence[Event]], path: Path, *, warmup: int = 0) -> None:
    """Every event from step ``warmup`` on, one track per rank, times in µs from that step's start on rank 0."""
    t0 = step_window(per_rank[0], warmup)[0]
    events: list[dict[str, Any]] = []
    for rank, recorded in sorted(per_rank.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for label, start, end, microbatch in recorded:
            if start < t0:
                continue
            name = label if microbatch is None else f"{label}{microbatch}"
            events.append(
                {
                    "name": name,
                    "cat": _CATEGORY.get(label, "message"),
                    "ph": "X",
                    "ts": round(1e6 * (start - t0), 1),
                    "dur": round(1e6 * (end - start), 1),
                    "pid": 0,
                    "tid": rank,
                }
            )
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")


def plot_step(per_rank: Mapping[int, Sequence[Event]], path: Path, *, step: int, title: str) -> None:
    """A picture of step ``step`` on every rank (PNG, or any format matplotlib infers from ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    windows = {rank: step_window(events, step) for rank, events in per_rank.items()}
    t0 = min(start for start, _ in windows.values())  # each lane shows its own step; one clock for all
    span = 1e3 * (max(end for _, end in windows.values()) - t0)
    ranks = sorted(per_rank)
    figure, axes = plt.subplots(figsize=(10, 0.9 + 0.75 * len(ranks)))
    for lane, rank in enumerate(ranks):
        y = len(ranks) - 1 - lane  # rank 0 on top
        begin, end = windows[rank]
        shown = [(label, 1e3 * (a - t0), 1e3 * (b - a), mb) for label, a, b, mb in per_rank[rank] if begin <= a < end]
        waited = 0.0
        for label, start, width, microbatch in shown:
            if label in _COLOURS:
                axes.broken_barh([(start, width)], (y - 0.35, 0.7), color=_COLOURS[label], edgecolor="white")
                if width > 0.02 * span:
                    axes.text(
                        start + width / 2, y, f"{label}{microbatch}", ha="center", va="center", fontsize=8, zorder=3
                    )
            elif label in WAITS:
                waited += width
                axes.broken_barh(
                    [(start, width)],
                    (y - 0.35, 0.7),
                    facecolor="#DDDDDD",
                    edgecolor="#888888",
                    hatch="///",
                    lw=0,
                    zorder=2,
                )
        idle = waited / (1e3 * (end - begin))
        axes.text(
            -0.01, y, f"rank {rank}\nidle {idle:.0%}", transform=axes.get_yaxis_transform(), ha="right", va="center"
        )
    axes.set(xlim=(0, span), ylim=(-0.6, len(ranks) - 0.4), yticks=[], xlabel="ms from the step's start")
    axes.set_title(title, fontsize=10)
    axes.legend(
        handles=[
            Patch(color=_COLOURS["F"], label="forward"),
            Patch(color=_COLOURS["B"], label="backward"),
            Patch(facecolor="#DDDDDD", edgecolor="#888888", hatch="///", label="waiting for a message (idle)"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.3 if len(ranks) <= 2 else -0.18),
        ncol=3,
        frameon=False,
        fontsize=8,
    )
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
