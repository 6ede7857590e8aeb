"""Where one optimizer's fp32 master weights live: the `Masters` protocol and its whole and ZeRO-1 layouts.

Owns where the masters and their fp32 grads live, the gradient intake (`Masters.take_grads`: how the model's grads
get into the master grads — a copy, or a reduce-scatter over the data-parallel replicas; FSDP2's shards, the third
layout, in `sharded_data_parallel.py`, reduce their own), how updated masters get back into the model (a copy, or an
all-gather), which grads count in the global norm, and the translation between what the inner optimizer updates and
whole model parameters (checkpoints). Not owned: the order of an update and which parameters are trained
(`optimizer.py`), the overflow vote and the norm's reduction (`grad_vote.py`), when a bucket's collective starts
(`overlap.ReadyBuckets`), which backward is the last before a step (the strategy).
Sharded, as smp did and as Megatron's distributed optimizer does: the parameters laid out flat in buckets of at most
`reduction.BUCKET_BYTES` (one dtype each, the parameters in reverse order so that the first buckets are the first
whose gradients are final in backward), each padded to a multiple of dp; each replica owns a contiguous share of
every bucket, and the inner optimizer sees one 1-D piece per parameter that overlaps a share (Megatron's "shard main
params"), so param groups, LR schedulers and element-wise optimizers work unchanged; optimizers that read a
parameter's shape (Adafactor, Shampoo) do not. A bucket's reduce-scatter starts during the last backward before a
step, as soon as its gradients are final (`ShardedMasters.reduce_during_backward`, armed by the strategy; not under
pipeline parallelism, whose engine holds the grads aside during its schedule: there, and wherever nothing armed
it, every bucket is reduced in the step). The updated shares are all-gathered after the step, bucket by bucket;
Megatron overlaps that with the next forward, which is not done here."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_smp import collectives
from lightning_smp._compat import foreach_copy_, foreach_zero_
from lightning_smp.grad_vote import Counted, norm_copies
from lightning_smp.overlap import Launched, ReadyBuckets
from lightning_smp.reduction import BUCKET_BYTES, backward_buckets

if TYPE_CHECKING:
    from collections.abc import Generator

    from lightning_smp.topology import Topology

__all__ = ["HALF_DTYPES", "FlatPiece", "Masters", "Run", "ShardedMasters", "WholeMasters", "single_device"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

Run = Callable[[], "Topology | None"]
"""The running job's topology, looked up at each use (None: one process, or the run has ended): masters keep no
process group, so that the groups are freed when the run ends."""


class Masters(Protocol):
    """The fp32 masters of the trained parameters of one optimizer, wherever they live.

    Built as ``Masters(params, run)`` over the parameters the optimizer trains (`MasterWeightOptimizer` decides
    which), in its param groups' order.
    """

    params: list[Tensor]
    """The model parameters whose masters these are."""
    replicated: bool
    """Whether every data-parallel replica holds every master (the global norm then sums one replica's)."""

    def optimized(self) -> dict[int, Tensor]:
        """id(model parameter) → the tensor the inner optimizer updates in its place (absent: none on this rank)."""

    def master_params(self) -> list[Tensor]:
        """The fp32 tensors the inner optimizer updates."""

    def take_grads(self) -> None:
        """The gradient intake: make the model's latest grads (still loss-scaled) the master grads `grads` returns,
        reduced over the data-parallel replicas where the masters are sharded. Collective where it reduces."""

    def reduce_during_backward(self) -> AbstractContextManager[None]:
        """Around the last backward before `take_grads`: where `take_grads` reduces over the replicas, start the
        reduction of each bucket whose grads are final while the backward still runs (elsewhere: nothing)."""

    def grads(self) -> list[Tensor]:
        """The fp32 grads the update reads (unscaled, clipped in place)."""

    def counted_grads(self) -> list[Counted]:
        """The grads this rank counts in the global norm (`grad_vote`'s rule)."""

    def finite_check_grads(self) -> list[Tensor] | None:
        """The fused fast path: the still-scaled grads whose finiteness decides overflow, read in place of the
        unscale (after `take_grads`); None where there is no such path (then `grads` are unscaled)."""

    def write_params(self) -> None:
        """Put the updated masters into the model's parameters. Collective where the masters are sharded."""

    def after_step(self) -> None:
        """Restore what `take_grads` changed for one step only."""

    def positional_masters(self) -> list[tuple[Tensor, Tensor]]:
        """(model parameter, its fp32 master) for the masters that are copies, in order (``state_dict``)."""

    def master_parts(self) -> dict[int, Tensor | FlatPiece]:
        """id(model parameter) → its fp32 master as this rank holds it, for checkpoints to write and to load into in
        place: the whole master (the parameter itself when it is its own), or this replica's `FlatPiece` of it."""

    def load_masters(self, values: dict[int, Tensor | FlatPiece]) -> None:
        """Set the masters from values by id(model parameter) (whole tensors: this rank takes its part; the parts
        `master_parts` handed out, loaded in place, are kept), then the model's parameters from the masters."""

    def state_by_param(self, inner_state: dict[Tensor, Any]) -> list[tuple[Tensor, dict[str, Any]]]:
        """Each model parameter with optimizer state on this rank, with that state: element-wise values shaped like
        the parameter (or this replica's `FlatPiece` of them), others as they are."""

    def state_part(self, param: Tensor, dtype: torch.dtype) -> Tensor | FlatPiece | None:
        """An empty tensor for what this rank holds of an element-wise optimizer state of ``param`` (a checkpoint
        loads into it); None when it holds none."""

    def state_of_optimized(self, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Per-parameter states by id(model parameter) (whole, or the parts `state_part` made) → this rank's states
        by id(the tensor the optimizer updates)."""


@dataclass(frozen=True)
class FlatPiece:
    """Elements [start, start + flat.numel()) of a tensor shaped ``shape``, flattened row-major: what a ZeRO-1
    replica holds of a parameter's master or of its element-wise optimizer state. Checkpoints write and read it as
    chunks of the tensor (`checkpoint.dcp_adapter`), so that no replica gathers a whole one."""

    shape: torch.Size
    start: int
    flat: Tensor


class WholeMasters:
    """Every master on this rank: half-precision parameters get fp32 copies in one flat buffer (param-shaped views,
    so unscale, overflow check and norm are one kernel each); fp32 parameters are their own masters. The grads are
    all-reduced over the replicas before the intake (DDP, the pipeline engine), which copies them."""

    replicated = True

    def __init__(self, params: Sequence[Tensor], run: Run) -> None:
        device = single_device(params)
        self.half_params = [p for p in params if p.dtype in HALF_DTYPES]
        self.own_params = [p for p in params if p.dtype not in HALF_DTYPES]
        self._flat_master = torch.empty(sum(p.numel() for p in self.half_params), dtype=torch.float32, device=device)
        self._flat_grad = torch.zeros_like(self._flat_master)
        master_views = _views(self._flat_master, self.half_params)
        self._grad_views = _views(self._flat_grad, self.half_params)
        with torch.no_grad():
            if self.half_params:
                foreach_copy_(master_views, self.half_params)
        self.masters: list[Tensor] = []
        for view, grad in zip(master_views, self._grad_views, strict=True):
            master = nn.Parameter(view)
            master.grad = grad
            self.masters.append(master)
        self._norm_counts = [norm_copies(p) > 0 for p in self.half_params + self.own_params]
        self._grads_detached = False  # some masters had their grad set to None for one step (unused params)

    @property
    def params(self) -> list[Tensor]:
        return self.half_params + self.own_params

    def optimized(self) -> dict[int, Tensor]:
        """id(model parameter) → the tensor the inner optimizer updates in its place."""
        return {id(p): m for p, m in zip(self.half_params, self.masters, strict=True)} | {
            id(p): p for p in self.own_params
        }

    def master_params(self) -> list[Tensor]:
        return [*self.masters, *self.own_params]

    def take_grads(self) -> None:
        """Copy the half grads of the latest backward, still scaled, into the fp32 master grads."""
        half_grads = [p.grad for p in self.half_params]
        if any(g is None for g in half_grads):
            # Unused parameters keep no gradient, like in the fp32 run: torch optimizers skip a param whose
            # grad is None, so the master has none either for this step (restored in `after_step`). Its slot in
            # the flat buffer is zeroed so a stale value counts neither for overflow nor for the norm.
            present, missing = [], []
            self._grads_detached = True
            for master, grad, view in zip(self.masters, half_grads, self._grad_views, strict=True):
                master.grad = None if grad is None else view
                (missing if grad is None else present).append((view, grad))
            foreach_zero_([view for view, _ in missing])
            if present:
                foreach_copy_([view for view, _ in present], [grad for _, grad in present])
        elif half_grads:
            foreach_copy_(self._grad_views, half_grads)

    def reduce_during_backward(self) -> AbstractContextManager[None]:
        return nullcontext()  # the grads arrive reduced (DDP, the pipeline engine): nothing to overlap here

    def finite_check_grads(self) -> list[Tensor] | None:
        """The half grads (half the bytes of their fp32 copies) and the fp32 params' grads, when every half
        parameter has a grad; None otherwise (then the masters' grads are checked as they are unscaled)."""
        half_grads = [p.grad for p in self.half_params]
        if any(g is None for g in half_grads):
            return None
        return half_grads + [p.grad for p in self.own_params if p.grad is not None]

    def grads(self) -> list[Tensor]:
        """Every fp32 grad the update reads: the flat master grad (one kernel) and the fp32 params' own grads."""
        own = [p.grad for p in self.own_params if p.grad is not None]
        return ([self._flat_grad] if self.half_params else []) + own

    def counted_grads(self) -> list[Counted]:
        """The grads that count in the global norm: all of them (one flat kernel) unless some are duplicates."""
        if all(self._norm_counts):
            return [(grad, 1) for grad in self.grads()]
        grads = [master.grad for master in self.masters] + [p.grad for p in self.own_params]
        return [(g, 1) for g, counts in zip(grads, self._norm_counts, strict=True) if counts and g is not None]

    def write_params(self) -> None:
        """Copy the masters into the half-precision parameters."""
        if self.half_params:
            foreach_copy_(self.half_params, self.masters)

    def after_step(self) -> None:
        if self._grads_detached:
            for master, view in zip(self.masters, self._grad_views, strict=True):
                master.grad = view
            self._grads_detached = False

    def positional_masters(self) -> list[tuple[Tensor, Tensor]]:
        return list(zip(self.half_params, self.masters, strict=True))

    def master_parts(self) -> dict[int, Tensor | FlatPiece]:
        return {id(p): m for p, m in self._pairs()}

    def load_masters(self, values: dict[int, Tensor | FlatPiece]) -> None:
        for param, master in self._pairs():
            value = values.get(id(param))
            if value is not None and value is not master:
                master.copy_(value)
        self.write_params()

    def state_by_param(self, inner_state: dict[Tensor, Any]) -> list[tuple[Tensor, dict[str, Any]]]:
        return [(p, dict(inner_state[m])) for p, m in self._pairs() if inner_state.get(m)]

    def state_part(self, param: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.empty(param.shape, dtype=dtype, device=param.device)

    def state_of_optimized(self, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return {id(m): states[id(p)] for p, m in self._pairs() if id(p) in states}

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Each model parameter with its fp32 master (itself when already fp32)."""
        return [*zip(self.half_params, self.masters, strict=True), *((p, p) for p in self.own_params)]


@dataclass
class _Bucket:
    """Parameters of one dtype, laid out flat and padded to a multiple of dp; this rank owns [lo, lo+share)."""

    params: list[Tensor]
    dtype: torch.dtype
    padded: int
    lo: int
    master: Tensor  # (share,) fp32
    grad: Tensor  # (share,) fp32


@dataclass
class _Piece:
    """The part of one parameter's flattened elements [start, end) that lies in this rank's share."""

    param: Tensor
    bucket: _Bucket
    start: int
    end: int
    at: int  # where the piece starts in the bucket's share
    master: nn.Parameter  # a view of the bucket's master share; its grad a view of the grad share


class ShardedMasters:
    """This data-parallel rank's contiguous share of each bucket of the flat fp32 masters (ZeRO-1).

    Args:
        params: every parameter the optimizer updates, in its param groups' order.
        run: the running job, whose data-parallel replicas hold the same parameters.
        scatter_by_all_reduce: take this replica's share from a whole all-reduce (gloo, whose reduce-scatter is
            slower than its all-reduce: `ReductionPlan.scatter_by_all_reduce`).
        bucket_bytes: the most bytes of parameters in one bucket (a larger parameter is a bucket of its own).
    """

    replicated = False

    def __init__(
        self,
        params: Sequence[Tensor],
        run: Run,
        *,
        scatter_by_all_reduce: bool = False,
        bucket_bytes: float = BUCKET_BYTES,
    ) -> None:
        self.params = list(params)
        self._run = run
        self._scatter_by_all_reduce = scatter_by_all_reduce
        device = single_device(params)
        group = self._group()
        self._replicas = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self._buckets: list[_Bucket] = []
        self._pieces: list[_Piece] = []
        for same in backward_buckets(self.params, max_bytes=bucket_bytes):
            dtype = same[0].dtype
            total = sum(p.numel() for p in same)
            share = max(1, math.ceil(total / self._replicas))
            master = torch.zeros(share, dtype=torch.float32, device=device)
            bucket = _Bucket(same, dtype, share * self._replicas, rank * share, master, torch.zeros_like(master))
            self._buckets.append(bucket)
            for param, begin in zip(same, _offsets(same), strict=True):
                start = max(begin, bucket.lo) - begin
                end = min(begin + param.numel(), bucket.lo + share) - begin
                if start >= end:
                    continue
                at = begin + start - bucket.lo
                piece = nn.Parameter(master[at : at + end - start])
                piece.grad = bucket.grad[at : at + end - start]
                with torch.no_grad():
                    piece.copy_(param.detach().reshape(-1)[start:end])
                self._pieces.append(_Piece(param, bucket, start, end, at, piece))
        self._counts = [norm_copies(piece.param) > 0 for piece in self._pieces]
        self._reduction: ReadyBuckets | None = None  # this step's, started by an armed backward

    def optimized(self) -> dict[int, Tensor]:
        """id(model parameter) → its piece in this rank's share; parameters wholly in other shares are absent."""
        return {id(piece.param): piece.master for piece in self._pieces}

    def master_params(self) -> list[Tensor]:
        return [piece.master for piece in self._pieces]

    def take_grads(self) -> None:
        """Average the model's grads over the replicas, each keeping its share of every bucket (reduce-scatter, or an
        all-reduce where that is faster; in the grads' dtype as DDP's all-reduce is; divided first, as DDP averages),
        into the fp32 grad share: wait for the buckets an armed backward started (`reduce_during_backward`), start
        the others now. A parameter with no grad contributes zeros (its state still advances, unlike an unsharded
        step)."""
        reduction, self._reduction = self._reduction or self._ready_buckets(), None
        reduction.finish()

    @contextmanager
    def reduce_during_backward(self) -> Generator[None, None, None]:
        """While the body runs (the last backward before `take_grads`, the same on every replica), each bucket's
        reduction starts once its parameters' grads are final, in bucket order (`overlap.ReadyBuckets`); `take_grads`
        waits for them. A reduction started by an earlier armed backward that no step took is finished first, so
        that every collective is waited for once."""
        if self._reduction is not None:
            self._reduction.finish()
        self._reduction = self._ready_buckets()
        with self._reduction.armed():
            yield

    def _ready_buckets(self) -> ReadyBuckets:
        return ReadyBuckets([bucket.params for bucket in self._buckets], self._launch)

    @torch.no_grad()
    def _launch(self, index: int) -> Launched:
        """Start bucket ``index``'s reduction on its parameters' grads as they are now."""
        bucket = self._buckets[index]
        flat = torch.zeros(bucket.padded, dtype=bucket.dtype, device=bucket.grad.device)
        views = _views(flat, bucket.params)
        present = [(view, p.grad) for view, p in zip(views, bucket.params, strict=True) if p.grad is not None]
        if present:
            foreach_copy_([view for view, _ in present], [grad for _, grad in present])
        flat.div_(self._replicas)
        if self._scatter_by_all_reduce:
            work = dist.all_reduce(flat, group=self._group(), async_op=True)
            own = flat[bucket.lo : bucket.lo + bucket.grad.numel()]
            return Launched(work, functools.partial(bucket.grad.copy_, own))
        if bucket.dtype == torch.float32:  # reduce-scattered into the grad share in place
            work = collectives.reduce_scatter_single(bucket.grad, flat, group=self._group(), async_op=True)
            return Launched(work, _nothing)
        share = torch.empty_like(bucket.grad, dtype=bucket.dtype)
        work = collectives.reduce_scatter_single(share, flat, group=self._group(), async_op=True)
        return Launched(work, functools.partial(bucket.grad.copy_, share))

    def finite_check_grads(self) -> None:
        return None  # the grads are this rank's share only after a reduce-scatter: no fused fast path

    def grads(self) -> list[Tensor]:
        return [bucket.grad for bucket in self._buckets]

    def counted_grads(self) -> list[Counted]:
        if all(self._counts):
            return [(grad, 1) for grad in self.grads()]  # the padding is zero
        return [(piece.master.grad, 1) for piece, counts in zip(self._pieces, self._counts, strict=True) if counts]

    def write_params(self) -> None:
        """All-gather the updated shares into every replica's parameters (in their dtype)."""
        for bucket in self._buckets:
            full = torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.master.device)
            collectives.all_gather_single(full, bucket.master.to(bucket.dtype), group=self._group())
            foreach_copy_(bucket.params, _views(full, bucket.params))

    def after_step(self) -> None:
        pass

    def positional_masters(self) -> list[tuple[Tensor, Tensor]]:
        raise ValueError(
            "`optimizer.state_dict()` and `load_state_dict()` hold one rank's masters by position, which a sharded "
            "optimizer (shard_optimizer_state=True) does not have whole. Use `trainer.save_checkpoint` / "
            "`ckpt_path=` or `smp.save_checkpoint` / `smp.resume_from_checkpoint`: they store the optimizer state "
            "by parameter name, which loads at any data-parallel degree, sharded or not."
        )

    def master_parts(self) -> dict[int, Tensor | FlatPiece]:
        """Every parameter's `FlatPiece` on this replica (an empty one where it holds none): a checkpoint writes
        each replica's share as chunks and reads into them, gathering nothing."""
        parts: dict[int, Tensor | FlatPiece] = {}
        for param in self.params:
            parts[id(param)] = FlatPiece(param.shape, 0, torch.empty(0, dtype=torch.float32, device=param.device))
        for piece in self._pieces:
            parts[id(piece.param)] = FlatPiece(piece.param.shape, piece.start, piece.master.detach())
        return parts

    def load_masters(self, values: dict[int, Tensor | FlatPiece]) -> None:
        """Take this rank's share of the values (whole ones, or this rank's pieces), then all-gather the shares
        into every replica's parameters."""
        for piece in self._pieces:
            value = values.get(id(piece.param))
            if isinstance(value, FlatPiece):
                if value.flat.data_ptr() != piece.master.data_ptr():  # else: loaded in place
                    piece.master.copy_(value.flat[piece.start - value.start : piece.end - value.start])
            elif value is not None:
                piece.master.copy_(value.reshape(-1)[piece.start : piece.end])
        self.write_params()

    def state_by_param(self, inner_state: dict[Tensor, Any]) -> list[tuple[Tensor, dict[str, Any]]]:
        """The optimizer state of every parameter with a piece on this rank: element-wise values as that piece's
        `FlatPiece`, scalar ones (a step count) as they are. Nothing is gathered."""
        states = []
        for piece in self._pieces:
            state = inner_state.get(piece.master)
            if state:
                states.append((piece.param, {key: _as_part(piece, value) for key, value in state.items()}))
        return states

    def state_part(self, param: Tensor, dtype: torch.dtype) -> FlatPiece | None:
        piece = next((piece for piece in self._pieces if piece.param is param), None)
        if piece is None:
            return None
        flat = torch.empty(piece.end - piece.start, dtype=dtype, device=param.device)
        return FlatPiece(param.shape, piece.start, flat)

    def state_of_optimized(self, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Per-parameter states by id(model parameter) → this rank's pieces of them by id(piece)."""
        pieces = {}
        for piece in self._pieces:
            state = states.get(id(piece.param))
            if state is not None:
                pieces[id(piece.master)] = {key: _own_part(piece, value) for key, value in state.items()}
        return pieces

    def _group(self) -> dist.ProcessGroup:
        topology = self._run()
        if topology is None:
            raise RuntimeError(
                "The run of this sharded optimizer has ended and its process groups are gone: its masters live on "
                "the data-parallel replicas. Build a new optimizer in the next run (`configure_optimizers`)."
            )
        return topology.group(topology.replica_axis)


def single_device(params: Sequence[Tensor]) -> torch.device:
    """The one device ``params`` live on (the CPU for none)."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"The optimizer's parameters live on several devices {sorted(map(str, devices))}; one rank trains on "
            "one device. Move the model to one device before building the optimizer."
        )
    return devices.pop() if devices else torch.device("cpu")


def _nothing() -> None:
    """What completes a reduction that wrote its result in place."""


def _offsets(params: Sequence[Tensor]) -> list[int]:
    offsets, offset = [], 0
    for param in params:
        offsets.append(offset)
        offset += param.numel()
    return offsets


def _views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    return [flat[o : o + p.numel()].view_as(p) for o, p in zip(_offsets(params), params, strict=True)]


def _as_part(piece: _Piece, value: Any) -> Any:
    """An optimizer state value of ``piece`` as checkpoints store it: an element-wise one as a `FlatPiece`."""
    elementwise = isinstance(value, Tensor) and value.dim() > 0 and value.shape == piece.master.shape
    return FlatPiece(piece.param.shape, piece.start, value) if elementwise else value


def _own_part(piece: _Piece, value: Any) -> Any:
    """``piece``'s part of a loaded optimizer state value: its `FlatPiece`, or its range of a whole value."""
    if isinstance(value, FlatPiece):
        return value.flat[piece.start - value.start : piece.end - value.start]
    if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == piece.param.numel():
        return value.reshape(-1)[piece.start : piece.end].clone()
    return value
