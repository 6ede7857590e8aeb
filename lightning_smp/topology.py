"""The rank layout dp x pp x tp x cp and every process group of a run.

Owns: where each rank sits in the data / pipeline / tensor grid (pure functions over ints), and the one
``build`` that creates the DeviceMesh and all process groups. No other module calls ``init_device_mesh`` or
``new_group``; everything else receives a ``Topology`` as ``topology=`` and asks it for sizes, ranks and
groups, keeping none: the topology is the groups' one owner, and `Topology.release` ends a run's hold on them. Not
owned: choosing the degrees (``config.py``) and initialising the default group (the strategy).
Why a DeviceMesh: DTensor / ``parallelize_module`` and ``torch.distributed.pipelining`` take meshes, and a
mesh whose dims follow the placement order has exactly the layout of ``rank_groups`` as its row-major order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_smp._compat import flatten_mesh, set_process_group_timeout, unflatten_mesh

__all__ = ["AXES", "Topology", "build", "coordinates", "placement_letters", "rank_groups"]

log = logging.getLogger(__name__)

AXES = ("dp", "pp", "tp", "cp", "mp", "dp_tp", "dp_cp", "embedding", "world")
"""Every axis a ``Topology`` answers for; see ``rank_groups`` for what each one means."""

_LETTER_AXIS = {"D": "dp", "P": "pp", "T": "tp", "C": "cp"}
_ALIASES = {"cluster": "DPT", "spread": "TPD"}
# The grid dims each axis spans; "mp", "dp_tp" and "dp_cp" are sub-meshes flattened into one group each.
_AXIS_LETTERS = {"dp": "D", "pp": "P", "tp": "T", "cp": "C", "mp": "PT", "dp_tp": "DT", "dp_cp": "DC", "world": "DPTC"}
_FLAT_AXES = ("mp", "dp_tp", "dp_cp")


def rank_groups(order: str, *, dp: int, pp: int, tp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Global ranks of every group on every axis, following smp's ``placement_strategy``.

    ``order`` is "cluster" (= "DPT"), "spread" (= "TPD") or any permutation of "D", "P", "T", optionally with
    "C" (context parallelism) among them; without it, C sits just left of T (the cp ranks of one tp rank are
    neighbours after the tp ranks, as Megatron's order tp-cp-dp-pp puts them). The left-most letter varies
    slowest and the right-most letter fastest, i.e. its groups live on neighbouring ranks (smp):
    ``rank = (c0 * n1 + c1) * n2 + c2`` for coordinates ``c`` and degrees ``n`` taken in that order.

    Axes (each maps to a list of groups; every group is sorted, and a rank's position in its group is its rank
    in that axis's process group):

    - ``dp``: true data-parallel replicas (same pp and tp coordinate; smp's ``rdp``).
    - ``pp``: the pipeline stages of one replica's tp slice.
    - ``tp``: the tensor-parallel shards of one stage.
    - ``cp``: the context-parallel ranks that split one batch's sequence (same dp, pp and tp coordinate).
    - ``mp``: pp x tp, all ranks holding different parts of one model replica (smp's ``mp`` group).
    - ``dp_tp``: dp x tp, the ranks of one stage that read different batches (smp's own ``dp`` group: each tp
      rank reads its own batch in smp, so smp counts it as data parallel); the cp ranks read the same one.
    - ``dp_cp``: dp x cp, every rank holding the same parameters: the group the gradients are reduced over.
    - ``embedding``: for each (dp, tp) the ranks of stage 0 and stage pp - 1, which hold tied embedding / head
      weights; one rank per group when pp == 1. Ranks of middle stages belong to no embedding group.
    - ``world``: all ranks.

    Worked example, world 8 = dp 2 x pp 2 x tp 2 (coordinates written as dp/pp/tp)::

        "DPT" (cluster): rank = dp*4 + pp*2 + tp       "TPD" (spread): rank = tp*4 + pp*2 + dp
          rank 0..7 = 000 001 010 011 100 101 110 111     rank 0..7 = 000 100 010 110 001 101 011 111
          tp:    [0, 1] [2, 3] [4, 5] [6, 7]              tp:    [0, 4] [1, 5] [2, 6] [3, 7]
          pp:    [0, 2] [1, 3] [4, 6] [5, 7]              pp:    [0, 2] [1, 3] [4, 6] [5, 7]
          dp:    [0, 4] [1, 5] [2, 6] [3, 7]              dp:    [0, 1] [2, 3] [4, 5] [6, 7]
          mp:    [0, 1, 2, 3] [4, 5, 6, 7]                mp:    [0, 2, 4, 6] [1, 3, 5, 7]
          dp_tp: [0, 1, 4, 5] [2, 3, 6, 7]                dp_tp: [0, 1, 4, 5] [2, 3, 6, 7]
          embedding = pp (two stages: first and last)     embedding = pp

    With pp 4 x tp 2 under "DPT" (rank = pp*2 + tp) the pp groups are [0, 2, 4, 6] [1, 3, 5, 7] and the
    embedding groups [0, 6] [1, 7]; ranks 2..5 are in none.
    """
    letters, degrees = _layout(order, dp=dp, pp=pp, tp=tp, cp=cp)
    all_coords = list(product(*(range(degrees[letter]) for letter in letters)))  # row-major == rank order
    groups: dict[str, list[list[int]]] = {}
    for axis, members in _AXIS_LETTERS.items():
        fixed = [i for i, letter in enumerate(letters) if letter not in members]
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank, coords in enumerate(all_coords):
            by_key.setdefault(tuple(coords[i] for i in fixed), []).append(rank)
        groups[axis] = sorted(by_key.values())
    groups["embedding"] = [sorted({stages[0], stages[-1]}) for stages in groups["pp"]]
    return {axis: groups[axis] for axis in AXES}


def coordinates(rank: int, order: str, *, dp: int, pp: int, tp: int, cp: int = 1) -> dict[str, int]:
    """``rank``'s place in the grid, e.g. ``{"dp": 1, "pp": 0, "tp": 1, "cp": 0}``; the inverse of ``rank_groups``."""
    letters, degrees = _layout(order, dp=dp, pp=pp, tp=tp, cp=cp)
    world_size = dp * pp * tp * cp
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank} is outside the job: dp={dp} x pp={pp} x tp={tp} x cp={cp} has ranks 0..{world_size - 1}"
        )
    coords = {}
    for letter in reversed(letters):  # the right-most letter varies fastest
        rank, coords[_LETTER_AXIS[letter]] = divmod(rank, degrees[letter])
    return {axis: coords[axis] for axis in ("dp", "pp", "tp", "cp")}


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Topology:
    """This rank's view of the dp x pp x tp x cp grid and its process groups. Create it with ``build``.

    The topology is the one owner of its run's process groups: the tensor-parallel layers, the pipeline's transport,
    the step engine, the optimizers and the precision plugin keep the topology and look a group up (`group`) when they
    communicate, never a group of their own. So `release` at the end of the run (at interpreter exit,
    `fault_tolerance.close_process_groups`) drops every reference this package holds to them in one call. A copy is
    the topology itself (one owner per run), and it cannot be pickled: process groups exist in one process only.
    """

    dp: int
    """Data-parallel degree: number of model replicas."""
    pp: int
    """Pipeline-parallel degree: number of stages."""
    tp: int
    """Tensor-parallel degree: shards per stage."""
    order: str
    """Placement order as letters ("DPCT", "CTPD", ...: C placed as `rank_groups` places it), never an alias."""
    global_rank: int
    """This process's rank in the default group."""
    _groups: _Groups = field(repr=False)
    """The meshes and groups themselves, held here only (`release` empties it)."""
    sdp: int = 1
    """Sharded-data-parallel degree: ranks of the data-parallel axis one parameter is sharded over (1: none)."""
    cp: int = 1
    """Context-parallel degree: ranks one sequence is split over (1: none)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def replica_axis(self) -> str:
        """The axis of the ranks holding the same parameters, over which gradients are reduced: "dp", or "dp_cp"
        under context parallelism (its ranks train on parts of the same sequences with the same weights)."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def is_first_stage(self) -> bool:
        return self.rank("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank("pp") == self.pp - 1

    @property
    def mesh(self) -> DeviceMesh:
        """The 4-D mesh, dims named "dp", "pp", "tp", "cp" in placement order."""
        return self._live().mesh

    @property
    def released(self) -> bool:
        """Whether `release` has run: the run has ended, and its groups are out of reach."""
        return self._groups.released

    def group(self, axis: str) -> ProcessGroup:
        """The process group of this rank on ``axis`` (one of ``AXES``); "world" is the default group."""
        _check_axis(axis)
        groups = self._live()
        if axis == "world":
            return dist.group.WORLD
        group = groups.groups[axis]
        if group is None:
            raise ValueError(
                f"rank {self.global_rank} is pipeline stage {self.rank('pp')} of {self.pp}; only the "
                "first and last stages hold tied embeddings. Check `topology.is_first_stage or "
                "topology.is_last_stage` before asking for the 'embedding' group."
            )
        return group

    def size(self, axis: str) -> int:
        """Number of ranks in this rank's group on ``axis``."""
        return self.group(axis).size()

    def rank(self, axis: str) -> int:
        """This rank's index within its group on ``axis`` (its rank in ``group(axis)``)."""
        return self.group(axis).rank()

    def sharding_mesh(self, *, sharded: bool = True) -> DeviceMesh:
        """The data-parallel mesh ``fully_shard`` takes under sharded data parallelism: (replicas, shard group)
        with the shard groups on neighbouring data-parallel ranks (HSDP, 1-D when one group spans dp); with
        ``sharded=False`` (dp, 1), for modules kept whole on every rank whose grads are all-reduced."""
        if self.sdp == 1:
            raise ValueError(
                "this run has no sharded data parallelism (sharded_data_parallel_degree=1); set "
                "sharded_data_parallel_degree to a divisor of the data-parallel degree to shard parameters."
            )
        return self._live().sharding_meshes["sharded" if sharded else "whole"]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on ``axis``, ascending (= group-rank order)."""
        return dist.get_process_group_ranks(self.group(axis))

    def release(self) -> None:
        """The run has ended: drop this topology's meshes and process groups, the package's only references to
        them, so that ``destroy_process_group`` frees them (`fault_tolerance.close_process_groups`). It destroys
        nothing itself. Every later lookup, from any object of the run, raises."""
        self._groups.release()

    def _live(self) -> _Groups:
        if self._groups.released:
            raise RuntimeError(
                f"the process groups of this run (dp={self.dp} pp={self.pp} tp={self.tp} cp={self.cp}) were released "
                "when it ended (at interpreter exit): its layers, pipeline and optimizers cannot communicate any "
                "more. Use a new run (a Trainer's fit, smp.init()) to train again."
            )
        return self._groups

    def __copy__(self) -> Topology:
        return self  # one owner per run: a copied module or record shares it

    def __deepcopy__(self, memo: dict[int, Any]) -> Topology:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            "a lightning_smp Topology holds its run's process groups, which exist in this process only, and cannot "
            "be pickled. To save a split model, use its strategy's checkpoint (trainer.save_checkpoint, fabric.save, "
            "smp.save_checkpoint) or its state_dict, not the module object."
        )


class _Groups:
    """The meshes and process groups of one run, held by its `Topology` alone. Each group is resolved once, here,
    so that a lookup on a hot path (a tensor-parallel layer's collective) is a dict read."""

    __slots__ = ("groups", "mesh", "released", "sharding_meshes")

    def __init__(
        self,
        mesh: DeviceMesh,
        meshes: Mapping[str, DeviceMesh],
        embedding_group: ProcessGroup | None,
        sharding_meshes: Mapping[str, DeviceMesh],
    ) -> None:
        self.mesh = mesh
        self.groups: dict[str, ProcessGroup | None] = {axis: sub.get_group() for axis, sub in meshes.items()}
        self.groups["embedding"] = embedding_group  # None on a middle pipeline stage
        self.sharding_meshes = dict(sharding_meshes)
        self.released = False

    def release(self) -> None:
        self.mesh = None  # type: ignore[assignment]
        self.groups, self.sharding_meshes, self.released = {}, {}, True


def build(
    *,
    dp: int,
    pp: int,
    tp: int,
    order: str,
    device_type: str,
    timeout: timedelta | None = None,
    sdp: int = 1,
    cp: int = 1,
) -> Topology:
    """Create the DeviceMesh and every process group of the run.

    Call it once on every rank, with the same arguments (group creation is collective), after the default
    process group exists. ``order`` is as in ``rank_groups``; ``device_type`` is the mesh's ("cuda", "cpu").
    ``timeout`` applies to every group made here, as to the default group: torch would otherwise give the
    subgroups its own default (30 minutes on gloo), and a rank stuck in a tp or pp collective would outwait it.
    ``sdp`` (sharded data parallelism) splits the dp axis into shard groups of ``sdp`` neighbouring dp ranks
    (see ``Topology.sharding_mesh``); it must divide ``dp`` x ``cp`` (the ranks of ``Topology.replica_axis``).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "topology.build needs the default process group; call torch.distributed.init_process_group first "
            "(SMPStrategy.setup_environment does this)."
        )
    letters, degrees = _layout(order, dp=dp, pp=pp, tp=tp, cp=cp)
    world_size = dist.get_world_size()
    if dp * pp * tp * cp != world_size:
        raise ValueError(
            f"dp={dp} x pp={pp} x tp={tp} x cp={cp} = {dp * pp * tp * cp}, but the job has world_size={world_size}. "
            f"The degrees must multiply to the number of processes: launch {dp * pp * tp * cp} processes or pick "
            f"degrees whose product is {world_size}."
        )
    names = tuple(_LETTER_AXIS[letter] for letter in letters)
    mesh = init_device_mesh(device_type, tuple(degrees[letter] for letter in letters), mesh_dim_names=names)
    meshes = {name: mesh[name] for name in names}
    for flat_name in _FLAT_AXES:
        # torch 2.13 slices only in the root's dim order, and slicing a flattened dim from the root mesh is
        # deprecated: slice in placement order and keep the flattened mesh ourselves.
        dims = tuple(_LETTER_AXIS[letter] for letter in letters if letter in _AXIS_LETTERS[flat_name])
        meshes[flat_name] = flatten_mesh(mesh[dims], flat_name)
    replica_axis = "dp_cp" if cp > 1 else "dp"
    sharding_meshes = _sharding_meshes(meshes[replica_axis], dp=dp * cp, sdp=sdp)
    layout = rank_groups(letters, dp=dp, pp=pp, tp=tp, cp=cp)
    if pp <= 2:
        # Stage 0 and stage pp-1 are the whole pipeline group: reuse it rather than open another communicator.
        embedding_group = meshes["pp"].get_group()
    else:
        embedding_group, _ = dist.new_subgroups_by_enumeration(layout["embedding"], group_desc="embedding")
    topology = Topology(
        dp=dp,
        pp=pp,
        tp=tp,
        order=letters,
        global_rank=dist.get_rank(),
        _groups=_Groups(mesh, meshes, embedding_group, sharding_meshes),
        sdp=sdp,
        cp=cp,
    )
    _check_groups(topology, layout)
    if timeout is not None:
        sharding_groups = [group for mesh in sharding_meshes.values() for group in mesh.get_all_groups()]
        groups = [*(mesh.get_group() for mesh in meshes.values()), embedding_group, *sharding_groups]
        for group in {id(g): g for g in groups if g is not None}.values():
            set_process_group_timeout(timeout, group)
    where = coordinates(topology.global_rank, letters, dp=dp, pp=pp, tp=tp, cp=cp)
    log.info(
        "lightning_smp topology: dp=%d pp=%d tp=%d cp=%d order=%s world_size=%d; rank %d is %s",
        dp,
        pp,
        tp,
        cp,
        letters,
        world_size,
        topology.global_rank,
        " ".join(f"{axis}={c}" for axis, c in where.items()),
    )
    return topology


def _sharding_meshes(dp_mesh: DeviceMesh, *, dp: int, sdp: int) -> dict[str, DeviceMesh]:
    """The meshes of sharded data parallelism, split from the dp mesh (FSDP2 reads a 2-D mesh as replicate x
    shard): "sharded" puts ``sdp`` neighbouring dp ranks in a shard group, "whole" shards over one rank."""
    if isinstance(sdp, bool) or not isinstance(sdp, int) or sdp < 1 or dp % sdp:
        raise ValueError(
            f"sharded_data_parallel_degree={sdp!r} does not divide the data-parallel degree {dp}; pick a divisor "
            f"of {dp} (the ranks one parameter is sharded over), e.g. sharded_data_parallel_degree={dp}."
        )
    if sdp == 1:
        return {}
    sharded = dp_mesh if sdp == dp else unflatten_mesh(dp_mesh, 0, (dp // sdp, sdp), ("sdp_replicate", "sdp"))
    return {"sharded": sharded, "whole": unflatten_mesh(dp_mesh, 0, (dp, 1), ("sdp_whole_replicate", "sdp_whole"))}


def placement_letters(order: str) -> str:
    """``order`` as four letters: an alias resolved, and C (context parallelism) placed just left of T when absent
    ("DPT" -> "DPCT", "TPD" -> "CTPD"); raises for anything but a permutation of D, P, T (and C)."""
    letters = _ALIASES.get(order, order)
    if sorted(letters) == ["D", "P", "T"]:
        letters = letters.replace("T", "CT")
    if sorted(letters) != ["C", "D", "P", "T"]:
        raise ValueError(
            f"placement order {order!r} is not valid; use 'cluster' (= 'DPT'), 'spread' (= 'TPD') or another "
            "permutation of the letters D, P, T, optionally with C (context parallel) among them (right-most letter "
            "= neighbouring ranks)."
        )
    return letters


def _layout(order: str, *, dp: int, pp: int, tp: int, cp: int = 1) -> tuple[str, dict[str, int]]:
    """Validate the arguments; return the order as letters ("DPCT") and the degrees keyed by letter."""
    letters = placement_letters(order)
    degrees = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
    for axis, degree in degrees.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{axis}={degree!r} is not a valid degree; every degree must be an integer >= 1.")
    return letters, {letter: degrees[axis] for letter, axis in _LETTER_AXIS.items()}


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; valid axes are {', '.join(map(repr, AXES))}.")


def _check_groups(topology: Topology, layout: dict[str, list[list[int]]]) -> None:
    """Re-check each group of this rank against the pure layout, as torchtitan's ``_validate_meshes`` does."""
    rank = topology.global_rank
    for axis, groups in layout.items():
        expected = next((group for group in groups if rank in group), None)
        if expected is None:  # a middle pipeline stage, in no "embedding" group
            continue
        actual = topology.ranks(axis)
        if actual != expected:
            raise ValueError(
                f"the {axis!r} group of rank {rank} holds ranks {actual}, but order={topology.order} with "
                f"dp={topology.dp} pp={topology.pp} tp={topology.tp} cp={topology.cp} needs {expected}. This is a "
                "bug in lightning_smp.topology; please report it with these numbers."
            )
