"""Tier 1 (pure, one process, no group): shard arithmetic, which modules were created tensor-parallel, what a plan
splits and the errors it raises, and the layers before they are split (they must be the torch layer exactly)."""

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_smp import SMPStrategy, smp
from lightning_smp.config import SMPConfig
from lightning_smp.tensor_parallel import (
    ColumnParallelLinear,
    DistributedEmbedding,
    DistributedLinear,
    DistributedLMHead,
    DistributedTransformerLayer,
    RowParallelLinear,
    ShardSpec,
    merge_shards,
    plan_tensor_parallel,
    slice_shard,
)
from lightning_smp.tensor_parallel.creation import creation_setting, set_tensor_parallelism
from lightning_smp.tensor_parallel.plan import match_pattern

# -- shards ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("spec", [ShardSpec(0), ShardSpec(1), ShardSpec(0, blocks=3)])
def test_slices_merge_back_into_the_whole_tensor(parts, spec):
    whole = torch.arange(24 * 8.0).view(24, 8)
    pieces = [slice_shard(whole, spec, index, parts) for index in range(parts)]
    assert torch.equal(merge_shards(pieces, spec), whole)


def test_packed_qkv_shards_keep_each_ranks_heads_of_q_k_and_v():
    q, k, v = torch.zeros(4, 2), torch.ones(4, 2), torch.full((4, 2), 2.0)
    piece = slice_shard(torch.cat([q, k, v]), ShardSpec(0, blocks=3), index=1, parts=2)
    assert piece[:, 0].tolist() == [0, 0, 1, 1, 2, 2]


def test_a_size_that_does_not_split_names_the_numbers():
    with pytest.raises(ValueError, match="dim 0 of size 10 does not split into 3 block"):
        slice_shard(torch.zeros(10, 2), ShardSpec(0, blocks=3), 0, 2)


# -- creation under smp.tensor_parallelism ---------------------------------------------------------------------


def test_the_innermost_context_decides_and_containers_children_are_seen():
    with smp.tensor_parallelism():
        blocks = nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Embedding(4, 2))])
        with smp.model_creation(tensor_parallelism=False):
            kept = nn.MultiheadAttention(4, 2)
        embedding = nn.Embedding(4, 2)  # a leaf: only its parameter registration shows it is being created
    after = nn.Linear(2, 2)
    assert creation_setting(blocks).enabled and creation_setting(blocks[1][0]).enabled
    assert creation_setting(embedding).enabled
    assert not creation_setting(kept).enabled and not creation_setting(kept.out_proj).enabled
    assert creation_setting(after) is None  # the hooks are gone once the last context closes


def test_the_note_survives_deepcopy_as_in_transformer_encoder_clones():
    with smp.tensor_parallelism():
        layer = nn.TransformerEncoderLayer(8, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor + norm_first warnings are torch's
        encoder = nn.TransformerEncoder(layer, num_layers=2)
    assert all(creation_setting(clone).enabled for clone in encoder.layers)


def test_set_tensor_parallelism_overrides_the_creation_context():
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16))
    set_tensor_parallelism(model, True, distribute_embedding=False)
    assert creation_setting(model[0]).enabled and not creation_setting(model[0]).distribute_embedding
    assert smp.set_tensor_parallelism is set_tensor_parallelism


def test_unknown_tensor_parallel_options_suggest_the_nearest():
    message = r"unknown tensor-parallelism option 'distribute_embeddings'; did you mean 'distribute_embedding'"
    with pytest.raises(ValueError, match=message), smp.tensor_parallelism(distribute_embeddings=True):
        pass


def test_smp_options_without_effect_warn():
    with (
        pytest.warns(UserWarning, match="fused_softmax have no effect in lightning_smp"),
        smp.model_creation(tensor_parallelism=True, fused_softmax=True),
    ):
        pass


# -- what a plan splits ------------------------------------------------------------------------------------------


class _Gpt(nn.Module):
    def __init__(self, heads: int = 4, ff: int = 32, tied: bool = True) -> None:
        super().__init__()
        with smp.tensor_parallelism():
            self.tok = nn.Embedding(64, 16)
            self.pos = nn.Embedding(8, 16)
            self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, heads, ff, batch_first=True) for _ in range(2))
        self.head = nn.Linear(16, 64, bias=False)
        if tied:
            self.head.weight = self.tok.weight


def _labels(plan):
    return [unit.label for unit in plan.units]


def test_context_layers_are_split_and_a_tied_embedding_stays_whole():
    plan = plan_tensor_parallel(_Gpt(), tp_size=2)
    assert _labels(plan) == [
        "pos (Embedding)",
        "blocks.0 (TransformerEncoderLayer)",
        "blocks.1 (TransformerEncoderLayer)",
    ]
    assert plan.kept_whole == (("tok (Embedding)", "its weight tok.weight is shared with head.weight (Linear)"),)
    assert plan.sharded_specs["blocks.0.self_attn.in_proj_weight"] == ShardSpec(0, blocks=3)
    assert plan.sharded_specs["blocks.1.linear2.weight"] == ShardSpec(1)
    assert "blocks.0.norm1.weight" not in plan.sharded_specs and "blocks.0.linear2.bias" not in plan.sharded_specs
    assert "tok (Embedding)" in _labels(plan_tensor_parallel(_Gpt(tied=False), tp_size=2))


def test_sizes_that_do_not_divide_keep_the_layer_whole_with_the_numbers():
    plan = plan_tensor_parallel(_Gpt(heads=2, ff=30), tp_size=4)
    reasons = dict(plan.kept_whole)
    assert reasons["blocks.0 (TransformerEncoderLayer)"] == (
        "self_attn.num_heads=2 is not divisible by tensor_parallel_degree=4"
    )
    assert _labels(plan) == ["pos (Embedding)"]
    assert dict(plan_tensor_parallel(_Gpt(ff=30), tp_size=4).kept_whole)["blocks.1 (TransformerEncoderLayer)"] == (
        "linear1.out_features=30 is not divisible by tensor_parallel_degree=4"
    )


def test_our_own_modules_split_without_a_context_and_ties_between_them_are_kept():
    class Lm(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = DistributedEmbedding(64, 16)
            self.proj = DistributedLinear(16, 16)
            self.head = DistributedLMHead(16, 64)
            self.head.weight = self.embed.weight  # both split by vocabulary rows: the tie survives

    plan = plan_tensor_parallel(Lm(), tp_size=2)
    assert _labels(plan) == ["embed (DistributedEmbedding)", "proj (DistributedLinear)", "head (DistributedLMHead)"]
    assert plan.kept_whole == ()


def test_distribute_embedding_false_keeps_embeddings_out():
    with smp.tensor_parallelism(distribute_embedding=False):
        model = nn.Sequential(nn.Embedding(8, 4), nn.TransformerEncoderLayer(4, 2, 8))
    assert _labels(plan_tensor_parallel(model, tp_size=2)) == ["1 (TransformerEncoderLayer)"]


def _mlp() -> nn.Module:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = nn.Linear(8, 32), nn.Linear(32, 8)

    model = nn.Module()
    model.blocks = nn.ModuleList(Block() for _ in range(2))
    return model


def test_plan_patterns_match_one_path_component_per_star():
    assert match_pattern("blocks.*.fc", "blocks.0.fc")
    assert not match_pattern("blocks.*.fc", "blocks.0.mlp.fc")
    assert not match_pattern("blocks.*", "blocks.0.fc")
    plan = plan_tensor_parallel(_mlp(), tp_size=2, patterns={"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"})
    assert [(unit.name, unit.target) for unit in plan.units] == [
        ("blocks.0.fc", ColumnParallelLinear),
        ("blocks.0.proj", RowParallelLinear),
        ("blocks.1.fc", ColumnParallelLinear),
        ("blocks.1.proj", RowParallelLinear),
    ]


@pytest.mark.parametrize(
    ("patterns", "match"),
    [
        (
            {"blocks.*.fcc": "colwise"},
            r"'blocks.\*.fcc' matches no module of the model; close module names: blocks.1.fc, blocks.0.fc",
        ),
        (
            {"blocks.*.fc": "vocab"},
            r"gives 'blocks.0.fc' the style 'vocab', but it is a Linear; 'vocab' applies to exactly Embedding",
        ),
        ({"blocks.*.fc": "colwise", "blocks.0.*": "rowwise"}, "matched by several tensor_parallel_plan patterns"),
        (
            {"blocks.0.fc": "rowwise"},
            r"cannot split 1 module\(s\) 3 ways: blocks.0.fc \(Linear\): in_features=8 is not divisible",
        ),
        ({"blocks.0.fc": "auto"}, "'auto' applies to exactly TransformerEncoderLayer"),
    ],
)
def test_unusable_plans_raise_with_the_fix(patterns, match):
    with pytest.raises(ValueError, match=match):
        plan_tensor_parallel(_mlp(), tp_size=3 if "3 ways" in match else 2, patterns=patterns)


def test_a_plan_entry_inside_a_context_layer_raises_and_replicate_excludes_a_subtree():
    model = _Gpt()
    with pytest.raises(ValueError, match=r"'blocks.0.linear1', inside a module that is already split as a whole"):
        plan_tensor_parallel(model, tp_size=2, patterns={"blocks.0.linear1": "colwise"})
    plan = plan_tensor_parallel(model, tp_size=2, patterns={"blocks.0": "replicate", "pos": "replicate"})
    assert _labels(plan) == ["blocks.1 (TransformerEncoderLayer)"]


def test_subclasses_of_torch_layers_are_not_converted():
    class MyLinear(nn.Linear):
        pass

    model = nn.Module()
    model.fc = MyLinear(4, 4)
    with pytest.raises(ValueError, match="it is a MyLinear; 'colwise' applies to exactly Linear"):
        plan_tensor_parallel(model, tp_size=2, patterns={"fc": "colwise"})


# -- config and strategy -----------------------------------------------------------------------------------------


def test_the_strategy_takes_a_plan_and_tensor_parallel_degree():
    strategy = SMPStrategy(tensor_parallel_degree=2, tensor_parallel_plan={"blocks.*.fc": "colwise"})
    assert strategy.config.tensor_parallel_degree == 2
    assert dict(strategy.config.tensor_parallel_plan) == {"blocks.*.fc": "colwise"}


# -- the layers before they are split ---------------------------------------------------------------------------


def test_a_distributed_transformer_layer_is_the_torch_layer_until_split():
    torch.manual_seed(0)
    expected = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    torch.manual_seed(0)
    layer = DistributedTransformerLayer(16, 4, 32, dropout=0.0, batch_first=True)
    assert isinstance(layer, nn.TransformerEncoderLayer) and isinstance(layer.linear1, ColumnParallelLinear)
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in expected.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), expected.parameters(), strict=True))
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(layer(x), expected(x), rtol=0, atol=0)


def test_converting_keeps_the_module_object_and_its_parameters():
    linear = nn.Linear(4, 8)
    weight = linear.weight
    ColumnParallelLinear.tp_convert(linear)
    assert type(linear) is ColumnParallelLinear and linear.weight is weight and not linear.gather_output
    assert copy.deepcopy(linear).weight.shape == (8, 4)


def test_the_head_loss_is_cross_entropy_before_the_split():
    head = DistributedLMHead(8, 16)
    hidden, target = torch.randn(2, 3, 8), torch.randint(0, 16, (2, 3))
    expected = nn.functional.cross_entropy(head(hidden).flatten(0, 1), target.flatten())
    torch.testing.assert_close(head.loss(head(hidden), target), expected)


def test_tensor_parallel_plan_config_round_trips_through_pickle():
    config = SMPConfig(tensor_parallel_plan={"a.*": "colwise"})
    assert copy.deepcopy(config).tensor_parallel_plan == config.tensor_parallel_plan
