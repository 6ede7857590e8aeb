"""Tensor parallelism through Lightning, against the single-process run of the same model and data.

Two launches: two processes (tp=2) and four (tp=4 and dp=2 x tp=2). Each runs several short fits one after another
in the same processes; the tests below assert on their records. Every reference is the same model and data trained
in plain torch (`plain_reference`), the sequence-parallel runs' too (dropout draws its masks from the same random
stream as one process, gradients clipped as Lightning clips them).
- GPT: token + position ``nn.Embedding``, two ``nn.TransformerEncoderLayer`` (causal mask), a head tied to the
  token embedding, built under ``smp.model_creation(tensor_parallelism=...)``: the tied embedding stays whole (one
  warning), the rest is split. fp32: losses within 1e-5 relative and every gathered gradient matches, every step;
  fp16: losses within 2e-2 with the same skipped steps and loss scale.
- MLP: plain ``nn.Linear`` blocks split by ``tensor_parallel_plan`` patterns only.
- Vocabulary-parallel LM: ``DistributedEmbedding`` tied to ``DistributedLMHead`` and its vocab-parallel loss.
"""

import copy
import math
import os
import pickle
from contextlib import nullcontext

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import SumMetric

from lightning_smp import SMPStrategy
from lightning_smp.build import ShapeOnlyTopology
from lightning_smp.config import SMPConfig
from lightning_smp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_shards,
    parallelize,
    shard_of,
)
from lightning_smp.tensor_parallel.comm import ShapeOnlyGroup, split_sequence
from tests.distributed import init_gloo, launch_once
from tests.gpt import SEQ, WIDTH, TinyGPT, token_batches
from tests.models import quiet_trainer
from tests.parity import (
    FP16_REL,
    FP32_REL,
    assert_fp16_matches,
    assert_tensors_close,
    lightning_batches,
    mean_losses,
    plain_fit,
)

STEPS = 10
GLOBAL_BATCH = 8
VOCAB, D = 64, WIDTH
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**20, "scale_window": 4}}
PLAN = {"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}


class _TinyGPT(TinyGPT):
    """`tests.gpt.TinyGPT` with a 64-token vocabulary and a GELU feed-forward network 4 x wide, trained with AdamW;
    ``samples`` counts the samples it saw (a torchmetrics metric), ``losses`` every step's loss."""

    def __init__(
        self, per_rank_batch: int, *, vocab_parallel: bool = False, dropout: float = 0.0, checkpointing: bool = False
    ) -> None:
        super().__init__(
            vocab_parallel=vocab_parallel, vocab=VOCAB, ff=4 * D, activation="gelu", dropout=dropout,
            checkpointing=checkpointing,
        )  # fmt: skip
        self.per_rank_batch = per_rank_batch
        self.samples = SumMetric()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.item())  # sync: fine for tests
        self.samples.update(torch.tensor(float(batch[0].shape[0])))
        self.log("samples", self.samples, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)  # a mean over the data-parallel replicas only

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        tokens = token_batches(seed=1, samples=STEPS * GLOBAL_BATCH, vocab=VOCAB)
        return DataLoader(TensorDataset(*tokens), batch_size=self.per_rank_batch)

    def val_dataloader(self) -> DataLoader:
        tokens = token_batches(seed=3, samples=2 * GLOBAL_BATCH, vocab=VOCAB)
        return DataLoader(TensorDataset(*tokens), batch_size=self.per_rank_batch)


class _ResidualMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


class _MlpRegressor(pl.LightningModule):
    """Plain ``nn.Linear`` blocks, no smp code: only the strategy's ``tensor_parallel_plan`` splits them."""

    def __init__(self, per_rank_batch: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.per_rank_batch = per_rank_batch
        self.blocks = nn.ModuleList(_ResidualMlp() for _ in range(2))
        self.out = nn.Linear(D, 1)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        for block in self.blocks:
            x = block(x)
        loss = F.mse_loss(self.out(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(2)
        x = torch.randn(STEPS * GLOBAL_BATCH, D, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        return DataLoader(TensorDataset(x, y), batch_size=self.per_rank_batch)


class _Record(Callback):
    """Gathers whole parameters at the start and whole gradients before every step (on every rank, collective)."""

    def __init__(self, gradients: bool) -> None:
        self.gradients = gradients
        self.initial: dict[str, Tensor] = {}
        self.grads: list[dict[str, Tensor]] = []
        self.norms: list[float] = []

    def _whole(self, trainer, pl_module, grads: bool) -> dict[str, Tensor]:
        group = trainer.strategy.topology.group("tp")
        return {
            name: gather_shards((p.grad if grads else p).detach().float(), shard_of(p), group).clone()
            for name, p in pl_module.named_parameters()
        }

    def on_train_start(self, trainer, pl_module):
        self.initial = self._whole(trainer, pl_module, grads=False)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.gradients:
            self.grads.append(self._whole(trainer, pl_module, grads=True))
        elif hasattr(optimizer, "clip_master_grads"):
            # the global norm of the unscaled master grads (-1 on overflow); an infinite bound clips nothing
            self.norms.append(optimizer.clip_master_grads(math.inf).item())


class _LastBlockInput(Callback):
    """The shape of what the last block takes in (its first norm's input; under pp2, what the last stage received)."""

    shape: tuple[int, ...] | None = None

    def on_train_start(self, trainer, pl_module):
        norm = getattr(pl_module.blocks[-1], "norm1", None)  # the GPT's (the MLP regressor's blocks have none)
        if norm is not None:
            norm.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        self.shape = tuple(args[0].shape)


def _fit(
    rank: int,
    model: pl.LightningModule,
    strategy_kwargs: dict,
    *,
    warns: str | None = None,
    validate: bool = False,
    accumulate: int = 1,
    **trainer_kwargs,
) -> dict:
    pipelined = strategy_kwargs.get("pipeline_parallel_degree", 1) > 1  # rank 0 holds stage 0's parameters only
    recorder = _Record(gradients=not strategy_kwargs.get("fp16") and not pipelined)
    block_input = _LastBlockInput()
    trainer = quiet_trainer(
        SMPStrategy(**strategy_kwargs),
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder, block_input],
        num_sanity_val_steps=0,
        check_val_every_n_epoch=2,  # validation runs once, after fit (a second setup of the split model)
        **trainer_kwargs,
    )
    with pytest.warns(UserWarning, match=warns) if warns and rank == 0 else nullcontext():
        trainer.fit(model)
    metrics = trainer.callback_metrics
    samples = metrics["samples"].item() if "samples" in metrics else None  # before validate replaces the metrics
    val_loss = trainer.validate(model, verbose=False)[0]["val_loss"] if validate else None
    optimizer = trainer.strategy.optimizers[0]
    return {
        "losses": model.losses,
        "val_loss": val_loss,
        "initial": recorder.initial if rank == 0 else None,  # whole tensors: the same on every rank
        "grads": recorder.grads if rank == 0 else None,
        "norms": recorder.norms,
        "skipped": optimizer.skipped_steps.item() if hasattr(optimizer, "skipped_steps") else None,
        "scale": optimizer.loss_scale if hasattr(optimizer, "loss_scale") else None,
        "samples": samples,
        "local_params": sum(p.numel() for p in model.parameters()),
        "sharded": sorted(name for name, p in model.named_parameters() if shard_of(p) is not None),
        "last_block_input": block_input.shape,
    }


_SHARED_WEIGHT = r"keeps 1 module\(s\) whole.*tok \(Embedding\): its weight tok.weight is shared with head.weight"


def _run_all(rank: int, layouts: list[tuple[int, bool]]) -> dict:
    """Every check of one launch; ``layouts`` are ``(tensor_parallel_degree, also fp16 / plan / vocab runs)``."""
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    if world > 1:
        init_gloo()  # the Trainers below find and keep this default group
    for tp, everything in layouts:
        dp = world // tp
        # every rank reads its own share (prescaled_batch=False): a tensor-parallel group trains on tp of them
        batch, key, degree = GLOBAL_BATCH // world, f"tp{tp}_dp{dp}", {"tensor_parallel_degree": tp}
        warning = _SHARED_WEIGHT
        results[f"gpt_{key}"] = _fit(rank, _TinyGPT(batch), degree, warns=warning, validate=True)
        if everything:
            results[f"gpt_fp16_{key}"] = _fit(rank, _TinyGPT(batch), {**FP16, **degree}, warns=warning)
            results[f"mlp_{key}"] = _fit(rank, _MlpRegressor(batch), {**degree, "tensor_parallel_plan": PLAN})
            results[f"mlp_accumulated_{key}"] = _fit(
                rank, _MlpRegressor(batch), {**degree, "tensor_parallel_plan": PLAN}, accumulate=2
            )
            results[f"vocab_{key}"] = _fit(rank, _TinyGPT(batch, vocab_parallel=True), degree)
            # the vocabulary-parallel embedding and loss around sequence-parallel layers
            results[f"vocab_sp_{key}"] = _fit(rank, _TinyGPT(batch, vocab_parallel=True), {**degree, **SP})
    for name, (dropout, strategy_kwargs) in _SEQUENCE_RUNS[world].items():
        readers = world // strategy_kwargs.get("pipeline_parallel_degree", 1)  # a stage's tp x dp ranks read their own
        if strategy_kwargs.get("prescaled_batch"):
            readers //= strategy_kwargs["tensor_parallel_degree"]  # ... but a tensor-parallel group shares one
        model = _TinyGPT(GLOBAL_BATCH // readers, dropout=dropout, checkpointing=True)
        results[name] = _fit(rank, model, strategy_kwargs, validate=True, gradient_clip_val=CLIP)
    return results


# Sequence parallelism, with dropout on the residual stream (the masks of one device), activation checkpointing and
# gradient clipping: name -> (dropout, strategy settings). Pipeline stages draw their dropout in another order than
# one device, so the pipelined runs go without (tests/test_tensor_parallel_layers.py checks the masks of a region).
CLIP, DROPOUT = 0.5, 0.2
SP, SHARED_BATCH, PP2_TP2 = (
    {"sequence_parallel": True},
    {"prescaled_batch": True},
    {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2},
)
_SEQUENCE_RUNS: dict[int, dict[str, tuple[float, dict]]] = {
    # With dropout, the tensor-parallel ranks share one batch (smp's prescaled_batch=True): the union of batches
    # read per rank (the default) holds the samples in another order than one device's batch, so other masks.
    2: {
        "sp_tp2": (DROPOUT, {**SP, **SHARED_BATCH, "tensor_parallel_degree": 2}),
        "sp_tp2_fp16": (DROPOUT, {**SP, **SHARED_BATCH, **FP16, "tensor_parallel_degree": 2}),
    },
    4: {
        "sp_pp2_tp2": (0.0, {**SP, **PP2_TP2, "offload_activations": True}),
        "sp_pp2_tp2_fp16": (0.0, {**SP, **FP16, **PP2_TP2}),
    },
}


# (tensor_parallel_degree, also the fp16 / plan / vocabulary runs) per world size; every reference is plain torch
# (`plain_reference`)
_LAYOUTS: dict[int, list[tuple[int, bool]]] = {2: [(2, True)], 4: [(4, False), (2, False)]}


def launch(world: int) -> list[dict]:
    """Every record of one world size, from one launch per test session (the first caller waits)."""
    return launch_once(_run_all, world, _LAYOUTS[world], timeout=420)


def _gpt_loss(model: _TinyGPT, batch: tuple[Tensor, Tensor]) -> Tensor:
    return model.loss(batch)


def _mlp_loss(model: _MlpRegressor, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    for block in model.blocks:
        x = block(x)
    return F.mse_loss(model.out(x), y)


def plain_reference(name: str) -> dict:
    """The single-process run of a layout test's model and data in plain torch (`tests.parity.plain_fit`), with
    the records the layouts are compared on: ``gpt`` (validated after training), ``gpt_fp16``, ``vocab`` (smp.nn's
    vocabulary-parallel embedding and head, whole on one process), ``mlp``, ``mlp_accumulated`` (two batches per
    step); and the sequence-parallel runs' (`_SEQUENCE_RUNS`): ``sp``, ``sp_fp16`` (with dropout on the residual
    stream), ``sp_no_dropout``, ``sp_fp16_no_dropout``, each clipped to `CLIP` and validated."""
    accumulate = 2 if name == "mlp_accumulated" else 1
    sequence_parallel = name.startswith("sp")
    if sequence_parallel:
        model, loss = _TinyGPT(GLOBAL_BATCH, dropout=0.0 if name.endswith("no_dropout") else DROPOUT), _gpt_loss
    elif name.startswith("gpt") or name == "vocab":
        model, loss = _TinyGPT(GLOBAL_BATCH, vocab_parallel=name == "vocab"), _gpt_loss
    else:
        model, loss = _MlpRegressor(GLOBAL_BATCH), _mlp_loss
    if isinstance(model, _TinyGPT):
        model.configure_model()
    validated = sequence_parallel or name == "gpt"
    return plain_fit(
        model,
        loss,
        lightning_batches(model.train_dataloader(), STEPS * accumulate),
        optimizer=model.configure_optimizers(),
        accumulate=accumulate,
        fp16=FP16["dynamic_loss_args"] if name in ("gpt_fp16", "sp_fp16", "sp_fp16_no_dropout") else None,
        clip_norm=CLIP if sequence_parallel else None,
        validation=list(model.val_dataloader()) if validated else (),  # validation is read in order
    )


def _assert_matches(runs: list[dict], reference: dict, *, rel: float = FP32_REL) -> None:
    """Per-step losses (averaged over the data-parallel replicas), initial weights and every gathered gradient."""
    losses = mean_losses(runs, steps=STEPS)
    assert len(losses) == STEPS >= 10
    assert losses == pytest.approx(reference["losses"], rel=rel)
    if reference["val_loss"] is not None:  # trainer.validate after fit: eval mode, no grad, a second setup
        assert all(run["val_loss"] == pytest.approx(reference["val_loss"], rel=rel) for run in runs)
    first = runs[0]
    assert first["initial"].keys() == reference["initial"].keys()
    for name, value in reference["initial"].items():
        assert torch.equal(first["initial"][name], value), f"initial {name} differs from the single-device model"
    for step, (grads, expected) in enumerate(zip(first["grads"], reference["grads"], strict=True)):
        assert_tensors_close(grads, expected, rtol=1e-4, atol=1e-6, label=f"step {step}")


# Each test may be the first to need a launch (~10-30 s on two shared cores): the timeouts cover one.


@pytest.mark.timeout(500)
def test_gpt_tp2_fp32_matches_one_process():
    reference = plain_reference("gpt")
    runs = [rank["gpt_tp2_dp1"] for rank in launch(2)]
    _assert_matches(runs, reference)
    assert "blocks.1.self_attn.in_proj_weight" in runs[0]["sharded"] and "pos.weight" in runs[0]["sharded"]
    assert "tok.weight" not in runs[0]["sharded"]  # tied with the head: kept whole
    assert runs[0]["local_params"] < 0.7 * sum(value.numel() for value in reference["initial"].values())
    assert runs[0]["samples"] == runs[1]["samples"] == STEPS * GLOBAL_BATCH  # torchmetrics counts each sample once


@pytest.mark.timeout(500)
@pytest.mark.parametrize("layout", ["tp4_dp1", "tp2_dp2"])
def test_gpt_tp4_and_dp2_tp2_fp32_match_one_process(layout):
    reference = plain_reference("gpt")
    runs = [rank[f"gpt_{layout}"] for rank in launch(4)]
    _assert_matches(runs, reference)
    assert all(run["samples"] == STEPS * GLOBAL_BATCH for run in runs)


@pytest.mark.timeout(500)
def test_gpt_tp2_fp16_matches_one_process_with_the_same_skipped_steps():
    reference = plain_reference("gpt_fp16")
    runs = [rank["gpt_fp16_tp2_dp1"] for rank in launch(2)]
    assert reference["skipped"] >= 1  # the comparison covers the overflow path
    for run in runs:
        assert_fp16_matches(run, reference)
        # the global gradient norm counts every value once: sharded pieces on every rank, replicated ones on one
        assert run["norms"] == pytest.approx(reference["norms"], rel=FP16_REL)
    assert all(torch.equal(runs[0]["initial"][name], value) for name, value in reference["initial"].items())


@pytest.mark.timeout(500)
def test_plain_linear_mlp_split_by_an_explicit_plan_matches_one_process():
    runs = [rank["mlp_tp2_dp1"] for rank in launch(2)]
    _assert_matches(runs, plain_reference("mlp"))
    expected = [f"blocks.{i}.{name}" for i in range(2) for name in ("fc.bias", "fc.weight", "proj.weight")]
    assert runs[0]["sharded"] == expected


@pytest.mark.timeout(500)
def test_gradient_accumulation_over_two_batches_at_tp2_matches_one_process():
    reference = plain_reference("mlp_accumulated")
    assert len(reference["losses"]) == 2 * len(reference["grads"]) == 2 * STEPS  # two batches per optimizer step
    runs = [rank["mlp_accumulated_tp2_dp1"] for rank in launch(2)]
    for run in runs:
        assert run["losses"] == pytest.approx(reference["losses"], rel=FP32_REL)
    for step, (grads, expected) in enumerate(zip(runs[0]["grads"], reference["grads"], strict=True)):
        assert_tensors_close(grads, expected, rtol=1e-4, atol=1e-6, label=f"step {step}")


@pytest.mark.timeout(500)
def test_vocab_parallel_embedding_tied_to_the_lm_head_matches_one_process():
    for name in ("vocab_tp2_dp1", "vocab_sp_tp2_dp1"):  # without and with sequence parallelism
        runs = [rank[name] for rank in launch(2)]
        _assert_matches(runs, plain_reference("vocab"))
        assert "tok.weight" in runs[0]["sharded"]  # split once, still tied to the head


# -- sequence parallelism -------------------------------------------------------------------------------------


def _step_losses(run: dict) -> list[float]:
    """Per-step losses of a rank's record: the mean over the step's microbatches where a pipeline splits it."""
    per_step = len(run["losses"]) // STEPS
    return [sum(run["losses"][i : i + per_step]) / per_step for i in range(0, len(run["losses"]), per_step)]


@pytest.mark.timeout(500)
def test_sequence_parallel_tp2_matches_one_process_with_dropout_checkpointing_and_clipping():
    reference = plain_reference("sp")
    runs = [rank["sp_tp2"] for rank in launch(2)]
    _assert_matches(runs, reference)  # losses, validation loss, every gathered gradient (norms summed over tp)
    assert runs[0]["last_block_input"] == (GLOBAL_BATCH, SEQ // 2, D)  # blocks pass each other their slice
    reference = plain_reference("sp_fp16")
    assert reference["skipped"] >= 1
    for run in (rank["sp_tp2_fp16"] for rank in launch(2)):
        assert_fp16_matches(run, reference)
        assert run["norms"] == pytest.approx(reference["norms"], rel=FP16_REL)  # norms and biases counted once


@pytest.mark.timeout(500)
def test_sequence_parallel_pp2_tp2_with_offloading_matches_one_process_and_sends_slices_between_stages():
    runs = launch(4)
    for name, reference in (
        ("sp_pp2_tp2", "sp_no_dropout"),
        ("sp_pp2_tp2_fp16", "sp_fp16_no_dropout"),
    ):
        reference = plain_reference(reference)
        last = runs[-1][name]  # the last stage's ranks compute the loss
        if "fp16" in name:
            assert reference["skipped"] >= 1 and last["skipped"] == reference["skipped"]
            assert _step_losses(last) == pytest.approx(reference["losses"], rel=FP16_REL)
        else:
            assert _step_losses(last) == pytest.approx(reference["losses"], rel=FP32_REL)
            assert last["val_loss"] == pytest.approx(reference["val_loss"], rel=FP32_REL)
    # the last stage receives blocks.0's output from stage 0: one microbatch's slice of the sequence
    assert runs[-1]["sp_pp2_tp2"]["last_block_input"] == (GLOBAL_BATCH // 2, SEQ // 2, D)


def test_a_sequence_that_does_not_split_evenly_names_the_fix():
    with pytest.raises(ValueError, match=r"sequence length 10 \(dim 1\), not a multiple of 4.*sequence_parallel=False"):
        split_sequence(torch.zeros(2, 10, 8), ShapeOnlyGroup(rank=0, size=4), dim=1)


def test_a_split_layer_looks_its_group_up_through_the_run_and_its_copies_share_that_owner():
    owner = ShapeOnlyTopology(tp=2)  # the memory planner's stand-in owner: a rehearsal, no processes
    model = nn.Sequential(ColumnParallelLinear(8, 16), nn.ReLU(), RowParallelLinear(16, 8))
    parallelize(model, topology=owner, config=SMPConfig(tensor_parallel_degree=2))
    x = torch.randn(3, 8)
    for layer in (model[0], model[2]):
        assert layer.tp_context.owner is owner and "group" not in vars(layer.tp_context)  # looked up, not held
        assert repr(layer.tp_context.group) == "ShapeOnlyGroup(rank=0, size=2)"
    copied = copy.deepcopy(model)  # a layer of the same run: its context, with the owner, is shared
    assert copied[0].tp_context is model[0].tp_context and copied[0].weight is not model[0].weight
    unpickled = pickle.loads(pickle.dumps(model))  # a shape-only owner is plain data (a run's Topology refuses)
    assert unpickled[2].tp_context.owner == owner
    for clone in (copied, unpickled):
        torch.testing.assert_close(clone(x), model(x))
