"""Fault tolerance: a failure or a scheduler's signal on one rank ends every rank, promptly, with the cause shown;
a run that succeeded ends with exit code 0 on every rank.

It owns the agreement on a scheduler's signal (SIGTERM, SLURM's requeue signal: every rank stops after the same
training step, voted without a blocking collective), the explanation added to an error when a peer rank was lost,
in the process that launched the other ranks, ending them and saying how each one ended, and closing the process
groups at interpreter exit. It does not own what a stop saves (`preemption`), checkpoint atomicity
(`checkpoint/`) nor the timeout value (the strategy's `timeout`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import signal
import subprocess
import time
import weakref
from datetime import timedelta
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_smp._compat import install_sigterm_hooks, mark_sigterm_received, stop_child_process_observer
from lightning_smp.host_mirror import HostMirror
from lightning_smp.topology import Topology

__all__ = [
    "PEER_LOST_MESSAGES",
    "SchedulerSignal",
    "close_process_groups",
    "close_process_groups_at_exit",
    "end_launched_ranks",
    "explain_failure",
    "forget_metric_groups",
]

log = logging.getLogger(__name__)


VOTE_INTERVAL_S = 0.25
"""About how often, in seconds of training, the ranks vote on a scheduler's signal (every step once steps take
this long or longer)..."""
MAX_STEPS_BETWEEN_VOTES = 8
"""...and at least every this many training steps (steps that slow down cannot delay a stop for long)."""
STOP_VOTE = 1e30
"""A rank's vote once it noted SIGTERM (larger than any seconds per step, finite in fp32)."""
REQUEUE_VOTE = math.inf
"""A rank's vote once it noted the cluster's requeue signal (SLURM's ``--signal``): stop, and requeue the job."""


class SchedulerSignal:
    """SIGTERM and SLURM's requeue signal stop every rank after the same training step, with no blocking collective
    per step; the handler only notes the signal.

    Lightning 2.6's handler broadcasts inside the signal handler (`_SignalConnector._sigterm_notifier_fn`) and each
    rank acts on its own flag at the end of a step. When a scheduler signals every rank, as SLURM and Kubernetes
    do, those broadcasts interleave with the step's collectives and the job hangs until the process-group timeout.
    Lightning also broadcasts rank 0's flag at the start of every training step (`_broadcast_sigterm_tensor`): a
    blocking collective and a host read per step, which lines the ranks up and so costs a pipeline the overlap
    of one step's end with the next one's start. Under ``SLURMEnvironment(auto_requeue=True)`` its requeue signal's
    handler saves a checkpoint inside the handler, a collective that can start on one rank mid-schedule: it is
    replaced by the same note.

    Here the handler only notes the signal (and passes it to the ranks this process launched), and the per-step
    broadcast is replaced by a vote: at the start of a training step each rank starts a non-blocking all-reduce
    (max) of its vote and reads the vote started at the previous voting step (long since arrived; on CUDA through
    a non-blocking copy). A rank votes `STOP_VOTE` once it noted SIGTERM, `REQUEUE_VOTE` once it noted the requeue
    signal, else its seconds per training step since the last vote. Every rank reads the same result at the same
    step: a stop vote stops all of them before that step (a SIGTERMException, as Lightning's broadcast raises;
    ``stopped`` and ``requeue`` say so, and `preemption` saves); otherwise the result sets how many steps pass
    until the next vote: about `VOTE_INTERVAL_S` of training, at most `MAX_STEPS_BETWEEN_VOTES` steps, every step
    when steps take `VOTE_INTERVAL_S` or longer. So once steps take 0.25 s or more, every rank stops within two
    steps of the signal (the step it arrived in and the next: the vote started at the next step's start is read
    one step later); with shorter steps, within two intervals and a step (about 0.5 s of training, or 2 × 8 steps,
    whichever comes first). A signal that arrives during a checkpoint save or during validation is only noted, and
    acted on at the next vote. A one-rank run has no vote: Lightning's loops stop it after the current batch.
    """

    def __init__(self) -> None:
        self._watched: pl.Trainer | None = None
        self._noted = 0.0
        self._requeue_signal: int | None = None
        self._vote: tuple[dist.Work, Tensor] | None = None
        self._mirror: HostMirror | None = None
        self._steps_between_votes = 1
        self._steps_to_vote = 0
        self._voted_at = 0.0
        self.stopped = False
        """Whether the ranks agreed to stop (a one-rank run: it noted a signal) in the current fit."""
        self.requeue = False
        """Whether the stop came from the cluster's requeue signal (on some rank)."""

    def install(self, trainer: pl.Trainer) -> None:
        self._watched, self._noted, self._vote = trainer, 0.0, None
        self._steps_between_votes, self._steps_to_vote = 1, 0
        self.stopped = self.requeue = False
        environment = trainer.strategy.cluster_environment
        self._requeue_signal = getattr(environment, "requeue_signal", None)  # SLURMEnvironment's
        install_sigterm_hooks(trainer, on_signal=self._note, before_step=self._agree)
        device = trainer.strategy.root_device
        self._mirror = HostMirror(device) if device.type == "cuda" and trainer.world_size > 1 else None

    def forget_vote(self) -> None:
        """Drop the vote in flight (it holds its process group); at exit, once the groups are destroyed."""
        self._vote = None

    def _note(self, signum: int, frame: Any) -> None:
        trainer = self._watched
        log.info("lightning_smp: rank %d received signal %d", trainer.global_rank, signum)
        if not self._noted and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        vote = REQUEUE_VOTE if signum == self._requeue_signal else STOP_VOTE
        self._noted = max(self._noted, vote)
        if trainer.state.fn != TrainerFn.FITTING or trainer.world_size == 1:
            # no training steps to agree at (or no one to agree with): it stops at its next batch
            self.stopped, self.requeue = True, self._noted == REQUEUE_VOTE
            mark_sigterm_received(trainer)

    def _agree(self) -> None:
        """At the start of every training step on every rank (in place of Lightning's broadcast); collective at
        the voting steps, which every rank counts alike. With gradient accumulation it runs at every batch; an
        agreed stop waits for the batch that starts an optimizer step (the accumulated gradients are not saved)."""
        trainer = self._watched
        if self.stopped:  # agreed on at a batch inside an accumulation
            self._stop_at_an_optimizer_step(trainer)
            return
        self._steps_to_vote -= 1
        if self._steps_to_vote > 0:
            return
        now = time.monotonic()
        seconds_per_step = 0.0
        if self._vote is not None:
            work, votes = self._vote
            if self._mirror is None:
                work.wait()  # gloo: the previous vote has arrived
                result = votes.item()
            else:
                result = self._mirror.read()
            if result >= STOP_VOTE:
                self._vote = None
                self.stopped, self.requeue = True, result == REQUEUE_VOTE
                self._stop_at_an_optimizer_step(trainer)
                return
            seconds_per_step = (now - self._voted_at) / self._steps_between_votes
            steps = int(VOTE_INTERVAL_S / result) if result > 0 else 1
            self._steps_between_votes = min(max(steps, 1), MAX_STEPS_BETWEEN_VOTES)
        vote = self._noted or seconds_per_step
        votes = torch.tensor(vote, device=trainer.strategy.root_device)
        work = dist.all_reduce(votes, op=dist.ReduceOp.MAX, async_op=True)
        if self._mirror is not None:
            work.wait()  # NCCL: the stream waits, not the host
            self._mirror.capture(votes)
        self._vote = (work, votes)
        self._voted_at = now
        self._steps_to_vote = self._steps_between_votes

    @staticmethod
    def _stop_at_an_optimizer_step(trainer: pl.Trainer) -> None:
        completed = trainer.fit_loop.epoch_loop.batch_progress.current.completed  # this epoch's, alike on every rank
        if completed % trainer.accumulate_grad_batches == 0:
            mark_sigterm_received(trainer)
            raise SIGTERMException  # as Lightning's broadcast does, before the step


# What gloo and NCCL say when a peer has died or stopped answering.
PEER_LOST_MESSAGES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "collective operation timeout",
    "communicator was aborted",
)


def end_launched_ranks(launcher: Any, *, grace_s: float) -> list[str]:
    """In the process that launched this node's other ranks (Lightning's subprocess launcher): close this rank's
    process groups, so ranks waiting on it fail at once rather than at the timeout, wait up to ``grace_s`` for
    the launched ranks to stop, kill those that do not (one stuck outside any collective never would), and say how
    each one that failed ended. Elsewhere (torchrun, SLURM, ...) the launcher ends the job; returns nothing."""
    procs = getattr(launcher, "procs", None) or []
    if not procs:
        return []
    stop_child_process_observer()  # Lightning's: it would SIGKILL this process mid-report
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as error:
            log.debug("lightning_smp: closing the process groups after a failure: %s", error)
    deadline = time.monotonic() + grace_s
    notes = []
    for local_rank, proc in enumerate(procs, start=1):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            notes.append(f"local rank {local_rank} (pid {proc.pid}) had not stopped {grace_s:.0f}s later: killed it")
            continue
        if proc.returncode:
            how = f"exit code {proc.returncode}"
            if proc.returncode < 0 and -proc.returncode in signal.valid_signals():
                how = f"signal {signal.Signals(-proc.returncode).name}"
            notes.append(f"local rank {local_rank} (pid {proc.pid}) ended with {how}")
    return notes


def explain_failure(
    exception: BaseException, *, rank: int, world_size: int, timeout: timedelta | None, launcher: Any
) -> list[str]:
    """Lines to add to ``exception``: why this rank stopped when a peer was lost, and how the ranks this process
    launched ended (after ending them)."""
    notes = []
    if world_size > 1 and any(sign in str(exception) for sign in PEER_LOST_MESSAGES):
        notes.append(
            f"lightning_smp: rank {rank} of {world_size} lost a peer: another rank of this job died or did not "
            f"answer within the process-group timeout ({timeout}; `SMPStrategy(timeout=...)`), so this rank stops "
            "too. The first error is in that rank's output; a rank killed by the system (out of memory, a "
            "scheduler) prints nothing, its exit code below says so."
        )
    grace_s = min(timeout.total_seconds(), 30.0) if timeout else 30.0
    return notes + end_launched_ranks(launcher, grace_s=grace_s)


class _HoldsProcessGroups(Protocol):
    failed: bool
    """Whether this run's last fit/validate/test ended in an exception."""

    def forget_process_groups(self) -> None:
        """Drop what this door holds that reaches its process groups, besides its runs' topologies (released next,
        `Topology.release`); the groups are destroyed after."""


def forget_metric_groups(model: nn.Module) -> None:
    """Drop the process groups ``model``'s torchmetrics metrics hold (a door's ``forget_process_groups``).

    ``Metric.process_group`` is torchmetrics' own API, which takes a group object and cannot look one up through
    the run's topology: the strategy sets it to the replicas' group (so a metric counts each sample once), and a
    user may set one. Every other holder reaches the groups through the topology, which releases them itself."""
    for module in model.modules():
        if isinstance(module, Metric):
            module.process_group = None


_at_exit: weakref.WeakSet[_HoldsProcessGroups] = weakref.WeakSet()
_owners: weakref.WeakSet[Topology] = weakref.WeakSet()
_registered = False


def close_process_groups_at_exit(run: _HoldsProcessGroups, topology: Topology) -> None:
    """Have `close_process_groups` run at interpreter exit, for ``run`` (a door: a strategy, a script) and the others
    registered in this process, and release ``topology``, the owner of the groups of the run it starts (each fit or
    validate of a Trainer starts one; objects of an earlier run may still look its groups up)."""
    global _registered
    _at_exit.add(run)
    _owners.add(topology)
    if not _registered:
        atexit.register(close_process_groups)
        _registered = True


def close_process_groups() -> None:
    """Destroy the process groups and free them, while the interpreter is still whole; nothing after a failure.

    torch's groups keep threads until the group object itself is freed (gloo: a network loop and two workers per
    group); ``destroy_process_group`` alone drops only torch's own references, and gloo's ``shutdown`` stops no
    thread. A group still referenced at exit (by a topology, a DDP model, a metric) is torn down during interpreter
    finalization, where a rank of a run that succeeded can abort: "terminate called without an active exception",
    exit code -6. So the registered doors drop what they hold (and settle their pipelines), each run's topology, the
    one owner of its groups, releases them (`Topology.release`: the layers, transports, optimizers and precision
    plugins of that run reach them only through it), and a garbage collection frees what held them now. In that
    order: the holders (a DDP model's reducer among them) are freed while torch still registers the groups, so that
    each group's last reference is dropped by ``destroy_process_group``, which releases the GIL while gloo's workers
    stop; dropped by a reducer instead (the GIL held), a worker that still has to release a finished collective's
    tensors waits for the GIL forever (pytorch #56297). After a failure nothing is done here: destroying NCCL groups
    with work in flight can block, and the job is ending anyway (`end_launched_ranks`, the launcher).
    """
    runs = list(_at_exit)
    if any(run.failed for run in runs):
        return
    for run in runs:
        run.forget_process_groups()
    for topology in list(_owners):
        topology.release()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
