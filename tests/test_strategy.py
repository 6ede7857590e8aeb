"""SMPStrategy: its names and arguments, and data parallelism checked against the single-process run."""

import dataclasses
import inspect
import math
import os
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry

from lightning_smp import SMPStrategy
from lightning_smp.config import SMPConfig
from tests.distributed import run_distributed, run_process
from tests.models import TinyRegressor, quiet_trainer
from tests.parity import FP16_REL, FP32_REL, assert_same_overflow, mean_losses, single_device_run

STEPS = 12
PER_RANK_BATCH = 8

# -- construction ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("smp", {}),
        ("smp_fp16", {"fp16": True}),
        ("smp_bf16", {"bf16": True}),
        ("smp_fork", {"start_method": "fork"}),
        ("smp_notebook", {"start_method": "fork"}),
        ("smp_fp16_fork", {"fp16": True, "start_method": "fork"}),
        ("smp_bf16_fork", {"bf16": True, "start_method": "fork"}),
    ],
)
def test_names_are_registered_on_import(name, params):
    assert StrategyRegistry[name]["strategy"] is SMPStrategy
    assert StrategyRegistry[name]["init_params"] == params


def test_from_smp_options_takes_the_sagemaker_dict_as_pasted():
    strategy = SMPStrategy.from_smp_options(
        {"enabled": True, "parameters": {"microbatches": 4, "fp16": True, "placement_strategy": "spread"}}
    )
    assert strategy.config.fp16 and strategy.config.microbatches == 4
    assert strategy.config.placement_order == "TPD"
    assert strategy.precision_plugin.dtype == torch.float16


def test_a_keyword_given_wins_over_smp_options_even_at_its_default():
    options = {"parameters": {"microbatches": 4, "fp16": True}}
    with pytest.warns(UserWarning, match=r"microbatches=1 given as a keyword argument overrides microbatches=4"):
        strategy = SMPStrategy(microbatches=1, smp_options=options)
    assert (strategy.config.microbatches, strategy.config.fp16) == (1, True)
    assert SMPStrategy(smp_options=options).config.microbatches == 4  # not given: smp_options decides
    with pytest.warns(UserWarning, match=r"fp16=False given as a keyword argument overrides fp16=True"):
        assert not SMPStrategy.from_smp_options(options, fp16=False).config.fp16


def test_the_sagemaker_environment_variable_overrides_the_script(monkeypatch):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"microbatches": 8, "fp16": true}')
    with pytest.warns(UserWarning, match="SM_HP_MP_PARAMETERS sets microbatches=8") as record:
        strategy = SMPStrategy(microbatches=2, smp_options={"microbatches": 4}, fp16=False)
    assert (strategy.config.microbatches, strategy.config.fp16) == (8, True)
    assert any("SM_HP_MP_PARAMETERS sets fp16=True, overriding False" in str(w.message) for w in record)


def test_settings_without_effect_say_so():
    with pytest.warns(UserWarning, match="horovod=True has no effect"):
        SMPStrategy(horovod=True)


def test_unknown_smp_keys_suggest_the_nearest():
    with pytest.raises(ValueError, match="did you mean 'microbatches'"):
        SMPStrategy.from_smp_options({"parameters": {"microbatch": 4}})


# -- data parallelism against one process ------------------------------------------------------------------------


class _Record(Callback):
    def __init__(self, inject_at=None):
        self.inject_at = inject_at
        self.weights = []

    def on_after_backward(self, trainer, pl_module):
        # After DDP's all-reduce: only this rank sees the inf, so only the job-wide overflow vote can skip the step.
        if trainer.global_step == self.inject_at:
            next(pl_module.parameters()).grad.view(-1)[0] = math.inf

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append(torch.cat([p.detach().float().flatten() for p in pl_module.parameters()]))


class _Logged(TinyRegressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("rank_value", float(self.global_rank), sync_dist=True, on_step=True)
        return loss


def _fit(rank, strategy_kwargs, batch_size, inject_rank=None):
    """One rank of a data-parallel fit; returns what the parent compares."""
    torch.manual_seed(0)
    world_size = int(os.environ["WORLD_SIZE"])
    model = _Logged(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), num_samples=256, batch_size=batch_size)
    recorder = _Record(inject_at=3 if rank == inject_rank else None)
    trainer = quiet_trainer(SMPStrategy(**strategy_kwargs), devices=world_size, max_steps=STEPS, callbacks=[recorder])
    trainer.fit(model)
    optimizers = trainer.strategy.optimizers
    return {
        "losses": model.losses,
        "weights": recorder.weights,
        "sampler": trainer.strategy.distributed_sampler_kwargs,
        "rank_value": trainer.callback_metrics["rank_value"].item(),
        "skipped": optimizers[0].skipped_steps.item() if hasattr(optimizers[0], "skipped_steps") else None,
        "scale": optimizers[0].loss_scale if hasattr(optimizers[0], "loss_scale") else None,
    }


def _reference(*, fp16: bool = False) -> dict:
    """The same model and the two replicas' batches in one process, in plain PyTorch (tests/parity.py)."""
    return single_device_run(
        lambda: _Logged(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), num_samples=256, batch_size=PER_RANK_BATCH),
        lambda model, batch, step: F.mse_loss(model(batch[0]), batch[1]),
        steps=STEPS,
        replicas=2,
        fp16=fp16,
        init_scale=2.0**20,
    )


def _data_parallel(strategy_kwargs, inject_rank=None):
    return run_distributed(_fit, 2, strategy_kwargs, PER_RANK_BATCH, inject_rank, timeout=100)


@pytest.mark.timeout(240)
def test_dp2_fp32_matches_one_process_on_the_global_batch():
    single = _reference()
    ranks = _data_parallel({})
    assert [r["sampler"] for r in ranks] == [{"num_replicas": 2, "rank": 0}, {"num_replicas": 2, "rank": 1}]
    losses = mean_losses(ranks)
    assert len(losses) == STEPS >= 10
    assert losses == pytest.approx(single["losses"], rel=FP32_REL)
    for step in range(STEPS):
        torch.testing.assert_close(ranks[0]["weights"][step], single["step_weights"][step], rtol=1e-5, atol=1e-6)
        assert torch.equal(ranks[0]["weights"][step], ranks[1]["weights"][step])  # replicas stay identical
    assert ranks[0]["rank_value"] == ranks[1]["rank_value"] == 0.5  # sync_dist means over the replicas


@pytest.mark.timeout(240)
def test_dp2_fp16_matches_one_process_with_the_same_skipped_steps():
    fp16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**20}}
    single = _reference(fp16=True)
    ranks = _data_parallel(fp16)
    for rank in ranks:
        assert_same_overflow(rank, single)
    assert mean_losses(ranks) == pytest.approx(single["losses"], rel=FP16_REL)


@pytest.mark.timeout(240)
def test_an_overflow_on_one_rank_is_skipped_on_every_rank():
    fp16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**8}}
    ranks = _data_parallel(fp16, inject_rank=1)
    for result in ranks:
        assert result["skipped"] == 1
        assert result["scale"] == 2.0**7
        assert torch.equal(result["weights"][3], result["weights"][2])  # the step with the inf did nothing
        assert not torch.equal(result["weights"][4], result["weights"][3])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[1]["weights"], strict=True))


# -- launching ---------------------------------------------------------------------------------------------------

_FORK_SCRIPT = textwrap.dedent(
    """
    import torch, lightning.pytorch as pl
    import lightning_smp
    from tests.models import TinyRegressor

    torch.set_num_threads(1)
    model = TinyRegressor()
    before = model.net[0].weight.detach().clone()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="smp_fp16_fork", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    # the fork launcher hands rank 0's trained weights back to this process
    print("world_size", trainer.world_size, "trained", not torch.equal(before, model.net[0].weight.float()))
    """
)


@pytest.mark.timeout(150)
def test_the_fork_launched_name_trains_on_two_processes():
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "."}
    result = run_process([sys.executable, "-c", _FORK_SCRIPT], timeout=140, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world_size 2 trained True" in result.stdout
    assert "`max_steps=3` reached" in result.stderr


def test_every_smp_setting_is_a_keyword_of_the_strategy_with_the_configs_default():
    # SMPConfig is the one list of settings; the strategy repeats them as keywords only so that LightningCLI and IDEs
    # see each one, and this keeps the two from drifting apart
    keywords = inspect.signature(SMPStrategy.__init__).parameters
    for setting in dataclasses.fields(SMPConfig):
        assert setting.name in keywords, f"SMPStrategy has no keyword {setting.name!r}: add it to its signature"
        default = setting.default if setting.default is not dataclasses.MISSING else setting.default_factory()
        assert keywords[setting.name].default == default, setting.name
