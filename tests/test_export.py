"""`export_hf` and `consolidate_checkpoint` from sharded checkpoints of every layout, used as a user would.

A tiny Hugging Face Llama (grouped-query attention, untied head) trained a few steps under one device, tp2, pp2,
dp2 with ``shard_optimizer_state``, sdp2, pp2 x tp2 and sdp2 x tp2 is exported; ``from_pretrained(out_dir)`` alone
loads it, its weights and logits equal the single-device run's, and it generates. Also: a tied-embedding Llama, a
module that is not a Hugging Face model (plain safetensors), an fp16 run exported in fp32 and bf16, progress lines,
the errors, and the memory both take: a Llama with a few large tensors saved under tp2 is exported and consolidated
in a process that measures its peak resident memory above where it started. Three launches (one, two and four
ranks) train and save everything; exports run in the test process.
"""

import functools
import json
import os
import shutil
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, cli, consolidate_checkpoint, consolidated_state_dict, export_hf
from lightning_smp.checkpoint import META_FILENAME, CheckpointError, consolidation, dcp_adapter, export
from lightning_smp.checkpoint.hugging_face import RECORD_KEY
from lightning_smp.checkpoint.names import model_state_dict, optimizer_state_dict
from lightning_smp.progress import Progress
from tests.distributed import return_freed_memory_at_once, run_distributed
from tests.gpt import TinyGPT, TinyLlama, token_batches
from tests.models import quiet_trainer
from tests.parity import FP32_REL, single_device_run

transformers = pytest.importorskip("transformers")

STEPS, BATCH = 3, 4
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**16}}
SDP = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}
PP2, TP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}, {"tensor_parallel_degree": 2}
LAYOUTS_2 = {"tp2": TP2, "pp2": PP2, "dp2_zero1": {"shard_optimizer_state": True}, "sdp2": SDP}
LAYOUTS_4 = {"pp2xtp2": {**PP2, **TP2}, "sdp2xtp2": {**SDP, **TP2}}
RESUMED = {"sdp2xtp2"}  # also resumed in the launch that saved it (the other layouts' resumes: test_checkpoint)
# how many ranks read their own batch (smp.dp_size(): each tensor-parallel rank too, prescaled_batch=False)
REPLICAS = {"one_device": 1, "tp2": 2, "pp2": 1, "dp2_zero1": 2, "sdp2": 2, "pp2xtp2": 2, "sdp2xtp2": 4}
# The memory model: an embedding and an LM head of 32 MiB each (fp32), the rest small.
BIG = {"vocab_size": 16384, "hidden_size": 512, "intermediate_size": 256, "num_hidden_layers": 1}
LARGEST = 16384 * 512 * 4


class _GPT(TinyGPT):
    """Not a Hugging Face model (a head tied to the token embedding): exported as plain safetensors."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*token_batches(seed=1, samples=32)), batch_size=BATCH)


# -- the runs --------------------------------------------------------------------------------------------------------


def _fit(module: pl.LightningModule, strategy: dict, path: Path, steps: int = STEPS) -> pl.Trainer:
    trainer = quiet_trainer(SMPStrategy(**strategy), devices=int(os.environ["WORLD_SIZE"]), max_steps=steps)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    return trainer


def _trained(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Tensor]:
    """The run's own weights, fp32 (the masters of an fp16 run), by name (one device: every one of them)."""
    return {k: v.float().clone() for k, v in model_state_dict(module, trainer.strategy.optimizers).items()}


def _one_device(rank: int, root: str) -> dict:
    torch.set_num_threads(1)
    root_path = Path(root)
    lines: list[str] = []
    dcp_adapter.Progress = functools.partial(Progress, interval=0.0, report=lines.append)  # this process only
    results = {}
    for name, module, strategy in [
        ("one_device", TinyLlama(), {}),
        ("tied", TinyLlama(tie_word_embeddings=True), {}),
        ("plain", _GPT(), {}),
        ("fp16", TinyLlama(), FP16),
    ]:
        trainer = _fit(module, strategy, root_path / f"{name}.ckpt")
        results[name] = _trained(module, trainer)
    results["save_progress"] = lines
    return results


def _layouts(rank: int, root: str, layouts: dict) -> dict:
    torch.set_num_threads(1)
    return_freed_memory_at_once()  # the export's and consolidation's peaks (`_measured`) count live tensors only
    for name, strategy in layouts.items():
        module = TinyLlama()
        trainer = _fit(module, strategy, Path(root) / f"{name}.ckpt")
        if name in RESUMED:
            _resumes_exactly(module, trainer, strategy, Path(root) / f"{name}.ckpt")
    if "tp2" not in layouts:
        return {}
    _fit(TinyLlama(**BIG), TP2, Path(root) / "big.ckpt", steps=1)
    result = _measured(Path(root)) if rank == 0 else {}
    dist.barrier()
    return result


def _resumes_exactly(module: pl.LightningModule, trainer: pl.Trainer, strategy: dict, path: Path) -> None:
    """The checkpoint restores every rank's own weights and optimizer state, bit for bit, in a new run."""
    resumed = TinyLlama()
    again = quiet_trainer(SMPStrategy(**strategy), devices=int(os.environ["WORLD_SIZE"]), max_steps=STEPS)
    again.fit(resumed, ckpt_path=path)  # restores, then stops: max_steps is reached
    for saved, restored in zip(_own_state(module, trainer), _own_state(resumed, again), strict=True):
        assert saved.keys() == restored.keys()
        for key, value in saved.items():
            assert torch.equal(value, restored[key]), key


def _own_state(module: pl.LightningModule, trainer: pl.Trainer) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """This rank's pieces of the weights and of the optimizer state, by name."""

    def own(value: Tensor) -> Tensor:
        return (value.to_local() if isinstance(value, DTensor) else value).detach().clone()

    weights = {name: own(value) for name, value in model_state_dict(module, trainer.strategy.optimizers).items()}
    (optimizer,) = trainer.strategy.optimizers
    state = optimizer_state_dict(optimizer, module)["state"]
    moments = {f"{n}/{k}": own(v) for n, values in state.items() for k, v in values.items() if isinstance(v, Tensor)}
    return weights, moments


def _measured(root: Path) -> dict:
    """Peak resident memory above the process's own while exporting and while consolidating ``big.ckpt``."""

    def growth(work) -> int:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
        before = _status("VmRSS")
        work()
        return _status("VmHWM") - before

    return {
        "export": growth(lambda: export_hf(root / "big.ckpt", root / "big_hf")),
        "consolidate": growth(lambda: consolidate_checkpoint(root / "big.ckpt", root / "big.pt")),
    }


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def one_device(root) -> dict:
    (result,) = run_distributed(_one_device, 1, str(root), timeout=400)
    return result


@pytest.fixture(scope="module")
def two_ranks(root) -> dict:
    return run_distributed(_layouts, 2, str(root), LAYOUTS_2, timeout=600)[0]


@pytest.fixture(scope="module")
def four_ranks(root) -> None:
    run_distributed(_layouts, 4, str(root), LAYOUTS_4, timeout=600)


@functools.cache
def _reference(replicas: int) -> dict[str, Tensor]:
    """The single-device run in plain PyTorch on the global batch: its trained weights, by the Llama's own names."""

    def build() -> TinyLlama:
        module = TinyLlama()
        module.configure_model()
        return module

    run = single_device_run(build, lambda model, batch, step: model.loss(batch), steps=STEPS, replicas=replicas)
    return {name.removeprefix("model."): value for name, value in run["weights"].items()}


def _exported(root: Path, name: str, **options) -> Path:
    out = root / f"{name}_hf_{'_'.join(f'{k}={v}' for k, v in options.items())}"
    shutil.rmtree(out, ignore_errors=True)
    return export_hf(root / f"{name}.ckpt", out, **options)


def _generates(model: torch.nn.Module) -> None:
    prompt = token_batches(seed=3, samples=2)[0][:, :4]
    generated = model.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert generated.shape == (2, 7) and torch.equal(generated[:, :4], prompt)


# -- every layout: from_pretrained alone, the single-device run's weights ----------------------------------------------


def _check_layout(root: Path, name: str) -> None:
    out = _exported(root, name, max_shard_size="20KB")  # several files and their index
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    llama = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.config.num_key_value_heads == 2
    weights = llama.state_dict()
    reference = _reference(REPLICAS[name])
    assert set(weights) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=FP32_REL, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    trained = TinyLlama()
    trained.configure_model()
    trained.model.load_state_dict(reference)
    ids = token_batches(seed=3, samples=4)[0]
    with torch.no_grad():
        torch.testing.assert_close(
            llama(input_ids=ids).logits, trained.model(input_ids=ids).logits, rtol=FP32_REL, atol=1e-5
        )
    _generates(llama)


@pytest.mark.timeout(600)
def test_one_device_export_loads_alone_and_is_the_runs_own_weights(root, one_device):
    _check_layout(root, "one_device")
    llama = transformers.AutoModelForCausalLM.from_pretrained(_exported(root, "one_device"))
    for key, value in one_device["one_device"].items():
        assert torch.equal(llama.state_dict()[key.removeprefix("model.")], value), key  # bit for bit


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_export_from_two_rank_layouts_equals_the_single_device_run(root, two_ranks, name):
    _check_layout(root, name)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_export_from_four_rank_layouts_equals_the_single_device_run(root, four_ranks, name):
    _check_layout(root, name)


@pytest.mark.timeout(600)
def test_the_files_are_what_save_pretrained_writes(root, one_device, tmp_path):
    module = TinyLlama()
    module.configure_model()
    module.model.load_state_dict(consolidated_state_dict(consolidate_checkpoint(root / "one_device.ckpt"), "model"))
    module.model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    ours = _exported(root, "one_device", max_shard_size="20KB")
    assert sorted(os.listdir(ours)) == sorted(os.listdir(tmp_path / "hf"))
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert index == json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    for name in ("config.json", "generation_config.json"):
        theirs = json.loads((tmp_path / "hf" / name).read_text())
        assert json.loads((ours / name).read_text()) == theirs, name


# -- tied embeddings, a module that is not a Hugging Face model, dtypes ------------------------------------------------


@pytest.mark.timeout(600)
def test_a_tied_embedding_is_written_once_and_ties_on_load(root, one_device):
    from safetensors import safe_open

    out = _exported(root, "tied")
    with safe_open(out / "model.safetensors", "pt") as files:
        names = set(files.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    llama = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    trained = one_device["tied"]
    assert torch.equal(llama.model.embed_tokens.weight, trained["model.model.embed_tokens.weight"])
    for key, value in trained.items():
        assert torch.equal(llama.state_dict()[key.removeprefix("model.")], value), key
    _generates(llama)


@pytest.mark.timeout(600)
def test_a_module_that_is_not_a_hugging_face_model_gets_its_state_dict_as_safetensors(root, one_device):
    from safetensors.torch import load_file

    out = _exported(root, "plain")
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # no config: there is no Hugging Face model
    loaded = load_file(out / "model.safetensors")
    assert set(loaded) == set(one_device["plain"])
    for key, value in one_device["plain"].items():
        assert torch.equal(loaded[key], value), key
    module = _GPT()
    module.configure_model()
    module.load_state_dict(loaded, strict=True)
    sharded = _exported(root, "plain", max_shard_size=4096)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(loaded) and len(set(index["weight_map"].values())) > 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [None, "float32", "bf16"])
def test_an_fp16_run_exports_its_fp32_masters_in_the_dtype_asked(root, one_device, dtype):
    out = _exported(root, "fp16", **({} if dtype is None else {"dtype": dtype}))
    expected = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert json.loads((out / "config.json").read_text())["dtype"] == str(expected).removeprefix("torch.")
    llama = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert llama.dtype == expected
    masters = one_device["fp16"]
    for key, value in masters.items():
        assert torch.equal(llama.state_dict()[key.removeprefix("model.")], value.to(expected)), key
    _generates(llama)


# -- progress ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_saving_consolidating_and_exporting_report_progress(root, one_device, tmp_path, monkeypatch):
    saved = one_device["save_progress"]  # one line per tensor written (interval 0), then the closing one
    assert saved[0].startswith("lightning_smp: saving one_device.ckpt (rank 0's files): ") and "/s" in saved[0]
    assert saved[-1].startswith("lightning_smp: saving fp16.ckpt (rank 0's files): done, ")
    lines: list[str] = []
    reporting = functools.partial(Progress, interval=0.0, report=lines.append)
    monkeypatch.setattr(consolidation, "Progress", reporting)
    monkeypatch.setattr(export, "Progress", reporting)
    consolidate_checkpoint(root / "one_device.ckpt", tmp_path / "one.pt")
    assert lines[-1].startswith("lightning_smp: consolidating one_device.ckpt into one.pt: done, ")
    total = sum(v.numel() * 4 for v in one_device["one_device"].values())
    assert f"of {_size(total)} (100%)" in lines[-2]
    lines.clear()
    export_hf(root / "one_device.ckpt", tmp_path / "hf")
    assert lines[0].startswith(f"lightning_smp: exporting one_device.ckpt to {tmp_path / 'hf'}: ")
    assert lines[-1].startswith(f"lightning_smp: exporting one_device.ckpt to {tmp_path / 'hf'}: done, ")


def _size(count: int) -> str:
    from lightning_smp.memory import format_bytes

    return format_bytes(count)


# -- memory -----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
def test_export_and_consolidation_hold_about_one_tensor_at_a_time(root, two_ranks):
    whole = sum(v.numel() * v.element_size() for v in _safetensors(root / "big_hf").values())
    assert whole > 2 * LARGEST  # holding every tensor at once would show
    for work in ("export", "consolidate"):
        assert two_ranks[work] <= 1.2 * LARGEST, (work, two_ranks[work])
    assert torch.load(root / "big.pt", mmap=True)["state_dict"]["model.lm_head.weight"].shape == (16384, 512)


def _safetensors(directory: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


# -- the command and the errors ---------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_the_command_exports_and_names_a_bad_dtype(root, one_device, tmp_path, capsys):
    cli.main(["export-hf", str(root / "one_device.ckpt"), str(tmp_path / "out"), "--dtype", "bfloat16"])
    assert "Exported" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as exited:
        cli.main(["export-hf", str(root / "one_device.ckpt"), str(tmp_path / "other"), "--dtype", "fp8"])
    assert exited.value.code == 1
    assert (
        "error: dtype='fp8' is not one export_hf writes; use one of float32, fp32, bfloat16" in capsys.readouterr().err
    )
    assert not (tmp_path / "other").exists()


@pytest.mark.timeout(600)
def test_user_mistakes_name_the_fix(root, one_device, tmp_path):
    source = root / "one_device.ckpt"
    with pytest.raises(CheckpointError, match="There is no checkpoint at"):
        export_hf(tmp_path / "missing.ckpt", tmp_path / "a")
    consolidated = consolidate_checkpoint(source, tmp_path / "file.ckpt")
    with pytest.raises(CheckpointError, match=r"it is a file, not a sharded lightning_smp checkpoint.*Pass that dir"):
        export_hf(consolidated, tmp_path / "a")
    with pytest.raises(ValueError, match=r"max_shard_size='5 parsecs' is not a size; give bytes with a unit"):
        export_hf(source, tmp_path / "a", max_shard_size="5 parsecs")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"it exists and is not an empty directory\. Export into a new"):
        export_hf(source, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["tokenizer.json"]
    old = tmp_path / "old.ckpt"  # as an earlier lightning_smp saved it: no record of the Hugging Face model
    shutil.copytree(source, old)
    meta = torch.load(old / META_FILENAME, weights_only=False)
    del meta["lightning_smp"][RECORD_KEY]
    torch.save(meta, old / META_FILENAME)
    with pytest.raises(CheckpointError, match=r"saved by an earlier lightning_smp.*Resume from it and save again"):
        export_hf(old, tmp_path / "a")
    assert not (tmp_path / "a").exists()
