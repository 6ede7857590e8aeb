"""Pipeline schedules as plans: the ordered forward / backward actions each stage runs in one step. Pure.

Owns the orders smp offers — "simple" (GPipe: every forward, then every backward, in waves of at most
``active_microbatches``), "interleaved" (1F1B: a backward as early as possible, at most ``active_microbatches``
in flight) — ours, "zero_bubble" (ZB-H1, Qi et al. 2023, arXiv 2401.10241: each backward split into the input
gradient B, on the critical path, and the weight gradient W, placed to fill 1F1B's bubble), the forward-only order
of evaluation, Megatron's interleaved order for several model chunks ("virtual stages") per rank, and
`simulate`, which replays a set of plans with non-blocking sends and blocking receives to prove they cannot
deadlock and to measure their makespan and bubble. `runtime.py` consumes the plans.

Chunks: with ``chunks_per_stage`` = v the trunk is cut into ``stages * v`` chunks; chunk ``c`` runs on stage
``c % stages``, so activations always travel to the next rank (the last rank wraps to rank 0) and the loss is
computed by the last chunk, on the last stage. With v = 1, chunk == stage.
"""

from __future__ import annotations

import functools
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
    "peak_in_flight",
    "simulate",
    "zero_bubble",
    "zero_bubble_h1",
]

PIPELINES = ("simple", "interleaved", "zero_bubble")


FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


@dataclass(frozen=True, slots=True)
class Action:
    """Run one part of ``microbatch`` through trunk chunk ``chunk``: its forward (``"F"``), its backward
    (``"B"``), or the weight-gradient part of its backward (``"W"``). A plan that holds a W for a microbatch and
    chunk runs its B as the input gradient only (what the previous chunk waits for) and its W later; without
    one, B is the whole backward."""

    kind: str
    microbatch: int
    chunk: int = 0

    @property
    def forward(self) -> bool:
        return self.kind == FORWARD

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


def gpipe(*, stages: int, stage: int, microbatches: int, active: int | None = None) -> list[Action]:
    """smp's "simple": forwards of a wave of ``active`` microbatches, then their backwards, wave after wave.

    With ``active`` None (or >= microbatches) this is GPipe: all forwards, then all backwards in the same order.
    """
    _check(stages=stages, stage=stage, microbatches=microbatches)
    wave = _cap(active, microbatches)
    actions: list[Action] = []
    for start in range(0, microbatches, wave):
        members = range(start, min(start + wave, microbatches))
        actions += [Action(FORWARD, i, stage) for i in members]
        actions += [Action(BACKWARD, i, stage) for i in members]
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
    warmup = _warmup(stages=stages, stage=stage, microbatches=microbatches, cap=_cap(active, microbatches))
    actions = [Action(FORWARD, i, stage) for i in range(warmup)]
    for offset in range(microbatches - warmup):
        actions += [Action(FORWARD, warmup + offset, stage), Action(BACKWARD, offset, stage)]
    actions += [Action(BACKWARD, i, stage) for i in range(microbatches - warmup, microbatches)]
    return actions


def zero_bubble(*, stages: int, stage: int, microbatches: int, active: int | None = None) -> list[Action]:
    """Ours, "zero_bubble": ZB-H1 (Qi et al. 2023, arXiv 2401.10241 §3), 1F1B with its backwards split where that
    shortens the step.

    B (the input gradient, what the previous stage waits for) runs where `one_f_one_b` runs the backward; the W
    that follows it (the weight gradients) waits, and the held-back W's fill the time where 1F1B leaves a stage
    idle, while the earlier stages finish their backwards (`zero_bubble_h1`). A split backward costs more than a
    whole one (its second pass through the graph), and most of ZB-H1's W's only trade places with the next B in
    the steady state, where no stage idles: so, starting from ZB-H1's plans, each W in turn is merged back into
    its B (the backward then runs whole) wherever `simulate` with F = B = W says the step does not get longer,
    with messages free and with a latency (`_MERGE_COSTS`). At pp=2 with 8 microbatches 5 of the last stage's 8
    backwards stay split, with 16, 8 of 16; the bubble is ZB-H1's, a third of 1F1B's. Plans with more than
    ``MERGE_SEARCH_LIMIT`` held W's keep them all (the search would take seconds).
    """
    return list(_merged_zero_bubble(stages, microbatches, active)[stage])


MERGE_SEARCH_LIMIT = 128
"""The most held W's `zero_bubble` tries to merge back (two simulations of every stage's plan each: about a second
at this limit)."""


@functools.cache
def _merged_zero_bubble(stages: int, microbatches: int, active: int | None) -> tuple[tuple[Action, ...], ...]:
    plans = [zero_bubble_h1(stages=stages, stage=s, microbatches=microbatches, active=active) for s in range(stages)]
    held = [(s, action) for s, plan in enumerate(plans) for action in plan if action.kind == WEIGHT]
    if len(held) <= MERGE_SEARCH_LIMIT:
        shortest = [simulate(plans, **costs).makespan for costs in _MERGE_COSTS]
        for s, weight in held:
            trial = [*plans[:s], [a for a in plans[s] if a != weight], *plans[s + 1 :]]
            if all(
                simulate(trial, **costs).makespan <= most for costs, most in zip(_MERGE_COSTS, shortest, strict=True)
            ):
                plans = trial
    return tuple(tuple(plan) for plan in plans)


_MERGE_COSTS = (
    dict(forward_time=1.0, backward_time=2.0, weight_time=1.0),
    dict(forward_time=1.0, backward_time=2.0, weight_time=1.0, latency=0.3),
)
"""The cost models a merged W must not lengthen the step under: F = B = W, with messages free and with messages
taking 0.3 of a forward (held W's also fill the waits for messages, so latency keeps more of them)."""


def zero_bubble_h1(*, stages: int, stage: int, microbatches: int, active: int | None = None) -> list[Action]:
    """ZB-H1 as the paper builds it: every backward of a stage that holds W's back split.

    Each stage holds back as many W's as keep its live microbatches (forward to W) at the first stage's peak under
    1F1B, ``stages + 1`` (capped by ``active``): none on the first stage, ``s`` on stage ``s``, ``stages`` on the
    last. It runs the oldest held W after each B once more are held, the rest after its last B. The backwards
    travelling down the stages then carry B alone, so with F = B = W the bubble is a third of 1F1B's, at 1F1B's
    peak of live microbatches over the stages. The warm-up is `one_f_one_b`'s (one microbatch ahead). A stage that
    holds none runs each backward whole.
    """
    _check(stages=stages, stage=stage, microbatches=microbatches)
    cap = _cap(active, microbatches)
    warmup = _warmup(stages=stages, stage=stage, microbatches=microbatches, cap=cap)
    hold = min(stages + 1, cap) - 1 - warmup
    actions = [Action(FORWARD, i, stage) for i in range(warmup)]
    held: list[int] = []

    def backward(i: int) -> None:
        actions.append(Action(BACKWARD, i, stage))
        if hold > 0:
            held.append(i)
            if len(held) > hold:
                actions.append(Action(WEIGHT, held.pop(0), stage))

    for offset in range(microbatches - warmup):
        actions.append(Action(FORWARD, warmup + offset, stage))
        backward(offset)
    for i in range(microbatches - warmup, microbatches):
        backward(i)
    return actions + [Action(WEIGHT, i, stage) for i in held]


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
        return Action(FORWARD if forward else BACKWARD, (k // group) * stages + k % stages, local * stages + stage)

    warmup = min((stages - stage - 1) * 2 + (v - 1) * stages, total)
    actions = [action(k, True) for k in range(warmup)]
    for offset in range(total - warmup):
        actions += [action(warmup + offset, True), action(offset, False)]
    actions += [action(k, False) for k in range(total - warmup, total)]
    return actions


def forward_only(*, stages: int, stage: int, microbatches: int, chunks_per_stage: int = 1) -> list[Action]:
    """Evaluation: every microbatch forward through this stage's chunks, in microbatch then chunk order."""
    _check(stages=stages, stage=stage, microbatches=microbatches)
    chunks = [local * stages + stage for local in range(chunks_per_stage)]
    return [Action(FORWARD, i, chunk) for i in range(microbatches) for chunk in chunks]


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
    """The plan of ``stage`` for the ``pipeline`` setting: smp's "simple" or "interleaved", or "zero_bubble"."""
    if not training:
        return forward_only(stages=stages, stage=stage, microbatches=microbatches, chunks_per_stage=chunks_per_stage)
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r} is not a schedule; use one of {PIPELINES}.")
    if chunks_per_stage > 1:
        if pipeline != "interleaved":
            raise ValueError(
                f"{chunks_per_stage} chunks per stage need pipeline='interleaved'; {pipeline!r} runs one chunk per "
                "stage."
            )
        return interleaved_virtual(
            stages=stages, stage=stage, microbatches=microbatches, chunks_per_stage=chunks_per_stage
        )
    make = {"simple": gpipe, "interleaved": one_f_one_b, "zero_bubble": zero_bubble}[pipeline]
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

    @property
    def bubble(self) -> float:
        """The time the busiest stage idles in the step: makespan minus its busy time."""
        return self.makespan - max(self.busy)


def simulate(
    plans: Sequence[Sequence[Action]],
    *,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    weight_time: float | None = None,
    latency: float = 0.0,
) -> Simulation:
    """Run the per-stage ``plans`` (index = stage) as the runtime does: sends never block, a stage waits for
    the message an action needs, which arrives ``latency`` after the action that sent it ended. A whole backward
    takes ``backward_time``; split, its W takes ``weight_time`` (default half of it) and its B the rest. A
    microbatch is live on a stage from its forward to the end of its backward (its W, if split). Raises
    ``ValueError`` if the plans are incomplete or deadlock."""
    stages = len(plans)
    chunks = 1 + max((a.chunk for plan in plans for a in plan), default=0)
    _check_complete(plans, chunks)
    weight = backward_time / 2 if weight_time is None else weight_time
    split = {(a.microbatch, a.chunk) for plan in plans for a in plan if a.kind == WEIGHT}
    costs = {FORWARD: forward_time, WEIGHT: weight}
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
                whole = (action.microbatch, action.chunk) not in split
                cost = costs.get(action.kind, backward_time if whole else backward_time - weight)
                arrivals = (done[need] + (latency if need.chunk != action.chunk else 0.0) for need in needs)
                start = max([free[stage], *arrivals])
                done[action] = free[stage] = start + cost
                busy[stage] += cost
                live[stage] += _live_change(action, whole)
                peak[stage] = max(peak[stage], live[stage])
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {s: plans[s][position[s]] for s in range(stages) if position[s] < len(plans[s])}
            raise ValueError(f"the plans deadlock: stages wait at {waiting}")
    return Simulation(makespan=max(free), busy=tuple(busy), peak_in_flight=tuple(peak))


def peak_in_flight(plan: Sequence[Action]) -> int:
    """The most microbatches whose activations one stage's ``plan`` holds at once (forward to end of backward)."""
    split = {(a.microbatch, a.chunk) for a in plan if a.kind == WEIGHT}
    live = peak = 0
    for action in plan:
        live += _live_change(action, (action.microbatch, action.chunk) not in split)
        peak = max(peak, live)
    return peak


def _live_change(action: Action, whole: bool) -> int:
    if action.kind == FORWARD:
        return 1
    return -1 if action.kind == WEIGHT or whole else 0


def _dependencies(action: Action, chunks: int) -> list[Action]:
    mb, chunk = action.microbatch, action.chunk
    if action.forward:
        return [Action(FORWARD, mb, chunk - 1)] if chunk > 0 else []
    if action.kind == WEIGHT:
        return [Action(BACKWARD, mb, chunk)]
    needs = [Action(FORWARD, mb, chunk)]
    if chunk < chunks - 1:
        needs.append(Action(BACKWARD, mb, chunk + 1))
    return needs


def _check_complete(plans: Sequence[Sequence[Action]], chunks: int) -> None:
    stages = len(plans)
    for stage, plan in enumerate(plans):
        if len(set(plan)) != len(plan):
            raise ValueError(f"stage {stage}'s plan repeats an action: {list(plan)}")
        foreign = [a for a in plan if a.chunk % stages != stage]
        if foreign:
            raise ValueError(f"stage {stage}'s plan has actions of other stages' chunks: {foreign}")
    forwards = {(a.microbatch, a.chunk) for plan in plans for a in plan if a.kind == FORWARD}
    backwards = {(a.microbatch, a.chunk) for plan in plans for a in plan if a.kind == BACKWARD}
    weights = {(a.microbatch, a.chunk) for plan in plans for a in plan if a.kind == WEIGHT}
    microbatches = {mb for mb, _ in forwards}
    expected = {(mb, c) for mb in microbatches for c in range(chunks)}
    if forwards != expected or (backwards and backwards != expected) or not weights <= backwards:
        raise ValueError("the plans do not run every microbatch through every chunk exactly once")


def _warmup(*, stages: int, stage: int, microbatches: int, cap: int) -> int:
    """`one_f_one_b`'s warm-up forwards: PipeDream-flush's, one more before the last stage, at most ``cap - 1``."""
    ahead = 1 if stage < stages - 1 else 0
    return min(stages - stage - 1 + ahead, cap - 1, microbatches)


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
