"""Delayed initialisation through the strategy: a model built on the meta device is planned, pruned and
materialised per rank with exactly the values of an eager single-device build (gloo, CPU).

`configure_model` under ``SMPStrategy(delayed_parameter_initialization=True)`` and ``trainer.init_module(
empty_init=True)`` build on the meta device; after setup every rank's parameters are compared bit for bit with the
matching part (its stage, its tensor-parallel shard) of an eager build with the same seed, training losses with
the single-device run, and the memory a rank reaches while setting up with what it keeps.
"""

import math
import os
import resource

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy
from lightning_smp.materialization import materialize_kept
from lightning_smp.tensor_parallel.shard import ShardSpec, shard_of, slice_shard
from tests.distributed import return_freed_memory_at_once, run_distributed
from tests.models import quiet_trainer, small_cnn
from tests.parity import single_device_run

STEPS = 6
VOCAB, WIDTH, SEQ, BLOCKS = 32, 16, 8, 4
_TOKENS = torch.randint(0, VOCAB, (48, SEQ + 1), generator=torch.Generator().manual_seed(1))
_IMAGES = torch.randn(48, 1, 8, 8, generator=torch.Generator().manual_seed(2))
_LABELS = torch.randint(0, 10, (48,), generator=torch.Generator().manual_seed(3))


class _Built(pl.LightningModule):
    """Builds its layers in ``configure_model`` (seeded), or at once with ``build_now`` (under
    ``trainer.init_module``); the data is made at import, outside any init context."""

    def __init__(self, *, build_now: bool = False) -> None:
        super().__init__()
        self.built = False
        if build_now:
            self.build()

    def configure_model(self) -> None:
        if not self.built:
            torch.manual_seed(0)
            self.build()

    def build(self) -> None:
        raise NotImplementedError

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _Positions(nn.Module):
    """Sinusoidal position encodings in a buffer computed at build time (as a rotary table is): no parameters."""

    def __init__(self) -> None:
        super().__init__()
        position = torch.arange(SEQ).unsqueeze(1).float()
        frequency = torch.exp(torch.arange(0, WIDTH, 2).float() * (-math.log(10000.0) / WIDTH))
        table = torch.zeros(SEQ, WIDTH)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)
        self.register_buffer("table", table)

    def forward(self, length: int) -> torch.Tensor:
        return self.table[:length]


class GPT(_Built):
    """An embedding and a position table, nn.TransformerEncoderLayer blocks in a ModuleList (the trunk), a norm and
    an untied head."""

    def build(self) -> None:
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.positions = _Positions()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True) for _ in range(BLOCKS)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.built = True

    def forward(self, idx):
        x = self.wte(idx) + self.positions(idx.shape[1])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def train_dataloader(self):
        return DataLoader(_TOKENS, batch_size=8)


class CNN(_Built):
    """The whole model is one nn.Sequential (the trunk)."""

    def build(self) -> None:
        self.net = small_cnn()
        self.built = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def train_dataloader(self):
        return DataLoader(TensorDataset(_IMAGES, _LABELS), batch_size=8)


class Wide(CNN):
    """24 linear layers of 1024 x 1024 (4 MiB each, 96 MiB in all) in an nn.Sequential: big enough that building
    it whole shows in the process's peak memory."""

    def build(self) -> None:
        self.net = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(24)))
        self.built = True

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(4, 1024)), batch_size=4)


MODELS = {"gpt": GPT, "cnn": CNN, "wide": Wide}
GPT_TP_PLAN = {"wte": "vocab", "blocks.*": "auto"}
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**20}}  # one overflow, at the first step
_SAME_BATCHES = {"use_distributed_sampler": False}  # one replica everywhere: every run reads the batches in order


class _Capture(Callback):
    """This rank's parameters and buffers (with their shard), its peak memory once set up, every step's loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.params: dict = {}
        self.peak_kib = 0

    def on_fit_start(self, trainer, pl_module):
        self.peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for name, param in [*pl_module.named_parameters(), *pl_module.named_buffers()]:
            shard = shard_of(param)
            where = None if shard is None else (shard.dim, shard.blocks, shard.index, shard.parts)
            self.params[name] = (param.detach().float().clone(), where)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit(model_name: str, strategy: SMPStrategy | str, *, init_module: bool = False, steps: int = STEPS) -> dict:
    capture = _Capture()
    devices = int(os.environ.get("WORLD_SIZE", "1")) if isinstance(strategy, SMPStrategy) else 1
    trainer = quiet_trainer(strategy, devices=devices, max_steps=steps, callbacks=[capture], **_SAME_BATCHES)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if init_module:
        torch.manual_seed(0)
        with trainer.init_module(empty_init=True):
            model = MODELS[model_name](build_now=True)
        assert all(p.is_meta for p in model.parameters())
    else:
        model = MODELS[model_name]()
    trainer.fit(model)
    optimizer = trainer.optimizers[0]
    return {
        "losses": capture.losses,
        "params": capture.params,
        "setup_growth": (capture.peak_kib - baseline) * 1024,
        "kept": sum(param.numel() * 4 for param, _ in capture.params.values()),
        "skipped": getattr(optimizer, "skipped_steps", torch.zeros(())).item(),
    }


def _layouts(rank: int, layouts: dict) -> dict:
    torch.set_num_threads(1)
    return_freed_memory_at_once()
    results = {}
    for name, (model_name, strategy_kwargs, options) in layouts.items():
        # every rank reads the same batches in order (no sampler): a tensor-parallel group reads one batch
        strategy = SMPStrategy(delayed_parameter_initialization=True, prescaled_batch=True, **strategy_kwargs)
        results[name] = _fit(model_name, strategy, **options)
    return results


_REFERENCES: dict = {}


def _eager(model_name: str) -> dict:
    """The single-device fp32 run of the eagerly built model in plain PyTorch, and its whole parameters."""
    if model_name not in _REFERENCES:
        torch.manual_seed(0)
        model = MODELS[model_name](build_now=True)
        whole = {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
        run = single_device_run(
            lambda: MODELS[model_name](build_now=True),
            lambda model, batch, step: model.training_step(batch, step),
            steps=STEPS,
            shuffle=False,
        )
        _REFERENCES[model_name] = {**run, "whole": whole}
    return _REFERENCES[model_name]


def _check_bit_identical(run: dict, whole: dict) -> None:
    assert run["params"], "the rank holds parameters"
    for name, (value, where) in run["params"].items():
        expected = whole[name]
        if where is not None:
            dim, blocks, index, parts = where
            expected = slice_shard(expected, ShardSpec(dim, blocks), index, parts)
        assert torch.equal(value, expected), name


def _check_layout(ranks: list[dict], name: str, model_name: str) -> None:
    reference = _eager(model_name)
    held = set()
    for result in ranks:
        run = result[name]
        _check_bit_identical(run, reference["whole"])
        held |= set(run["params"])
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
    assert held == set(reference["whole"]), name  # every parameter lives on some rank


# -- one device ----------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_name", ["gpt", "cnn"])
def test_one_device_materialises_the_eager_values_and_trains_the_same(model_name):
    run = _fit(model_name, SMPStrategy(delayed_parameter_initialization=True))
    reference = _eager(model_name)
    _check_bit_identical(run, reference["whole"])
    assert set(run["params"]) == set(reference["whole"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_a_meta_tensor_made_by_hand_is_a_clear_error():
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match=r"weight is on the meta device but was not created inside delayed init"):
        materialize_kept(model, device=torch.device("cpu"))


# -- two ranks: pp2, tp2 ---------------------------------------------------------------------------------------------

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
TP2_GPT = {"tensor_parallel_degree": 2, "tensor_parallel_plan": GPT_TP_PLAN}
LAYOUTS_2 = {
    # a tiny pp2 fit first: a rank forked from the launcher's server maps the library code a pipeline's set-up runs
    # on first use, and those pages would count in wide_pp2's peak
    "cnn_pp2": ("cnn", PP2, {}),
    "wide_pp2": ("wide", PP2, {"steps": 1}),  # second: nothing bigger has run in the rank before it
    "gpt_pp2": ("gpt", PP2, {}),
    "gpt_pp2_init_module": ("gpt", PP2, {"init_module": True}),
    "gpt_tp2": ("gpt", TP2_GPT, {}),
    "cnn_tp2": ("cnn", {"tensor_parallel_degree": 2}, {}),
    "gpt_pp2_fp16": ("gpt", {**PP2, **FP16}, {}),
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_layouts, 2, LAYOUTS_2, timeout=400)


@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    ("name", "model_name"),
    [("gpt_pp2", "gpt"), ("gpt_pp2_init_module", "gpt"), ("gpt_tp2", "gpt"), ("cnn_pp2", "cnn"), ("cnn_tp2", "cnn")],
)
def test_two_ranks_materialise_the_eager_values_of_what_they_keep_and_train_the_same(two_ranks, name, model_name):
    _check_layout(two_ranks, name, model_name)


@pytest.mark.timeout(500)
def test_the_layouts_really_split_the_model(two_ranks):
    first, last = (set(r["gpt_pp2"]["params"]) for r in two_ranks)
    assert "wte.weight" in first and "wte.weight" not in last and "head.weight" in last
    assert not {n for n in first if n.startswith("blocks.")} & {n for n in last if n.startswith("blocks.")}
    for result in two_ranks:
        sharded = {n for n, (_, where) in result["gpt_tp2"]["params"].items() if where is not None}
        assert {"wte.weight", "blocks.0.linear1.weight", "blocks.0.self_attn.in_proj_weight"} <= sharded
    assert all("positions.table" in r["gpt_pp2"]["params"] for r in two_ranks)  # buffer-only: on every stage


@pytest.mark.timeout(500)
def test_pp2_fp16_after_delayed_init_matches_one_device_with_the_same_skipped_steps(two_ranks):
    reference = single_device_run(
        lambda: GPT(build_now=True),
        lambda model, batch, step: model.training_step(batch, step),
        steps=STEPS,
        fp16=True,
        init_scale=FP16["dynamic_loss_args"]["init_scale"],
        shuffle=False,
    )
    for result in two_ranks:
        run = result["gpt_pp2_fp16"]
        assert run["skipped"] == reference["skipped"] > 0
        assert run["losses"] == pytest.approx(reference["losses"], rel=2e-2)


@pytest.mark.timeout(500)
def test_no_rank_holds_the_whole_model_while_setting_up(two_ranks):
    whole = 24 * (1024 * 1024 + 1024) * 4
    largest = 1024 * 1024 * 4
    for result in two_ranks:
        run = result["wide_pp2"]
        assert run["kept"] == whole // 2
        # Building the whole model would take the peak past `whole`; what a rank keeps plus one parameter, plus
        # room for the process's own allocations while setting up, stays well below it.
        assert run["setup_growth"] <= run["kept"] + largest + 16 * 2**20 < whole, run["setup_growth"]


# -- four ranks: pp2 x tp2 --------------------------------------------------------------------------------------------

LAYOUTS_4 = {
    "gpt_pp2_tp2": ("gpt", {**PP2, **TP2_GPT}, {}),
    "cnn_pp2_tp2": ("cnn", {**PP2, "tensor_parallel_degree": 2}, {}),
}


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_layouts, 4, LAYOUTS_4, timeout=400)


@pytest.mark.timeout(500)
@pytest.mark.parametrize(("name", "model_name"), [("gpt_pp2_tp2", "gpt"), ("cnn_pp2_tp2", "cnn")])
def test_pp2_tp2_materialises_the_eager_values_of_each_stage_and_shard_and_trains_the_same(
    four_ranks, name, model_name
):
    _check_layout(four_ranks, name, model_name)
