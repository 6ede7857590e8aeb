"""No hangs, no lost work: a killed rank ends the job with its cause; a scheduler's SIGTERM ends it cleanly; a run
that succeeded frees its process groups before the interpreter exits.

The fault jobs run the way users launch them: this module, run as ``python -m tests.test_fault_tolerance MODE DIR``,
is the training script, and Lightning's own subprocess launcher starts the second rank. Each test launches one job.
"""

import functools
import glob
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

from lightning_smp import SMPStrategy, consolidate_checkpoint
from lightning_smp.fault_tolerance import MAX_STEPS_BETWEEN_VOTES, close_process_groups, end_launched_ranks
from lightning_smp.preemption import PREEMPTED_EXIT_CODE
from lightning_smp.tensor_parallel import TensorParallelModule
from tests.distributed import run_distributed, run_process
from tests.gpt import AdamWGPT
from tests.models import TinyRegressor, quiet_trainer
from tests.parity import FP16_REL, single_device_run

# The job's process-group timeout. It also bounds the wait for the second rank to join, which Lightning's launcher
# starts as a fresh interpreter (~12 s of imports on an idle core, twice that on a loaded one).
TIMEOUT_S = 60
ROOT = Path(__file__).resolve().parent.parent


class _Fault(Callback):
    """At the fourth batch: rank 1 is killed (``kill``), or every rank gets SIGTERM in the middle of writing that
    step's checkpoint (``sigterm``, ``epoch=0-step=4.ckpt``), as a scheduler sends it to every process of a job, or,
    in torchrun's first attempt, rank 1 is killed in the middle of writing its part of that checkpoint
    (``torchrun``)."""

    def __init__(self, mode: str, directory: Path) -> None:
        self.mode, self.directory = mode, directory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.mode == "kill" and trainer.global_step == 3 and trainer.global_rank == 1:
            (self.directory / "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "sigterm" and trainer.global_step == 3:
            original = FileSystemWriter.write_data

            def write_data(writer, plan, planner):
                os.kill(os.getpid(), signal.SIGTERM)  # held until the save is whole
                FileSystemWriter.write_data = original
                return original(writer, plan, planner)

            FileSystemWriter.write_data = write_data
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if self.mode == "torchrun" and trainer.global_step == 3 and trainer.global_rank == 1 and first_attempt:

            def write_half_then_die(writer, plan, planner):
                (Path(writer.path) / "__1_0.distcp").write_bytes(b"half a shard")
                os.kill(os.getpid(), signal.SIGKILL)

            FileSystemWriter.write_data = write_half_then_die


def _job(mode: str, directory: Path) -> None:
    torch.set_num_threads(1)
    trainer = quiet_trainer(
        SMPStrategy(fp16=True, timeout=timedelta(seconds=TIMEOUT_S)),
        devices=2,
        max_steps=6 if mode == "torchrun" else 40,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[_Fault(mode, directory), ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)],
    )
    torch.manual_seed(0)  # the reference's weights
    model = TinyRegressor(num_samples=400)
    try:
        trainer.fit(model, ckpt_path="last" if mode == "torchrun" else None)
    finally:
        print(f"rank {trainer.global_rank} stopped at step {trainer.global_step}", flush=True)
        print(f"rank {trainer.global_rank} resumed from {trainer.ckpt_path}: losses {model.losses}", flush=True)


def _launch(mode: str, directory: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.test_fault_tolerance", mode, str(directory)]
    result = run_process(command, cwd=ROOT, env=env, timeout=300)
    return result, time.time()


@pytest.mark.timeout(360)
def test_killing_one_rank_ends_every_rank_within_the_timeout_with_the_cause(tmp_path):
    result, ended_at = _launch("kill", tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert ended_at - float((tmp_path / "killed_at").read_text()) < TIMEOUT_S  # not a hang until some timeout
    assert "local rank 1" in output and "ended with signal SIGKILL" in output, output[-3000:]
    assert "rank 0 of 2 lost a peer" in output


@pytest.mark.timeout(360)
def test_sigterm_on_every_rank_during_a_save_finishes_the_save_then_saves_the_agreed_step_and_exits_preempted(tmp_path):
    result, _ = _launch("sigterm", tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    # the signal came while step 4's checkpoint was written; every rank stopped after the same later step, at most
    # two vote intervals of MAX_STEPS_BETWEEN_VOTES steps later, instead of training on to max_steps=40
    stopped = {int(step) for step in re.findall(r"rank \d stopped at step (\d+)", output)}
    assert len(re.findall(r"rank \d stopped at step", output)) == 2 and len(stopped) == 1, output[-3000:]
    (last,) = stopped
    assert 5 <= last <= 4 + 2 * MAX_STEPS_BETWEEN_VOTES, output[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != "killed_at")
    assert f"preempted-step={last}.ckpt" in names, names  # the agreed step, saved in ModelCheckpoint's directory
    names.remove(f"preempted-step={last}.ckpt")
    assert all(re.fullmatch(r"epoch=\d+-step=\d+\.ckpt", name) for name in names), names  # nothing half-written
    assert sorted(int(name.split("step=")[1][:-5]) for name in names) == list(range(1, last + 1))
    consolidated = torch.load(consolidate_checkpoint(tmp_path / "epoch=0-step=4.ckpt", tmp_path.parent / "c.pt"))
    assert consolidated["global_step"] == 4  # the checkpoint the signal interrupted is whole


@pytest.mark.timeout(420)
def test_torchrun_restarts_after_a_rank_is_killed_mid_save_and_resumes_from_the_last_whole_checkpoint(tmp_path):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # pytorch#135712, as docs/preemption.md tells users
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "1", "-m", "tests.test_fault_tolerance", "torchrun", str(tmp_path)]
    result = run_process(command, cwd=ROOT, env=env, timeout=360)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    # the first attempt: rank 1 died writing step 4's checkpoint, which was never published; the restarted
    # attempt's "last" is step 3's, whole, and the run finishes
    resumed = re.findall(r"rank (\d) resumed from (\S+): losses \[(.*)\]", output)
    assert sorted(rank for rank, _, _ in resumed) == ["0", "0", "1"], output[-4000:]  # rank 1's first attempt died
    restarted = [(path, losses) for _, path, losses in resumed if path != "None"]
    assert [Path(path).name for path, _ in restarted] == ["epoch=0-step=3.ckpt"] * 2, restarted
    assert all(len(losses.split(",")) == 3 for _, losses in restarted)  # steps 4 to 6
    # ... with the losses of an uninterrupted run: the plain-torch fp16 reference on both replicas' batches
    reference = single_device_run(
        lambda: TinyRegressor(num_samples=400),
        lambda model, batch, step: model.training_step(batch, step),
        steps=6,
        replicas=2,
        fp16=True,
        init_scale=2.0**32,  # SMPStrategy(fp16=True)'s
    )
    per_rank = [[float(value) for value in losses.split(",")] for _, losses in restarted]
    assert [sum(pair) / 2 for pair in zip(*per_rank, strict=True)] == pytest.approx(
        reference["losses"][3:], rel=FP16_REL
    )
    assert set(re.findall(r"rank \d stopped at step (\d+)", output)) >= {"6"}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [int(name.split("step=")[1][:-5]) for name in names] == [1, 2, 3, 4, 5, 6], names  # none half-written


class _Launcher:
    def __init__(self, procs):
        self.procs = procs


@pytest.mark.timeout(60)
def test_the_launching_rank_kills_a_rank_stuck_outside_collectives_and_reports_each_ending():
    commands = ["import time; time.sleep(60)", "raise SystemExit(3)", "pass"]
    procs = [subprocess.Popen([sys.executable, "-c", command]) for command in commands]
    try:
        started = time.monotonic()
        notes = end_launched_ranks(_Launcher(procs), grace_s=2.0)
        assert time.monotonic() - started < 10
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert notes == [
        f"local rank 1 (pid {procs[0].pid}) had not stopped 2s later: killed it",
        f"local rank 2 (pid {procs[1].pid}) ended with exit code 3",
    ]


def _count_votes(rank: int) -> tuple[int, int]:
    """A 40-step dp=2 fp32 fit (DDP reduces in C++); every Python-level all-reduce in it is a SIGTERM vote."""
    torch.set_num_threads(1)
    votes = 0
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        nonlocal votes
        votes += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    trainer = quiet_trainer(SMPStrategy(), devices=2, max_steps=40, limit_val_batches=0)
    trainer.fit(TinyRegressor(num_samples=400))
    return votes, trainer.global_step


@pytest.mark.timeout(120)
def test_the_sigterm_vote_is_not_a_collective_every_step_when_steps_are_short():
    (votes, steps), other = run_distributed(_count_votes, 2, timeout=100)
    assert steps == 40 and other == (votes, steps)
    # about one per VOTE_INTERVAL_S of training (steps here take milliseconds), at least every 8 steps
    assert steps // MAX_STEPS_BETWEEN_VOTES <= votes <= steps // 2


def _threads() -> list[str]:
    return sorted(Path(path).read_text().strip() for path in glob.glob("/proc/self/task/*/comm"))


def _three_runs_then_exit(rank: int) -> dict[str, Any]:
    """dp=2 fp16, tp=2 and pp=2 fits in one process (as in a notebook), then what runs at interpreter exit; and
    whether each run's precision plugin, tensor-parallel layers and pipeline transport still reach a process group
    after it (they use the groups through their run's topology, the groups' one owner)."""
    torch.set_num_threads(1)
    runs = [({"fp16": True}, TinyRegressor()), ({"tensor_parallel_degree": 2}, AdamWGPT())]
    runs.append(({"pipeline_parallel_degree": 2, "microbatches": 2}, AdamWGPT()))
    uses: dict[str, list[Callable[[], Any]]] = {"precision plugin": [], "tensor-parallel layer": [], "transport": []}
    owners = []
    for strategy_kwargs, model in runs:
        strategy = SMPStrategy(**strategy_kwargs)
        quiet_trainer(strategy, devices=2, max_steps=2, limit_val_batches=0).fit(model)
        owner = strategy.topology
        owners.append(owner)
        plugin = strategy.precision_plugin
        assert plugin.topology is owner
        uses["precision plugin"].append(lambda plugin=plugin: plugin.topology.group("dp"))
        for layer in model.modules():
            if isinstance(layer, TensorParallelModule) and layer.tp_distributed:
                assert layer.tp_context.owner is owner
                uses["tensor-parallel layer"].append(lambda tp=layer.tp_context: tp.group)
        if strategy.pipeline is not None:
            transport = strategy.pipeline._transport  # the engine's, made by its first step
            send = functools.partial(transport.send_activation, torch.ones(1), dst=transport.peer(1), tag=9)
            uses["transport"].append(send)
    before = _threads()
    close_process_groups()
    after = _threads()
    return {
        "before": before,
        "after": after,
        "released": [owner.released for owner in owners],
        "reaching": {what: [_reaches_a_group(use) for use in calls] for what, calls in uses.items()},
    }


def _reaches_a_group(use: Callable[[], Any]) -> bool:
    try:
        use()
    except RuntimeError as error:
        assert "were released when it ended" in str(error), error
        return False
    return True


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through Linux's /proc")
@pytest.mark.timeout(180)
def test_process_groups_are_freed_at_exit_after_runs_that_succeeded():
    for result in run_distributed(_three_runs_then_exit, 2, timeout=150):
        assert any(name.startswith("pt_gloo") for name in result["before"])  # held by the runs' objects
        assert not [name for name in result["after"] if "gloo" in name], result["after"]
        assert result["released"] == [True, True, True]  # each run's topology, by one call at exit
        for what, reaching in result["reaching"].items():
            assert reaching and not any(reaching), what  # every holder looks its groups up through that owner


if __name__ == "__main__":
    _job(sys.argv[1], Path(sys.argv[2]))
