"""Sharded checkpoints: resume, resharding, consolidation, atomic saves and the errors a bad checkpoint gives.

Process launches are expensive on the shared CPUs, so three jobs do all the work and the tests read their results:
a four-rank job trains a small GPT under pp=2 x tp=2 and resumes it; a two-rank job trains and resumes data-parallel
runs, fails a save, and resumes the GPT under tp=2 and pp=2; a one-rank job resumes both on one device. A
checkpoint-level round trip of hand-made tensor-parallel shards (packed q/k/v blocks, Adam moments) runs inside them.
"""

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.optim.lr_scheduler import StepLR

from lightning_smp import SMPStrategy, checkpoint, consolidate_checkpoint, smp
from lightning_smp.checkpoint import CheckpointError, asynchronous, loading, storage
from lightning_smp.checkpoint.dcp_adapter import flat_range_boxes, stored
from lightning_smp.consolidate_checkpoint import main as consolidate_main
from lightning_smp.master_shard import FlatPiece
from lightning_smp.placement import TPShard, place_tp_shard
from lightning_smp.tensor_parallel.shard import ShardSpec, slice_shard
from tests.distributed import run_distributed
from tests.gpt import AdamWGPT
from tests.models import TinyRegressor, quiet_trainer
from tests.parity import FP16_REL, mean_losses, one_process

STEPS_PER_EPOCH = 4  # 64 samples, 2 ranks x 8 (or 1 rank x 16) per step
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**12, "scale_window": 3}}


class _Model(TinyRegressor):
    """AdamW + a per-step StepLR, so optimizer state, LR schedule and (fp16) loss scale all cross the resume."""

    def __init__(self, hidden: int = 16, dropout: float = 0.0, batch_size: int = 8) -> None:
        super().__init__(hidden=hidden, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), batch_size=batch_size)
        if dropout:
            self.net.insert(2, nn.Dropout(dropout))  # its masks come from the RNG the checkpoint carries

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _trainer(strategy_kwargs, dirpath, max_epochs, devices):
    return quiet_trainer(
        SMPStrategy(**strategy_kwargs),
        devices=devices,
        max_epochs=max_epochs,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=dirpath, save_top_k=-1, save_last=True)],
    )


def _fit(strategy_kwargs, dirpath, *, devices, batch_size=8, dropout=0.0, hidden=16, ckpt_path=None, **kwargs):
    torch.manual_seed(0)
    model = _Model(hidden=hidden, dropout=dropout, batch_size=batch_size)
    trainer = _trainer(strategy_kwargs, dirpath, kwargs.get("max_epochs", 3), devices)
    trainer.callbacks.extend(kwargs.get("callbacks", ()))
    trainer.fit(model, ckpt_path=ckpt_path)
    weights = checkpoint.model_state_dict(model, trainer.strategy.optimizers)
    return trainer, model, {"losses": model.losses, "weights": {k: v.float().clone() for k, v in weights.items()}}


def _dp2_job(rank, root):
    root = Path(root)
    results = {}
    for name, kwargs, dropout in (("fp32", {}, 0.1), ("fp16", FP16, 0.0)):
        trainer, model, full = _fit(kwargs, root / name, devices=2, dropout=dropout)
        _, _, resumed = _fit(
            kwargs, root / name / "resumed", devices=2, dropout=dropout, ckpt_path=root / name / "epoch=0-step=4.ckpt"
        )
        model.eval()
        full["outputs"] = model(torch.linspace(-1, 1, 40).view(5, 8).to(next(model.parameters()).dtype)).float()
        results[name] = {"full": full, "resumed": resumed}
    results["failed_save"] = _fail_a_save(rank, trainer, root / "fp16")
    results["gpt"] = _resume_gpt(["tp2", "pp2"], root)
    _save_tensor_parallel(rank, root / "tp.ckpt")
    return results


def _write_half_then_fail(writer, plan, planner):
    """Rank 1's shard writer: half a file, then an error, as when a disk fills or a node dies mid-save."""
    (Path(writer.path) / "__1_0.distcp").write_bytes(b"half a shard")
    raise OSError("disk full (simulated)")


def _fail_a_save(rank, trainer, directory):
    """Overwrite last.ckpt with different weights while rank 1's write fails; last.ckpt must stay as it was."""
    for optimizer in trainer.strategy.optimizers:
        with torch.no_grad():
            for master in optimizer.master_params():
                master.mul_(2.0)  # what a successful save would write
    original = FileSystemWriter.write_data
    if rank == 1:
        FileSystemWriter.write_data = _write_half_then_fail
    try:
        trainer.save_checkpoint(directory / "last.ckpt")
        error = None
    except Exception as exception:
        error = f"{type(exception).__name__}: {exception}"
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()
    return {"error": error, "leftovers": sorted(p.name for p in directory.iterdir() if "partial" in p.name)}


# -- a small GPT under pipeline and tensor parallelism ---------------------------------------------------------

GPT_FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**10, "scale_window": 3}}
GPT_LAYOUTS = {
    "pp2_tp2": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2},
    "tp2": {"tensor_parallel_degree": 2},
    "pp2": {"pipeline_parallel_degree": 2, "microbatches": 2},
    "one_device": {},
}


class _StepLosses(Callback):
    """The step's loss as every rank sees it (a pipeline's last stage broadcasts it)."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit_gpt(layout, dirpath, ckpt_path=None):
    torch.manual_seed(0)
    losses = _StepLosses()
    trainer = _trainer({**GPT_LAYOUTS[layout], **GPT_FP16}, dirpath, 2, int(os.environ["WORLD_SIZE"]))
    trainer.callbacks.append(losses)
    trainer.fit(AdamWGPT(), ckpt_path=ckpt_path)
    return losses.losses


def _pp2_tp2_job(rank, root):
    """The uninterrupted run, and its resume under the same layout."""
    gpt = Path(root) / "gpt"
    return {
        "full": _fit_gpt("pp2_tp2", gpt),
        "resumed": _fit_gpt("pp2_tp2", gpt / "resumed", gpt / "epoch=0-step=4.ckpt"),
    }


def _resume_gpt(layouts, root):
    gpt = Path(root) / "gpt"
    return {layout: _fit_gpt(layout, gpt / layout, gpt / "epoch=0-step=4.ckpt") for layout in layouts}


# -- tensor-parallel shards, by hand ---------------------------------------------------------------------------


def _slice(whole, dim, blocks, index, parts):
    return torch.cat([block.chunk(parts, dim=dim)[index] for block in whole.chunk(blocks, dim=dim)], dim=dim)


_TP_SPECS = {"qkv": (0, 3), "row": (1, 1)}  # name -> (dim, blocks); "bias" stays replicated


def _whole_module():
    generator = torch.Generator().manual_seed(1)
    module = nn.Module()
    module.qkv = nn.Parameter(torch.randn(12, 4, generator=generator))
    module.row = nn.Parameter(torch.randn(4, 6, generator=generator))
    module.bias = nn.Parameter(torch.randn(4, generator=generator))
    return module


def _adam_step(module, shard_of=None):
    """One AdamW step with fixed gradients (the slice of the whole gradient on a shard)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    grads = {name: p.detach() * 0.5 + 1 for name, p in _whole_module().named_parameters()}
    for name, param in module.named_parameters():
        param.grad = shard_of(name, grads[name]) if shard_of else grads[name]
    optimizer.step()
    return optimizer


def _sharded_module(rank):
    module = _whole_module()
    for name, (dim, blocks) in _TP_SPECS.items():
        piece = nn.Parameter(_slice(getattr(module, name).detach(), dim, blocks, rank, 2))
        place_tp_shard(piece, TPShard(dim, rank, 2, blocks))
        setattr(module, name, piece)
    return module


def _save_tensor_parallel(rank, path):
    """tp=2 over the two ranks: each holds its slices of qkv (packed, 3 blocks) and row, and the whole bias."""
    module = _sharded_module(rank)

    def shard_of(name, whole):
        return _slice(whole, *_TP_SPECS[name], rank, 2) if name in _TP_SPECS else whole

    optimizer = _adam_step(module, shard_of)
    state = {
        "state_dict": checkpoint.model_state_dict(module),
        "optimizer_states": [checkpoint.optimizer_state_dict(optimizer, module)],
    }
    checkpoint.save(state, path, module=module, run={"layout": {"dp": 1, "pp": 1, "tp": 2}})
    # and back into tp=2: each rank gets its own slices and their Adam moments
    fresh = _sharded_module(rank)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    checkpoint.load(path, module=fresh, optimizers=[fresh_optimizer], run={"layout": {"dp": 1, "pp": 1, "tp": 2}})
    for name, param in module.named_parameters():
        assert torch.equal(getattr(fresh, name), param), name
        assert torch.equal(fresh_optimizer.state[getattr(fresh, name)]["exp_avg"], optimizer.state[param]["exp_avg"])


# -- the one-rank job: a different layout ------------------------------------------------------------------------


def _dp1_job(rank, root):
    root = Path(root)
    results = {}
    # dp=2 -> dp=1, the global batch kept (2 x 8 -> 1 x 16)
    resume = root / "fp16" / "epoch=0-step=4.ckpt"
    _, _, results["dp1_fp16"] = _fit(FP16, root / "dp1", devices=1, batch_size=16, ckpt_path=resume)
    _, _, results["dp1_fp32_from_fp16"] = _fit({}, root / "dp1_fp32", devices=1, batch_size=16, ckpt_path=resume)
    bf16 = {"bf16": True}
    _, _, results["dp1_bf16_from_fp16"] = _fit(bf16, root / "dp1_bf16", devices=1, batch_size=16, ckpt_path=resume)
    # evaluation loads the weights alone (no optimizer): the fp32 run's final weights, into a fresh model
    model = _Model(dropout=0.1)
    _trainer({}, root / "v", 1, 1).validate(model, ckpt_path=root / "fp32" / "last.ckpt", verbose=False)
    results["validated_weights"] = _weights(model, model.trainer)
    # a plain single-file checkpoint (the consolidated fp32 masters) into an fp16 model
    plain = consolidate_checkpoint(root / "fp16" / "last.ckpt", root / "fp16_consolidated.ckpt")
    model = _Model()
    _trainer(FP16, root / "w", 1, 1).validate(model, ckpt_path=plain, verbose=False)
    results["validated_fp16_weights"] = _weights(model, model.trainer)
    results["different_model"] = _error_of(lambda: _fit(FP16, root / "x", devices=1, hidden=32, ckpt_path=resume))
    truncated = root / "truncated.ckpt"
    shutil.copytree(resume, truncated)
    with open(truncated / "__1_0.distcp", "r+b") as stream:
        stream.truncate(100)
    results["truncated"] = _error_of(lambda: _fit(FP16, root / "y", devices=1, ckpt_path=truncated))
    results["gpt"] = _resume_gpt(["one_device"], root)
    results["smp"] = _smp_facade_round_trip(root / "smp")
    # tp=2 -> one device: the whole tensors and the whole Adam state of the same step
    whole = _whole_module()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    checkpoint.load(root / "tp.ckpt", module=whole, optimizers=[optimizer], run={"layout": {"tp": 1}})
    reference_module = _whole_module()
    reference = _adam_step(reference_module)
    for name, param in whole.named_parameters():
        expected = getattr(reference_module, name)
        assert torch.equal(param, expected), name
        assert torch.equal(optimizer.state[param]["exp_avg"], reference.state[expected]["exp_avg"]), name
    return results


class _SmpSave(Callback):
    def __init__(self, path):
        self.path, self.weights = path, None

    def on_train_end(self, trainer, pl_module):
        for tag in ("first", "second"):  # keep one: "first" goes
            smp.save_checkpoint(self.path, tag, user_content={"tag": tag}, num_kept_partial_checkpoints=1)
        self.weights = _weights(pl_module, trainer)


class _SmpResume(Callback):
    def __init__(self, path):
        self.path, self.content, self.weights = path, None, None

    def on_fit_start(self, trainer, pl_module):
        self.content = smp.resume_from_checkpoint(self.path)
        self.weights = _weights(pl_module, trainer)


def _weights(module, trainer):
    return {k: v.float().clone() for k, v in checkpoint.model_state_dict(module, trainer.strategy.optimizers).items()}


def _smp_facade_round_trip(path):
    """smp.save_checkpoint at the end of one fit, smp.resume_from_checkpoint at the start of another."""
    save, resume = _SmpSave(str(path)), _SmpResume(str(path))
    _fit(FP16, path / "a", devices=1, batch_size=16, max_epochs=1, callbacks=[save])
    _fit(FP16, path / "b", devices=1, batch_size=16, max_epochs=1, callbacks=[resume])
    return {
        "content": resume.content,
        "same_weights": all(torch.equal(resume.weights[k], v) for k, v in save.weights.items()),
        "entries": sorted(p.name for p in path.iterdir() if p.name not in ("a", "b")),
    }


def _error_of(function):
    try:
        function()
    except CheckpointError as error:
        return str(error)
    return None


# -- the runs, once per module -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def pp2_tp2(root):
    return run_distributed(_pp2_tp2_job, 4, str(root), timeout=200)


@pytest.fixture(scope="module")
def dp2(root, pp2_tp2):
    return run_distributed(_dp2_job, 2, str(root), timeout=200)


@pytest.fixture(scope="module")
def dp1(root, dp2):
    return one_process(_dp1_job, str(root), timeout=150)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_resume_under_the_same_layout_continues_bit_identically(dp2, name):
    for rank in dp2:
        full, resumed = rank[name]["full"], rank[name]["resumed"]
        assert len(full["losses"]) == 3 * STEPS_PER_EPOCH
        assert resumed["losses"] == full["losses"][STEPS_PER_EPOCH:]  # exact floats, every step after the resume
        for key, value in full["weights"].items():
            assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.timeout(300)
def test_pp2_tp2_resume_under_the_same_layout_continues_bit_identically(pp2_tp2):
    for rank in pp2_tp2:
        assert len(rank["full"]) == 2 * STEPS_PER_EPOCH
        assert rank["resumed"] == rank["full"][STEPS_PER_EPOCH:]


@pytest.mark.timeout(300)
def test_pp2_tp2_resumes_under_tp2_pp2_and_one_device_within_fp16_tolerance(pp2_tp2, dp2, dp1):
    expected = pp2_tp2[0]["full"][STEPS_PER_EPOCH:]
    resumed = {**dp2[0]["gpt"], **dp1["gpt"]}
    assert set(resumed) == {"tp2", "pp2", "one_device"}
    for layout, losses in resumed.items():
        assert losses == pytest.approx(expected, rel=FP16_REL), layout


@pytest.mark.timeout(300)
def test_resume_from_dp2_on_one_device_continues_within_fp16_tolerance(dp2, dp1):
    expected = mean_losses([rank["fp16"]["full"] for rank in dp2])[STEPS_PER_EPOCH:]
    assert dp1["dp1_fp16"]["losses"] == pytest.approx(expected, rel=FP16_REL)
    # and with another precision: the fp32 and bf16 runs continue from the fp16 run's masters
    assert dp1["dp1_fp32_from_fp16"]["losses"] == pytest.approx(expected, rel=FP16_REL)
    assert dp1["dp1_bf16_from_fp16"]["losses"] == pytest.approx(expected, rel=5e-2)  # bf16 keeps 8 mantissa bits


@pytest.mark.timeout(300)
def test_validate_with_a_checkpoint_loads_the_weights(dp2, dp1):
    for key, value in dp2[0]["fp32"]["full"]["weights"].items():
        assert torch.equal(dp1["validated_weights"][key], value), key
    for key, value in dp2[0]["fp16"]["full"]["weights"].items():  # no optimizer, so no masters: fp16 parameters
        assert torch.equal(dp1["validated_fp16_weights"][key], value.half().float()), key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_consolidation_round_trips_into_the_single_device_model(dp2, root, tmp_path, name):
    source = root / name / "last.ckpt"
    if name == "fp32":
        target = consolidate_checkpoint(source, tmp_path / "model.ckpt")
    else:  # the command line's entry point
        assert consolidate_main([str(source), "--output_file", str(tmp_path / "model.ckpt")]) == 0
        target = tmp_path / "model.ckpt"
    consolidated = torch.load(target)  # weights_only: plain tensors and containers
    model = _Model(dropout=0.1 if name == "fp32" else 0.0)
    model.load_state_dict(consolidated["state_dict"], strict=True)
    full = dp2[0][name]["full"]
    for key, value in consolidated["state_dict"].items():
        assert value.dtype == torch.float32
        assert torch.equal(value, full["weights"][key]), key  # fp16: the fp32 masters, not the rounded params
    model.eval()
    outputs = model(torch.linspace(-1, 1, 40).view(5, 8))
    if name == "fp32":
        assert torch.equal(outputs, full["outputs"])
    else:
        torch.testing.assert_close(outputs, full["outputs"], rtol=2e-2, atol=2e-3)
    assert consolidated["global_step"] == 3 * STEPS_PER_EPOCH
    assert consolidated["lightning_smp"]["layout"]["dp"] == 2


@pytest.mark.timeout(300)
def test_tensor_parallel_shards_reshard_to_one_device(dp2, dp1, root, tmp_path):
    # the round trips ran inside the jobs (tp2 -> tp2 on two ranks, tp2 -> one device on one); consolidation too:
    consolidated = torch.load(consolidate_checkpoint(root / "tp.ckpt", tmp_path / "tp.pt"), weights_only=False)
    _whole_module().load_state_dict(consolidated["state_dict"], strict=True)
    reference = _whole_module()
    _adam_step(reference)  # the same step on the whole tensors
    for name, param in reference.named_parameters():
        assert torch.equal(consolidated["state_dict"][name], param.detach()), name


@pytest.mark.timeout(300)
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(dp2, root, tmp_path):
    for rank in dp2:
        assert "disk full (simulated)" in rank["failed_save"]["error"]  # every rank raised, none hung
        assert rank["failed_save"]["leftovers"] == []  # rank 0 deleted the half-written directory
    consolidated = torch.load(
        consolidate_checkpoint(root / "fp16" / "last.ckpt", tmp_path / "m.pt"), weights_only=False
    )
    for key, value in dp2[0]["fp16"]["full"]["weights"].items():
        assert torch.equal(consolidated["state_dict"][key], value), key  # the old weights, not the doubled ones


def test_a_crash_between_the_renames_falls_back_to_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    path.mkdir()
    (path / checkpoint.META_FILENAME).write_text("old")
    staging = tmp_path / ".last.ckpt.partial-1"
    staging.mkdir()
    (staging / checkpoint.META_FILENAME).write_text("new")
    calls = []
    real_replace = storage.os.replace

    def crash_on_second(source, destination):
        calls.append(source)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies between moving the old checkpoint aside and renaming the new
        real_replace(source, destination)

    monkeypatch.setattr(storage.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        storage.publish(staging, path)
    assert not path.exists()
    assert checkpoint.resolve(path) == tmp_path / "last.ckpt.previous"  # whole, and loaded with a warning
    monkeypatch.undo()
    storage.publish(staging, path)  # the next save of the same name completes the swap
    assert (path / checkpoint.META_FILENAME).read_text() == "new"
    assert not (tmp_path / "last.ckpt.previous").exists()


@pytest.mark.timeout(300)
def test_smp_save_checkpoint_and_resume_from_checkpoint_map_onto_the_same_checkpoints(dp1, tmp_path):
    assert dp1["smp"] == {"content": {"tag": "second"}, "same_weights": True, "entries": ["newest", "second_partial"]}
    with pytest.raises(RuntimeError, match=r"ckpt_path='.*/step_9_partial'"):  # outside a run: says how instead
        smp.resume_from_checkpoint(str(tmp_path), tag="step_9")


# -- errors -------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_loading_into_a_different_model_names_the_shapes(dp1):
    message = dp1["different_model"]
    assert "comes from a different model" in message
    assert "net.0.weight: (16, 8) in the checkpoint, (32, 8) in this model" in message


@pytest.mark.timeout(300)
def test_a_truncated_shard_is_named_on_every_rank_before_anything_loads(dp1):
    assert "__1_0.distcp (written by rank 1) is truncated: 100 bytes" in dp1["truncated"]


def _copy(root, tmp_path):
    return Path(shutil.copytree(root / "fp32" / "last.ckpt", tmp_path / "bad.ckpt"))


@pytest.mark.timeout(300)
def test_a_corrupted_shard_is_named(dp2, root, tmp_path):
    bad = _copy(root, tmp_path)
    data = bytearray((bad / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp \(written by rank 0\) is corrupted"):
        consolidate_checkpoint(bad, tmp_path / "out.pt")


@pytest.mark.timeout(300)
def test_a_missing_rank_file_is_named(dp2, root, tmp_path):
    bad = _copy(root, tmp_path)
    (bad / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__1_0.distcp \(written by rank 1\) is missing"):
        consolidate_checkpoint(bad, tmp_path / "out.pt")


@pytest.mark.timeout(300)
def test_an_unfinished_checkpoint_is_refused(dp2, root, tmp_path):
    bad = _copy(root, tmp_path)
    (bad / checkpoint.META_FILENAME).unlink()
    with pytest.raises(CheckpointError, match="not a complete lightning_smp checkpoint"):
        consolidate_checkpoint(bad, tmp_path / "out.pt")
    with pytest.raises(CheckpointError, match="There is no checkpoint at"):
        consolidate_checkpoint(tmp_path / "nothing.ckpt", tmp_path / "out.pt")


def test_names_the_checkpoint_lacks_or_has_extra_are_listed(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    saved = {
        f"model/{name}": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), [])
        for name, shape in {"net.0.weight": (16, 8), "net.0.bias": (16,), "head.weight": (1, 16)}.items()
    }
    metadata = Metadata(state_dict_metadata=saved)
    targets = loading._model_targets(TinyRegressor(), {})
    problems = loading._model_problems(targets, metadata, strict=True)
    problems += loading._unexpected_problems(metadata, set(targets))
    assert "this model has 2 entries the checkpoint lacks: net.2.weight, net.2.bias" in problems[0]
    assert "it has 1 entries this model lacks: head.weight" in problems[1]


# -- what a rank writes: flat pieces and tensor-parallel shards as chunks of the global tensor (pure) ---------------


def test_a_flat_range_is_contiguous_boxes_of_the_tensor():
    assert flat_range_boxes(torch.Size([3, 4]), 2, 9) == [
        (torch.Size([0, 2]), torch.Size([1, 2]), 0),
        (torch.Size([1, 0]), torch.Size([1, 4]), 2),
        (torch.Size([2, 0]), torch.Size([1, 3]), 6),
    ]
    for shape in ([7], [3, 5], [2, 3, 4], []):
        whole = torch.arange(math.prod(shape)).view(shape)
        for start in range(whole.numel() + 1):
            for end in range(start, whole.numel() + 1):
                covered = []
                for offsets, sizes, at in flat_range_boxes(whole.shape, start, end - start):
                    box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                    assert box.flatten().tolist() == list(range(start + at, start + at + box.numel()))
                    covered += box.flatten().tolist()
                assert covered == list(range(start, end))


@pytest.mark.parametrize("shard", [None, TPShard(dim=0, index=1, parts=2, blocks=3), TPShard(dim=1, index=0, parts=2)])
def test_a_replicas_flat_piece_of_a_tensor_parallel_shard_is_chunks_of_the_global_tensor(shard):
    whole = torch.arange(12 * 6.0).view(12, 6)
    local = whole if shard is None else slice_shard(whole, ShardSpec(shard.dim, shard.blocks), shard.index, 2)
    for start, end in ((0, local.numel()), (5, 17), (13, 14), (4, 4)):
        piece = FlatPiece(local.shape, start, local.flatten()[start:end].clone())
        chunks = stored(piece, shard)
        assert chunks.size() == whole.shape
        seen = []
        for item in chunks.__create_write_items__("w", None):
            offsets, sizes = item.index.offset, item.tensor_data.chunk.sizes
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            assert torch.equal(chunks.chunk(offsets), whole[region])  # each chunk holds the global tensor's values
            seen += chunks.chunk(offsets).flatten().tolist()
        assert sorted(seen) == sorted(piece.flat.tolist())  # every element of the piece, once


# -- asynchronous saves: the snapshot and the writer thread (pure) ------------------------------------------------


def test_an_asynchronous_snapshot_copies_every_tensor_and_chunk():
    weight = torch.arange(8.0).view(2, 4)
    chunks = stored(weight, TPShard(dim=0, parts=2, index=1))
    entries = {"model/w": weight, "model/c": chunks, "rng/0": {"torch": torch.ones(2), "python": (3, (1, 2), None)}}
    snapshot = asynchronous.snapshot(entries)
    weight.add_(100.0)  # training goes on changing the originals
    assert torch.equal(snapshot["model/w"], torch.arange(8.0).view(2, 4))
    assert torch.equal(chunks.chunk(torch.Size([2, 0])), weight)  # a view of the live tensor
    assert torch.equal(snapshot["model/c"].chunk(torch.Size([2, 0])), torch.arange(8.0).view(2, 4))  # a copy
    assert snapshot["model/c"].size() == chunks.size() and snapshot["rng/0"]["python"] == (3, (1, 2), None)


def test_an_asynchronous_save_that_failed_raises_at_the_next_wait_naming_the_fix():
    def fail():
        raise OSError("disk full (simulated)")

    asynchronous.submit(fail)
    with pytest.raises(CheckpointError, match=r"disk full \(simulated\).*async_checkpoint=False"):
        asynchronous.wait()
    asynchronous.wait()  # reported once
    done = []
    asynchronous.submit(lambda: done.append(1))
    asynchronous.wait()
    assert done == [1]
