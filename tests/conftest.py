"""One CPU thread per process, and one test's in-process fit kept from leaking into the processes later tests launch.

Every model here is tiny: a second torch thread buys nothing and, on two cores shared with the ranks and other
jobs (load ~18), its OpenMP spin-waits made a 10-step single-device GPT run take 4.8 s of CPU instead of 0.11 s.
The test process and everything it starts (ranks, CLI and example jobs, benchmarks) use one thread.

Lightning writes ``MASTER_ADDR`` and ``MASTER_PORT`` into this process's environment when a strategy sets up its
process group, and that one-rank group keeps listening on the port after ``fit``. A benchmark or CLI job a later
test starts inherits the variables and fails to bind the same port (EADDRINUSE). Each test therefore gets the
launch variables back as they were when the session started. The same goes for the seed Lightning's ``seed_everything``
(a CLI fit) writes as ``PL_GLOBAL_SEED``: a rank launched later would re-seed from it when its strategy sets up,
and build a model other than the single-process reference it is compared with.
"""

import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

_LAUNCH_VARIABLES = (
    *("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"),
    *("PL_GLOBAL_SEED", "PL_SEED_WORKERS"),
)


# As the session found them: a module-scoped fixture that fits in process sets them up before a test's own fixtures
# run, so restoring what a test saw when it started would keep that fixture's port for the rest of the session.
_AT_SESSION_START = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}


@pytest.fixture(autouse=True)
def _restore_launch_variables() -> Iterator[None]:
    yield
    for name, value in _AT_SESSION_START.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
