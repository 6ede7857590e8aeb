"""A consolidated checkpoint used as a user would, with no Trainer: loaded with ``strict=True`` into the plain
LightningModule (its ``configure_model`` asks ``smp.tp_size()``), and into a wrapped Hugging Face model directly
(`consolidated_state_dict`). Each checks the loaded model's loss on a held-out batch against the run's own
``trainer.validate`` on that batch.
"""

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, consolidate_checkpoint, consolidated_state_dict, smp
from lightning_smp.checkpoint import CheckpointError
from tests.distributed import run_distributed
from tests.gpt import TinyGPT, llama_config, token_batches
from tests.models import quiet_trainer

PP2_TP2 = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}
HELD_OUT = token_batches(seed=2, samples=8)


class _Training:
    """Trains and validates ``self.loss`` on token batches (mixed into a LightningModule that has ``loss``)."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _GPT(_Training, TinyGPT):
    """The tiny GPT with smp.nn's vocabulary-parallel embedding and LM head."""

    def __init__(self) -> None:
        super().__init__(vocab_parallel=True)


def _llama_config():
    return llama_config(pad_token_id=None)  # no padding row: every embedding row trains


class _Llama(_Training, pl.LightningModule):
    """A random-init ``LlamaForCausalLM`` wrapped as ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.model = LlamaForCausalLM(_llama_config())

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return _llama_loss(self.model, batch)


def _llama_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    ids, target = batch
    return F.cross_entropy(model(input_ids=ids).logits.float().flatten(0, 1), target.flatten())


# -- the runs ------------------------------------------------------------------------------------------------------


def _train_save_and_validate(rank: int, module: type[pl.LightningModule], strategy: dict, root: str) -> dict:
    """Train a few steps, save, validate on the held-out batch (the run's own loss on it); then, on rank 0, load
    the consolidated file into a new module after the run has ended (the facade answers from the run)."""
    torch.set_num_threads(1)
    model = module()
    trainer = quiet_trainer(SMPStrategy(**strategy), devices=int(os.environ["WORLD_SIZE"]), max_steps=4)
    trainer.fit(model, DataLoader(TensorDataset(*token_batches(seed=1, samples=32)), batch_size=8))
    trainer.save_checkpoint(Path(root) / "model.ckpt")
    (metrics,) = trainer.validate(model, DataLoader(TensorDataset(*HELD_OUT), batch_size=8), verbose=False)
    result = {"validated": float(metrics["val_loss"]), "tp_size_after_the_run": smp.tp_size()}
    if rank == 0:
        loaded = module.load_from_checkpoint(consolidate_checkpoint(Path(root) / "model.ckpt"))
        with torch.no_grad():
            result["loaded_after_the_run"] = loaded.loss(HELD_OUT).item()
    return result


def _run(module: type[pl.LightningModule], strategy: dict, world_size: int, root: Path) -> tuple[Path, dict]:
    results = run_distributed(_train_save_and_validate, world_size, module, strategy, str(root), timeout=400)
    assert len({result["validated"] for result in results}) == 1  # every rank reports the last stage's loss
    return root / "model.ckpt.consolidated", results[0]


@pytest.fixture(scope="module")
def gpt_pp2_tp2(tmp_path_factory) -> tuple[Path, dict]:
    return _run(_GPT, PP2_TP2, 4, tmp_path_factory.mktemp("gpt"))


@pytest.fixture(scope="module")
def llama_pp2(tmp_path_factory) -> tuple[Path, dict]:
    pytest.importorskip("transformers")
    return _run(_Llama, {"pipeline_parallel_degree": 2, "microbatches": 2}, 2, tmp_path_factory.mktemp("llama"))


# -- the plain LightningModule ---------------------------------------------------------------------------------------


def _load_where_no_run_started(rank: int, consolidated: str) -> dict:
    model = _GPT.load_from_checkpoint(consolidated)  # calls configure_model, then load_state_dict(strict=True)
    with torch.no_grad():
        return {"loss": model.loss(HELD_OUT).item(), "tp_size": smp.tp_size(), "initialized": smp.state.initialized}


@pytest.mark.timeout(500)
def test_load_from_checkpoint_outside_a_trainer_gives_the_runs_validation_loss(gpt_pp2_tp2):
    consolidated, run = gpt_pp2_tp2
    (fresh,) = run_distributed(_load_where_no_run_started, 1, str(consolidated), timeout=100)
    assert (fresh["tp_size"], fresh["initialized"]) == (1, False)  # the facade answers as one process
    assert fresh["loss"] == pytest.approx(run["validated"], rel=1e-5)
    # and in the run's own process once it has ended, where smp.tp_size() still says 2
    assert run["tp_size_after_the_run"] == 2
    assert run["loaded_after_the_run"] == pytest.approx(run["validated"], rel=1e-5)


@pytest.mark.timeout(500)
def test_configure_model_by_hand_then_a_strict_load(gpt_pp2_tp2):
    consolidated, run = gpt_pp2_tp2
    model = _GPT()
    model.configure_model()
    with torch.no_grad():
        untrained = model.loss(HELD_OUT).item()
    model.load_state_dict(consolidated_state_dict(consolidated), strict=True)
    with torch.no_grad():
        loss = model.loss(HELD_OUT).item()
    assert loss == pytest.approx(run["validated"], rel=1e-5)
    assert loss != pytest.approx(untrained, rel=1e-3)  # the checkpoint's trained weights, not the initial ones


@pytest.mark.timeout(500)
def test_consolidated_state_dict_names_the_fix(gpt_pp2_tp2, tmp_path):
    consolidated, _ = gpt_pp2_tp2
    with pytest.raises(CheckpointError, match=r"no entries under 'model\.'.*top-level names: blocks, head, norm, pos"):
        consolidated_state_dict(consolidated, "model")
    with pytest.raises(CheckpointError, match=r"is a sharded checkpoint.*consolidate it first"):
        consolidated_state_dict(consolidated.with_name("model.ckpt"))


# -- a wrapped Hugging Face model --------------------------------------------------------------------------------------


@pytest.mark.timeout(500)
def test_a_wrapped_transformers_model_loads_its_own_weights_and_generates(llama_pp2):
    from transformers import LlamaForCausalLM

    consolidated, run = llama_pp2
    llama = LlamaForCausalLM(_llama_config())
    llama.load_state_dict(consolidated_state_dict(consolidated, "model"), strict=True)
    llama.eval()
    with torch.no_grad():
        assert _llama_loss(llama, HELD_OUT).item() == pytest.approx(run["validated"], rel=1e-5)
        prompt = HELD_OUT[0][:2, :4]
        generated = llama.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        first_new = llama(input_ids=prompt).logits[:, -1].argmax(-1)
    assert generated.shape == (2, 8)
    assert torch.equal(generated[:, :4], prompt) and torch.equal(generated[:, 4], first_new)
