"""Pipeline schedules as plans: the ordered forward / backward actions each stage runs in one step. Pure.

Owns the orders smp offers — "simple" (GPipe: every forward, then every backward, in waves of at most
``active_microbatches``), "interleaved" (1F1B: a backward as early as possible, at most ``active_microbatches``
in flight) — the forward-only order of evaluation, Megatron's interleaved order for several model chunks
("virtual stages") per rank, and `simulate`, which replays a set of plans with non-blocking sends and blocking
receives to prove they cannot deadlock and to measure their makespan. `runtime.py` consumes the plans.

Chunks: with ``chunks_per_stage`` = v the trunk is cut into ``stages * v`` chunks; chunk ``c`` runs on stage
``c % stages``, so activations always travel to the next rank (the last rank wraps to rank 0) and the loss is
computed by the last chunk, on the last stage. With v = 1, chunk == stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PIPELINES",
    "Action",
    "Simulation",
    "build",
    "forward_only",
    "gpipe",
    "interleaved_virtual",
    "one_f_one_b",
    "simulate",
]

PIPELINES = ("simple", "interleaved")


@dataclass(frozen=True, slots=True)
class Action:
    """Run the forward (or the backward) of ``microbatch`` through trunk chunk ``chunk``."""

    forward: bool
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{'F' if self.forward else 'B'}{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


def gpipe(*, stages: int, stage: int, microbatches: int, active: int | None = None) -> list[Action]:
    """smp's "simple": forwards of a wave of ``active`` microbatches, then their backwards, wave after wave.

    With ``active`` None (or >= microbatches) this is GPipe: all forwards, then all backwards in the same order.
    """
    _check(stages=stages, stage=stage, microbatches=microbatches)
    wave = _cap(active, microbatches)
    actions: list[Action] = []
    for start in range(0, microbatches, wave):
        members = range(start, min(start + wave, microbatches))
        actions += [Action(True, i, stage) for i in members]
        actions += [Action(False, i, stage) for i in members]
    return actions


def one_f_one_b(*, stages: int, stage: int, microbatches: int, active: int | None = None) -> list[Action]:
    """smp's "interleaved": a backward as early as possible (1F1B, PipeDream-flush), one microbatch ahead.

    Stage ``s`` first runs warm-up forwards, then alternates one forward and one backward, then drains the
    remaining backwards. PipeDream-flush warms up with ``stages - s - 1`` forwards; every stage but the last here
    runs one more (capped by ``active - 1`` and ``microbatches``), so at most ``min(stages - s + 1, active)``
    microbatches hold activations on a stage before the last (the last: 1). Why: in plain 1F1B a stage's next
    forward waits for the gradient of its oldest microbatch, so every microbatch puts two message latencies on the
    critical path (gradient up, activation down) with nothing to hide them; one microbatch ahead, a whole forward
    and backward downstream hide them. smp's pipeline is dynamic to the same end (its default ``active`` is
    ``stages + 2``); gloo cannot tell whether a message has arrived without waiting for it, so the order is fixed.
    `simulate` with ``latency`` shows the difference.
    """
    _check(stages=stages, stage=stage, microbatches=microbatches)
    ahead = 1 if stage < stages - 1 else 0
    warmup = min(stages - stage - 1 + ahead, _cap(active, microbatches) - 1, microbatches)
    actions = [Action(True, i, stage) for i in range(warmup)]
    for offset in range(microbatches - warmup):
        actions += [Action(True, warmup + offset, stage), Action(False, offset, stage)]
    actions += [Action(False, i, stage) for i in range(microbatches - warmup, microbatches)]
    return actions


def interleaved_virtual(*, stages: int, stage: int, microbatches: int, chunks_per_stage: int) -> list[Action]:
    """Megatron's interleaved 1F1B with ``chunks_per_stage`` model chunks per rank (arXiv 2104.04473 §2.2).

    The bubble shrinks by the factor ``chunks_per_stage`` at the cost of that many times more messages. Like
    Megatron, it needs ``microbatches`` to be a multiple of ``stages``.
    """
    _check(stages=stages, stage=stage, microbatches=microbatches)
    v = chunks_per_stage
    if v == 1:
        return one_f_one_b(stages=stages, stage=stage, microbatches=microbatches)
    if microbatches % stages:
        raise ValueError(
            f"the interleaved schedule with {v} chunks per stage needs microbatches to be a multiple of "
            f"pipeline_parallel_degree={stages}, got microbatches={microbatches}; use microbatches="
            f"{max(stages, microbatches - microbatches % stages)} or one chunk per stage."
        )
    group = stages * v
    total = microbatches * v

    def action(k: int, forward: bool) -> Action:
        local = (k % group) // stages
        if not forward:
            local = v - 1 - local
        return Action(forward, (k // group) * stages + k % stages, local * stages + stage)

    warmup = min((stages - stage - 1) * 2 + (v - 1) * stages, total)
    actions = [action(k, True) for k in range(warmup)]
    for offset in range(total - warmup):
        actions += [action(warmup + offset, True), action(offset, False)]
    actions += [action(k, False) for k in range(total - warmup, total)]
    return actions


def forward_only(*, stages: int, stage: int, microbatches: int, chunks_per_stage: int = 1) -> list[Action]:
    """Evaluation: every microbatch forward through this stage's chunks, in microbatch then chunk order."""
    _check(stages=stages, stage=stage, microbatches=microbatches)
    return [Action(True, i, local * stages + stage) for i in range(microbatches) for local in range(chunks_per_stage)]


def build(
    pipeline: str,
    *,
    stages: int,
    stage: int,
    microbatches: int,
    active: int | None = None,
    chunks_per_stage: int = 1,
    training: bool = True,
) -> list[Action]:
    """The plan of ``stage`` for smp's ``pipeline`` setting ("simple" or "interleaved")."""
    if not training:
        return forward_only(stages=stages, stage=stage, microbatches=microbatches, chunks_per_stage=chunks_per_stage)
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r} is not a schedule; use one of {PIPELINES}.")
    if chunks_per_stage > 1:
        if pipeline != "interleaved":
            raise ValueError(
                f"{chunks_per_stage} chunks per stage need pipeline='interleaved'; 'simple' runs one chunk per stage."
            )
        return interleaved_virtual(
            stages=stages, stage=stage, microbatches=microbatches, chunks_per_stage=chunks_per_stage
        )
    make = gpipe if pipeline == "simple" else one_f_one_b
    return make(stages=stages, stage=stage, microbatches=microbatches, active=active)


@dataclass(frozen=True, slots=True)
class Simulation:
    """What `simulate` measured: the step's length and each stage's busy time and peak live microbatches."""

    makespan: float
    busy: tuple[float, ...]
    peak_in_flight: tuple[int, ...]

    @property
    def efficiency(self) -> float:
        """Busy time of the busiest stage over the makespan (1.0: no bubble)."""
        return max(self.busy) / self.makespan


def simulate(
    plans: Sequence[Sequence[Action]], *, forward_time: float = 1.0, backward_time: float = 2.0, latency: float = 0.0
) -> Simulation:
    """Run the per-stage ``plans`` (index = stage) as the runtime does: sends never block, a stage waits for
    the message an action needs, which arrives ``latency`` after the action that sent it ended. Raises
    ``ValueError`` if the plans are incomplete or deadlock."""
    stages = len(plans)
    chunks = 1 + max((a.chunk for plan in plans for a in plan), default=0)
    _check_complete(plans, chunks)
    done: dict[Action, float] = {}
    position = [0] * stages
    free = [0.0] * stages
    live = [0] * stages
    peak = [0] * stages
    busy = [0.0] * stages
    remaining = sum(map(len, plans))
    while remaining:
        progressed = False
        for stage, plan in enumerate(plans):
            while position[stage] < len(plan):
                action = plan[position[stage]]
                needs = _dependencies(action, chunks)
                if any(need not in done for need in needs):
                    break
                cost = forward_time if action.forward else backward_time
                arrivals = (done[need] + (latency if need.chunk != action.chunk else 0.0) for need in needs)
                start = max([free[stage], *arrivals])
                done[action] = free[stage] = start + cost
                busy[stage] += cost
                live[stage] += 1 if action.forward else -1
                peak[stage] = max(peak[stage], live[stage])
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {s: plans[s][position[s]] for s in range(stages) if position[s] < len(plans[s])}
            raise ValueError(f"the plans deadlock: stages wait at {waiting}")
    return Simulation(makespan=max(free), busy=tuple(busy), peak_in_flight=tuple(peak))


def _dependencies(action: Action, chunks: int) -> list[Action]:
    mb, chunk = action.microbatch, action.chunk
    if action.forward:
        return [Action(True, mb, chunk - 1)] if chunk > 0 else []
    needs = [Action(True, mb, chunk)]
    if chunk < chunks - 1:
        needs.append(Action(False, mb, chunk + 1))
    return needs


def _check_complete(plans: Sequence[Sequence[Action]], chunks: int) -> None:
    stages = len(plans)
    for stage, plan in enumerate(plans):
        if len(set(plan)) != len(plan):
            raise ValueError(f"stage {stage}'s plan repeats an action: {list(plan)}")
        foreign = [a for a in plan if a.chunk % stages != stage]
        if foreign:
            raise ValueError(f"stage {stage}'s plan has actions of other stages' chunks: {foreign}")
    forwards = {(a.microbatch, a.chunk) for plan in plans for a in plan if a.forward}
    backwards = {(a.microbatch, a.chunk) for plan in plans for a in plan if not a.forward}
    microbatches = {mb for mb, _ in forwards}
    expected = {(mb, c) for mb in microbatches for c in range(chunks)}
    if forwards != expected or (backwards and backwards != expected):
        raise ValueError("the plans do not run every microbatch through every chunk exactly once")


def _cap(active: int | None, microbatches: int) -> int:
    if active is None:
        return microbatches
    if active < 1:
        raise ValueError(f"active_microbatches={active} must be >= 1")
    return min(active, microbatches)


def _check(*, stages: int, stage: int, microbatches: int) -> None:
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of the {stages} pipeline stages")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
