"""The one launcher for multi-process tests: ``run_distributed`` starts the ranks, ``launch_once`` shares one launch
between the tests that read it, ``init_gloo`` joins the ranks, ``run_benchmark`` runs a script of benchmarks/ as a
user does.

Each rank is a fresh process forked from a fork server that imported torch, Lightning, transformers and this
package once per test session (``_PRELOAD``): a rank starts in a fraction of a second instead of spending ~10 s of
CPU on imports, and still shares no state with other ranks or earlier launches. It gets the test process's
environment plus the one torchrun would give it (and ``TORCHELASTIC_RUN_ID``), so a Lightning Trainer built inside
a rank detects an external launch and does not spawn processes itself. The parent never hangs: the first rank
error, a rank that dies silently, or the timeout ends every rank and fails the test.
"""

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

__all__ = ["init_gloo", "launch_once", "return_freed_memory_at_once", "run_benchmark", "run_distributed"]

# What the fork server imports before it forks the first rank (each is imported by nearly every rank's target).
# Nothing here may start a thread: the server forks, and a fork copies only the forking thread.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "torchmetrics", "transformers", "lightning_smp"]
# How long the parent keeps reading after a rank exited without a result (its message may be in flight).
_DRAIN_S = 2.0
# How long ranks that all returned may take to exit before they are terminated.
_EXIT_GRACE_S = 10.0
# How long a rank whose target returned waits for the others at the closing barrier.
_BARRIER_S = 5.0
_REPO = Path(__file__).resolve().parents[1]


def run_distributed(
    target: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, env: dict | None = None
) -> list:
    """Run ``target(rank, *args)`` in ``world_size`` new processes; return their results in rank order.

    ``target`` must be a module-level function of an importable module (``tests.test_x.fn``), its arguments and
    result picklable. ``env`` is added to every rank's environment. A rank that raises fails the test with its
    traceback (``pytest.fail``; match it with ``pytest.raises(pytest.fail.Exception, match=...)``). ``timeout``
    counts from the ranks' start (the fork server's imports, once per session, come before it).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: at this session's first launch
    results_queue = ctx.Queue()
    base_env = {
        **os.environ,  # the server forks with the environment it started with; a rank gets this process's
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        "TORCHELASTIC_RUN_ID": "test",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    processes = []
    try:
        for rank in range(world_size):
            rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            # Not daemonic, so that a rank may start DataLoader workers; the finally below ends every rank.
            process = ctx.Process(target=_child, args=(target, rank, args, rank_env, results_queue), name=f"rank{rank}")
            process.start()
            processes.append(process)
        results = _collect(processes, results_queue, timeout)
        grace_deadline = time.monotonic() + _EXIT_GRACE_S
        for process in processes:  # let finished ranks exit on their own before the finally ends stragglers
            process.join(timeout=max(0.0, grace_deadline - time.monotonic()))
        return results
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        results_queue.close()


_launched: dict[tuple, list | BaseException] = {}


def launch_once(target: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list:
    """``run_distributed(target, world_size, *args)`` once per test session: every test that asks for the same
    launch reads the same records, so one ``target`` runs every check of a world size and each test asserts on its
    part. A failed launch fails every test that asks for it, without launching again. ``args`` must have a stable
    ``repr`` (they are part of the key)."""
    key = (target.__module__, target.__qualname__, world_size, repr(args))
    if key not in _launched:
        try:
            _launched[key] = run_distributed(target, world_size, *args, timeout=timeout)
        except (Exception, pytest.fail.Exception) as error:
            _launched[key] = error
    outcome = _launched[key]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def run_process(
    command: list[str], *, timeout: float, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``command`` and capture its output, as ``subprocess.run`` does; past the timeout its whole process group
    ends, the ranks it launched included (``subprocess.run`` kills only the first process), so that they do not go
    on taking the cores of the tests that follow, and the test fails."""
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            pytest.fail(f"{' '.join(map(str, command))} ran past {timeout} s", pytrace=False)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_benchmark(script: str, *args: str, timeout: float = 240) -> str:
    """Run ``benchmarks/<script> ARGS`` in a fresh interpreter from the repository root (`run_process`); returns its
    stdout, fails with its stderr's tail."""
    result = run_process([sys.executable, str(_REPO / "benchmarks" / script), *args], timeout=timeout, cwd=_REPO)
    assert result.returncode == 0, f"{script} failed:\n{result.stderr[-3000:]}"
    return result.stdout


def init_gloo() -> None:
    """Initialise a gloo default group from the environment ``run_distributed`` set up."""
    dist.init_process_group("gloo")


def _child(target: Callable[..., Any], rank: int, args: tuple, env: dict[str, str], results_queue: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        # Plain pickle bytes: torch's queue reducers would share tensors through memory this process owns.
        results_queue.put((rank, True, pickle.dumps(target(rank, *args))))
    except BaseException:
        # Report before cleaning up: destroying the group may block while other ranks wait in a collective.
        results_queue.put((rank, False, traceback.format_exc()))
    else:
        _wait_for_the_other_ranks()
    if dist.is_initialized():
        dist.destroy_process_group()


def _wait_for_the_other_ranks() -> None:
    """Rank 0 serves the job's store: had it exited as soon as its own target returned, a rank still creating a
    group it is not in (a tp group of ranks 2 and 3) would lose the store mid-rendezvous ("Connection reset by
    peer"). Waiting at a barrier keeps the store up until every rank is done; bounded, because a rank whose peer
    failed on purpose (the fault-tolerance tests) has no one to meet."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # the results are already sent; a peer that is gone ends the wait early
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=_BARRIER_S))


def _collect(processes: list, results_queue: Any, timeout: float) -> list:
    world_size = len(processes)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    silent_exit_at: float | None = None
    while len(results) < world_size:
        now = time.monotonic()
        if now > deadline:
            running = [rank for rank, process in enumerate(processes) if process.is_alive()]
            pytest.fail(f"timed out after {timeout}s; ranks still running: {running}", pytrace=False)
        try:
            rank, ok, payload = results_queue.get(timeout=min(0.5, deadline - now))
        except queue.Empty:
            dead = [r for r, p in enumerate(processes) if r not in results and p.exitcode is not None]
            if dead:
                silent_exit_at = silent_exit_at or now
                if now - silent_exit_at > _DRAIN_S:
                    codes = {r: processes[r].exitcode for r in dead}
                    pytest.fail(f"ranks exited without a result (rank: exit code): {codes}", pytrace=False)
            continue
        if not ok:
            pytest.fail(f"rank {rank} of {world_size} raised:\n{payload}", pytrace=False)
        results[rank] = pickle.loads(payload)
    return [results[rank] for rank in range(world_size)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def return_freed_memory_at_once() -> None:
    """Make a process's peak resident memory measure live tensors (call it in the rank before measuring): glibc
    raises its mmap threshold after the first large free, and then keeps freed multi-MiB blocks in its heap, so a
    peak would depend on what the process freed before."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


_M_MMAP_THRESHOLD = -3
