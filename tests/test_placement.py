"""The public placement of a parameter: what tensor parallelism and the pipeline record, what others read."""

import dataclasses

import pytest
import torch
from torch import nn

from lightning_smp.placement import Cut, Placement, TPShard, mark_norm_duplicate, place_tp_shard, placement_of


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


# -- Cut: which elements of a whole tensor a rank holds ----------------------------------------------------------


@pytest.mark.parametrize(("dim", "blocks"), [(0, 1), (1, 1), (0, 3)])
def test_a_cut_of_a_shard_is_the_shard_and_its_rows_are_the_shard_s_rows(dim: int, blocks: int) -> None:
    from lightning_smp.tensor_parallel.shard import ShardSpec, slice_shard

    whole = torch.arange(24 * 6).reshape(24, 6)
    for index in range(2):
        cut = Cut.of_shard(whole.shape, TPShard(dim, index, 2, blocks))
        piece = slice_shard(whole, ShardSpec(dim, blocks), index, 2)
        assert torch.equal(cut(whole), piece) and cut.shape == tuple(piece.shape)
        rows = piece.shape[0]
        for start, stop in ((0, rows // 3), (rows // 3, rows), (rows, rows)):  # sharded data parallelism's rows
            assert torch.equal(cut.rows(start, stop)(whole), piece[start:stop])
            assert cut.rows(start, stop).shape == tuple(piece[start:stop].shape)


def test_a_whole_cut_is_the_tensor_and_a_packed_one_is_one_box_per_block() -> None:
    whole = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(Cut.whole(whole.shape)(whole), whole) and Cut.of_shard((6, 2), None) == Cut.whole((6, 2))
    packed = Cut.of_shard((6, 2), TPShard(dim=0, index=1, parts=2, blocks=3))
    assert packed.boxes == (((1, 2), (0, 2)), ((3, 4), (0, 2)), ((5, 6), (0, 2)))
    assert packed.indices()[0] == (slice(1, 2), slice(0, 2))
