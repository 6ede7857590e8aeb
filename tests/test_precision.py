"""SMPPrecision inside Lightning's loop, single process on the CPU: casting, scaling, skipping, clipping, resuming."""

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import TensorDataset

from lightning_smp import MasterWeightOptimizer, SMPPrecision, SMPStrategy
from tests.models import TinyRegressor, quiet_trainer


def _trainer(strategy, **kwargs) -> pl.Trainer:
    return quiet_trainer(strategy, **{"max_epochs": 1, **kwargs})


def _fp16(**config) -> SMPStrategy:
    return SMPStrategy(fp16=True, **config)


# -- module and input conversion ----------------------------------------------------------------------------------


def test_convert_module_keeps_batchnorm_in_fp32_and_returns_the_model_dtype():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    SMPPrecision(torch.float16).convert_module(model)
    assert model[0].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32
    assert model[1].running_mean.dtype == torch.float32
    out = model(torch.randn(5, 4, dtype=torch.float16))
    assert out.dtype == torch.float16


def test_convert_input_casts_floating_tensors_only():
    batch = {"x": torch.randn(2, 3), "ids": torch.arange(3), "nested": [torch.ones(1, dtype=torch.float64)]}
    converted = SMPPrecision(torch.bfloat16).convert_input(batch)
    assert converted["x"].dtype == torch.bfloat16
    assert converted["ids"].dtype == torch.int64
    assert converted["nested"][0].dtype == torch.bfloat16
    assert SMPPrecision(None).convert_input(batch) is batch


# -- ownership of precision --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["smp_fp16", "smp", "smp_bf16"])
def test_trainer_gets_the_smp_plugin_for_every_registered_name(strategy):
    trainer = _trainer(strategy)
    assert isinstance(trainer.strategy, SMPStrategy)
    assert isinstance(trainer.precision_plugin, SMPPrecision)
    expected = {"smp_fp16": torch.float16, "smp": None, "smp_bf16": torch.bfloat16}[strategy]
    assert trainer.precision_plugin.dtype == expected


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-true"])
def test_a_conflicting_trainer_precision_is_a_clear_error(precision):
    with pytest.raises(MisconfigurationException, match=r"Remove `precision=` from the Trainer.*'smp_fp16'"):
        _trainer("smp_fp16", precision=precision)


def test_a_conflicting_precision_plugin_is_a_clear_error():
    with pytest.raises(MisconfigurationException, match="SMPStrategy chooses the precision itself"):
        _trainer(SMPStrategy(fp16=True), plugins=[HalfPrecision("16-true")])


# -- training ---------------------------------------------------------------------------------------------------


class _NoisyRegressor(TinyRegressor):
    """A regression with a real noise floor (MSE ≈ 0.09), so fp16 and fp32 must end up at the same loss."""

    def __init__(self, **kwargs):
        super().__init__(num_samples=256, batch_size=32, **kwargs)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(256, 8, generator=generator)
        y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] + 0.3 * torch.randn(256, 1, generator=generator)
        self._dataset = TensorDataset(x, y)


def _adam(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)


def test_fp16_converges_to_within_2_percent_of_fp32():
    # init_scale 2**12 instead of smp's 2**32: no step is skipped, so only fp16 arithmetic separates the runs
    # (with 2**32 the first ~22 of 320 steps are skipped while the scale comes down; see the overflow tests).
    final = {}
    for name, strategy in (("fp32", "smp"), ("fp16", _fp16(dynamic_loss_args={"init_scale": 2.0**12}))):
        torch.manual_seed(0)
        model = _NoisyRegressor(optimizer=_adam)
        trainer = _trainer(strategy, max_epochs=40)
        trainer.fit(model)
        x, y = model._dataset.tensors
        final[name] = F.mse_loss(model.net.float()(x), y).item()  # the trained model on the whole set, in fp32
    assert trainer.strategy.optimizers[0].skipped_steps.item() == 0
    assert final["fp32"] < 0.15  # it learned: the noise floor is 0.09, the start about 1.3
    assert final["fp16"] == pytest.approx(final["fp32"], rel=2e-2)


class _InjectOverflow(Callback):
    """Puts an inf into one gradient after backward at the given global steps; records what each step did."""

    def __init__(self, steps):
        self.steps = set(steps)
        self.weights, self.lrs, self.scales = [], [], []

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step in self.steps:
            next(pl_module.parameters()).grad.view(-1)[0] = math.inf

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        optimizer = trainer.strategy.optimizers[0]
        self.weights.append(next(pl_module.parameters()).detach().clone())
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.scales.append(optimizer.loss_scale)


class _WithStepScheduler(TinyRegressor):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("fused", [False, True])
def test_an_overflow_skips_the_step_the_scheduler_and_backs_off_the_scale(fused):
    class Model(_WithStepScheduler):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            if fused:
                optimizer = torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)
                config["optimizer"] = optimizer
                config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
            return config

    recorder = _InjectOverflow(steps=[3])
    model = Model()
    trainer = _trainer(_fp16(dynamic_loss_args={"init_scale": 2.0**10}), max_steps=6, callbacks=[recorder])
    trainer.fit(model)

    assert torch.equal(recorder.weights[3], recorder.weights[2])  # step 3 skipped: weights untouched
    assert not torch.equal(recorder.weights[4], recorder.weights[3])  # step 4 updates again
    assert recorder.lrs[3] == recorder.lrs[2]  # ... and the LR scheduler did not advance
    assert recorder.lrs[4] == recorder.lrs[3] * 0.5
    assert recorder.scales[2] == 2.0**10 and recorder.scales[3] == 2.0**9  # smp: halve on overflow
    optimizer = trainer.strategy.optimizers[0]
    assert isinstance(optimizer, MasterWeightOptimizer)
    assert optimizer.skipped_steps.item() == 1
    assert trainer.callback_metrics["loss_scale"] == 2.0**9
    assert "loss_scale" not in trainer.progress_bar_metrics  # no bar: no per-step host sync for showing it
    assert trainer.callback_metrics["skipped_steps"].item() == 1  # logged before the last step's update


def test_the_progress_bar_shows_the_loss_scale():
    trainer = _trainer(_fp16(dynamic_loss_args={"init_scale": 2.0**10}), max_steps=2, enable_progress_bar=True)
    trainer.fit(TinyRegressor())
    assert trainer.progress_bar_metrics["loss_scale"] == 2.0**10


def test_delayed_shift_two_needs_two_overflows_to_back_off():
    recorder = _InjectOverflow(steps=[1, 3])
    strategy = _fp16(dynamic_loss_args={"init_scale": 2.0**10, "delayed_shift": 2})
    _trainer(strategy, max_steps=5, callbacks=[recorder]).fit(_WithStepScheduler())
    assert recorder.scales == [2.0**10, 2.0**10, 2.0**10, 2.0**9, 2.0**9]


class _RecordMasterGradNorm(Callback):
    """After each step the master grads still hold the (clipped) values the step used."""

    def __init__(self):
        self.norms, self.max_abs = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        grads = [p.grad for p in trainer.strategy.optimizers[0].master_params()]
        self.norms.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())
        self.max_abs.append(max(g.abs().max().item() for g in grads))


@pytest.mark.parametrize(("algorithm", "limit"), [("norm", 0.05), ("value", 0.01)])
def test_trainer_gradient_clipping_clips_the_fp32_master_grads(algorithm, limit):
    recorder = _RecordMasterGradNorm()
    strategy = _fp16(dynamic_loss_args={"init_scale": 2.0**8})
    trainer = _trainer(
        strategy, max_steps=6, gradient_clip_val=limit, gradient_clip_algorithm=algorithm, callbacks=[recorder]
    )
    trainer.fit(TinyRegressor())
    measured = recorder.norms if algorithm == "norm" else recorder.max_abs
    assert max(measured) <= limit * (1 + 1e-4)
    unclipped = _RecordMasterGradNorm()
    _trainer(_fp16(dynamic_loss_args={"init_scale": 2.0**8}), max_steps=6, callbacks=[unclipped]).fit(TinyRegressor())
    assert max(unclipped.norms if algorithm == "norm" else unclipped.max_abs) > limit  # clipping had work to do


class _ManualRegressor(TinyRegressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.norms = []

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.manual_backward(loss)
        self.norms.append(optimizer.clip_master_grads(1.0))
        optimizer.step()
        self.losses.append(loss.item())


def test_manual_optimization_scales_clips_and_steps():
    model = _ManualRegressor()
    trainer = _trainer(_fp16(dynamic_loss_args={"init_scale": 2.0**8}), max_epochs=5)
    trainer.fit(model)
    assert all(isinstance(norm, torch.Tensor) for norm in model.norms)
    assert all(norm.item() > 0 for norm in model.norms)  # no overflow at 2**8: real norms, not -1
    assert sum(model.losses[-8:]) < 0.5 * sum(model.losses[:8])


def test_bf16_trains_with_fp32_masters_and_no_loss_scale():
    model = TinyRegressor(optimizer=_adam)
    trainer = _trainer("smp_bf16", max_epochs=3)
    trainer.fit(model)
    optimizer = trainer.strategy.optimizers[0]
    assert model.net[0].weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in optimizer.master_params())
    assert optimizer.loss_scaler is None
    assert "loss_scale" not in trainer.callback_metrics
    assert model.losses[-1] < model.losses[0]


# -- checkpoints --------------------------------------------------------------------------------------------------


class _Scheduled(TinyRegressor):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_checkpoint_resume_continues_bit_identically(tmp_path):
    def strategy():
        # init_scale 2**18 overflows for a few steps first, so the scaler state in the checkpoint matters
        return _fp16(dynamic_loss_args={"init_scale": 2.0**18, "scale_window": 5})

    torch.manual_seed(0)
    straight = _Scheduled()
    straight_trainer = _trainer(strategy(), max_epochs=4)
    straight_trainer.fit(straight)

    torch.manual_seed(0)
    first = _Scheduled()
    trainer = _trainer(strategy(), max_epochs=2)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "half.ckpt")

    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    resumed = _Scheduled()
    resumed_trainer = _trainer(strategy(), max_epochs=4)
    resumed_trainer.fit(resumed, ckpt_path=tmp_path / "half.ckpt")

    steps_per_epoch = len(straight.losses) // 4
    assert resumed.losses == straight.losses[2 * steps_per_epoch :]
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    expected, got = straight_trainer.strategy.optimizers[0], resumed_trainer.strategy.optimizers[0]
    assert got.loss_scaler.state_dict() == expected.loss_scaler.state_dict()
    assert got.skipped_steps.item() == expected.skipped_steps.item() > 0
    assert got.param_groups[0]["lr"] == expected.param_groups[0]["lr"]


# -- torch.compile -------------------------------------------------------------------------------------------------


class _CompilesItsNet(TinyRegressor):
    """Compiles its network in ``configure_model``, the way docs/train-on-one-node.md recommends."""

    def __init__(self, backend, **kwargs):
        super().__init__(**kwargs)
        self._backend = backend

    def configure_model(self):
        if not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
            self.net = torch.compile(self.net, backend=self._backend)


def _fp16_losses_and_skips(model, fitted=None):
    trainer = _trainer(_fp16(dynamic_loss_args={"init_scale": 2.0**20}), max_epochs=2)
    trainer.fit(fitted if fitted is not None else model)
    return model.losses, trainer.strategy.optimizers[0].skipped_steps.item()


@pytest.mark.parametrize(
    ("how", "backend"), [("configure_model", "aot_eager"), ("configure_model", "inductor"), ("fit", "aot_eager")]
)
def test_a_compiled_model_trains_like_the_eager_one(how, backend):
    """torch.compile of the network in ``configure_model``, or of the whole LightningModule handed to ``fit``
    (Lightning compiles its steps then): the fp16 masters, the loss scale and the skipped steps work unchanged."""
    torch.manual_seed(0)
    eager = _fp16_losses_and_skips(TinyRegressor(optimizer=_adam))
    torch._dynamo.reset()
    torch.manual_seed(0)
    if how == "configure_model":
        compiled = _fp16_losses_and_skips(_CompilesItsNet(backend, optimizer=_adam))
    else:
        model = TinyRegressor(optimizer=_adam)
        compiled = _fp16_losses_and_skips(model, torch.compile(model, backend=backend))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it really ran compiled
    assert compiled[1] == eager[1] > 0  # the same overflow-skipped steps, and there were some
    # aot_eager runs the same kernels as eager; inductor fuses them and may round the fp16 values differently
    assert compiled[0] == pytest.approx(eager[0], rel=0 if backend == "aot_eager" else 1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_fit_on_cuda_matches_the_cpu_run():
    def run(accelerator):
        torch.manual_seed(0)
        model = _NoisyRegressor(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True))
        trainer = _trainer(_fp16(dynamic_loss_args={"init_scale": 2.0**20}), accelerator=accelerator, max_epochs=3)
        trainer.fit(model)
        optimizer = trainer.strategy.optimizers[0]
        return model.losses, optimizer.skipped_steps.item(), optimizer.loss_scale

    cpu_losses, cpu_skipped, cpu_scale = run("cpu")
    gpu_losses, gpu_skipped, gpu_scale = run("gpu")
    assert (gpu_skipped, gpu_scale) == (cpu_skipped, cpu_scale)
    assert gpu_losses == pytest.approx(cpu_losses, rel=2e-2)
