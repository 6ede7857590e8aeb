"""Where one pipelined step's time goes: a per-action timeline of SMPStrategy(pipeline_parallel_degree=2) on both
ranks, on the model and machine set-up of `pipeline_bench.py` (one thread per rank, gloo).

Each rank wraps the engine's forward and backward actions and the transport's sends, receives and waits with
wall-clock stamps (one clock: both ranks run on this machine), trains ``--steps`` steps, and the parent prints
one step (``--show``, after warm-up) as ``label[start+duration]`` in ms from rank 0's step start, then each
label's mean time per step over the steps after warm-up. Waits show where a rank idles (``recv_activation``: for
an activation, or on a stage before the last for the step's result, inside ``share``; ``wait_grads``: for
gradients); sends and posted receives (``post_receive``: an activation's or the result's, ``post_grads``) show
what a message costs the caller.

With ``--data-parallel 2`` (four ranks: two replicas of the two stages) the step's all-reduces over the replicas
show too: ``all_reduce`` where a bucket's collective is issued (from the gradient hooks of each stage's last
backward), ``reduce_wait`` where Lightning's backward call waits for them; a line per rank says how long before its
last backward ended the first bucket left (with ``--width 2048`` the stages' gradients fill several 25 MiB buckets).

With ``--pipeline zero_bubble`` the weight-gradient actions show as W, and the lanes drawn after the step (one
character per slice of the step: F, B, W for the actions, ``.`` for a rank waiting) show where they run: in the
time 1F1B leaves idle.

    python benchmarks/pipeline_timeline.py --microbatches 8 --pipeline interleaved
    python benchmarks/pipeline_timeline.py --microbatches 8 --pipeline zero_bubble
    python benchmarks/pipeline_timeline.py --microbatches 8 --pipeline simple --active-microbatches 8  # bench's GPipe
    python benchmarks/pipeline_timeline.py --microbatches 8 --data-parallel 2 --width 2048 --batch 64

``--trace run.json`` also writes every event after warm-up as a Chrome trace (open it at https://ui.perfetto.dev),
``--plot step.png`` draws the ``--show`` step per rank (`timeline_render.py`; docs/pipeline.md shows one per
``pipeline`` value, drawn by ``python scripts/pictures.py pipeline``).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

try:
    from benchmarks import pipeline_bench as bench
    from benchmarks import timeline_render
except ImportError:  # run as `python benchmarks/pipeline_timeline.py`
    import pipeline_bench as bench
    import timeline_render

from lightning_smp import overlap
from lightning_smp.pipeline import p2p, runtime

_WRAPPED = (
    (runtime.PipelineEngine, "training_step", "STEP"),
    (runtime.PipelineEngine, "_forward", "F"),
    (runtime.PipelineEngine, "_backward", "B"),
    (runtime.PipelineEngine, "_weight", "W"),
    (p2p.Transport, "send_activation", "send_activation"),
    (p2p.Transport, "send_grads", "send_grads"),
    (p2p.Transport, "recv_activation", "recv_activation"),
    (p2p.Transport, "wait_grads", "wait_grads"),
    (p2p.Transport, "_post", "post_receive"),
    (p2p.Transport, "post_grads", "post_grads"),
    (runtime.PipelineEngine, "_share", "share"),  # on the stages before the last, the step result's receive
    (overlap.ReadyBuckets, "_start", "all_reduce"),  # --data-parallel: a bucket's all-reduce issued
    (overlap.ReadyBuckets, "finish", "reduce_wait"),  # --data-parallel: waiting for the step's all-reduces
)


def _stamp(events: list, cls: type, name: str, label: str) -> None:
    original = cls.__dict__[name]
    function = original.__func__ if isinstance(original, staticmethod) else original

    def stamped(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            action = args[1] if len(args) > 1 and hasattr(args[1], "microbatch") else None
            events.append((label, start, time.time(), None if action is None else action.microbatch))

    setattr(cls, name, staticmethod(stamped) if isinstance(original, staticmethod) else stamped)


def _rank(rank: int, args: argparse.Namespace, out: Any) -> None:
    from lightning_smp import SMPStrategy

    events: list = []
    for cls, name, label in _WRAPPED:
        _stamp(events, cls, name, label)

    strategy = SMPStrategy(
        pipeline_parallel_degree=2,
        microbatches=args.microbatches,
        pipeline=args.pipeline,
        active_microbatches=args.active_microbatches,
    )
    bench.fit_blocks(args, strategy, args.steps, devices=2 * args.data_parallel)
    out.put((rank, events))


def report(per_rank: dict[int, list], args: argparse.Namespace) -> None:
    steps = {rank: [e for e in events if e[0] == "STEP"] for rank, events in per_rank.items()}
    t0, t1 = steps[0][args.show][1], steps[0][args.show + 1][1]
    print(f"step {args.show}: {1e3 * (t1 - t0):.1f} ms on rank 0 (ms from its start: label[start+duration])")
    for rank, events in sorted(per_rank.items()):
        shown = [e for e in events if t0 <= e[1] < t1 and e[0] != "STEP"]
        cells = [
            f"{label}{'' if mb is None else mb}[{1e3 * (a - t0):.1f}+{1e3 * (b - a):.1f}]" for label, a, b, mb in shown
        ]
        print(f"rank {rank}: " + " ".join(cells))
    for rank, lane in lanes(per_rank, t0, t1, width=args.lane_width).items():
        print(f"rank {rank} |{lane}|")
    for rank, events in sorted(per_rank.items()):
        shown = [e for e in events if t0 <= e[1] < t1]
        issued = [a for label, a, _, _ in shown if label == "all_reduce"]
        backwards = [b for label, _, b, _ in shown if label in ("B", "W")]
        if issued and backwards:
            print(
                f"rank {rank}: {len(issued)} all-reduce bucket(s) issued from {1e3 * (min(issued) - t0):.1f} ms, "
                f"{1e3 * (max(backwards) - min(issued)):.1f} ms before its last backward ended "
                f"({1e3 * (max(backwards) - t0):.1f} ms)"
            )
    print(f"mean ms per step over steps {args.warmup}..{args.steps - 2}:")
    for rank, events in sorted(per_rank.items()):
        begin, end = steps[rank][args.warmup][1], steps[rank][-1][1]
        totals: dict[str, float] = defaultdict(float)
        for label, a, b, _ in events:
            if begin <= a < end:
                totals[label] += b - a
        count = len(steps[rank]) - 1 - args.warmup
        step_ms = (end - begin) / count
        cells = " ".join(f"{label}={1e3 * total / count:.2f}" for label, total in sorted(totals.items()))
        print(f"rank {rank}: step={1e3 * step_ms:.2f} {cells}")


def lanes(per_rank: dict[int, list], start: float, end: float, *, width: int) -> dict[int, str]:
    """Each rank's compute in [start, end) as a lane of ``width`` characters: the kind of action (F, B, W) that
    computes for most of each slice, ``.`` where the rank waits (between actions, or inside one for a message: the
    bubble, or a message's cost)."""
    drawn = {}
    slice_s = (end - start) / width
    for rank, events in sorted(per_rank.items()):
        covered = [dict.fromkeys("FBW.", 0.0) for _ in range(width)]
        for label, a, b, _ in events:
            kind = {"recv_activation": ".", "wait_grads": "."}.get(label, label)
            if kind not in covered[0] or b <= start or a >= end:
                continue
            first, last = int((max(a, start) - start) / slice_s), int((min(b, end) - start) / slice_s)
            for index in range(first, min(last, width - 1) + 1):
                low, high = start + index * slice_s, start + (index + 1) * slice_s
                covered[index][kind] += max(0.0, min(b, high) - max(a, low))
        cells = []
        for cell in covered:
            waiting = cell.pop(".")  # a wait inside an action: not compute
            kind = max(cell, key=cell.get)
            cells.append(kind if cell[kind] - waiting > slice_s / 2 else ".")
        drawn[rank] = "".join(cells)
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--pipeline", default="interleaved", choices=("interleaved", "simple", "zero_bubble"))
    parser.add_argument(
        "--active-microbatches",
        type=int,
        default=None,
        help="smp's cap (default stages + 2); pipeline_bench's GPipe: m",
    )
    parser.add_argument("--data-parallel", type=int, default=1, help="replicas of the two stages (2x as many ranks)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--show", type=int, default=10, help="the step printed action by action")
    parser.add_argument("--lane-width", type=int, default=100, help="characters per rank in the drawn lanes")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--trace", type=Path, help="write the events after warm-up as a Chrome trace JSON")
    parser.add_argument("--plot", type=Path, help="draw the --show step per rank (PNG; needs matplotlib)")
    args = parser.parse_args()
    if not args.warmup <= args.show < args.steps - 1:
        parser.error("--show must lie in [--warmup, --steps - 2]")
    per_rank = dict(bench.spawn(_rank, 2 * args.data_parallel, args, env={"TORCHELASTIC_RUN_ID": "timeline"}))
    report(per_rank, args)
    if args.trace:
        timeline_render.write_chrome_trace(per_rank, args.trace, warmup=args.warmup)
    if args.plot:
        title = (
            f'pipeline="{args.pipeline}", 2 stages, {args.microbatches} microbatches: step {args.show}, '
            f"measured ({args.blocks} x Linear({args.width}), batch {args.batch}, CPU)"
        )
        timeline_render.plot_step(per_rank, args.plot, step=args.show, title=title)


if __name__ == "__main__":
    main()
