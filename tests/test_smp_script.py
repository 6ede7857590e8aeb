"""smp v1 scripts run unchanged but for the import (`lightning_smp.smp.script`, `model`, `step`): ``smp.init``,
``smp.DistributedModel``, ``smp.DistributedOptimizer`` and ``@smp.step`` with ``model.backward(loss)``, trained in
every layout against the plain single-process torch run of the same model and data (`tests/parity.py`), checkpoints
resumed under another layout, and the mistakes a script can make.

`_script` is the training loop of AWS's examples, shrunk: the model built (under ``smp.model_creation``), wrapped,
its optimizer built over the wrapped model's parameters (or before wrapping, as the MNIST example does), the data
sharded by ``smp.dp_rank()`` / ``smp.dp_size()``, and per step ``train_step(model, inputs, targets)`` then
``optimizer.step()``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_smp import SMPStrategy, smp
from tests.distributed import run_distributed
from tests.gpt import VOCAB, ScriptGPT, ScriptLlama, token_batches
from tests.models import quiet_trainer
from tests.parity import FP16_REL, FP32_REL, mean_losses, single_device_run

STEPS, BATCH, LR = 4, 8, 1e-2  # BATCH: the global batch, read in shares by smp.dp_size() ranks
DATASET = TensorDataset(*token_batches(seed=3, samples=64))
TIMEOUT = 120.0


class _Recipe:
    """The reference's view of the script: its optimizer and its data, as `single_device_run` reads them."""

    replicas = 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(DATASET, batch_size=BATCH // self.replicas)


class _GPTRecipe(_Recipe, ScriptGPT):
    pass


class _LlamaRecipe(_Recipe, ScriptLlama):
    pass


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor], step: int = 0) -> Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB).float(), targets.reshape(-1))


def _reference(replicas: int, *, steps: int = STEPS, model: str = "gpt", **options: Any) -> dict:
    """The plain torch run of the script's ``model`` on the global batch (``replicas`` shares of it in order);
    ``options`` as `single_device_run` takes them (``fp16``, ``init_scale``, ``clip_norm``)."""
    _Recipe.replicas = replicas
    recipe = {"gpt": _GPTRecipe, "llama": _LlamaRecipe}[model]
    return single_device_run(recipe, _loss, steps=steps, replicas=replicas, **options)


@smp.step
def train_step(model: smp.DistributedModel, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    output = model(inputs)
    loss = F.cross_entropy(output.reshape(-1, VOCAB), targets.reshape(-1))
    model.backward(loss)
    return output, loss


@smp.step
def evaluation_step(model: smp.DistributedModel, inputs: Tensor, targets: Tensor) -> float:
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1)).item()


def _script(rank: int, config: dict, options: dict) -> dict:
    """An smp v1 training script: ``options`` says how it builds its optimizer (``"before_wrapping"``), whether it
    saves a checkpoint after a step (``"save_after"``, into ``"directory"``) or resumes from one (``"resume"``)."""
    smp.init(config)
    torch.manual_seed(0)
    if options.get("model") == "llama":
        model = ScriptLlama()  # builds itself under smp.model_creation
    else:
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            model = ScriptGPT()
    built_on_meta = next(model.parameters()).is_meta
    if options.get("before_wrapping"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model = smp.DistributedModel(model)
    else:
        model = smp.DistributedModel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    if options.get("smp_optimizer_defaults"):
        optimizer = smp.DistributedOptimizer(optimizer)  # smp's defaults: a static loss scale of 1.0
    else:
        scaling = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2**16}}
        optimizer = smp.DistributedOptimizer(optimizer, **scaling)
    # smp's data parallelism: every rank reads its share (smp.dp_*), a tensor-parallel group one with prescaled_batch
    shares, share = (
        (smp.rdp_size(), smp.rdp_rank()) if config.get("prescaled_batch") else (smp.dp_size(), smp.dp_rank())
    )
    sampler = DistributedSampler(DATASET, num_replicas=shares, rank=share, seed=0)
    loader = DataLoader(DATASET, batch_size=BATCH // shares, sampler=sampler)
    first = smp.resume_from_checkpoint(options["directory"])["step"] if options.get("resume") else 0
    losses = []
    for step, (inputs, targets) in enumerate(loader):
        if step >= options.get("steps", STEPS):
            break
        if step < first:
            continue
        optimizer.zero_grad()
        _, loss = train_step(model, inputs, targets)
        optimizer.step()
        losses.append(loss.reduce_mean().item())
        if step + 1 == options.get("save_after"):
            smp.save_checkpoint(options["directory"], tag=f"step{step + 1}", user_content={"step": step + 1})
    model.eval()
    with torch.no_grad():
        evaluation = evaluation_step(model, *next(iter(loader)))
    return {
        "losses": losses,
        "dp": share,  # the ranks reading one share of the data
        "skipped": float(getattr(optimizer, "skipped_steps", torch.tensor(0.0))),
        "scale": getattr(optimizer, "loss_scale", None) if config.get("fp16") else None,
        "evaluation": evaluation.outputs,
        "microbatches": smp.num_microbatches(),
        "built_on_meta": built_on_meta,
    }


def _run(world_size: int, config: dict, **options: object) -> list[dict]:
    return run_distributed(_script, world_size, config, options, timeout=TIMEOUT)


LAYOUTS = {  # name: (world size, smp config, data-parallel shares of the batch)
    "one process, smp defaults": (1, {}, 1),
    "dp2 m2": (2, {"microbatches": 2, "ddp": True}, 2),
    "tp2": (2, {"tensor_parallel_degree": 2}, 2),
    "pp2 interleaved m2": (2, {"pipeline_parallel_degree": 2, "microbatches": 2}, 1),
    "pp2 simple m4": (2, {"partitions": 2, "microbatches": 4, "pipeline": "simple"}, 1),
    "dp2 ZeRO-1": (2, {"shard_optimizer_state": True, "microbatches": 2}, 2),
    "sdp2": (2, {"sharded_data_parallel_degree": 2}, 2),  # clips at smp's sdp_gradient_clipping=1.0
    "tp2 prescaled_batch": (2, {"tensor_parallel_degree": 2, "prescaled_batch": True}, 1),
    "pp2 tp1 delayed init": (2, {"pipeline_parallel_degree": 2, "delayed_parameter_initialization": True}, 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_script_trains_as_the_single_process_torch_run(layout: str) -> None:
    world_size, config, shares = LAYOUTS[layout]
    runs = _run(world_size, config)
    reference = _reference(shares, clip_norm=1.0 if "sharded_data_parallel_degree" in config else None)
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(reference["losses"], rel=FP32_REL)
    assert runs[0]["microbatches"] == config.get("microbatches", 1)
    assert runs[0]["built_on_meta"] == config.get("delayed_parameter_initialization", False)
    assert len(runs[0]["evaluation"]) == config.get("microbatches", 1)  # a number per microbatch, as smp's
    assert all(run["evaluation"] == runs[0]["evaluation"] for run in runs if run["dp"] == runs[0]["dp"])


@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_a_transformers_llama_trains_in_a_script_as_the_torch_run(layout: str) -> None:
    pytest.importorskip("transformers")
    config = {"pipeline_parallel_degree": 2, "microbatches": 2} if layout == "pp2" else {"tensor_parallel_degree": 2}
    runs = _run(2, config, model="llama")
    reference = _reference(1 if layout == "pp2" else 2, model="llama")
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(reference["losses"], rel=FP32_REL)


def test_fp16_pp2_tp2_skips_the_steps_the_torch_run_skips() -> None:
    config = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2, "fp16": True}
    runs = _run(4, config)
    reference = _reference(2, fp16=True)
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(reference["losses"], rel=FP16_REL)
    for run in runs:
        assert (run["skipped"], run["scale"]) == (reference["skipped"], reference["scale"])


def test_fp16_dp2_with_the_optimizer_built_before_wrapping() -> None:
    runs = _run(2, {"fp16": True, "microbatches": 2}, before_wrapping=True)
    reference = _reference(2, fp16=True)
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(reference["losses"], rel=FP16_REL)
    assert runs[0]["skipped"] == reference["skipped"]


def test_fp16_with_smp_distributed_optimizers_defaults_trains_at_a_static_scale_of_one() -> None:
    runs = _run(2, {"fp16": True, "microbatches": 2}, smp_optimizer_defaults=True)
    reference = _reference(2, fp16=True, init_scale=1.0)  # a scale of 1 that nothing overflows at: static
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(reference["losses"], rel=FP16_REL)
    assert all((run["skipped"], run["scale"]) == (0.0, 1.0) for run in runs)


def test_a_pp2_checkpoint_resumes_at_tp2_as_the_uninterrupted_run(tmp_path: Path) -> None:
    directory = str(tmp_path / "checkpoints")
    _run(2, {"pipeline_parallel_degree": 2, "microbatches": 2}, save_after=2, directory=directory)
    assert (tmp_path / "checkpoints" / "newest").read_text().strip() == "step2"
    resumed = _run(2, {"tensor_parallel_degree": 2}, resume=True, directory=directory)
    reference = _reference(2)
    assert mean_losses(resumed, replica="dp", steps=STEPS - 2) == pytest.approx(reference["losses"][2:], rel=FP32_REL)


class LitScriptGPT(pl.LightningModule):
    """The script's model as a LightningModule, under the same parameter names: the Trainer's side of a checkpoint
    that goes from a script to a Trainer and back. It resumes the script's newest checkpoint when fit starts, trains
    on the batches the reference trains on at steps 2 and 3, and saves in smp's layout when training ends."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        gpt = ScriptGPT()
        self.embedding, self.layers, self.head = gpt.embedding, gpt.layers, gpt.head
        self.directory, self.losses = directory, []

    forward = ScriptGPT.forward

    def on_fit_start(self) -> None:
        assert smp.resume_from_checkpoint(self.directory) == {"step": 2}

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = _loss(self, batch)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self) -> None:
        smp.save_checkpoint(self.directory, tag="step4", user_content={"step": 4})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        order = list(DistributedSampler(DATASET, num_replicas=1, rank=0, seed=0))  # the reference's epoch 0
        batches = [DATASET[torch.tensor(order[step * BATCH : (step + 1) * BATCH])] for step in (2, 3)]
        return DataLoader(batches, batch_size=None)


def _trainer_steps_2_and_3(rank: int, directory: str) -> list[float]:
    model = LitScriptGPT(directory)
    quiet_trainer(SMPStrategy(), max_steps=2, use_distributed_sampler=False).fit(model)
    return model.losses


def test_a_checkpoint_goes_from_a_script_to_a_trainer_and_back(tmp_path: Path) -> None:
    directory = str(tmp_path)
    _run(2, {"pipeline_parallel_degree": 2, "microbatches": 2}, save_after=2, directory=directory)
    (trainer_losses,) = run_distributed(_trainer_steps_2_and_3, 1, directory, timeout=TIMEOUT)
    resumed = _run(2, {"tensor_parallel_degree": 2}, resume=True, directory=directory, steps=6)
    reference = _reference(1, steps=6)
    assert trainer_losses == pytest.approx(reference["losses"][2:4], rel=FP32_REL)
    assert mean_losses(resumed, replica="dp", steps=2) == pytest.approx(reference["losses"][4:6], rel=FP32_REL)


def _partial_files(rank: int, directory: str) -> dict:
    smp.init({"pipeline_parallel_degree": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(ScriptGPT())
    smp.save(model.local_state_dict(), os.path.join(directory, "model.pt"), partial=True)
    loaded = smp.load(os.path.join(directory, "model.pt"), partial=True)
    return {"same": all(torch.equal(loaded[k], v) for k, v in model.local_state_dict().items())}


def test_smp_save_and_load_write_one_file_per_model_parallel_rank(tmp_path: Path) -> None:
    runs = run_distributed(_partial_files, 2, str(tmp_path), timeout=TIMEOUT)
    assert all(run["same"] for run in runs)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.pt_0_0", "model.pt_1_0"]


def _mistakes(rank: int) -> dict:
    errors = {}
    with pytest.raises(RuntimeError, match=r"smp.init\(\) first") as error:
        smp.DistributedModel(ScriptGPT())
    errors["before init"] = str(error.value)
    smp.init({"microbatches": 2})
    with pytest.raises(RuntimeError, match="DistributedModel") as error:
        train_step(None, torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    errors["step before the model"] = str(error.value)
    model = smp.DistributedModel(ScriptGPT())
    with pytest.raises(RuntimeError, match=r"@smp\.step"):
        model.backward(torch.zeros(()))
    with pytest.raises(ValueError, match="microbatches=2 does not divide"):
        train_step(model, torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match="once per process"):
        smp.init()
    ids = torch.zeros(4, 8, dtype=torch.long)
    weights = torch.ones(VOCAB)  # not a batch: split in two it would be two halves of the classes
    samples, classes = weighted_step(model, ids, ids, weights=weights)
    errors["whole"] = (samples.outputs, classes.outputs)
    with pytest.raises(ValueError, match=r"input_split_axes=\{'inputs': 1\}.*move the batch axis"):
        smp.step(input_split_axes={"inputs": 1, "targets": 0})(evaluation_step)
    return errors


@smp.step(non_split_inputs=["weights"])
def weighted_step(model: smp.DistributedModel, inputs: Tensor, targets: Tensor, weights: Tensor) -> tuple[int, int]:
    return (inputs.shape[0], weights.shape[0])


def test_a_scripts_mistakes_end_in_errors_that_name_the_fix() -> None:
    (errors,) = run_distributed(_mistakes, 1, timeout=TIMEOUT)
    assert "smp.init(config)" in errors["before init"]
    assert "smp.DistributedModel(model)" in errors["step before the model"]
    assert errors["whole"] == ([2, 2], [VOCAB, VOCAB])  # non_split_inputs: whole in each of the two microbatches


def _under_mpirun(rank: int, config: dict) -> dict:
    """`_script` in a process launched as mpirun launches one (SageMaker's launcher for smp): Open MPI's
    ``OMPI_COMM_WORLD_*`` variables and the exported MASTER_ADDR / MASTER_PORT, none of torchrun's rank variables."""
    for ours, mpi in (
        ("RANK", "OMPI_COMM_WORLD_RANK"),
        ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
        ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ):
        os.environ[mpi] = os.environ.pop(ours)
    return _script(rank, config, {})


def test_a_script_launched_by_mpirun_trains_as_the_torch_run() -> None:
    runs = run_distributed(_under_mpirun, 2, {"microbatches": 2, "ddp": True}, timeout=TIMEOUT)
    assert sorted(run["dp"] for run in runs) == [0, 1]  # each process took its rank from Open MPI's variables
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(_reference(2)["losses"], rel=FP32_REL)


def test_the_config_comes_from_sm_hp_mp_parameters_as_in_smp() -> None:
    (run,) = run_distributed(
        _script, 1, {"microbatches": 4}, {}, timeout=TIMEOUT, env={"SM_HP_MP_PARAMETERS": '{"microbatches": 2}'}
    )
    assert run["microbatches"] == 2
