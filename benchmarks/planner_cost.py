"""What the memory planner costs: the CPU seconds of one ``lightning-smp estimate`` command, by default the 70B
listing of docs/choosing-a-layout.md (every pp x tp x dp layout of 64 devices, each traced on the meta device).

Each repeat runs the command in a fresh interpreter (``python -m lightning_smp estimate ...``, from the repository
root) and reads the CPU seconds (user + system) it used from ``getrusage(RUSAGE_CHILDREN)``, so other jobs on the
machine do not count; the same for ``import lightning_smp.cli`` alone, the floor every command pays (Lightning's
imports). Printed: the median of each over ``--repeats`` and the layouts listed. ``--root`` runs another checkout's
planner (its directory first on ``PYTHONPATH``), for a figure before a change; ``--out`` writes the JSON.

    python benchmarks/planner_cost.py
    python benchmarks/planner_cost.py --root /tmp/base --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:
    from benchmarks import pipeline_bench as bench
except ImportError:  # run as `python benchmarks/planner_cost.py`
    import pipeline_bench as bench

_ROOT = Path(__file__).resolve().parents[1]
ESTIMATE = (
    "--config examples/planning/gpt_70b.yaml --device-memory 80GiB --devices 64 --micro-batch-size 1 "
    "--sequence-length 2048"
)


def timed(command: list[str], root: Path) -> tuple[float, float, str]:
    """CPU seconds (user + system) and wall seconds of ``command`` run from ``root``, and its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, result.stdout


def listed_layouts(output: str) -> int:
    """The rows of the fitting-layouts table the command printed (0 without one)."""
    table = output.split("smallest model-parallel degree first:\n")
    return len(table[1].strip().splitlines()) - 1 if len(table) > 1 else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimate", default=ESTIMATE, help="the arguments of `lightning-smp estimate`")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=_ROOT, help="the checkout whose planner runs")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    estimate = [sys.executable, "-m", "lightning_smp", "estimate", *args.estimate.split()]
    imports = [sys.executable, "-c", "import lightning_smp.cli"]
    runs, floors, output = [], [], ""
    for _ in range(args.repeats):
        cpu, wall, output = timed(estimate, args.root)
        runs.append((cpu, wall))
        floors.append(timed(imports, args.root)[0])
    row = {
        "command": f"lightning-smp estimate {args.estimate}",
        "cpu_s": statistics.median(cpu for cpu, _ in runs),
        "wall_s": statistics.median(wall for _, wall in runs),
        "import_cpu_s": statistics.median(floors),
        "layouts_listed": listed_layouts(output),
    }
    row["planner_cpu_s"] = row["cpu_s"] - row["import_cpu_s"]
    print(
        f"{row['command']}: {row['cpu_s']:.1f} s of CPU (median of {args.repeats}; {row['import_cpu_s']:.1f} s of it "
        f"importing lightning_smp.cli, {row['planner_cpu_s']:.1f} s planning), {row['wall_s']:.1f} s wall, "
        f"{row['layouts_listed']} layout(s) listed"
    )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(bench.record([row], args), handle, indent=2, default=str)


if __name__ == "__main__":
    main()
