"""Sharded optimizer state (``shard_optimizer_state=True``, ZeRO-1) against the same run without sharding.

Every layout runs twice in one launch, sharded and not, on the same data: losses, skipped steps and the global
gradient norm must agree (fp32 to 1e-5, fp16 to 2e-2); the sharded rank must hold about half the masters and
optimizer state, and hand a checkpoint only its share; and a sharded checkpoint must resume unsharded, at another
dp degree, and consolidate. The reduction in several buckets (a small cap, and a stock model past the default cap)
matches the single-device run, starts during the backward before a step and never during an accumulation
micro-step, and every collective it starts is waited for in its step. On gloo ZeRO-1 takes each replica's share
from an all-reduce; inside `collectives.native_on_cpu` it reduce-scatters, as on NCCL, and must match the same runs.
"""

import dataclasses
import math
import os
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from lightning_smp import SMPStrategy, collectives
from lightning_smp import engine as engine_module
from lightning_smp.checkpoint import consolidate_checkpoint, model_state_dict, optimizer_state_dict
from lightning_smp.grad_vote import clip_grad_norm_counted
from lightning_smp.master_shard import FlatPiece
from lightning_smp.optimizer import MasterWeightOptimizer
from tests.distributed import run_distributed
from tests.gpt import TinyLlama
from tests.models import TinyRegressor, quiet_trainer
from tests.parity import FP32_REL, mean_losses, single_device_run

STEPS = 12
SAVED_AT = 4  # the first epoch's end: 64 samples, 2 replicas x 8 (or 1 x 16) per step
PER_RANK_BATCH = 8
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**17}}  # the first steps overflow, are skipped
SHARD = {"shard_optimizer_state": True}
TP2 = {"tensor_parallel_degree": 2, "tensor_parallel_plan": {"net.0": "colwise", "net.2": "rowwise"}}
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
LLAMA_STEPS = 4


class _Record(Callback):
    """Every step's loss (the last stage's under pipeline parallelism, on every rank) and the global gradient norm
    before the step (with an infinite bound, clipping changes nothing)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if isinstance(optimizer, MasterWeightOptimizer):
            norm = optimizer.clip_master_grads(math.inf)
        else:
            norm = clip_grad_norm_counted(list(pl_module.parameters()), math.inf, topology=trainer.strategy.topology)
        self.norms.append(norm.item())


class _Launches(Callback):
    """Per training batch, the asynchronous all-reduces and reduce-scatters started (ZeRO-1's buckets: all-reduces
    on gloo, reduce-scatters inside `collectives.native_on_cpu`; nothing else here starts one), of them the
    reduce-scatters, those waited for, and how many had started when the backward computed the gradient of ``first``
    (the model's first weight, the last gradient of a backward: None where no backward reached it, or this rank does
    not hold it)."""

    def __init__(self, first) -> None:
        self.first, self.batches = first, []
        self.launched = self.scattered = self.waited = 0

    @contextmanager
    def counting(self):
        all_reduce, reduce_scatter, record = dist.all_reduce, collectives.reduce_scatter_single, self

        class Counted:
            def __init__(self, work):
                self.work = work

            def wait(self, *args, **kwargs):
                record.waited += 1
                return self.work.wait(*args, **kwargs)

        def counted_all_reduce(tensor, *args, async_op=False, **kwargs):
            work = all_reduce(tensor, *args, async_op=async_op, **kwargs)
            if not async_op:
                return work
            record.launched += 1
            return Counted(work)

        def counted_reduce_scatter(output, tensor, *args, async_op=False, **kwargs):
            work = reduce_scatter(output, tensor, *args, async_op=async_op, **kwargs)
            if not async_op:
                return work
            record.launched += 1
            record.scattered += 1
            return Counted(work)

        scattering = mock.patch.object(collectives, "reduce_scatter_single", counted_reduce_scatter)
        with mock.patch.object(dist, "all_reduce", counted_all_reduce), scattering:
            yield

    def on_train_start(self, trainer, pl_module):
        first = self.first(pl_module)
        if first is not None:  # None: a later pipeline stage
            first.register_hook(lambda grad: self.batches[-1].update(at_first_weight=self.launched))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.launched = self.scattered = self.waited = 0
        self.batches.append({"at_first_weight": None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches[-1].update(launched=self.launched, scattered=self.scattered, waited=self.waited)


@contextmanager
def _bucket_cap(max_bytes: int | None):
    """The run's gradient buckets hold at most ``max_bytes`` (None: the default, `reduction.BUCKET_BYTES`)."""
    if max_bytes is None:
        yield
        return
    plan = engine_module.plan_reduction

    def capped(config, topology):
        return dataclasses.replace(plan(config, topology), bucket_bytes=max_bytes)

    with mock.patch.object(engine_module, "plan_reduction", capped):
        yield


def _state_bytes(optimizer: MasterWeightOptimizer) -> int:
    """Exact bytes of the fp32 masters and the optimizer state this rank holds (each storage once)."""
    tensors = optimizer.master_params() + [
        value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)
    ]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _checkpoint_bytes(trainer) -> int:
    """Bytes of the tensors this rank hands a checkpoint save: its model weights (masters) and optimizer state."""
    module, optimizers = trainer.lightning_module, trainer.strategy.optimizers
    values = list(model_state_dict(module, optimizers).values())
    values += [v for state in optimizer_state_dict(optimizers[0], module)["state"].values() for v in state.values()]
    held = [value.flat if isinstance(value, FlatPiece) else value for value in values]
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, Tensor))


def _regressor(batch_size: int = PER_RANK_BATCH) -> TinyRegressor:
    return TinyRegressor(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), num_samples=64, batch_size=batch_size)


def _fit(
    strategy_kwargs: dict,
    *,
    batch_size: int = PER_RANK_BATCH,
    dirpath=None,
    ckpt_path=None,
    accumulate: int = 1,
    bucket_bytes: int | None = None,
) -> dict:
    torch.manual_seed(0)
    model = _regressor(batch_size)
    record = _Record()
    launches = _Launches(lambda module: getattr(module.net[0], "weight", None))
    callbacks = [record, launches]
    if dirpath is not None:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, save_top_k=-1))
    trainer = quiet_trainer(
        SMPStrategy(**strategy_kwargs),
        devices=int(os.environ["WORLD_SIZE"]),
        max_epochs=STEPS // SAVED_AT,
        gradient_clip_val=0.1,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        enable_checkpointing=dirpath is not None,
    )
    with _bucket_cap(bucket_bytes), launches.counting():
        trainer.fit(model, ckpt_path=ckpt_path)
    optimizer = trainer.strategy.optimizers[0]
    wrapped = isinstance(optimizer, MasterWeightOptimizer)
    return {
        "launches": launches.batches,
        "losses": record.losses,
        "norms": record.norms,
        "skipped": optimizer.skipped_steps.item() if wrapped else None,
        "state_bytes": _state_bytes(optimizer) if wrapped else None,
        "checkpoint_bytes": _checkpoint_bytes(trainer),
        "state_dict_error": _error_of(optimizer.state_dict),
    }


def _llama() -> TinyLlama:
    """A stock Llama whose fp32 parameters (8.4M, mostly a 131072-token embedding and head) fill two buckets of the
    default 25 MiB."""
    model = TinyLlama(vocab_size=131072, hidden_size=32)
    model.configure_model()
    return model


def _llama_loss(model, batch, step):
    return model.loss(batch)


def _fit_llama() -> dict:
    record, launches = _Record(), _Launches(lambda module: module.model.model.embed_tokens.weight)
    trainer = quiet_trainer(SMPStrategy(**SHARD), devices=2, max_steps=LLAMA_STEPS, callbacks=[record, launches])
    with launches.counting():
        trainer.fit(_llama())
    return {"losses": record.losses, "launches": launches.batches}


def _regressor_loss(model, batch, step):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _error_of(function) -> str | None:
    try:
        function()
    except ValueError as error:
        return str(error)
    return None


def _dp2_job(rank: int, root: str) -> dict:
    root = Path(root)
    results = {}
    for name, precision in (("fp32", {}), ("fp16", FP16), ("bf16", {"bf16": True})):
        saves = name == "fp16"
        results[name] = _fit(precision, dirpath=root / "fp16_plain" if saves else None)
        results[f"{name}_sharded"] = _fit({**precision, **SHARD}, dirpath=root / "fp16" if saves else None)
    for name, precision in (("fp32", {}), ("fp16", FP16)):  # two batches per optimizer step
        results[f"{name}_accumulated"] = _fit(precision, accumulate=2)
        results[f"{name}_accumulated_sharded"] = _fit({**precision, **SHARD}, accumulate=2)
    # several buckets: a cap of 32 bytes puts each of the four parameters in a bucket of its own, fp32 or fp16
    results["fp32_sharded_buckets"] = _fit(SHARD, bucket_bytes=32)
    results["fp16_accumulated_sharded_buckets"] = _fit({**FP16, **SHARD}, accumulate=2, bucket_bytes=32)
    results["llama_sharded"] = _fit_llama()
    with collectives.native_on_cpu():  # the reduce-scatters NCCL runs, on gloo
        results["fp32_sharded_buckets_native"] = _fit(SHARD, bucket_bytes=32)
        results["fp16_accumulated_sharded_buckets_native"] = _fit({**FP16, **SHARD}, accumulate=2, bucket_bytes=32)
    saved = root / "fp16" / f"epoch=0-step={SAVED_AT}.ckpt"
    results["resumed_unsharded"] = _fit(FP16, ckpt_path=saved)
    results["resumed_sharded"] = _fit({**FP16, **SHARD}, ckpt_path=saved)
    return results


def _dp1_job(rank: int, root: str) -> dict:
    saved = Path(root) / "fp16" / f"epoch=0-step={SAVED_AT}.ckpt"
    return _fit(FP16, batch_size=2 * PER_RANK_BATCH, ckpt_path=saved)


def _four_ranks_job(rank: int, root: str) -> dict:
    results = {}
    # each tensor-parallel rank reads its own half of a replica's batch (prescaled_batch=False): STEPS steps either way
    for layout, degrees, batch in (("dp2_tp2", TP2, PER_RANK_BATCH // 2), ("pp2_dp2", PP2, PER_RANK_BATCH)):
        for name, precision in (("fp32", {}), ("fp16", FP16)):
            results[f"{layout}_{name}"] = _fit({**degrees, **precision}, batch_size=batch)
            results[f"{layout}_{name}_sharded"] = _fit({**degrees, **precision, **SHARD}, batch_size=batch)
    # the dp2 run's sharded save, re-partitioned over four replicas (the same global batch)
    saved = Path(root) / "fp16" / f"epoch=0-step={SAVED_AT}.ckpt"
    results["dp4_resumed_sharded"] = _fit({**FP16, **SHARD}, batch_size=PER_RANK_BATCH // 2, ckpt_path=saved)
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("zero1")


@pytest.fixture(scope="module")
def dp2(root):
    return run_distributed(_dp2_job, 2, str(root), timeout=400)


@pytest.fixture(scope="module")
def dp1(root, dp2):
    (result,) = run_distributed(_dp1_job, 1, str(root), timeout=150)
    return result


def _mean_losses(ranks: list[dict], run: str) -> list[float]:
    return [(a + b) / 2 for a, b in zip(ranks[0][run]["losses"], ranks[1][run]["losses"], strict=True)]


def _assert_same_run(sharded: dict, plain: dict, rel: float) -> None:
    assert len(sharded["losses"]) == STEPS >= 10
    assert sharded["losses"] == pytest.approx(plain["losses"], rel=rel)
    assert sharded["norms"] == pytest.approx(plain["norms"], rel=rel)
    assert sharded["skipped"] == plain["skipped"] or plain["skipped"] is None


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "rel"), [("fp32", 1e-5), ("fp16", 2e-2), ("bf16", 2e-2)])
def test_dp2_sharded_matches_the_unsharded_run(dp2, name, rel):
    for rank in dp2:
        _assert_same_run(rank[f"{name}_sharded"], rank[name], rel)
    if name == "fp16":
        assert dp2[0]["fp16"]["skipped"] >= 1  # the comparison covers the overflow path
        assert dp2[0]["fp16_sharded"]["skipped"] == dp2[1]["fp16_sharded"]["skipped"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "rel"), [("fp32", 1e-5), ("fp16", 2e-2)])
def test_dp2_sharded_accumulates_gradients_as_the_unsharded_run(dp2, name, rel):
    for rank in dp2:
        plain = rank[f"{name}_accumulated"]
        assert len(plain["norms"]) == STEPS // 2  # the 12 batches made 6 optimizer steps
        _assert_same_run(rank[f"{name}_accumulated_sharded"], plain, rel)


@pytest.mark.timeout(600)
def test_dp2_sharded_in_several_buckets_matches_one_device_and_reduces_during_the_backward_before_each_step(dp2):
    reference = single_device_run(_regressor, _regressor_loss, steps=STEPS, replicas=2, clip_norm=0.1)
    run = [rank["fp32_sharded_buckets"] for rank in dp2]
    assert mean_losses(run, steps=STEPS) == pytest.approx(reference["losses"], rel=FP32_REL)
    for rank, plain in zip(run, dp2, strict=True):
        _assert_same_run(rank, plain["fp32"], FP32_REL)  # the gradient norms too (AdamW hides a scaled gradient)
        for batch in rank["launches"]:
            assert batch["launched"] == batch["waited"] == 4  # one collective per bucket, each waited for
            assert batch["at_first_weight"] >= 1  # started before the backward's last gradient


@pytest.mark.timeout(600)
def test_a_stock_model_past_the_default_bucket_cap_matches_one_device_and_reduces_during_backward(dp2):
    reference = single_device_run(_llama, _llama_loss, steps=LLAMA_STEPS, replicas=2)
    run = [rank["llama_sharded"] for rank in dp2]
    assert mean_losses(run, steps=LLAMA_STEPS) == pytest.approx(reference["losses"], rel=FP32_REL)
    for rank in run:
        for batch in rank["launches"]:
            assert batch["launched"] == batch["waited"] == 2
            assert batch["at_first_weight"] >= 1


@pytest.mark.timeout(600)
def test_nothing_is_reduced_during_an_accumulation_micro_step_and_every_reduction_is_waited_for(dp2):
    for rank in dp2:
        run, plain = rank["fp16_accumulated_sharded_buckets"], rank["fp16_accumulated"]
        _assert_same_run(run, plain, 2e-2)
        assert run["skipped"] >= 1  # skipped steps take the grads too: their reductions are waited for
        micro_steps, steps = run["launches"][0::2], run["launches"][1::2]
        assert all(batch["launched"] == batch["waited"] == 0 for batch in micro_steps)
        assert all(batch["launched"] == batch["waited"] == 4 and batch["at_first_weight"] >= 1 for batch in steps)


@pytest.mark.timeout(600)
def test_dp2_sharded_reduce_scatters_during_the_backward_as_on_nccl_and_matches_one_device(dp2):
    """The branch a CPU run never takes: each bucket's share by gloo's own asynchronous reduce-scatter (fp32 in
    place, fp16 through a share in its dtype), started during the backward before a step, none during an
    accumulation micro-step, every one waited for; the same runs as the all-reduce's."""
    reference = single_device_run(_regressor, _regressor_loss, steps=STEPS, replicas=2, clip_norm=0.1)
    run = [rank["fp32_sharded_buckets_native"] for rank in dp2]
    assert mean_losses(run, steps=STEPS) == pytest.approx(reference["losses"], rel=FP32_REL)
    for rank in dp2:
        native = rank["fp32_sharded_buckets_native"]
        _assert_same_run(native, rank["fp32"], FP32_REL)
        for batch in native["launches"]:
            assert batch["scattered"] == batch["launched"] == batch["waited"] == 4 and batch["at_first_weight"] >= 1
        accumulated = rank["fp16_accumulated_sharded_buckets_native"]
        _assert_same_run(accumulated, rank["fp16_accumulated"], 2e-2)
        assert accumulated["skipped"] >= 1
        micro_steps, steps = accumulated["launches"][0::2], accumulated["launches"][1::2]
        assert all(batch["launched"] == batch["waited"] == 0 for batch in micro_steps)
        for batch in steps:
            assert batch["scattered"] == batch["launched"] == batch["waited"] == 4 and batch["at_first_weight"] >= 1
    for rank in dp2:  # outside the block, gloo's all-reduce
        assert all(batch["scattered"] == 0 for batch in rank["fp32_sharded_buckets"]["launches"])


@pytest.mark.timeout(600)
def test_a_sharded_rank_holds_about_half_the_masters_and_optimizer_state(dp2):
    for rank in dp2:
        assert rank["fp16_sharded"]["state_bytes"] <= 0.52 * rank["fp16"]["state_bytes"]


@pytest.mark.timeout(600)
def test_a_sharded_replica_saves_its_share_of_the_masters_and_optimizer_state_gathering_nothing(dp2):
    for rank in dp2:
        assert rank["fp16_sharded"]["checkpoint_bytes"] <= 0.55 * rank["fp16"]["checkpoint_bytes"]


@pytest.mark.timeout(600)
def test_a_sharded_optimizers_positional_state_dict_points_to_the_checkpoints_by_name(dp2):
    assert dp2[0]["fp16"]["state_dict_error"] is None
    assert "by parameter name" in dp2[0]["fp16_sharded"]["state_dict_error"]


@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_resumes_sharded_and_unsharded_at_dp2_and_on_one_device(dp2, dp1):
    unbroken = _mean_losses(dp2, "fp16_sharded")
    for resumed in ("resumed_sharded", "resumed_unsharded"):
        mean = _mean_losses(dp2, resumed)
        assert mean == pytest.approx(unbroken[SAVED_AT:], rel=2e-2), resumed
    assert dp2[0]["resumed_sharded"]["losses"] == dp2[0]["fp16_sharded"]["losses"][SAVED_AT:]  # same layout: exact
    assert dp1["losses"] == pytest.approx(unbroken[SAVED_AT:], rel=2e-2)


@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_consolidates_into_the_single_device_model(dp2, root, tmp_path):
    name = f"epoch=0-step={SAVED_AT}.ckpt"
    sharded = torch.load(consolidate_checkpoint(root / "fp16" / name, tmp_path / "sharded.ckpt"), weights_only=False)
    plain = torch.load(consolidate_checkpoint(root / "fp16_plain" / name, tmp_path / "plain.ckpt"), weights_only=False)
    TinyRegressor().load_state_dict(sharded["state_dict"], strict=True)
    for key, value in plain["state_dict"].items():  # the fp32 masters, gathered from both shares
        assert sharded["state_dict"][key].dtype == torch.float32
        torch.testing.assert_close(sharded["state_dict"][key], value, rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(900)
def test_dp2_tp2_and_pp2_dp2_sharded_match_the_unsharded_runs_and_a_dp2_save_resumes_at_dp4(dp2, root):
    ranks = run_distributed(_four_ranks_job, 4, str(root), timeout=840)
    for layout in ("dp2_tp2", "pp2_dp2"):
        for rank in ranks:
            _assert_same_run(rank[f"{layout}_fp32_sharded"], rank[f"{layout}_fp32"], 1e-5)
            _assert_same_run(rank[f"{layout}_fp16_sharded"], rank[f"{layout}_fp16"], 2e-2)
        assert ranks[0][f"{layout}_fp16"]["skipped"] >= 1
    per_rank = [rank["dp4_resumed_sharded"]["losses"] for rank in ranks]
    resumed = [sum(step) / 4 for step in zip(*per_rank, strict=True)]
    assert resumed == pytest.approx(_mean_losses(dp2, "fp16_sharded")[SAVED_AT:], rel=2e-2)
