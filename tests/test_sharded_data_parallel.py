"""Sharded data parallelism (FSDP2) against the single-process run in plain torch (`tests.parity.single_device_run`)
and the same layout without sharding: losses, skipped steps, clip norms, the bytes of model state each rank holds,
and the errors a user can cause. Every sdp setting at its default (smp's: small parameters kept whole, every step
clipped to norm 1.0) on a GPT of torch transformer layers and on a Hugging Face Llama, against one process clipping
to the same norm."""

import functools
import os
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_smp import SMPStrategy, consolidate_checkpoint, smp
from lightning_smp.config import SMPConfig
from tests.distributed import init_gloo, launch_once, run_distributed, run_process
from tests.gpt import TinyGPT, llama_config, token_batches
from tests.models import TinyRegressor, quiet_trainer
from tests.parity import FP16_REL, FP32_REL, assert_same_overflow, mean_losses, one_process, single_device_run

STEPS = 10
CLIP = 0.5
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**18, "scale_window": 4}}
SHARDED = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": CLIP}
SDP_DEFAULT_CLIP = SMPConfig().sdp_gradient_clipping  # smp's 1.0: every sdp step clips to it
INIT_SCALE = 2.0**18
FP16_AS_ONE_DEVICE = {"fp16": True, "dynamic_loss_args": {"init_scale": INIT_SCALE}}  # tests.parity's scale rule


class _Recorded:
    """Records each step's loss and, when the optimizer is fp16/sharded-aware, the global norm it clips by."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if gradient_clip_val is None:
            return
        if hasattr(optimizer, "clip_master_grads"):
            self.norms.append(optimizer.clip_master_grads(gradient_clip_val).item())
        else:
            self.clip_gradients(optimizer, gradient_clip_val)


class _Regressor(_Recorded, TinyRegressor):
    def __init__(self, batch_size: int, num_samples: int = 256) -> None:
        # even sizes, so that every rank holds exactly half of every sharded parameter
        adamw = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
        super().__init__(8, 32, 2, optimizer=adamw, num_samples=num_samples, batch_size=batch_size)
        self.norms: list[float] = []


class _OnTokens(_Recorded):
    """Trains ``self.loss`` on fixed random tokens with AdamW, recording each step's loss."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.losses: list[float] = []
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(*token_batches(0, 128)), batch_size=self.batch_size
        )


class _GPT(_OnTokens, TinyGPT):
    pass


class _Llama(_OnTokens, pl.LightningModule):
    """A tiny Hugging Face Llama (grouped-query attention, its own tensor-parallel plan)."""

    def configure_model(self) -> None:
        if hasattr(self, "llama"):
            return
        import transformers

        torch.manual_seed(0)
        config = llama_config(
            hidden_size=32, intermediate_size=64, bos_token_id=0, eos_token_id=0, max_position_embeddings=2048
        )
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.llama = transformers.LlamaForCausalLM(config)

    def loss(self, batch):
        ids, target = batch
        return F.cross_entropy(self.llama(ids).logits.float().flatten(0, 1), target.flatten())


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _state_bytes(model, optimizer) -> int:
    """Bytes of this rank's model states, read from the live objects: parameters and their grads, fp32 masters and
    their grads (when the optimizer keeps a copy), and the optimizer state."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    masters = getattr(optimizer, "master_params", lambda: [])()
    own = {id(p) for p in model.parameters()}
    tensors += [t for m in masters if id(m) not in own for t in (m, m.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _trainer(strategy_kwargs: dict, clip: float | None = CLIP, **kwargs) -> pl.Trainer:
    devices = int(os.environ["WORLD_SIZE"])
    return quiet_trainer(
        SMPStrategy(**strategy_kwargs), devices=devices, gradient_clip_val=clip, num_sanity_val_steps=0, **kwargs
    )


def _fit(model, strategy_kwargs: dict, *, validate: bool = False, clip: float | None = CLIP) -> dict:
    trainer = _trainer(strategy_kwargs, clip, max_steps=STEPS)
    trainer.fit(model)
    # trainer.validate sets the trained (sharded) model up again, for evaluation
    val_loss = trainer.validate(model, verbose=False)[0]["val_loss"] if validate else None
    optimizer = trainer.strategy.optimizers[0]
    return {
        "losses": model.losses,
        "norms": model.norms,
        "skipped": optimizer.skipped_steps.item() if hasattr(optimizer, "skipped_steps") else None,
        "scale": optimizer.loss_scale if hasattr(optimizer, "loss_scale") else None,
        "state_bytes": _state_bytes(model, optimizer),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "val_loss": val_loss,
        "whole": sorted(name for name, p in model.named_parameters() if _local(p).shape == p.shape),
    }


def _data_parallel_runs(rank: int) -> dict:
    """dp2 and sdp2, fp32, fp16 and bf16, in one launch (the Trainers share the default group)."""
    torch.set_num_threads(1)
    init_gloo()
    runs = {}
    layouts = {"dp2": {}, "sdp2": SHARDED, "dp2_fp16": FP16, "sdp2_fp16": {**FP16, **SHARDED}}
    layouts |= {"dp2_bf16": {"bf16": True}, "sdp2_bf16": {"bf16": True, **SHARDED}}
    for name, kwargs in layouts.items():
        torch.manual_seed(0)
        runs[name] = _fit(_Regressor(batch_size=8), kwargs, validate=True)
    runs |= _at_the_defaults({})
    return runs


def _at_the_defaults(degrees: dict) -> dict:
    """The GPT (fp32 and fp16) and the Llama with every sdp setting at its default, and without sdp clipping to the
    same norm."""
    runs = {}
    for model, precision, suffix in ((_GPT, {}, ""), (_GPT, FP16_AS_ONE_DEVICE, "_fp16"), (_Llama, {}, "")):
        name = model.__name__.lstrip("_").lower() + suffix
        runs[f"dp_{name}"] = _fit(model(batch_size=4), {**degrees, **precision}, clip=SDP_DEFAULT_CLIP)
        sharded = {**degrees, **precision, "sharded_data_parallel_degree": 2}
        runs[f"sdp_{name}"] = _fit(model(batch_size=4), sharded, clip=None)
    return runs


def _four_rank_runs(rank: int) -> dict:
    """dp2 x tp2 and sdp2 x tp2 of a tied-head GPT (fp32 and fp16); dp4 and two replicas of sdp2 (HSDP) with one
    module kept whole by the persistence threshold (fp16); in one launch."""
    torch.set_num_threads(1)
    init_gloo()
    tp = {"tensor_parallel_degree": 2}
    # fp16 without the scale doubling back after 4 clean steps: at the doubled scale a rank's gradients (of its own
    # 4 samples) overflowed in step 9 where one process's (of all 16) did not, with or without sharding
    layouts = {"dp2tp2": tp, "sdp2tp2": {**tp, **SHARDED}, "dp2tp2_fp16": {**tp, **FP16_AS_ONE_DEVICE}}
    layouts["sdp2tp2_fp16"] = {**tp, **FP16_AS_ONE_DEVICE, **SHARDED}
    runs = {name: _fit(_GPT(batch_size=4), kwargs) for name, kwargs in layouts.items()}
    # under a threshold of 100 elements net.0.weight (8 x 32) is sharded, net.0.bias (32) and net.2 (32 x 2, 2) whole
    hybrid = {**FP16, **SHARDED, "sdp_param_persistence_threshold": 100}
    for name, kwargs in {"dp4_fp16": FP16, "hsdp_fp16": hybrid}.items():
        torch.manual_seed(0)
        runs[name] = _fit(_Regressor(batch_size=4), kwargs)
    runs |= _at_the_defaults(tp)
    return runs


def _launch(world: int) -> list[dict]:
    return launch_once(_data_parallel_runs if world == 2 else _four_rank_runs, world, timeout=500)


def _assert_same_training(ranks: list[dict], plain: str, sharded: str, *, fp16: bool, reference: dict) -> None:
    """The sharded run and the same layout without sharding both train as ``reference``, the single-process run in
    plain torch (losses; fp16: the same skipped steps); and the two agree on what one process does not record (the
    validation loss after a second set-up, the fp16 norms Lightning clips by)."""
    rel = FP16_REL if fp16 else FP32_REL
    for name in (plain, sharded):
        losses = mean_losses([rank[name] for rank in ranks], steps=STEPS)
        assert len(losses) == STEPS >= 10
        assert losses == pytest.approx(reference["losses"], rel=rel), name
    if fp16:
        assert reference["skipped"] >= 1  # the comparison covers the overflow path
    for rank in ranks:
        assert rank[sharded]["sharded"] and not rank[plain]["sharded"]
        if rank[plain]["val_loss"] is not None:  # trainer.validate after fit: the sharded model set up again
            assert rank[sharded]["val_loss"] == pytest.approx(rank[plain]["val_loss"], rel=rel)
        if fp16:
            assert_same_overflow(rank[sharded], reference)
            assert_same_overflow(rank[plain], reference)
        if fp16 and rank[sharded]["norms"]:  # both clipped through Lightning (not the sdp step alone)
            assert rank[sharded]["norms"] == pytest.approx(rank[plain]["norms"], rel=FP16_REL)
            assert max(rank[plain]["norms"]) > CLIP  # and the clipping path


def _mse(model, batch, step):
    return F.mse_loss(model(batch[0]), batch[1])


@functools.cache
def _one_device(model: str, *, replicas: int, fp16: bool = False, clip: float = CLIP, window: int = 1000) -> dict:
    """A launch's model in one process, in plain torch (`tests.parity.single_device_run`), on the union of
    ``replicas`` ranks' batches (every rank reads its own, tensor-parallel ones too: prescaled_batch=False), clipping
    every step to ``clip``; fp16 from `INIT_SCALE`, doubling after ``window`` clean steps. ``model``: "regressor"
    (8 samples a rank under dp2, 4 under dp4), "gpt" or "llama"."""

    def built() -> pl.LightningModule:
        if model == "regressor":
            return _Regressor(batch_size=16 // replicas)
        module = {"gpt": _GPT, "llama": _Llama}[model](batch_size=4)
        module.configure_model()
        return module

    loss = _mse if model == "regressor" else lambda module, batch, step: module.loss(batch)
    return single_device_run(
        built, loss, steps=STEPS, replicas=replicas, fp16=fp16, init_scale=INIT_SCALE, scale_window=window,
        clip_norm=clip,
    )  # fmt: skip


_WINDOW = FP16["dynamic_loss_args"]["scale_window"]


@pytest.mark.timeout(600)
def test_sdp2_fp32_matches_dp2():
    _assert_same_training(_launch(2), "dp2", "sdp2", fp16=False, reference=_one_device("regressor", replicas=2))


@pytest.mark.timeout(600)
def test_sdp2_fp16_matches_dp2_with_the_same_skipped_steps_and_clip_norms():
    reference = _one_device("regressor", replicas=2, fp16=True, window=_WINDOW)
    _assert_same_training(_launch(2), "dp2_fp16", "sdp2_fp16", fp16=True, reference=reference)


@pytest.mark.timeout(600)
def test_sdp2_bf16_matches_dp2_bf16():
    ranks = _launch(2)
    # bf16 keeps 8 mantissa bits, and dp2 all-reduces bf16 gradients where sdp2 reduces in fp32
    assert mean_losses([r["sdp2_bf16"] for r in ranks]) == pytest.approx(
        mean_losses([r["dp2_bf16"] for r in ranks]), rel=5e-2
    )
    assert all(rank["sdp2_bf16"]["skipped"] == 0 for rank in ranks)


@pytest.mark.timeout(600)
def test_sdp2_holds_about_half_the_model_states_of_dp2():
    for rank in _launch(2):
        assert rank["sdp2"]["state_bytes"] <= 0.55 * rank["dp2"]["state_bytes"]
        assert rank["sdp2_fp16"]["state_bytes"] <= 0.55 * rank["dp2_fp16"]["state_bytes"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("model", "fp16"), [("gpt", False), ("gpt", True), ("llama", False)])
def test_sdp2_at_its_defaults_matches_dp2_clipping_to_the_same_norm(model, fp16):
    suffix = "_fp16" if fp16 else ""
    reference = _one_device(model, replicas=2, fp16=fp16, clip=SDP_DEFAULT_CLIP)
    _assert_same_training(_launch(2), f"dp_{model}{suffix}", f"sdp_{model}{suffix}", fp16=fp16, reference=reference)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "fp16"), [(2, False), (2, True), (4, False), (4, True)])
def test_sdp_at_its_defaults_on_a_gpt_of_torch_layers_trains_as_one_device(world, fp16):
    """sdp2 (world 2) and sdp2 x tp2 (world 4, the head tied to the embedding) with every sdp setting at its default,
    against the single-process run clipping to the same norm: fp32 to 1e-5, fp16 with the same skipped steps."""
    run = "sdp_gpt_fp16" if fp16 else "sdp_gpt"
    # every rank reads its own batch: sdp2 x tp2's tensor-parallel ranks too (prescaled_batch=False)
    ranks = _launch(world)
    reference = _one_device("gpt", replicas=world, fp16=fp16, clip=SDP_DEFAULT_CLIP)
    losses = mean_losses([rank[run] for rank in ranks], steps=STEPS)
    assert losses == pytest.approx(reference["losses"], rel=FP16_REL if fp16 else FP32_REL)
    if fp16:
        assert reference["skipped"] >= 1  # the comparison covers the overflow path
        for rank in ranks:
            assert_same_overflow(rank[run], reference)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("model", "fp16"), [("gpt", False), ("gpt", True), ("llama", False)])
def test_sdp2_tp2_at_its_defaults_matches_dp2_tp2_clipping_to_the_same_norm(model, fp16):
    suffix = "_fp16" if fp16 else ""
    reference = _one_device(model, replicas=4, fp16=fp16, clip=SDP_DEFAULT_CLIP)
    _assert_same_training(_launch(4), f"dp_{model}{suffix}", f"sdp_{model}{suffix}", fp16=fp16, reference=reference)


@pytest.mark.timeout(600)
def test_two_replicas_of_sdp2_keep_small_parameters_whole_and_match_dp4():
    ranks = _launch(4)
    reference = _one_device("regressor", replicas=4, fp16=True, window=_WINDOW)
    _assert_same_training(ranks, "dp4_fp16", "hsdp_fp16", fp16=True, reference=reference)
    # each parameter below the threshold (100 elements) whole, in its unit: net.0's bias but not its weight
    assert all(rank["hsdp_fp16"]["whole"] == ["net.0.bias", "net.2.bias", "net.2.weight"] for rank in ranks)


@pytest.mark.timeout(600)
def test_sdp2_tp2_matches_dp2_tp2():
    ranks = _launch(4)
    _assert_same_training(ranks, "dp2tp2", "sdp2tp2", fp16=False, reference=_one_device("gpt", replicas=4))
    reference = _one_device("gpt", replicas=4, fp16=True)
    _assert_same_training(ranks, "dp2tp2_fp16", "sdp2tp2_fp16", fp16=True, reference=reference)


# -- checkpoints ---------------------------------------------------------------------------------------------------

STEPS_PER_EPOCH = 4  # 64 samples, 2 ranks x 8 (or 1 rank x 16) per step
SHARDED_FP16 = {**FP16, **SHARDED}


def _fit_epochs(strategy_kwargs: dict, dirpath: Path, *, batch_size: int, ckpt_path: Path | None = None) -> dict:
    torch.manual_seed(0)
    model = _Regressor(batch_size, num_samples=64)
    saving = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, save_last=True)
    trainer = _trainer(strategy_kwargs, max_epochs=3, enable_checkpointing=True, callbacks=[saving])
    trainer.fit(model, ckpt_path=ckpt_path)
    weights = {name: _full(p).float() for name, p in model.named_parameters()}  # collective under sharding
    return {"losses": model.losses, "weights": weights, "skipped": trainer.strategy.optimizers[0].skipped_steps.item()}


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def _sharded_checkpoint_job(rank: int, root: str) -> dict:
    """sdp2 fp16 for 3 epochs (a checkpoint each), and the same run resumed from the first one, at sdp2."""
    torch.set_num_threads(1)
    init_gloo()
    full = _fit_epochs(SHARDED_FP16, Path(root) / "full", batch_size=8)
    resumed = _fit_epochs(SHARDED_FP16, Path(root) / "resumed", batch_size=8, ckpt_path=Path(root) / "full" / _FIRST)
    return {"full": full, "resumed": resumed}


def _one_device_job(rank: int, root: str) -> dict:
    """The sdp2 checkpoint resumed on one device, without sharding (fp16 master weights), on the same batches."""
    return _fit_epochs(FP16, Path(root) / "one", batch_size=16, ckpt_path=Path(root) / "full" / _FIRST)


_FIRST = f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"


@pytest.mark.timeout(600)
def test_an_sdp2_checkpoint_resumes_at_sdp2_and_on_one_device_and_consolidates(tmp_path):
    ranks = run_distributed(_sharded_checkpoint_job, 2, str(tmp_path), timeout=500)
    one_device = one_process(_one_device_job, str(tmp_path), timeout=300)
    full = mean_losses([rank["full"] for rank in ranks])
    assert len(full) == 3 * STEPS_PER_EPOCH
    for rank in ranks:  # the same layout continues bit-identically
        assert rank["resumed"]["losses"] == rank["full"]["losses"][STEPS_PER_EPOCH:]
        assert rank["resumed"]["skipped"] == rank["full"]["skipped"]
        for name, value in rank["full"]["weights"].items():
            assert torch.equal(rank["resumed"]["weights"][name], value), name
    assert one_device["losses"] == pytest.approx(full[STEPS_PER_EPOCH:], rel=FP16_REL)
    consolidated = torch.load(consolidate_checkpoint(tmp_path / "full" / "last.ckpt", tmp_path / "model.ckpt"))
    model = _Regressor(8)
    model.load_state_dict(consolidated["state_dict"], strict=True)  # whole fp32 tensors, plain names
    for name, value in ranks[0]["full"]["weights"].items():
        assert torch.equal(consolidated["state_dict"][name], value), name


# -- teardown ------------------------------------------------------------------------------------------------------

_LAUNCHED_SCRIPT = textwrap.dedent(
    """
    import torch, lightning.pytorch as pl
    import lightning_smp
    from tests.models import TinyRegressor

    torch.set_num_threads(1)
    strategy = lightning_smp.SMPStrategy(fp16=True, sharded_data_parallel_degree=2, sdp_param_persistence_threshold=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyRegressor(8, 32, 2))
    print("rank", trainer.global_rank, "trained", flush=True)
    """
)


@pytest.mark.timeout(200)
def test_a_sharded_run_launched_by_lightning_exits_cleanly(tmp_path):
    # FSDP2's modules and DTensors hold the groups' mesh: every rank must still free them at exit without aborting
    script = tmp_path / "sharded_run.py"
    script.write_text(_LAUNCHED_SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    result = run_process([sys.executable, str(script)], timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 trained" in result.stdout and "rank 1 trained" in result.stdout
    assert "terminate called" not in result.stderr


# -- errors ------------------------------------------------------------------------------------------------------


def test_sdp_refuses_pipeline_parallelism_and_optimizer_state_sharding():
    with pytest.raises(ValueError, match="set pipeline_parallel_degree=1"):
        SMPConfig(sharded_data_parallel_degree=2, pipeline_parallel_degree=2)
    with pytest.raises(ValueError, match="set shard_optimizer_state=False"):
        SMPConfig(sharded_data_parallel_degree=2, shard_optimizer_state=True)


def test_sdp_degree_must_divide_the_data_parallel_degree():
    config = SMPConfig(sharded_data_parallel_degree=4, tensor_parallel_degree=2)
    with pytest.raises(ValueError, match=r"does not divide the data-parallel degree 2 .*degree=2"):
        config.data_parallel_degree(4)
    assert SMPConfig(sharded_data_parallel_degree=2, tensor_parallel_degree=2).data_parallel_degree(8) == 4


def test_sdp_settings_without_an_fsdp2_equivalent_warn():
    lines = SMPConfig(sharded_data_parallel_degree=2, sdp_reduce_bucket_size=1000).inactive_settings()
    assert len(lines) == 1 and "sdp_reduce_bucket_size" in lines[0] and "FSDP2" in lines[0]
    assert not SMPConfig(sharded_data_parallel_degree=2, sdp_param_persistence_threshold=0).inactive_settings()
