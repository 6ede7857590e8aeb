"""smp's ``prescaled_batch`` under tensor parallelism, as AWS's smp scripts use it, against one device.

The LightningModule shards its data as AWS's GPT-2 examples do: a ``DistributedSampler`` over ``smp.dp_size()`` /
``smp.dp_rank()`` (every tensor-parallel rank reads its own batch: ``prescaled_batch=False``, smp's default) or
over ``smp.rdp_size()`` / ``smp.rdp_rank()`` (a tensor-parallel group reads one: ``prescaled_batch=True``). One step
of each layout must equal one device's step on the union of the batches its ranks read. Two launches: two ranks
(tp2, and the mistakes), four (tp2 x dp2, pp2 x tp2, evaluation and prediction).
"""

import os
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_smp import SMPStrategy, smp
from tests.distributed import run_distributed
from tests.gpt import TinyGPT, token_batches
from tests.models import quiet_trainer
from tests.parity import FP16_REL, FP32_REL, assert_same_overflow, mean_losses, single_device_run

STEPS, SAMPLES, PER_RANK_BATCH = 6, 96, 4
INIT_SCALE = 2.0**16
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": INIT_SCALE}}
TP2, PP2_TP2 = {"tensor_parallel_degree": 2}, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}


class _SmpScriptGPT(TinyGPT):
    """TinyGPT fed as an smp script feeds it: its own DistributedSampler over smp's ``dp`` or ``rdp`` ranks."""

    def __init__(self, sampled_over: str = "dp") -> None:
        super().__init__()
        self.sampled_over = sampled_over

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).float()  # (B, T, V): this rank's samples only

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return self.loader(seed=1, shuffle=True)

    def loader(self, *, seed: int, shuffle: bool) -> DataLoader:
        dataset = TensorDataset(*token_batches(seed, SAMPLES))
        if self.sampled_over == "dp":
            replicas, rank = smp.dp_size(), smp.dp_rank()
        else:
            replicas, rank = smp.rdp_size(), smp.rdp_rank()
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=0)
        return DataLoader(dataset, batch_size=PER_RANK_BATCH, sampler=sampler)


def _build(sampled_over: str = "dp") -> _SmpScriptGPT:
    model = _SmpScriptGPT(sampled_over)
    model.configure_model()
    return model


def _reference(replicas: int, *, fp16: bool = False) -> dict:
    """One device on the union of ``replicas`` ranks' batches (each reading its own share of the data)."""
    return single_device_run(
        _build,
        lambda model, batch, step: model.loss(batch),
        steps=STEPS,
        replicas=replicas,
        fp16=fp16,
        init_scale=INIT_SCALE,
    )


def _trainer(strategy: dict, **kwargs) -> object:
    defaults = {"max_steps": STEPS, "num_sanity_val_steps": 0, "limit_val_batches": 0}
    return quiet_trainer(SMPStrategy(**strategy), devices=int(os.environ["WORLD_SIZE"]), **{**defaults, **kwargs})


class _Losses(Callback):
    """Every step's loss as Lightning saw it (the mean over microbatches, the same on every pipeline stage)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def _fit(strategy: dict, sampled_over: str = "dp") -> dict:
    torch.manual_seed(0)
    recorder = _Losses()
    trainer = _trainer(strategy, callbacks=[recorder])
    trainer.fit(_SmpScriptGPT(sampled_over))
    optimizer = trainer.strategy.optimizers[0]
    return {
        "losses": recorder.losses,
        "rdp": smp.rdp_rank(),
        "skipped": optimizer.skipped_steps.item() if hasattr(optimizer, "skipped_steps") else 0.0,
        "scale": getattr(optimizer, "loss_scale", None),
    }


def _failed_fit(strategy: dict, sampled_over: str) -> dict:
    """The error a fit raises, and whether any update happened before it."""
    torch.manual_seed(0)
    model = _SmpScriptGPT(sampled_over)
    trainer = _trainer(strategy)
    try:
        trainer.fit(model)
    except ValueError as error:
        return {"error": str(error), "global_step": trainer.global_step}
    return {"error": None, "global_step": trainer.global_step}


def _evaluate(strategy: dict) -> dict:
    """A fresh model's validation loss and this rank's predictions, each rank reading its own samples."""
    torch.manual_seed(0)
    model = _SmpScriptGPT()
    evaluation = _trainer(strategy, limit_val_batches=None)
    loss = evaluation.validate(model, dataloaders=model.loader(seed=3, shuffle=False), verbose=False)
    predictions = _trainer(strategy).predict(model, dataloaders=model.loader(seed=3, shuffle=False))
    sampler = model.loader(seed=3, shuffle=False).sampler
    return {"val_loss": loss[0]["val_loss"], "predictions": torch.cat(predictions), "indices": list(sampler)}


def _two_ranks(rank: int) -> dict:
    results = {
        "tp2": _fit(TP2),
        "tp2_fp16": _fit({**TP2, **FP16}),
        "tp2_prescaled": _fit({**TP2, "prescaled_batch": True}, "rdp"),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(TP2, max_steps=1).fit(_SmpScriptGPT("rdp"))
    results["same_batches_warned"] = [str(w.message) for w in caught if "prescaled_batch=False" in str(w.message)]
    results["mismatched"] = _failed_fit({**TP2, "prescaled_batch": True}, "dp")
    return results


def _four_ranks(rank: int) -> dict:
    return {
        "tp2_dp2": _fit(TP2),
        "tp2_dp2_fp16": _fit({**TP2, **FP16}),
        "pp2_tp2": _fit({**PP2_TP2, "microbatches": 2}),
        "pp2_tp2_fp16": _fit({**PP2_TP2, "microbatches": 2, **FP16}),
        "evaluation": _evaluate(TP2),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_two_ranks, 2, timeout=420)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_distributed(_four_ranks, 4, timeout=420)


@pytest.fixture
def ranks(request: pytest.FixtureRequest, world: int) -> list[dict]:
    return request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("world", "layout", "replicas"), [(2, "tp2", 2), (4, "tp2_dp2", 4), (4, "pp2_tp2", 2)])
def test_every_rank_reading_its_own_batch_equals_one_device_on_their_union(ranks, layout, replicas):
    # smp.dp_size() counts the tensor-parallel ranks: tp2 -> 2 shards, tp2 x dp2 -> 4, pp2 x tp2 -> 2
    runs = [rank[layout] for rank in ranks]
    assert mean_losses(runs, steps=STEPS) == pytest.approx(_reference(replicas)["losses"], rel=FP32_REL)


@pytest.mark.timeout(480)
@pytest.mark.parametrize(("world", "layout", "replicas"), [(2, "tp2", 2), (4, "tp2_dp2", 4), (4, "pp2_tp2", 2)])
def test_fp16_every_rank_reading_its_own_batch_skips_as_one_device_on_their_union(ranks, layout, replicas):
    reference = _reference(replicas, fp16=True)
    assert reference["skipped"] >= 1  # the comparison covers the overflow path
    runs = [rank[f"{layout}_fp16"] for rank in ranks]
    for run in runs:
        assert_same_overflow(run, reference)
    assert mean_losses(runs, steps=STEPS) == pytest.approx(reference["losses"], rel=FP16_REL)


@pytest.mark.timeout(480)
def test_prescaled_batch_true_with_a_group_reading_one_batch_equals_one_device_on_it(two_ranks):
    runs = [rank["tp2_prescaled"] for rank in two_ranks]
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["losses"] == pytest.approx(_reference(1)["losses"], rel=FP32_REL)


@pytest.mark.timeout(480)
def test_prescaled_batch_true_with_different_batches_fails_before_the_first_update(two_ranks):
    for rank in two_ranks:
        error = rank["mismatched"]["error"]
        assert error is not None and error.startswith("prescaled_batch=True, but the tensor-parallel ranks [0, 1]")
        assert "Shard the data by smp.rdp_rank() / smp.rdp_size()" in error and "prescaled_batch=False" in error
        assert rank["mismatched"]["global_step"] == 0


@pytest.mark.timeout(480)
def test_prescaled_batch_false_with_a_group_reading_one_batch_warns(two_ranks):
    warned = two_ranks[0]["same_batches_warned"]
    assert len(warned) == 1 and "received the same batch" in warned[0] and "smp.dp_rank() / smp.dp_size()" in warned[0]


@pytest.mark.timeout(480)
def test_evaluation_sees_the_union_and_prediction_returns_each_rank_its_own_samples(four_ranks):
    torch.manual_seed(0)
    model = _build()
    model.eval()
    ids, target = token_batches(3, SAMPLES)
    with torch.no_grad():
        logits = model(ids).float()
        whole_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).item()
    evaluations = [rank["evaluation"] for rank in four_ranks]
    for rank in evaluations:
        assert rank["val_loss"] == pytest.approx(whole_loss, rel=FP32_REL)
        assert rank["predictions"].shape == (SAMPLES // 4, ids.shape[1], logits.shape[-1])
        torch.testing.assert_close(rank["predictions"], logits[rank["indices"]], rtol=1e-5, atol=1e-5)
    assert sorted(i for rank in evaluations for i in rank["indices"]) == list(range(SAMPLES))
