"""Run a command and print its wall time and the CPU seconds of its whole process tree, e.g.

    python scripts/cpu_time.py .venv/bin/python -m pytest -q tests/test_strategy.py

CPU seconds are what to compare on a shared machine: wall time there depends on the other jobs. ``/usr/bin/time``
misses processes nobody waits for, such as the test launcher's fork server and the ranks forked from it; this
process adopts them (Linux's child subreaper) and waits for every one before it reports.
"""

import ctypes
import os
import resource
import subprocess
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} COMMAND [ARGS...]")
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    code = subprocess.call(sys.argv[1:])
    wall = time.monotonic() - start
    while True:  # orphans re-parented to this process: wait until none is left
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = usage.ru_utime, usage.ru_stime
    print(f"{wall:.1f} s wall, {user + system:.1f} s CPU ({user:.1f} user + {system:.1f} system)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
