"""Pipeline planning without processes: microbatches, schedules, partitions, and the trunk's routing on one rank."""

import copy
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from lightning_smp import smp
from lightning_smp.config import SMPConfig
from lightning_smp.pipeline import schedule
from lightning_smp.pipeline.microbatch import batch_size, merge_outputs, reduce_values, split_batch
from lightning_smp.pipeline.partition import (
    ChildCost,
    assigned_partition,
    balance,
    child_weights,
    describe_children,
    find_trunk,
    plan_outside,
    plan_partition,
    sizes_from_assignment,
)
from lightning_smp.pipeline.stage import StageExit, StandIn, TrunkRouter, hold_outside
from lightning_smp.pipeline.trace import measure_children

Pair = namedtuple("Pair", ["x", "y"])

# -- microbatches ------------------------------------------------------------------------------------------------


def test_split_batch_splits_every_tensor_in_any_nesting_and_shares_the_rest():
    batch = {"x": torch.arange(8).view(8, 1), "pair": Pair(torch.arange(8), [torch.zeros(8, 2), "tag"]), "t": 3.0}
    batch["scalar"] = torch.tensor(5)
    pieces = split_batch(batch, 4)
    assert len(pieces) == 4
    assert [p["x"].flatten().tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert isinstance(pieces[1]["pair"], Pair) and pieces[1]["pair"].x.tolist() == [2, 3]
    assert pieces[3]["pair"].y[0].shape == (2, 2) and pieces[3]["pair"].y[1] == "tag"
    assert pieces[2]["t"] == 3.0 and pieces[2]["scalar"] is batch["scalar"]
    assert pieces[0]["x"].data_ptr() == batch["x"].data_ptr()  # views, no copy
    assert split_batch(batch, 1) == [batch]
    assert isinstance(split_batch(OrderedDict(a=torch.zeros(4)), 2)[0], OrderedDict)


def test_an_indivisible_batch_names_both_numbers_and_the_fix():
    with pytest.raises(
        ValueError, match=r"batch\['y'\] has 6 samples on dim 0, which microbatches=4 does not divide.*4 or 8"
    ):
        split_batch({"x": torch.zeros(8), "y": torch.zeros(6)}, 4)


def test_batch_size_is_dim_0_of_the_first_tensor():
    assert batch_size((torch.tensor(1.0), {"a": torch.zeros(5, 2)})) == 5
    assert batch_size(["no tensors"]) is None


def test_merge_outputs_means_losses_concatenates_predictions_and_sums_counts():
    outputs = [
        {"loss": torch.tensor(1.0), "preds": torch.tensor([1, 2]), "correct": torch.tensor(2), "n": 4, "tag": "a"},
        {"loss": torch.tensor(3.0), "preds": torch.tensor([3, 4]), "correct": torch.tensor(1), "n": 4, "tag": "b"},
    ]
    merged = merge_outputs(outputs)
    assert merged["loss"].item() == 2.0
    assert merged["preds"].tolist() == [1, 2, 3, 4]
    assert merged["correct"].item() == 3 and merged["n"] == 8 and merged["tag"] == "b"
    assert merge_outputs([None, None]) is None
    assert merge_outputs([(torch.ones(1, 2), 1.0), (torch.zeros(1, 2), 2.0)])[1] == 1.5


def test_reduce_values_follows_the_log_calls_reduce_fx():
    values = [torch.tensor(1.0), torch.tensor(4.0)]
    assert reduce_values(values, "mean").item() == 2.5
    assert reduce_values(values, "sum").item() == 5.0
    assert reduce_values(values, torch.max).item() == 4.0
    assert reduce_values([1, 2, 6], "mean") == 3.0
    assert reduce_values(values, lambda v: v).item() == 4.0  # unknown reduction: the last value, like on_step


# -- schedules ---------------------------------------------------------------------------------------------------


def _name(action):
    return f"{action.kind}{action.microbatch}"


def _orders(pipeline, stages, microbatches, **kwargs):
    plans = [
        schedule.build(pipeline, stages=stages, stage=s, microbatches=microbatches, **kwargs) for s in range(stages)
    ]
    return plans, schedule.simulate(plans)


def test_simple_is_gpipe_and_the_active_cap_makes_waves():
    plans, sim = _orders("simple", 2, 4)
    assert [_name(a) for a in plans[0]] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert sim.makespan == (4 + 2 - 1) * 3  # (m + p - 1) * (t_F + t_B)
    plans, _ = _orders("simple", 2, 4, active=2)
    assert [_name(a) for a in plans[1]] == ["F0", "F1", "B0", "B1", "F2", "F3", "B2", "B3"]


def test_interleaved_is_1f1b_with_warmup_by_stage_one_microbatch_ahead():
    plans, sim = _orders("interleaved", 4, 8)
    assert [_name(a) for a in plans[0][:7]] == ["F0", "F1", "F2", "F3", "F4", "B0", "F5"]
    assert [_name(a) for a in plans[3][:4]] == ["F0", "B0", "F1", "B1"]
    assert sim.peak_in_flight == (5, 4, 3, 1)  # 1F1B's p - s, plus one ahead before the last stage
    assert sim.makespan == (8 + 4 - 1) * 3  # the same bubble as GPipe, less memory
    _, capped = _orders("interleaved", 4, 8, active=2)
    assert max(capped.peak_in_flight) == 2


def test_one_microbatch_ahead_keeps_message_latency_off_the_critical_path():
    """With a latency per message, plain 1F1B (PipeDream-flush's warm-up) pays it at least once per microbatch;
    one microbatch ahead pays it only where the pipeline fills and drains."""
    for stages in (2, 4):
        plans = [schedule.build("interleaved", stages=stages, stage=s, microbatches=8) for s in range(stages)]
        plain = []
        for stage, plan in enumerate(plans):
            warmup = stages - stage - 1
            forwards = [a for a in plan if a.forward]
            backwards = [a for a in plan if not a.forward]
            order = forwards[:warmup]
            for offset in range(8 - warmup):
                order += [forwards[warmup + offset], backwards[offset]]
            plain.append(order + backwards[8 - warmup :])
        ideal = schedule.simulate(plans).makespan
        ours = schedule.simulate(plans, latency=0.3).makespan
        assert ours == pytest.approx(ideal + 2 * (stages - 1) * 0.3)  # fill and drain only
        assert schedule.simulate(plain, latency=0.3).makespan >= ideal + 0.3 * 8 - 1e-9


@pytest.mark.parametrize("pipeline", ["simple", "interleaved", "zero_bubble"])
def test_every_schedule_completes_without_deadlock(pipeline):
    for stages in range(1, 6):
        for microbatches in range(1, 10):
            for active in (None, 1, 2, stages + 2):
                plans, sim = _orders(pipeline, stages, microbatches, active=active)
                for kind in "FB":
                    assert sum(a.kind == kind for plan in plans for a in plan) == stages * microbatches
                assert sim.busy == (3.0 * microbatches,) * stages
                if active is not None:
                    assert max(sim.peak_in_flight) <= active


def test_zero_bubble_h1_is_1f1b_with_its_weight_gradients_held_back():
    plans = [schedule.zero_bubble_h1(stages=4, stage=s, microbatches=8) for s in range(4)]
    for stage, plan in enumerate(plans):
        one_f_one_b = schedule.build("interleaved", stages=4, stage=stage, microbatches=8)
        assert [a for a in plan if a.kind != "W"] == one_f_one_b  # F and B where 1F1B runs them
        held = [a for a in plan if a.kind == "W"]
        assert [a.microbatch for a in held] == ([] if stage == 0 else list(range(8)))  # the first stage: whole
        for weight in held:
            assert plan.index(schedule.Action("B", weight.microbatch, stage)) < plan.index(weight)
    # the last stage holds four W's back (its live microbatches then peak at 5, as 1F1B's first stage's)
    assert [_name(a) for a in plans[3][:12]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "W0", "F5"]
    assert [_name(a) for a in plans[3][-5:]] == ["W3", "W4", "W5", "W6", "W7"]


@pytest.mark.parametrize(("stages", "microbatches", "split"), [(2, 4, [0, 4]), (2, 8, [0, 5]), (4, 8, [0, 8, 7, 7])])
def test_zero_bubble_splits_only_the_backwards_whose_weight_gradients_shorten_the_step(stages, microbatches, split):
    h1 = [schedule.zero_bubble_h1(stages=stages, stage=s, microbatches=microbatches) for s in range(stages)]
    plans, _ = _orders("zero_bubble", stages, microbatches)
    assert [sum(a.kind == "W" for a in plan) for plan in plans] == split
    for plan, full in zip(plans, h1, strict=True):
        assert [a for a in plan if a.kind != "W"] == [a for a in full if a.kind != "W"]  # F and B where H1 has them
        assert [a for a in full if a in set(plan)] == plan  # the W's kept, in H1's places
    for latency in (0.0, 0.3):
        costs = dict(forward_time=1.0, backward_time=2.0, weight_time=1.0, latency=latency)
        merged, full = schedule.simulate(plans, **costs), schedule.simulate(h1, **costs)
        assert merged.makespan == pytest.approx(full.makespan)  # as short as H1's
        assert all(m <= f for m, f in zip(merged.peak_in_flight, full.peak_in_flight, strict=True))


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 8), (4, 8), (8, 32)])
def test_zero_bubble_leaves_a_third_of_1f1bs_bubble_at_its_memory(stages, microbatches):
    """ZB-H1 (arXiv 2401.10241 §3): with F = B = W the bubble is (p - 1)(F + B - W), a third of 1F1B's
    (p - 1)(F + B + W); no stage holds more live microbatches than 1F1B's first stage."""
    costs = dict(forward_time=1.0, backward_time=2.0, weight_time=1.0)  # F = B = W = 1, a whole backward 2
    one_f_one_b = schedule.simulate(_orders("interleaved", stages, microbatches)[0], **costs)
    zero_bubble = schedule.simulate(_orders("zero_bubble", stages, microbatches)[0], **costs)
    assert one_f_one_b.bubble == 3 * (stages - 1)
    assert zero_bubble.bubble == stages - 1 <= one_f_one_b.bubble / 3
    assert max(zero_bubble.peak_in_flight) == max(one_f_one_b.peak_in_flight)
    latency = dict(costs, latency=0.3)  # with a message latency too
    gained = (
        schedule.simulate(_orders("interleaved", stages, microbatches)[0], **latency).makespan
        - schedule.simulate(_orders("zero_bubble", stages, microbatches)[0], **latency).makespan
    )
    assert gained >= 1.5 * (stages - 1)


def test_virtual_stages_cut_the_bubble():
    _, plain = _orders("interleaved", 4, 8)
    plans, virtual = schedule.build("interleaved", stages=4, stage=0, microbatches=8, chunks_per_stage=2), None
    plans = [schedule.build("interleaved", stages=4, stage=s, microbatches=8, chunks_per_stage=2) for s in range(4)]
    virtual = schedule.simulate(plans, forward_time=0.5, backward_time=1.0)  # each chunk is half a stage
    assert {a.chunk for a in plans[1]} == {1, 5}
    assert virtual.efficiency == pytest.approx(8 / (8 + 3 / 2))  # m / (m + (p - 1) / v)
    assert virtual.efficiency > plain.efficiency
    with pytest.raises(ValueError, match="multiple of pipeline_parallel_degree=4, got microbatches=6"):
        schedule.build("interleaved", stages=4, stage=0, microbatches=6, chunks_per_stage=2)


def test_virtual_stages_are_checked_with_the_config():
    config = SMPConfig(pipeline_parallel_degree=2, microbatches=4, virtual_stages=2, partition=[1, 1, 1, 1])
    assert config.partition == (1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"needs pipeline='interleaved' \(got 'simple'\) and microbatches a multiple"):
        SMPConfig(pipeline_parallel_degree=2, microbatches=4, virtual_stages=2, pipeline="simple")
    with pytest.raises(ValueError, match=r"pipeline='zero_bubble' runs ZB-H1 with one trunk chunk per stage"):
        SMPConfig(pipeline_parallel_degree=2, microbatches=4, virtual_stages=2, pipeline="zero_bubble")
    with pytest.raises(ValueError, match=r"microbatches a multiple of pipeline_parallel_degree=2 \(got 3\)"):
        SMPConfig(pipeline_parallel_degree=2, microbatches=3, virtual_stages=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree=2 x virtual_stages=2 makes 4 chunks"):
        SMPConfig(pipeline_parallel_degree=2, microbatches=4, virtual_stages=2, partition=[2, 2])
    with pytest.raises(ValueError, match=r"virtual_stages=0 is invalid"):
        SMPConfig(virtual_stages=0)


def test_the_simulator_finds_deadlocks_and_incomplete_plans():
    forward, backward = schedule.Action("F", 0, 0), schedule.Action("B", 0, 0)
    first, second = schedule.Action("F", 0, 1), schedule.Action("B", 0, 1)
    weight = schedule.Action("W", 0, 1)
    with pytest.raises(ValueError, match="deadlock"):
        schedule.simulate([[backward, forward], [first, second]])  # stage 0 waits for a grad before sending
    with pytest.raises(ValueError, match="exactly once"):
        schedule.simulate([[forward], [first, second]])
    with pytest.raises(ValueError, match="deadlock"):
        schedule.simulate([[forward, backward], [first, weight, second]])  # a W before its own B
    with pytest.raises(ValueError, match="exactly once"):
        schedule.simulate([[forward, backward], [first, weight]])  # a W with no B


def test_the_simulator_costs_a_split_backward_as_its_two_parts():
    plans = [[schedule.Action("F", 0, 0), schedule.Action("B", 0, 0)]]
    plans.append([schedule.Action("F", 0, 1), schedule.Action("B", 0, 1), schedule.Action("W", 0, 1)])
    sim = schedule.simulate(plans, forward_time=1.0, backward_time=3.0, weight_time=2.0)
    # F@0, F@1, B@1 (3 - 2), then B@0 (whole) while W@1 runs
    assert sim.makespan == 1 + 1 + 1 + 3 and sim.busy == (4.0, 4.0) and sim.bubble == 2.0
    assert sim.peak_in_flight == (1, 1) and schedule.peak_in_flight(plans[1]) == 1


# -- partitions --------------------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self, blocks=4):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.small = nn.Sequential(nn.Linear(4, 4))
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(blocks))
        self.head = nn.Linear(4, 10, bias=False)


def test_the_trunk_is_the_sequential_container_with_most_parameters_or_the_named_one():
    net = _Net()
    assert find_trunk(net)[0] == "blocks"
    assert find_trunk(net, "small")[0] == "small"
    with pytest.raises(ValueError, match=r"'head' is a Linear; .* 'blocks' \(4 children, 80 params\)"):
        find_trunk(net, "head")
    with pytest.raises(ValueError, match="does not name a submodule"):
        find_trunk(net, "blocks.9")
    with pytest.raises(ValueError, match=r"has no nn.Sequential or nn.ModuleList.*nn.ModuleList run in order"):
        find_trunk(nn.Linear(2, 2))


def test_balance_minimises_the_heaviest_stage_and_prefers_even_sizes():
    assert balance([1.0] * 8, 4) == (2, 2, 2, 2)
    assert balance([4, 1, 1, 1, 1], 2) == (1, 4)
    assert balance([0, 1, 0, 1, 0], 2) in {(2, 3), (3, 2)}
    with pytest.raises(ValueError, match="cannot split 2 trunk children into 3"):
        balance([1, 1], 3)


def test_memory_weight_trades_compute_against_memory():
    children = [
        ChildCost("a", params=100, param_bytes=400, flops=1.0, activation_bytes=0),
        ChildCost("b", params=0, param_bytes=0, flops=3.0, activation_bytes=0),
    ]
    assert child_weights(children, 1.0) == pytest.approx([1.0, 0.0])  # memory only: the parameters
    assert child_weights(children, 0.0) == pytest.approx([0.25, 0.75])  # compute only: the FLOPs
    unmeasured = [ChildCost("a", params=10), ChildCost("b", params=30)]
    assert child_weights(unmeasured, 0.5) == pytest.approx([0.25, 0.75])  # compute estimated from parameters


def test_plans_from_sizes_the_cost_model_or_the_smp_placement():
    children = describe_children(_Net(6).blocks, "blocks")
    assert children[2] == ChildCost("blocks.2", params=20, param_bytes=80)
    auto = plan_partition("blocks", children, stages=3)
    assert auto.sizes == (2, 2, 2) and auto.owned(1) == (2, 3) and auto.stage_of(5) == 2
    manual = plan_partition("blocks", children, stages=2, sizes=(4, 2))
    assert manual.chunk_range(1) == range(4, 6)
    tagged = plan_partition("blocks", children, stages=2, auto=False, assignment=[0, None, None, 1, 1, 1], default=0)
    assert tagged.sizes == (3, 3)
    virtual = plan_partition("blocks", children, stages=2, chunks_per_stage=3)
    assert virtual.chunks_of(1) == (1, 3, 5) and virtual.owned(0) == (0, 2, 4)
    with pytest.raises(ValueError, match=r"virtual_stages=3 cuts the trunk into chunks; give partition="):
        plan_partition("blocks", children, stages=2, chunks_per_stage=3, auto=False, default=0)
    table = auto.table(outside=(50, 0, 7))
    assert "stage  trunk children" in table and "blocks.0 .. 1 + modules before the trunk" in table
    assert "90" in table.splitlines()[2] and "47" in table.splitlines()[4]  # 40 + 50 on stage 0, 40 + 7 on the last
    with pytest.raises(ValueError, match=r"has 6 children, fewer than the 8 pipeline stages.*<= 6"):
        plan_partition("blocks", children, stages=8)
    with pytest.raises(ValueError, match=r"partition=\(4, 1\) places 5 trunk children, but 'blocks' has 6"):
        plan_partition("blocks", children, stages=2, sizes=(4, 1))


class _Wide(nn.Module):
    """Few parameters but wide activations up front, many parameters and narrow activations at the end."""

    def __init__(self, skip=False):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 256), nn.ReLU(), nn.Linear(256, 4), nn.Linear(4, 4))
        self.skip = skip

    def forward(self, x):
        if not self.skip:
            return self.trunk(x)
        h = self.trunk[0](x)
        h = self.trunk[1](h)
        return self.trunk[3](self.trunk[2](h) + x[:, :4])


def test_example_input_array_measures_flops_and_activations_and_checks_the_chain_at_setup():
    model = _Wide()
    children = describe_children(model.trunk, "trunk")
    measured = measure_children(model, model.trunk, children, torch.zeros(8, 4))
    assert [c.flops for c in measured] == [2 * 4 * 256, 0, 2 * 256 * 4, 2 * 4 * 4]  # forward FLOPs per sample
    assert [c.activation_bytes for c in measured] == [8 * 256 * 4, 8 * 256 * 4, 8 * 4 * 4, 8 * 4 * 4]
    assert all(p.grad is None for p in model.parameters())
    compute_only = balance(child_weights(measured, 0.0), 2)
    memory_only = balance(child_weights(measured, 1.0), 2)
    assert compute_only != memory_only  # memory_weight moves the boundary once activations are known
    skipping = _Wide(skip=True)
    with pytest.raises(RuntimeError, match=r"'trunk\.3' did not get the previous child's output"):
        measure_children(skipping, skipping.trunk, children, torch.zeros(8, 4))


def test_smp_placement_must_follow_the_trunk_and_fill_every_stage():
    names = ["b0", "b1", "b2"]
    assert sizes_from_assignment(names, [0, 1, 1], stages=2, default=None) == (1, 2)
    with pytest.raises(ValueError, match="'b1' has no pipeline stage"):
        sizes_from_assignment(names, [0, None, 1], stages=2, default=None)
    with pytest.raises(ValueError, match="'b2' is placed on stage 0 after 'b1' on stage 1"):
        sizes_from_assignment(names, [0, 1, 0], stages=2, default=None)
    with pytest.raises(ValueError, match="stage 1 holds no trunk child"):
        sizes_from_assignment(names, [0, 0, 0], stages=2, default=None)
    with pytest.raises(ValueError, match="placed on stage 3, but pipeline_parallel_degree=2"):
        sizes_from_assignment(names, [0, 1, 3], stages=2, default=None)


def test_smp_partition_tags_modules_created_inside_and_set_partition_overrides():
    with smp.partition(0):
        first = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        with smp.partition(1):
            inner = nn.Linear(2, 2)
    loose = nn.Linear(2, 2)
    assert assigned_partition(first) == 0 and assigned_partition(inner) == 1
    assert assigned_partition(loose) is None
    smp.set_partition(loose, 1)
    assert assigned_partition(loose) == 1
    mixed = nn.Sequential(first, inner)
    with pytest.raises(ValueError, match="submodules placed on stages \\[0, 1\\]"):
        assigned_partition(mixed)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        smp.set_partition(loose, -1)


def test_outside_modules_live_on_their_side_of_the_trunk_and_tied_parameters_on_both():
    net = _Net()
    net.head.weight = net.embed.weight
    net.scale = nn.Parameter(torch.ones(4))  # set on the LightningModule itself: every stage holds it
    plan = plan_partition("blocks", describe_children(net.blocks, "blocks"), stages=3)
    outside = plan_outside(net, plan)
    assert outside.before == ("embed", "small") and outside.after == ("head",)
    assert outside.tied == ("embed.weight", "head.weight") and outside.shared == ("scale",)
    assert outside.params_per_stage == (40 + 20 + 4, 4, 40 + 4)  # the tied weight on the first and the last
    assert outside.dropped(0) == ("head",) and outside.dropped(1) == ("embed", "small", "head")
    assert outside.dropped(2) == ("embed", "small")
    assert outside.side_of("small.0.bias") == 0 and outside.side_of("head.weight") == 0  # tied: the first's
    assert outside.side_of("scale") is None
    net.blocks[3].weight = net.blocks[0].weight
    with pytest.raises(ValueError, match=r"shared by blocks\.0\.weight, blocks\.3\.weight, which run on different"):
        plan_outside(net, plan)


# -- routing the trunk on one rank -------------------------------------------------------------------------------


class _Chain(nn.Module):
    def __init__(self, between=None):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
        self.between = between

    def forward(self, x, extra=None):
        for index, block in enumerate(self.blocks):
            x = block(x) if extra is None else block(x, extra)
            if self.between is not None and index == 1:
                x = self.between(x)
        return x


def _router(model, stage):
    plan = plan_partition("blocks", describe_children(model.blocks, "blocks"), stages=2)
    return TrunkRouter(model.blocks, plan, stage)


def test_a_stage_keeps_its_children_and_leaves_after_its_last_one():
    torch.manual_seed(0)
    model, whole = _Chain(), _Chain()
    whole.load_state_dict(model.state_dict())
    first = _router(model, 0)
    x = torch.randn(2, 3)
    assert sum(1 for _ in model.parameters()) == 4  # blocks 2 and 3 became placeholders
    with first.run(0), pytest.raises(StageExit) as stop:
        model(x)
    expected_mid = whole.blocks[1](whole.blocks[0](x))
    torch.testing.assert_close(stop.value.output, expected_mid)
    assert model(x).shape == (2, 3)  # outside a step the owned children run, the placeholders pass through

    last_model = _Chain()
    last_model.load_state_dict(whole.state_dict())
    last = _router(last_model, 1)
    with last.run(1, expected_mid) as call:
        out = last_model(torch.full((2, 3), 123.0))  # the local input is replaced by the received activation
    assert call.finished
    torch.testing.assert_close(out, whole(x))


class _LanguageModel(nn.Module):
    """An embedding and a position table before a ModuleList trunk, a head after it; ``tied``: the head's weight
    is the embedding's."""

    def __init__(self, *, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.position = nn.Embedding(5, 3)
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
        self.head = nn.Linear(3, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        x += self.position(torch.arange(idx.shape[1]))  # in place: on a later stage, into the placeholder
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _hold(model, stage):
    plan = plan_partition("blocks", describe_children(model.blocks, "blocks"), stages=2)
    outside = plan_outside(model, plan)
    router = TrunkRouter(model.blocks, plan, stage)
    hold_outside(model, outside, router)
    return router


@pytest.mark.parametrize("tied", [False, True])
def test_a_later_stage_holds_no_module_before_the_trunk_and_replaces_its_output_by_zeros(tied):
    torch.manual_seed(0)
    whole = _LanguageModel(tied=tied)
    first, last = _LanguageModel(tied=tied), _LanguageModel(tied=tied)
    first.load_state_dict(whole.state_dict())
    last.load_state_dict(whole.state_dict())
    idx = torch.randint(0, 10, (2, 5))
    first_router, last_router = _hold(first, 0), _hold(last, 1)
    held_first = {name for name, _ in first.named_parameters(remove_duplicate=False)}
    held_last = {name for name, _ in last.named_parameters(remove_duplicate=False)}
    tied_names = {"embed.weight", "head.weight"} if tied else set()
    blocks = {f"blocks.{i}.{kind}" for i in range(4) for kind in ("weight", "bias")}
    assert held_first == {"embed.weight", "position.weight"} | {b for b in blocks if b < "blocks.2"} | tied_names
    assert held_last == {"head.weight"} | {b for b in blocks if b > "blocks.2"} | tied_names
    assert isinstance(first.head, StandIn) and isinstance(last.embed, StandIn)
    with first_router.run(0), pytest.raises(StageExit) as stop:
        first(idx)
    placeholder = last.embed(idx)
    assert placeholder.shape == (2, 5, 3) and not placeholder.any()
    with last_router.run(1, stop.value.output):
        out = last(idx)
    torch.testing.assert_close(out, whole(idx))
    last.half()
    assert last.embed(idx).dtype == torch.float16  # the placeholders follow the model's casts
    assert last.embed.embedding_dim == 3  # a module's settings are readable on every stage
    with pytest.raises(AttributeError, match="'position' lives on pipeline stage 0 only, but stage 1 used"):
        _ = last.position.weight
    copied = copy.deepcopy(last)  # e.g. an EMA callback's copy of the module
    assert isinstance(copied.embed, StandIn) and copied.embed(idx).dtype == torch.float16


def test_a_module_run_on_the_other_side_of_the_trunk_than_registered_is_a_clear_error():
    class HeadFirst(_LanguageModel):
        def forward(self, idx):
            x = self.head(self.embed(idx))[..., :3]  # registered after the trunk, run before it
            for block in self.blocks:
                x = block(x)
            return x

    model = HeadFirst(tied=False)
    router = _hold(model, 0)
    with router.run(0), pytest.raises(RuntimeError, match="'head' is placed after the pipelined trunk") as error:
        model(torch.zeros(1, 2, dtype=torch.long))
    assert "smp.set_partition(model.head, 0)" in str(error.value)


class _HeadRegisteredFirst(_LanguageModel):
    """The head registered before the trunk and run after it, as LitGPT's ``GPT`` registers its ``lm_head``."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.head = nn.Linear(3, 10, bias=False)
        self.embed = nn.Embedding(10, 3)
        self.position = nn.Embedding(5, 3)
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))


def test_set_partition_places_a_module_outside_the_trunk_where_it_runs_not_where_it_is_registered():
    model = _HeadRegisteredFirst()
    plan = plan_partition("blocks", describe_children(model.blocks, "blocks"), stages=3)
    assert plan_outside(model, plan).before == ("head", "embed", "position")
    smp.set_partition(model.head, 2)
    outside = plan_outside(model, plan)
    assert outside.before == ("embed", "position") and outside.after == ("head",)
    assert outside.params_per_stage == (30 + 15, 0, 30)
    smp.set_partition(model.head, 1)
    with pytest.raises(ValueError, match=r"'head' is placed on pipeline stage 1 .* stage 0 or 2, or make it part"):
        plan_outside(model, plan)


def test_a_head_registered_before_the_trunk_and_placed_after_it_runs_on_the_last_stage():
    torch.manual_seed(0)
    whole = _HeadRegisteredFirst()
    ids = torch.tensor([[1, 2, 3]])
    stages = [copy.deepcopy(whole) for _ in range(2)]
    routers = []
    for stage, model in enumerate(stages):
        smp.set_partition(model.head, 1)
        routers.append(_hold(model, stage))
    assert isinstance(stages[0].head, StandIn) and isinstance(stages[1].embed, StandIn)
    with routers[0].run(0), pytest.raises(StageExit) as stop:
        stages[0](ids)
    with routers[1].run(1, stop.value.output):
        torch.testing.assert_close(stages[1](ids), whole(ids))


def test_code_between_children_and_skip_connections_are_refused():
    model = _Chain(between=lambda x: x * 2)
    router = _router(model, 1)
    with router.run(1, torch.zeros(2, 3)), pytest.raises(RuntimeError, match="did not get the previous child's output"):
        model(torch.zeros(2, 3))
    model = _Chain()
    model.blocks = nn.ModuleList(_TwoInputs() for _ in range(4))
    router = _router(model, 0)
    with router.run(0), pytest.raises(RuntimeError, match="extra input that requires grad"):
        model(torch.zeros(2, 3), torch.zeros(2, 3, requires_grad=True))


class _TwoInputs(nn.Linear):
    def __init__(self):
        super().__init__(3, 3)

    def forward(self, x, extra):
        return super().forward(x) + extra


# -- a backward split into input and weight gradients (zero bubble) -------------------------------------------------


class _Hooked(nn.Module):
    """A linear layer whose weight gradient passes a hook (as tensor-parallel replicated norms sum theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.linear.weight.register_hook(lambda grad: 2 * grad)

    def forward(self, x):
        return self.linear(x)


class _Reused(nn.Module):
    """One layer applied twice: its weight meets the activation's path at two nodes, one below the other."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(torch.relu(self.linear(x)))


class _ParameterOnlyOutput(nn.Module):
    """Two outputs, one of which depends on parameters only (its path never meets the activation's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.table = nn.Parameter(torch.randn(8, 16))
        self.scale = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        y = self.table @ self.scale
        return self.linear(x) + y, 2 * y


class _OutputUsedAgain(_ParameterOnlyOutput):
    """An output off the activation's path that is also part of another output, on the path and off it: its
    gradient is its own plus what the others send it."""

    def forward(self, x):
        y = self.table @ self.scale
        return self.linear(x) + y, y, 2 * y


class _LossHead(nn.Module):
    """The last stage: a norm, a head and a scalar loss with a weight penalty off the activation's path."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.norm(x)).logsumexp(-1).mean() + 0.1 * self.head.weight.square().sum()


def _blocks(checkpointed: bool) -> nn.Module:
    from torch.utils.checkpoint import checkpoint

    from tests.models import TransformerBlock

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(TransformerBlock(16) for _ in range(2))

        def forward(self, x):
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
            for block in self.blocks:
                x = checkpoint(block, x, mask, use_reentrant=False) if checkpointed else block(x, mask)
            return x

    return Blocks()


_STAGES = {
    "mlp": lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU()),
    "transformer": lambda: _blocks(checkpointed=False),
    "checkpointed": lambda: _blocks(checkpointed=True),
    "hooked": _Hooked,
    "reused": _Reused,
    "parameter_only_output": _ParameterOnlyOutput,
    "output_used_again": _OutputUsedAgain,
    "loss": _LossHead,
}


@pytest.mark.parametrize("name", list(_STAGES))
@pytest.mark.parametrize("receives", [True, False])
def test_a_split_backward_gives_the_whole_backwards_gradients_in_two_parts(name, receives):
    """B gives the received activation's gradient and touches no weight; W then gives the weights' gradients the
    whole backward gives (without a received activation, the first stage: B does nothing, W is the whole)."""
    from lightning_smp.pipeline.split_backward import BackwardSplitter

    results = []
    for split in (False, True):
        torch.manual_seed(0)
        stage = _STAGES[name]()
        x = torch.randn(4, 8, 16, requires_grad=receives)
        outputs = stage(x)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grads = [None if out.dim() == 0 else torch.randn_like(out) for out in outputs]
        if not split:
            torch.autograd.backward(outputs, grads)
        else:
            weights = BackwardSplitter(list(stage.parameters())).backward_input(outputs, grads, [x])
            assert all(p.grad is None for p in stage.parameters())
            received = None if x.grad is None else x.grad.clone()
            weights()
            assert (x.grad is None and received is None) or torch.equal(x.grad, received)  # W: weights only
        results.append((x.grad, {n: p.grad for n, p in stage.named_parameters()}))
    (whole_input, whole), (split_input, split_weights) = results
    assert (whole_input is None) == (not receives)
    if receives:
        torch.testing.assert_close(split_input, whole_input)
    assert whole.keys() == split_weights.keys() and all(g is not None for g in split_weights.values())
    for param_name, grad in whole.items():
        torch.testing.assert_close(split_weights[param_name], grad, msg=param_name)
