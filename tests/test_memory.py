"""The memory planner: bytes per kind and per element, what tensor-parallel ranks and pipeline stages hold, the
activations traced on the meta device, the fit verdict and the layout search (pure, on meta-device models), and its
agreement with the bytes `benchmarks/memory_scale.py` and `benchmarks/sequence_parallel.py` measure on live ranks."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import memory_scale, sequence_parallel
from lightning_smp import SMPConfig, estimate_memory, fitting_layouts, smp
from lightning_smp.activation_memory import SavedBytes
from lightning_smp.memory import layouts_table
from tests.distributed import run_benchmark, run_distributed
from tests.gpt import llama_config

VOCAB, WIDTH, HEADS, FF, LAYERS = 64, 16, 2, 32, 4


class _GPT(nn.Module):
    def __init__(self, *, tied: bool = False, tensor_parallel: bool = True) -> None:
        super().__init__()
        with smp.tensor_parallelism(tensor_parallel):
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(WIDTH, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(LAYERS)
            )
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids: Tensor, target: Tensor) -> Tensor:  # the mean next-token loss
        h = self.tok(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return F.cross_entropy(self.head(self.norm(h)).float().flatten(0, 1), target.flatten())


def _gpt(**kwargs) -> _GPT:
    with torch.device("meta"):
        return _GPT(**kwargs)


def _batch(samples: int = 4, sequence: int = 8) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (samples, sequence + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # as a DataLoader collates them


def _numel(*modules: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())


# -- bytes per element ---------------------------------------------------------------------------------------------


def test_fp16_counts_every_kind_per_element():
    model = _gpt()
    (rank,) = estimate_memory(model, config={"fp16": True}).ranks
    n = _numel(model)
    assert (rank.parameters, rank.gradients, rank.masters, rank.master_gradients) == (2 * n, 2 * n, 4 * n, 4 * n)
    assert rank.optimizer_state == 8 * n  # two fp32 Adam moments per master element
    assert rank.model_states == 20 * n


def test_fp32_has_no_masters_and_adam_state_in_fp32():
    model = _gpt()
    (rank,) = estimate_memory(model).ranks
    n = _numel(model)
    assert (rank.parameters, rank.gradients, rank.masters, rank.master_gradients) == (4 * n, 4 * n, 0, 0)
    assert rank.optimizer_state == 8 * n


def test_batchnorm_stays_fp32_without_a_master_and_frozen_parameters_hold_only_weights():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8, 2))
    model[3].requires_grad_(False)
    (rank,) = estimate_memory(model, config={"bf16": True}).ranks
    conv, norm, frozen = _numel(model[0]), _numel(model[1]), _numel(model[3])
    assert rank.parameters == 2 * conv + 4 * norm + 2 * frozen
    assert rank.gradients == 2 * conv + 4 * norm
    assert rank.masters == rank.master_gradients == 4 * conv
    assert rank.optimizer_state == 8 * conv + 8 * norm


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_sharded_optimizer_state_keeps_a_1_over_dp_share_of_masters_their_grads_and_adam_state(precision):
    model = _gpt()
    n = _numel(model)
    config = {"shard_optimizer_state": True, "fp16": precision == "fp16"}
    whole = estimate_memory(model, config={"fp16": precision == "fp16"}, world_size=4).ranks[0]
    report = estimate_memory(model, config=config, world_size=4)
    (rank,) = report.ranks
    share = -(-n // 4)  # one dtype: one flat buffer padded to a multiple of dp
    assert report.layout.shard_optimizer_state and "optimizer state sharded" in str(report)
    assert "Assumes shard_optimizer_state: each replica keeps 1/dp" in str(report)
    assert (rank.parameters, rank.gradients) == (whole.parameters, whole.gradients)
    assert (rank.masters, rank.master_gradients, rank.optimizer_state) == (4 * share, 4 * share, 8 * share)
    if precision == "fp16":  # the padded fp16 gradients, plus the share cast to fp16
        assert rank.step_buffer == 2 * (4 * share + share)
        assert rank.masters + rank.optimizer_state <= 0.26 * (whole.masters + whole.optimizer_state)
    else:  # fp32 parameters are no longer their own masters; the reduce-scatter writes the fp32 share in place
        assert rank.step_buffer == 4 * 4 * share
        assert whole.masters == 0 and rank.optimizer_state <= 0.26 * whole.optimizer_state
    assert rank.total == rank.model_states + rank.step_buffer
    alone = estimate_memory(model, config=config).ranks[0]  # one replica: nothing to shard
    assert (alone.masters, alone.step_buffer) == (whole.masters, 0)


def test_sharded_optimizer_state_keeps_batchnorm_in_its_own_fp32_bucket():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    (rank,) = estimate_memory(model, config={"fp16": True, "shard_optimizer_state": True}, world_size=2).ranks
    conv, norm = _numel(model[0]), _numel(model[1])
    share = -(-conv // 2) + -(-norm // 2)
    assert (rank.masters, rank.optimizer_state) == (4 * share, 8 * share)
    assert rank.step_buffer == 2 * (2 * -(-conv // 2) + -(-conv // 2)) + 4 * 2 * -(-norm // 2)  # both dtypes at once


# -- what each rank holds -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", [{"fp16": True}, {"bf16": True}, {}])
def test_sharded_data_parallel_keeps_1_over_sdp_of_fp32_parameters_grads_and_adam_state(precision):
    model = _gpt()
    config = {**precision, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0}
    report = estimate_memory(model, config=config, world_size=4)
    (rank,) = report.ranks
    n = _numel(model)
    assert (rank.parameters, rank.gradients, rank.masters, rank.master_gradients) == (n, n, 0, 0)  # 4 bytes / 4
    assert rank.optimizer_state == 2 * n
    block = _numel(model.blocks[0])
    root = _numel(model) - LAYERS * block
    compute = 4 if not precision else 2
    per_element = compute + compute + (4 if precision else 0)  # gathered params, their grads, fp32 reduce input
    assert rank.step_buffer == max(block, root) * per_element
    assert rank.total == rank.model_states + rank.step_buffer
    assert report.layout.sdp == 4 and "sharded data parallel 4" in str(report)
    assert "fp32 shards of 1/sdp" in str(report) and "16-bit parameters and gradients" not in str(report)


def test_sharded_data_parallel_keeps_parameters_below_the_threshold_whole():
    model = _gpt()
    threshold = WIDTH * WIDTH + 1  # below: the LayerNorms, every bias, out_proj; above: the embedding, in_proj
    config = {"fp16": True, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": threshold}
    (rank,) = estimate_memory(model, config=config, world_size=2).ranks
    kept = sum(p.numel() for p in model.parameters() if p.numel() < threshold)
    assert 0 < kept < _numel(model)
    assert rank.parameters == 4 * kept + 4 * (_numel(model) - kept) // 2
    everything = estimate_memory(model, config={**config, "sdp_param_persistence_threshold": 10**9}, world_size=2)
    assert everything.largest.parameters == 4 * _numel(model) and everything.largest.step_buffer == 0


def test_sharded_data_parallel_refuses_pipeline_parallelism_as_the_config_does():
    with pytest.raises(ValueError, match="cannot be combined with pipeline_parallel_degree=2"):
        estimate_memory(_gpt(), config={"pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 2}, world_size=4)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tensor_parallel_ranks_hold_a_share_of_what_the_plan_splits(tied):
    model = _gpt(tied=tied)
    report = estimate_memory(model, config={"tensor_parallel_degree": 2, "tensor_parallel_plan": {"head": "colwise"}})
    (rank,) = report.ranks
    assert rank.ranks == (0, 1)
    # replicated on both ranks: the norms and the biases added after a row-parallel reduction
    replicated = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "norm" in name or name.endswith(("out_proj.bias", "linear2.bias"))
    )
    assert rank.parameters == 4 * (replicated + (_numel(model) - replicated) // 2)


def test_tensor_parallel_keeps_whole_what_the_plan_cannot_split():
    model = _gpt(tensor_parallel=False)  # nothing created tensor-parallel, no plan: every rank holds all
    (whole,) = estimate_memory(model).ranks
    (rank,) = estimate_memory(model, config={"tensor_parallel_degree": 2}).ranks
    assert rank.model_states == whole.model_states


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pipeline_stages_hold_their_trunk_children_and_the_modules_on_their_side(tied):
    model = _gpt(tied=tied)
    report = estimate_memory(model, config={"pipeline_parallel_degree": 2, "microbatches": 2}, world_size=4)
    first, last = report.ranks
    assert (first.ranks, last.ranks) == ((0, 2), (1, 3))  # cluster placement: dp varies slowest
    blocks = model.blocks
    expected_first = _numel(model.tok, blocks[0], blocks[1])
    expected_last = _numel(blocks[2], blocks[3], model.norm, model.head)  # tied: the head's weight is tok's
    assert (first.parameters, last.parameters) == (4 * expected_first, 4 * expected_last)


def test_a_parameter_set_on_the_trunks_ancestor_is_held_by_every_stage():
    model = _gpt()
    with torch.device("meta"):
        model.scale = nn.Parameter(torch.ones(WIDTH))  # on the LightningModule itself, as the pipeline allows
    without = estimate_memory(_gpt(), config={"pipeline_parallel_degree": 2, "microbatches": 2}).ranks
    with_scale = estimate_memory(model, config={"pipeline_parallel_degree": 2, "microbatches": 2}).ranks
    assert [b.parameters - a.parameters for a, b in zip(without, with_scale, strict=True)] == [4 * WIDTH] * 2


def test_manual_partition_sizes_decide_the_stages():
    model = _gpt()
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "partition": [1, 3]}
    first, last = estimate_memory(model, config=config).ranks
    assert first.parameters == 4 * _numel(model.tok, model.blocks[0])
    assert last.parameters == 4 * _numel(*model.blocks[1:], model.norm, model.head)


# -- activations ----------------------------------------------------------------------------------------------------


def test_activations_are_what_one_microbatch_keeps_for_backward_on_a_live_run():
    """On one device the trace on the meta device counts exactly what a real forward keeps (each storage once,
    the parameters left out), logits and loss included."""
    torch.manual_seed(0)
    live = _GPT()
    with SavedBytes(exclude=live.parameters()) as saved:
        live(*_batch())
    (rank,) = estimate_memory(_gpt(), batch=_batch()).ranks
    assert rank.activations == saved.total() > 0
    (rank,) = estimate_memory(_gpt(), config={"microbatches": 2}, batch=_batch()).ranks
    assert rank.in_flight == 2 and rank.activations < saved.total()  # one microbatch; without a pipeline both run


def test_activations_follow_tensor_and_sequence_parallelism_checkpointing_and_offloading():
    def activations(**config):
        model = _gpt()
        if config.pop("checkpointed", False):
            smp.set_activation_checkpointing(model.blocks)
        (rank,) = estimate_memory(model, config=config, batch=_batch()).ranks
        return rank

    one, tp2 = activations(), activations(tensor_parallel_degree=2)
    sequence = activations(tensor_parallel_degree=2, sequence_parallel=True)
    assert sequence.activations < tp2.activations < one.activations
    checkpointed = activations(tensor_parallel_degree=2, sequence_parallel=True, checkpointed=True)
    assert checkpointed.activations < sequence.activations / 2
    assert 0 < checkpointed.recompute < sequence.activations  # one layer rebuilt at a time
    offloaded = activations(tensor_parallel_degree=2, offload_activations=True, checkpointed=True)
    assert offloaded.activations < activations(tensor_parallel_degree=2, checkpointed=True).activations
    assert offloaded.recompute > checkpointed.recompute  # the layers loaded back ahead of their backward
    half = activations(fp16=True)
    assert 0.4 * one.activations < half.activations < 0.75 * one.activations  # 16-bit, but the loss in fp32


def test_pipeline_stage_holds_the_microbatches_its_schedule_keeps_in_flight():
    config = {"pipeline_parallel_degree": 2, "microbatches": 4, "active_microbatches": 2, "fp16": True}
    first, last = estimate_memory(_gpt(), config=config, batch=_batch()).ranks
    assert first.in_flight == 2 and last.in_flight == 1  # 1F1B: the first stage waits longest for backwards
    assert last.activations > first.activations  # two layers each; the last also keeps the logits and the loss


def test_activations_that_cannot_be_measured_leave_the_fit_unknown_with_the_reason():
    report = estimate_memory(_gpt(), device_memory="1GiB")
    assert report.ranks[0].activations is None and report.fits is None
    assert "not measured: give a batch" in report.activation_note
    assert "unknown whether it fits in 1.0 GiB" in str(report)

    class Logging(_GPT):
        def forward(self, ids: Tensor, target: Tensor) -> Tensor:
            loss = super().forward(ids, target)
            print(f"loss {loss.item()}")  # a host read: no value on the meta device
            return loss

    with torch.device("meta"):
        logging = Logging()
    report = estimate_memory(logging, device_memory="1GiB", batch=_batch())
    assert report.fits is None and ".item()" in report.activation_note
    assert fitting_layouts(logging, devices=2, device_memory="1GiB", batch=_batch()) == []  # none is known to fit


def test_a_transformers_model_is_traced_on_token_ids_of_the_given_size():
    transformers = pytest.importorskip("transformers")
    config = llama_config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, pad_token_id=None, max_position_embeddings=2048
    )
    with torch.device("meta"), smp.tensor_parallelism():
        model = transformers.LlamaForCausalLM(config)
    sizes = {"micro_batch_size": 2, "sequence_length": 16}
    (short,) = estimate_memory(model, **sizes).ranks
    (long,) = estimate_memory(model, micro_batch_size=2, sequence_length=32).ranks
    assert 1.9 * short.activations < long.activations < 2.1 * short.activations
    split = {"tensor_parallel_degree": 2, "sequence_parallel": True}
    (sequence,) = estimate_memory(model, config=split, **sizes).ranks
    assert sequence.activations < short.activations


# -- the verdict, the search, the text --------------------------------------------------------------------------------


def test_the_largest_rank_is_named_and_judged_against_the_device():
    model = _gpt(tied=True)
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "fp16": True}
    report = estimate_memory(model, config=config, device_memory=10**9, batch=_batch())
    assert report.largest is max(report.ranks, key=lambda r: r.total)
    assert report.fits is True
    text = str(report)
    assert f"Largest rank: stage {report.largest.stage}" in text and "fits in 953.7 MiB" in text
    tight = estimate_memory(model, config=config, device_memory=report.largest.total - 1, batch=_batch())
    assert tight.fits is False and "does NOT fit" in str(tight)
    assert estimate_memory(model, config=config, batch=_batch()).fits is None  # no device memory given


def test_fitting_layouts_lists_what_fits_smallest_model_parallel_degree_first():
    model = _gpt()
    config = {"fp16": True, "tensor_parallel_plan": {"head": "colwise"}}
    one_device = estimate_memory(model, config=config, batch=_batch()).largest.total
    found = fitting_layouts(model, devices=8, device_memory=one_device - 1, config=config, batch=_batch())
    assert found, "splitting over 8 devices must fit what one device misses by a byte"
    assert all(report.fits and report.layout.devices == 8 for report in found)
    assert all(r.layout.shard_optimizer_state for r in found if r.layout.model_parallel == 1)  # dp=8 alone: sharded
    degrees = [r.layout.model_parallel for r in found]
    assert degrees == sorted(degrees)
    assert 8 not in {r.layout.pp for r in found}  # a 4-child trunk cannot make 8 stages: left out
    first = found[0].layout
    assert layouts_table(found).splitlines()[1].split()[:3] == [str(first.pp), str(first.tp), str(first.dp)]


def test_fitting_layouts_shards_the_optimizer_state_where_that_makes_a_layout_fit():
    model = _gpt()
    config = {"fp16": True, "tensor_parallel_plan": {"head": "colwise"}}
    replicated = estimate_memory(model, config=config, world_size=8, batch=_batch(8)).largest.total
    found = fitting_layouts(model, devices=8, device_memory=replicated - 1, config=config, batch=_batch(8))
    assert str(found[0].layout) == "pp=1 x tp=1 x dp=8 (optimizer state sharded)"
    assert found[0].largest.total < replicated
    assert layouts_table(found).splitlines()[1].split()[:4] == ["1", "1", "8", "sharded"]
    roomy = fitting_layouts(model, devices=8, device_memory=replicated, config=config, batch=_batch(8))
    assert not roomy[0].layout.shard_optimizer_state  # fits whole: no sharding
    forced = fitting_layouts(
        model, devices=8, device_memory=replicated, config={**config, "shard_optimizer_state": True}, batch=_batch(8)
    )
    assert all(r.layout.shard_optimizer_state == (r.layout.dp > 1) for r in forced)
    assert (1, 8, 1) in {(r.layout.pp, r.layout.tp, r.layout.dp) for r in forced}  # dp = 1 stays listed


def test_fitting_layouts_offers_sharded_data_parallelism_where_only_that_fits():
    model = _gpt()
    config = {"fp16": True, "tensor_parallel_plan": {"head": "colwise"}, "sdp_param_persistence_threshold": 0}
    zero1 = estimate_memory(
        model, config={**config, "shard_optimizer_state": True}, world_size=8, batch=_batch(8)
    ).largest.total
    found = fitting_layouts(model, devices=8, device_memory=zero1 - 1, config=config, batch=_batch(8))
    assert str(found[0].layout) == "pp=1 x tp=1 x dp=8 (sharded data parallel 8)"
    assert found[0].largest.total < zero1
    assert layouts_table(found).splitlines()[1].split()[:4] == ["1", "1", "8", "sdp=8"]
    degrees = [r.layout.model_parallel for r in found]
    assert degrees == sorted(degrees)  # smallest model-parallel degree first
    assert all(r.layout.sdp == 1 for r in found if r.layout.pp > 1)  # sdp cannot combine with a pipeline
    asked = fitting_layouts(
        model, devices=8, device_memory="1GiB", config={**config, "sharded_data_parallel_degree": 2}, batch=_batch(8)
    )
    sharded = [r.layout for r in asked if r.layout.dp > 1]
    assert sharded and all(layout.sdp == layout.dp and layout.pp == 1 for layout in sharded)
    assert (1, 8, 1) in {(r.layout.pp, r.layout.tp, r.layout.dp) for r in asked}  # dp = 1 stays listed


def test_fitting_layouts_builds_the_model_once_per_tensor_parallel_degree():
    built = []

    def build(tp: int) -> nn.Module:
        built.append(tp)
        return _gpt(tensor_parallel=tp > 1)  # as `smp.model_creation(tensor_parallelism=smp.tp_size() > 1)`

    found = fitting_layouts(build, devices=4, device_memory="1GiB", batch=_batch())
    assert sorted(built) == [1, 2, 4]
    by_degrees = {(r.layout.pp, r.layout.tp): r.largest.parameters for r in found}
    assert by_degrees[(1, 2)] < 0.6 * by_degrees[(1, 1)]  # built tensor-parallel, so split


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="neither an SMPConfig nor a mapping"):
        estimate_memory(_gpt(), config=[("fp16", True)])
    with pytest.raises(ValueError, match="does not divide the world size 3"):
        estimate_memory(_gpt(), config={"tensor_parallel_degree": 2}, world_size=3)
    with pytest.raises(ValueError, match="pattern 'haed' matches no module"):
        estimate_memory(_gpt(), config={"tensor_parallel_degree": 2, "tensor_parallel_plan": {"haed": "colwise"}})
    with pytest.raises(ValueError, match="devices=0 is not a device count"):
        fitting_layouts(_gpt(), devices=0, device_memory="1GiB")
    assert estimate_memory(_gpt(), config=SMPConfig(fp16=True)).precision == "fp16 with fp32 masters"


# -- against the live ranks -------------------------------------------------------------------------------------------


def _measure_in_ranks(rank: int, jobs: list[tuple[str, str]], directory: str) -> None:
    for layout, head in jobs:
        memory_scale.run_layout(layout, head, "smoke", f"{directory}/{layout}_{head}.json", delayed_init=False)


def _measured_and_planned(tmp_path: Path, layouts: str, heads: str = "untied,tied") -> dict:
    """`benchmarks/memory_scale.py --size smoke`'s rows and summary for these layouts and heads, run one launch per
    world size (the script starts a fresh interpreter per layout and per rank; `test_the_script_...` runs it)."""
    jobs = [(layout, head) for head in heads.split(",") for layout in layouts.split(",")]
    worlds: dict[int, list[tuple[str, str]]] = {}
    for layout, head in jobs:
        pp, tp, dp, *_ = memory_scale.LAYOUTS[layout]
        worlds.setdefault(pp * tp * dp, []).append((layout, head))
    for world, in_world in worlds.items():
        run_distributed(_measure_in_ranks, world, in_world, str(tmp_path), timeout=240)
    rows = [memory_scale.row(layout, head, "smoke", str(tmp_path / f"{layout}_{head}.json")) for layout, head in jobs]
    return {"rows": rows, "summary": memory_scale.summarise(rows)}


def test_the_script_measures_and_plans_a_layout(tmp_path):
    out = tmp_path / "memory_scale.json"
    run_benchmark(
        "memory_scale.py", "--size", "smoke", "--layouts", "1", "--heads", "untied", "--out", str(out), timeout=280
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["layout"], row["head"], len(row["ranks"])) == ("1", "untied", 1)
    _assert_planned_within_10_percent([row])


@pytest.mark.timeout(600)  # eight short fits, in launches of one, two and four ranks
def test_planned_model_states_are_within_10_percent_of_the_measured_bytes(tmp_path):
    """One device, tp2, pp2 and pp2 x tp2, tied and untied head: every rank's parameters + gradients + masters +
    master gradients + optimizer state as the planner counts them, against the live tensors of a two-step fit."""
    layouts = ("1", "tp2", "pp2", "pp2xtp2")
    rows = _measured_and_planned(tmp_path, ",".join(layouts))["rows"]
    assert [(row["head"], row["layout"], len(row["ranks"])) for row in rows] == [
        (head, layout, ranks)
        for head in ("untied", "tied")
        for layout, ranks in zip(layouts, (1, 2, 2, 4), strict=True)
    ]
    _assert_planned_within_10_percent(rows)


def _assert_planned_within_10_percent(rows: list[dict]) -> None:
    kinds = ("parameters", "gradients", "masters", "master_gradients", "optimizer_state")
    for row in rows:
        for rank in row["ranks"]:
            measured = sum(rank[kind] for kind in kinds)
            planned = sum(rank["planned"][kind] for kind in kinds)
            assert abs(planned / measured - 1) <= 0.10, (row["layout"], row["head"], rank["rank"], planned, measured)


@pytest.mark.timeout(600)  # three short fits, in one launch of two ranks
def test_sharded_optimizer_state_and_sharded_data_parallel_at_dp2_as_planned(tmp_path):
    """dp2, dp2 with shard_optimizer_state and sdp2 (sharded_data_parallel_degree=2, every module sharded): the
    planner within 10% of every rank's live bytes; each ZeRO-1 rank's fp32 masters + optimizer state at most 0.52 of
    an unsharded rank's (1/2 plus the padding), each sdp2 rank's whole model states (parameters, gradients, masters,
    their gradients, optimizer state) at most 0.55 of a dp2 rank's."""
    result = _measured_and_planned(tmp_path, "dp2,dp2-sharded,sdp2", heads="untied")
    rows = result["rows"]
    assert [(row["layout"], len(row["ranks"])) for row in rows] == [("dp2", 2), ("dp2-sharded", 2), ("sdp2", 2)]
    _assert_planned_within_10_percent(rows)
    whole, sharded = ([r["masters"] + r["optimizer_state"] for r in row["ranks"]] for row in rows[:2])
    assert max(sharded) <= 0.52 * min(whole), (sharded, whole)
    kinds = ("parameters", "gradients", "masters", "master_gradients", "optimizer_state")
    replicated, sdp = ([sum(r[kind] for kind in kinds) for r in row["ranks"]] for row in (rows[0], rows[2]))
    assert max(sdp) <= 0.55 * min(replicated), (sdp, replicated)
    summary = {s["layout"]: s for s in result["summary"]}
    assert summary["dp2-sharded"]["masters_and_state_of_unsharded"] <= 0.52
    assert summary["sdp2"]["model_states_of_unsharded"] <= 0.55
    assert summary["dp2-sharded"]["step_time_of_unsharded"] > 0 and summary["sdp2"]["step_time_of_unsharded"] > 0


def _fit_layouts_in_rank(rank: int, model: str, layouts: list[str], path: str, args: argparse.Namespace) -> None:
    sequence_parallel.run_layouts(model, layouts, args.size, path, args)


def _sequence_parallel_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> list[dict]:
    """`benchmarks/sequence_parallel.py ARGS`'s rows, its ranks forked from the test's preloaded fork server instead
    of fresh interpreters (~12 s of imports each; tests/test_benchmarks.py runs the script itself)."""

    def launch(model, layouts, args, tmp, *, checkpointing=False):
        path = os.path.join(tmp, f"{model}.json")
        in_ranks = argparse.Namespace(**{**vars(args), "checkpointing": checkpointing})
        world = sequence_parallel.devices(layouts[0])
        run_distributed(_fit_layouts_in_rank, world, model, layouts, path, in_ranks, timeout=300)
        return sequence_parallel.records(path, layouts, checkpointing=checkpointing)

    out = tmp_path / "sequence_parallel.json"
    monkeypatch.setattr(sequence_parallel, "_launch", launch)
    monkeypatch.setattr(sys, "argv", ["sequence_parallel.py", *args, "--out", str(out)])
    sequence_parallel.main()
    return json.loads(out.read_text())["rows"]


@pytest.mark.timeout(900)  # three launches per model (one, two and four ranks), each fitting twice
def test_planned_activations_are_within_10_percent_of_what_live_ranks_keep(tmp_path, monkeypatch):
    """The GPT and a Hugging Face Llama on one device, tp2 with sequence parallelism and pp2 x tp2 with it, without
    and with activation checkpointing: every rank's bytes kept for backward per microbatch, counted on the live
    tensors, against the planner's trace of the model built on the meta device."""
    layouts = ("1", "tp2+sp", "pp2xtp2+sp")
    rows = _sequence_parallel_benchmark(
        tmp_path, monkeypatch, "planner", "--size", "smoke", "--layouts", ",".join(layouts)
    )
    covered = {(row["model"], row["layout"], row["checkpointing"]) for row in rows}
    assert covered == {(m, layout, c) for m in ("gpt", "llama") for layout in layouts for c in (False, True)}
    assert len(rows) == 2 * 2 * (1 + 2 + 4)
    for row in rows:
        assert abs(row["error"]) <= 0.10, row


@pytest.mark.timeout(600)  # two launches (two and four ranks), each fitting twice
def test_sequence_parallelism_keeps_less_of_the_layers_activations_than_tensor_parallelism_alone(tmp_path, monkeypatch):
    """The benchmark's GPT (residual dropout 0.1, fp16): each layer's bytes kept for backward per rank under tp2+sp
    at most 0.80 of tp2's, under tp4+sp at most 0.65 of tp4's; the planner within 10% of every layout."""
    measured = _sequence_parallel_benchmark(tmp_path, monkeypatch, "bytes", "--size", "smoke")
    rows = {row["layout"]: row for row in measured}
    assert rows["tp2+sp"]["layers_of_tp"] <= 0.80 and rows["tp4+sp"]["layers_of_tp"] <= 0.65
    assert rows["tp2+sp"]["whole_of_tp"] < 1 and rows["tp4+sp"]["whole_of_tp"] < rows["tp2+sp"]["whole_of_tp"]
    assert all(abs(row["planned_error"]) <= 0.10 for row in rows.values()), rows
