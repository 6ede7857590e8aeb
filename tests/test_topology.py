import copy
import dataclasses
import itertools
import logging
import pickle
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lightning_smp import topology
from lightning_smp.topology import AXES, build, coordinates, rank_groups
from tests.distributed import init_gloo, run_distributed

ORDERS = ["".join(letters) for letters in itertools.permutations("DPT")]

# ---------------------------------------------------------------- tier 1: the pure layout


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        (
            "DPT",
            {
                "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "mp": [[0, 1, 2, 3], [4, 5, 6, 7]],
                "dp_tp": [[0, 1, 4, 5], [2, 3, 6, 7]],
                "embedding": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "world": [list(range(8))],
            },
        ),
        (
            "TPD",
            {
                "dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "tp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "mp": [[0, 2, 4, 6], [1, 3, 5, 7]],
                "dp_tp": [[0, 1, 4, 5], [2, 3, 6, 7]],
                "embedding": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "world": [list(range(8))],
            },
        ),
        (
            "PDT",  # rank = pp*4 + dp*2 + tp
            {
                "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
                "dp_tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
                "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "world": [list(range(8))],
            },
        ),
    ],
)
def test_worked_examples_world_8(order, expected):
    groups = rank_groups(order, dp=2, pp=2, tp=2)
    assert groups.pop("cp") == [[rank] for rank in range(8)]  # no context parallelism: one rank per group
    assert groups.pop("dp_cp") == groups["dp"]
    assert groups == expected


@pytest.mark.parametrize(("alias", "letters"), [("cluster", "DPT"), ("spread", "TPD")])
def test_aliases(alias, letters):
    assert rank_groups(alias, dp=2, pp=3, tp=2) == rank_groups(letters, dp=2, pp=3, tp=2)
    assert coordinates(7, alias, dp=2, pp=3, tp=2) == coordinates(7, letters, dp=2, pp=3, tp=2)


DEGREES = [(1, 1, 1), (2, 2, 2), (3, 2, 1), (1, 4, 2), (2, 1, 3), (2, 3, 2)]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dp", "pp", "tp"), DEGREES)
def test_groups_partition_the_ranks(order, dp, pp, tp):
    world = dp * pp * tp
    group_size = {"dp": dp, "pp": pp, "tp": tp, "mp": pp * tp, "dp_tp": dp * tp, "world": world}
    groups = rank_groups(order, dp=dp, pp=pp, tp=tp)
    assert list(groups) == list(AXES)
    for axis, size in group_size.items():
        assert sorted(rank for group in groups[axis] for rank in group) == list(range(world)), axis
        assert all(len(group) == size and group == sorted(group) for group in groups[axis]), axis


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("dp", "pp", "tp"), DEGREES)
def test_coordinates_invert_the_layout(order, dp, pp, tp):
    groups = rank_groups(order, dp=dp, pp=pp, tp=tp)
    seen = set()
    for rank in range(dp * pp * tp):
        coords = coordinates(rank, order, dp=dp, pp=pp, tp=tp)
        seen.add(tuple(coords.values()))
        for axis in ("dp", "pp", "tp"):
            (group,) = [group for group in groups[axis] if rank in group]
            assert group.index(rank) == coords[axis]
        # Ranks sharing a group differ only in that axis' coordinate.
        (tp_group,) = [group for group in groups["tp"] if rank in group]
        assert {coordinates(r, order, dp=dp, pp=pp, tp=tp)["pp"] for r in tp_group} == {coords["pp"]}
    assert len(seen) == dp * pp * tp


def test_right_most_letter_is_neighbouring_ranks():
    assert coordinates(1, "DPT", dp=2, pp=2, tp=2) == {"dp": 0, "pp": 0, "tp": 1, "cp": 0}
    assert coordinates(1, "TPD", dp=2, pp=2, tp=2) == {"dp": 1, "pp": 0, "tp": 0, "cp": 0}
    assert coordinates(1, "TDP", dp=2, pp=2, tp=2) == {"dp": 0, "pp": 1, "tp": 0, "cp": 0}
    assert coordinates(6, "DPT", dp=2, pp=2, tp=2) == {"dp": 1, "pp": 1, "tp": 0, "cp": 0}


@pytest.mark.parametrize(
    ("pp", "expected"),
    [
        (1, [[0], [1], [2], [3]]),  # dp=2 x tp=2, one stage: each rank ties with itself
        (2, [[0, 2], [1, 3], [4, 6], [5, 7]]),
        (4, [[0, 6], [1, 7], [8, 14], [9, 15]]),  # stages 1 and 2 (e.g. ranks 2..5) are in none
    ],
)
def test_embedding_groups(pp, expected):
    assert rank_groups("DPT", dp=2, pp=pp, tp=2)["embedding"] == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"order": "DPP"}, "placement order 'DPP' is not valid"),
        ({"order": "dpt"}, "'cluster'"),
        ({"order": "clustered"}, "permutation of the letters D, P, T"),
        ({"dp": 0}, "dp=0 is not a valid degree"),
        ({"pp": -1}, "pp=-1 is not a valid degree"),
        ({"tp": 2.0}, "tp=2.0 is not a valid degree"),
        ({"tp": True}, "tp=True is not a valid degree"),
    ],
)
def test_layout_errors(kwargs, match):
    args = {"order": "DPT", "dp": 2, "pp": 2, "tp": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        rank_groups(**args)
    with pytest.raises(ValueError, match=match):
        coordinates(0, **args)


def test_rank_outside_the_job():
    with pytest.raises(ValueError, match=r"rank=8 is outside the job: dp=2 x pp=2 x tp=2 x cp=1 has ranks 0..7"):
        coordinates(8, "DPT", dp=2, pp=2, tp=2)


# ---------------------------------------------------------------- tier 2: real groups on gloo


def _one_rank(rank):
    with pytest.raises(RuntimeError, match=r"call torch\.distributed\.init_process_group first"):
        build(dp=1, pp=1, tp=1, order="cluster", device_type="cpu")
    init_gloo()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(topology.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    topo = build(dp=1, pp=1, tp=1, order="cluster", device_type="cpu")
    logger.removeHandler(handler)

    assert [r.getMessage() for r in records] == [
        "lightning_smp topology: dp=1 pp=1 tp=1 cp=1 order=DPCT world_size=1; rank 0 is dp=0 pp=0 tp=0 cp=0"
    ]
    assert (topo.dp, topo.pp, topo.tp, topo.order, topo.world_size, topo.global_rank) == (
        1,
        1,
        1,
        "DPCT",
        1,
        0,
    )
    assert topo.is_first_stage and topo.is_last_stage
    assert topo.mesh.mesh_dim_names == ("dp", "pp", "cp", "tp")
    assert topo.group("world") is dist.group.WORLD
    for axis in AXES:
        assert (topo.size(axis), topo.rank(axis), topo.ranks(axis)) == (1, 0, [0]), axis
    with pytest.raises(ValueError, match="unknown axis 'rdp'; valid axes are 'dp', 'pp', 'tp', 'cp', 'mp'"):
        topo.group("rdp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.tp = 2

    # one owner per run: a copy is the topology itself, a pickle refuses, and `release` ends every lookup
    assert copy.copy(topo) is topo and copy.deepcopy([topo])[0] is topo
    with pytest.raises(TypeError, match=r"cannot be pickled\. To save a split model, use its strategy's checkpoint"):
        pickle.dumps(topo)
    assert not topo.released
    topo.release()
    assert topo.released
    for axis in AXES:
        with pytest.raises(RuntimeError, match=r"the process groups of this run \(dp=1 pp=1 tp=1 cp=1\) were released"):
            topo.group(axis)
    with pytest.raises(RuntimeError, match="were released"):
        _ = topo.mesh
    assert (topo.tp, topo.world_size) == (1, 1)  # the layout's facts stay

    wrong = rank_groups("DPT", dp=1, pp=1, tp=1) | {"mp": [[0, 1]]}
    with (
        mock.patch.object(topology, "rank_groups", return_value=wrong),
        pytest.raises(ValueError, match=r"the 'mp' group of rank 0 holds ranks \[0\], .* needs \[0, 1\]"),
    ):
        build(dp=1, pp=1, tp=1, order="DPT", device_type="cpu")
    return True


@pytest.mark.timeout(60)
def test_world_1():
    assert run_distributed(_one_rank, 1, timeout=45) == [True]


LAYOUTS_4 = [  # (order, dp, pp, tp, cp)
    (order, dp, pp, tp, 1)
    for order in ("cluster", "spread")
    for dp, pp, tp in [(1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 4, 1)]
] + [("cluster", 1, 1, 2, 2), ("spread", 2, 1, 1, 2), ("DCPT", 1, 2, 1, 2)]


def _four_ranks(rank, layouts):
    init_gloo()
    with pytest.raises(ValueError, match=r"dp=2 x pp=2 x tp=2 x cp=1 = 8, but the job has world_size=4. .* launch 8"):
        build(dp=2, pp=2, tp=2, order="cluster", device_type="cpu")
    observed = {}
    for layout in layouts:
        order, dp, pp, tp, cp = layout
        topo = build(dp=dp, pp=pp, tp=tp, cp=cp, order=order, device_type="cpu")
        axes = [axis for axis in AXES if axis != "embedding" or topo.is_first_stage or topo.is_last_stage]
        view = {}
        for axis in axes:
            total = torch.tensor([rank])
            dist.all_reduce(total, group=topo.group(axis))
            view[axis] = (topo.size(axis), topo.rank(axis), topo.ranks(axis), total.item())
        if "embedding" not in axes:
            with pytest.raises(ValueError, match="only the first and last stages hold tied embeddings"):
                topo.group("embedding")
        observed[layout] = (view, topo.is_first_stage, topo.is_last_stage)
    return observed


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_four_ranks, 4, LAYOUTS_4, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", LAYOUTS_4, ids=lambda layout: "-".join(map(str, layout)))
def test_world_4_groups_match_the_layout(four_ranks, layout):
    order, dp, pp, tp, cp = layout
    groups = rank_groups(order, dp=dp, pp=pp, tp=tp, cp=cp)
    for rank, observed in enumerate(four_ranks):
        view, is_first, is_last = observed[layout]
        coords = coordinates(rank, order, dp=dp, pp=pp, tp=tp, cp=cp)
        assert (is_first, is_last) == (coords["pp"] == 0, coords["pp"] == pp - 1)
        expected = {}
        for axis in AXES:
            group = next((group for group in groups[axis] if rank in group), None)
            if group is not None:
                expected[axis] = (len(group), group.index(rank), group, sum(group))
        assert view == expected, f"rank {rank}"
        assert {axis: view[axis][1] for axis in ("dp", "pp", "tp", "cp")} == coords


def _group_timeouts(rank: int) -> list[float]:
    init_gloo()
    topology = build(dp=1, pp=2, tp=2, order="cluster", device_type="cpu", timeout=timedelta(seconds=42))
    return [
        topology.group(axis)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for axis in ("pp", "tp", "mp", "dp_tp")
    ]


@pytest.mark.timeout(120)
def test_every_group_gets_the_strategy_timeout():
    for timeouts in run_distributed(_group_timeouts, 4, timeout=100):
        assert timeouts == [42.0] * 4
