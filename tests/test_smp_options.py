"""AWS's own smp_options, as its example notebooks fill them for a 2-GPU run, train through both SageMaker entry
points: ``SMPStrategy.from_smp_options(smp_options)`` and the ``SM_HP_MP_PARAMETERS`` variable a SageMaker job sets
from them (with a bare ``SMPStrategy()``). Both must build the same config and train the same numbers; the GPT-2 one
(tensor parallelism 2, ``prescaled_batch`` False, fp16 at smp's default loss scale) the numbers of one device trained
on the union of the two ranks' batches.

Sources (aws/amazon-sagemaker-examples, training/distributed_training/pytorch/model_parallel/gpt2):
``smp-train-gpt-simple.ipynb`` (tensor parallelism, its ``gpt2-small`` settings on 2 GPUs instead of 8) and
``smp-train-gpt-simple-sharded-data-parallel.ipynb`` (sharded data parallelism of degree 2 instead of 32);
``train_gpt_simple.py``'s own ``smp.init`` dict, with its argument defaults, for the config alone.
"""

import json
import os

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_smp import SMPConfig, SMPStrategy, smp
from tests.distributed import run_distributed
from tests.gpt import TinyGPT, token_batches
from tests.models import quiet_trainer
from tests.parity import FP16_REL, assert_same_overflow, single_device_run

STEPS = 24  # smp's first loss scale, 2**32, overflows for 17 of them: 7 updates

GPT2_NOTEBOOK = {
    "enabled": True,
    "parameters": {
        "ddp": True,
        "tensor_parallel_degree": 2,
        "partitions": 1,
        "shard_optimizer_state": True,
        "prescaled_batch": False,
        "fp16": True,
        "optimize": "speed",
        "auto_partition": False,
        "default_partition": 0,
    },
}
SDP_NOTEBOOK = {
    "enabled": True,
    "parameters": {
        "ddp": True,
        "skip_tracing": True,
        "delayed_parameter_initialization": True,
        "offload_activations": False,
        "activation_loading_horizon": 4,
        "sharded_data_parallel_degree": 2,
        "fp16": False,
        "bf16": True,
        "partitions": 1,
    },
}
GPT2_SCRIPT = {  # train_gpt_simple.py's smp.init(smp_config) with its argument defaults, tensor parallelism 2
    "ddp": True,
    "tensor_parallel_degree": 2,
    "pipeline_parallel_degree": 1,
    "microbatches": 1,
    "shard_optimizer_state": False,
    "prescaled_batch": False,
    "fp16": True,
    "bf16": False,
    "offload_activations": False,
    "delayed_parameter_initialization": False,
    "optimize": "speed",
    "placement_strategy": "cluster",
    "activation_loading_horizon": 4,
    "skip_tracing": False,
    "auto_partition": True,
    "default_partition": 0,
    "static_mode": False,
    "fast_mode": False,
    "sharded_data_parallel_degree": 1,
    "ddp_dist_backend": "auto",
    "sdp_hierarchical_allgather": False,
    "sdp_gradient_clipping": 1.0,
}


def test_the_scripts_smp_init_dict_is_accepted_and_only_inactive_settings_warn():
    with pytest.warns(UserWarning) as record:
        strategy = SMPStrategy.from_smp_options(GPT2_SCRIPT)
    config = strategy.config
    assert (config.tensor_parallel_degree, config.fp16, config.default_partition) == (2, True, 0)
    warned = sorted(str(w.message).split("=")[0] for w in record)
    assert warned == ["ddp", "sdp_hierarchical_allgather"]  # the settings changed from smp's defaults that do nothing


class _NotebookGPT(TinyGPT):
    """TinyGPT fed as the notebooks' script feeds GPT-2: a DistributedSampler over smp.dp_rank() / smp.dp_size()."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(*token_batches(1, 64))
        sampler = DistributedSampler(dataset, num_replicas=smp.dp_size(), rank=smp.dp_rank(), seed=0)
        return DataLoader(dataset, batch_size=4, sampler=sampler)


def _build() -> _NotebookGPT:
    model = _NotebookGPT()
    model.configure_model()
    return model


def _train(strategy: SMPStrategy) -> dict:
    torch.manual_seed(0)
    model = _NotebookGPT()
    trainer = quiet_trainer(strategy, devices=int(os.environ["WORLD_SIZE"]), max_steps=STEPS)
    losses: list[float] = []
    model.on_train_batch_end = lambda outputs, batch, batch_idx: losses.append(outputs["loss"].item())
    trainer.fit(model)
    optimizer = trainer.strategy.optimizers[0]
    overflow = (
        {"skipped": optimizer.skipped_steps.item(), "scale": optimizer.loss_scale} if strategy.config.fp16 else {}
    )
    return {"losses": losses, "config": strategy.config, "global_step": trainer.global_step, **overflow}


def _both_entry_points(rank: int, smp_options: dict) -> dict:
    """The notebook's dict through from_smp_options, then through SM_HP_MP_PARAMETERS with a bare SMPStrategy."""
    pasted = _train(SMPStrategy.from_smp_options(smp_options))
    os.environ["SM_HP_MP_PARAMETERS"] = json.dumps(smp_options["parameters"])
    try:
        from_job = _train(SMPStrategy())
    finally:
        del os.environ["SM_HP_MP_PARAMETERS"]
    return {"pasted": pasted, "from_job": from_job}


def _check_trains_through_both(ranks: list[dict], smp_options: dict) -> None:
    expected = SMPConfig.from_smp_options(smp_options)
    for rank in ranks:
        pasted, from_job = rank["pasted"], rank["from_job"]
        assert pasted["config"] == from_job["config"] == expected
        assert pasted["global_step"] == from_job["global_step"] == STEPS
        assert all(torch.isfinite(torch.tensor(pasted["losses"])))
        assert pasted["losses"] == from_job["losses"]  # the same job, whichever way its parameters came


@pytest.mark.timeout(600)
def test_the_gpt2_notebooks_smp_options_train_through_both_entry_points():
    ranks = run_distributed(_both_entry_points, 2, GPT2_NOTEBOOK, timeout=500)
    _check_trains_through_both(ranks, GPT2_NOTEBOOK)
    assert ranks[0]["pasted"]["config"].shard_optimizer_state and ranks[0]["pasted"]["config"].fp16
    # each rank read its own batch (the notebook's sampler over smp.dp_size() = 2): one device on both batches
    reference = single_device_run(
        _build, lambda model, batch, step: model.loss(batch), steps=STEPS, replicas=2, fp16=True, init_scale=2.0**32
    )
    assert 0 < reference["skipped"] < STEPS  # overflows and updates both compared
    for rank in ranks:
        assert_same_overflow(rank["pasted"], reference)
        assert rank["pasted"]["losses"] == pytest.approx(reference["losses"], rel=FP16_REL)


@pytest.mark.timeout(600)
def test_the_sharded_data_parallel_notebooks_smp_options_train_through_both_entry_points():
    ranks = run_distributed(_both_entry_points, 2, SDP_NOTEBOOK, timeout=500)
    _check_trains_through_both(ranks, SDP_NOTEBOOK)
    assert ranks[0]["pasted"]["config"].sharded_data_parallel_degree == 2
