"""The public placement of a parameter: what tensor parallelism and the pipeline record, what others read."""

import dataclasses

import pytest
import torch
from torch import nn

from lightning_smp.placement import Placement, TPShard, mark_norm_duplicate, place_tp_shard, placement_of


def test_a_tensor_never_placed_is_whole_and_counts_in_the_norm() -> None:
    param = nn.Parameter(torch.zeros(3, 4))
    assert placement_of(param) == Placement(global_shape=(3, 4))
    assert placement_of(param).tp_shard is None
    assert placement_of(param).counts_in_norm


def test_a_tensor_parallel_piece_knows_its_global_shape() -> None:
    piece = nn.Parameter(torch.zeros(6, 4))  # rank 1's rows of q, k and v of a packed (36, 4) weight, tp=3
    place_tp_shard(piece, TPShard(dim=0, index=1, parts=3, blocks=3))
    assert placement_of(piece) == Placement(global_shape=(18, 4), tp_shard=TPShard(0, 1, 3, 3))


def test_norm_duplicates_collect_their_axes_and_keep_the_shard() -> None:
    param = nn.Parameter(torch.zeros(2, 5))
    place_tp_shard(param, TPShard(dim=1, index=0, parts=2))
    mark_norm_duplicate(param, axis="pp")
    mark_norm_duplicate(param, axis="tp")
    placement = placement_of(param)
    assert placement.norm_duplicate_on == frozenset({"pp", "tp"})
    assert not placement.counts_in_norm
    assert placement.tp_shard == TPShard(1, 0, 2) and placement.global_shape == (2, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.global_shape = (1,)  # type: ignore[misc]


def test_a_placement_survives_the_precision_conversion() -> None:
    model = nn.Linear(4, 2)
    place_tp_shard(model.weight, TPShard(dim=0, index=0, parts=2))
    mark_norm_duplicate(model.bias, axis="tp")
    model.half()  # after `parallelize`, as the strategy converts the model
    assert placement_of(model.weight).tp_shard == TPShard(0, 0, 2)
    assert placement_of(model.bias).norm_duplicate_on == frozenset({"tp"})
