"""Launch paths: torchrun, SLURM (srun) and MPI (mpirun, what SageMaker's ``mpi`` distribution uses), each
detected by Lightning's own cluster environments, with SMPStrategy's world size and ranks following them.

On one machine each launcher is faked by the environment variables it sets for one rank of a 2-node × 2-process
job; MPI also needs mpi4py, faked as what it answers under Open MPI's ``mpirun`` on one host. Then a real
2-process torchrun job and a real 2-process srun-like job train for two steps.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
from lightning.fabric.plugins.environments import (
    LightningEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.fabric.plugins.environments import mpi as lightning_mpi

from lightning_smp import SMPStrategy
from lightning_smp.topology import coordinates
from tests.distributed import run_process

_NODES, _PER_NODE = 2, 2
_WORLD = _NODES * _PER_NODE
_LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SM_")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT")  # fmt: skip


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Start every test from a shell outside any launcher, whatever ran pytest, and leave the environment as it
    was: Lightning's environments write MASTER_ADDR / MASTER_PORT into it, which would send later tests' process
    groups to the fake job's node1."""
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES) or name in _LAUNCHER_VARS:
            del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _torchrun_env(rank: int) -> dict[str, str]:
    """What ``torchrun --nnodes 2 --nproc-per-node 2`` sets for ``rank``."""
    return {
        "TORCHELASTIC_RUN_ID": "job",
        "RANK": str(rank),
        "WORLD_SIZE": str(_WORLD),
        "LOCAL_RANK": str(rank % _PER_NODE),
        "LOCAL_WORLD_SIZE": str(_PER_NODE),
        "GROUP_RANK": str(rank // _PER_NODE),
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
    }


def _slurm_env(rank: int) -> dict[str, str]:
    """What ``srun`` sets for ``rank`` in ``sbatch --nodes 2 --ntasks-per-node 2`` (job name not 'bash')."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "node[1-2]",
        "SLURM_NNODES": str(_NODES),
        "SLURM_NTASKS": str(_WORLD),
        "SLURM_NTASKS_PER_NODE": str(_PER_NODE),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % _PER_NODE),
        "SLURM_NODEID": str(rank // _PER_NODE),
    }


def _mpi_env(rank: int) -> dict[str, str]:
    """What Open MPI's ``mpirun -np 4 --npernode 2`` sets for ``rank`` (SageMaker's ``mpi`` distribution)."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(_WORLD),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % _PER_NODE),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(_PER_NODE),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank % _PER_NODE),
    }


def _fake_host() -> str:
    """This rank's host name in the fake job: ranks fill the nodes in order, ``--npernode`` at a time."""
    node = int(os.environ["OMPI_COMM_WORLD_RANK"]) // int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
    return f"node{node + 1}"


class _FakeComm:
    """mpi4py's communicator as Open MPI answers it, from its environment variables. Of the collectives Lightning
    uses, a gather of host names gives every rank's host and a broadcast returns the caller's own value: right for
    the node ranks (every rank computes the same host list), not for the main address, which goes unchecked."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix

    def Get_rank(self) -> int:
        return int(os.environ[f"{self._prefix}_RANK"])

    def Get_size(self) -> int:
        return int(os.environ[f"{self._prefix}_SIZE"])

    def bcast(self, obj: object, root: int = 0) -> object:
        return obj

    def gather(self, obj: object, root: int = 0) -> list:
        assert obj == _fake_host(), "the fake job only gathers host names"
        per_node = int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
        return [f"node{rank // per_node + 1}" for rank in range(self.Get_size())]

    def Split(self, color: int = 0) -> "_FakeComm":
        return _FakeComm("OMPI_COMM_WORLD_LOCAL")


@pytest.fixture
def fake_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = _FakeComm("OMPI_COMM_WORLD")
    package = types.ModuleType("mpi4py")
    package.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    monkeypatch.setattr(lightning_mpi, "_MPI4PY_AVAILABLE", True)
    monkeypatch.setattr(lightning_mpi, "socket", types.SimpleNamespace(gethostname=_fake_host))


_LAUNCHERS = {
    "torchrun": (_torchrun_env, TorchElasticEnvironment),
    "srun": (_slurm_env, SLURMEnvironment),
    "mpirun": (_mpi_env, MPIEnvironment),
}


@pytest.mark.usefixtures("fake_mpi4py")
@pytest.mark.parametrize("rank", range(_WORLD))
@pytest.mark.parametrize("launcher", sorted(_LAUNCHERS))
def test_lightning_picks_the_launchers_environment_and_the_strategy_follows(
    launcher: str, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_env, environment = _LAUNCHERS[launcher]
    for name, value in make_env(rank).items():
        monkeypatch.setenv(name, value)
    strategy = SMPStrategy(pipeline_parallel_degree=2, fp16=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=_PER_NODE, num_nodes=_NODES, strategy=strategy, logger=False, max_steps=1
    )
    assert trainer.strategy is strategy
    assert type(strategy.cluster_environment) is environment
    assert strategy.cluster_environment.creates_processes_externally  # Lightning launches nothing itself
    assert (strategy.world_size, strategy.global_rank) == (_WORLD, rank)
    assert (strategy.local_rank, strategy.node_rank) == (rank % _PER_NODE, rank // _PER_NODE)
    if launcher != "mpirun":
        assert strategy.cluster_environment.main_address == "node1"
    # the smp layout this rank takes once its process group exists: dp = 4 / pp
    config = strategy.config
    dp = config.data_parallel_degree(strategy.world_size)
    assert dp == 2
    where = coordinates(strategy.global_rank, config.placement_order, dp=dp, pp=2, tp=1)
    assert (where["dp"], where["pp"]) == divmod(rank, 2)  # "cluster": pipeline stages are neighbouring ranks


def test_without_a_launcher_lightning_launches_the_processes_itself() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SMPStrategy(), logger=False)
    assert type(trainer.strategy.cluster_environment) is LightningEnvironment
    assert not trainer.strategy.cluster_environment.creates_processes_externally


def test_slurm_interactive_shell_is_not_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """``salloc`` then ``python train.py`` (job name 'bash'): Lightning launches the processes itself."""
    for name, value in {**_slurm_env(0), "SLURM_JOB_NAME": "bash", "SLURM_NTASKS": "1"}.items():
        monkeypatch.setenv(name, value)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SMPStrategy(), logger=False)
    assert type(trainer.strategy.cluster_environment) is LightningEnvironment


# -- real jobs: two processes on this machine ----------------------------------------------------------------

_SCRIPT = """
import atexit, glob, json, sys
import lightning as L

def threads_at_exit():  # registered before lightning_smp's exit handler, so it runs after it
    with open(f"{sys.argv[1]}/threads{RANK}.json", "w") as f:
        json.dump([open(task).read().strip() for task in glob.glob("/proc/self/task/*/comm")], f)

atexit.register(threads_at_exit)
from lightning.pytorch.demos.boring_classes import BoringModel
import lightning_smp
from lightning_smp import smp

class Model(BoringModel):
    def on_train_start(self):
        s = self.trainer.strategy
        self.seen = {
            "environment": type(s.cluster_environment).__name__, "world_size": s.world_size,
            "global_rank": s.global_rank, "local_rank": s.local_rank, "smp_rank": smp.rank(), "smp_size": smp.size(),
            "dp_rank": smp.rdp_rank(), "dp_size": smp.rdp_size(), "sampler": s.distributed_sampler_kwargs,
        }

trainer = L.Trainer(accelerator="cpu", devices=2, strategy="smp_fp16", max_steps=2, limit_val_batches=0,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Model()
trainer.fit(model)
model.seen["loss_scale"] = float(trainer.callback_metrics["loss_scale"])
with open(f"{sys.argv[1]}/rank{trainer.global_rank}.json", "w") as f:
    json.dump(model.seen, f)
RANK = trainer.global_rank
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_ranks(out: Path, environment: str) -> None:
    seen = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, info in enumerate(seen):
        assert info["environment"] == environment
        assert (info["world_size"], info["global_rank"], info["local_rank"]) == (2, rank, rank)
        assert (info["smp_size"], info["smp_rank"], info["dp_size"], info["dp_rank"]) == (2, rank, 2, rank)
        assert info["sampler"] == {"num_replicas": 2, "rank": rank}
    assert seen[0]["loss_scale"] == seen[1]["loss_scale"]  # one overflow decision for the whole job
    for rank in range(2):  # the process groups were freed before the interpreter's teardown (fault_tolerance.py)
        threads = json.loads((out / f"threads{rank}.json").read_text())
        assert not [name for name in threads if "gloo" in name], threads


def _job_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def test_torchrun_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = run_process([*command, str(script), str(tmp_path)], env=_job_env(), timeout=240)
    assert result.returncode == 0, result.stderr[-6000:]
    _check_ranks(tmp_path, "TorchElasticEnvironment")


def test_srun_two_processes(tmp_path: Path) -> None:
    """What ``srun --ntasks-per-node 2 python train.py`` starts: both processes, with SLURM's variables."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODEID": "0",
        "MASTER_PORT": str(_free_port()),
    }
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env={**_job_env(), **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=240) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-6000:]
    _check_ranks(tmp_path, "SLURMEnvironment")
