"""Pretrained weights into a split model under delayed initialisation, against one device (gloo, CPU).

A tiny Llama (grouped-query attention, an untied head; a tied one too) saved with ``save_pretrained`` in several
safetensors shards is loaded with ``from_pretrained`` in ``configure_model`` under ``smp.model_creation`` and
``delayed_parameter_initialization=True``: after setup each rank holds exactly its slices of the checkpoint (its
tensor-parallel pieces, its stage, its sharded rows; compared bit for bit with a single-device ``from_pretrained``),
and trains as one device does (first-step loss within 1e-6, the rest within 1e-5 in fp32; fp16: the same skipped
steps, within 2e-2). A plain state-dict file (`lightning_smp.load_weights`) and a consolidated checkpoint
(``trainer.fit(ckpt_path=...)``) load under pp2 x tp2; a rank loading a bigger model holds its share, not the whole.
Every replica reads the same batches (``use_distributed_sampler=False``), so each layout's loss is one device's.
"""

import os
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, consolidate_checkpoint, load_weights, smp
from lightning_smp.checkpoint import CheckpointError
from lightning_smp.delayed_init import deferred_init
from lightning_smp.delayed_init.huggingface import PretrainedLoadingError
from lightning_smp.materialization import cut_of
from lightning_smp.placement import Cut
from lightning_smp.weight_files import open_state_dict
from tests.distributed import run_distributed
from tests.gpt import TinyGPT, token_batches
from tests.models import quiet_trainer
from tests.parity import single_device_run

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 4, 4, 8, 64
LLAMA = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
# a Llama big enough that holding it whole shows in a process's peak memory: 12 x 1.8M + 0.5M parameters, 87 MB
BIG = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 2048, "num_hidden_layers": 12}
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**20, "scale_window": 4}}
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
TP2 = {"tensor_parallel_degree": 2}
SDP2 = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 1e9}
_SAME_BATCHES = {"use_distributed_sampler": False}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Hugging Face directories (several safetensors shards and their index) of the Llamas, a plain safetensors
    state dict of the tiny GPT, and a consolidated checkpoint of the tiny GPT after two steps."""
    root = tmp_path_factory.mktemp("pretrained")
    paths = {}
    for name, config, shard in (("llama", LLAMA, "20KB"), ("tied", LLAMA, "20KB"), ("big", BIG, "8MB")):
        torch.manual_seed(1)
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**config, **HEADS, **TOKENS, tie_word_embeddings=name == "tied")
        )
        model.save_pretrained(root / name, max_shard_size=shard)
        assert len(list((root / name).glob("*.safetensors"))) > 1  # sharded, with model.safetensors.index.json
        paths[name] = str(root / name)
    gpt = _GPT()
    gpt.configure_model()
    with torch.no_grad():
        for param in gpt.parameters():
            param.add_(0.1)  # other values than the ones `configure_model` draws
    save_file({key: value.clone() for key, value in gpt.state_dict().items()}, root / "gpt.safetensors")
    paths["gpt"] = str(root / "gpt.safetensors")
    trainer = quiet_trainer(SMPStrategy(), max_steps=2, **_SAME_BATCHES)
    trainer.fit(_GPT())
    trainer.save_checkpoint(root / "gpt.ckpt")
    paths["consolidated"] = str(consolidate_checkpoint(root / "gpt.ckpt"))
    return paths


class _Llama(pl.LightningModule):
    """``from_pretrained(path)`` in ``configure_model``, as a user writes it, trained on fixed random tokens."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
                self.model = transformers.LlamaForCausalLM.from_pretrained(self.path)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=BATCH)


class _GPT(TinyGPT):
    """The tiny GPT (torch transformer layers, a tied head), its values from the file ``weights`` when given:
    `load_weights`, or (``plain``) torch's ``load_state_dict``."""

    def __init__(self, weights: str | None = None, *, plain: bool = False) -> None:
        super().__init__()
        self.weights, self.plain = weights, plain

    def configure_model(self) -> None:
        if self.blocks is None:
            super().configure_model()
            if self.weights is not None and self.plain:
                self.load_state_dict(load_file(self.weights))
            elif self.weights is not None:
                load_weights(self, self.weights)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        ids, target = token_batches(seed=0, samples=BATCH)  # the same batch at every step: see the resume test
        return DataLoader(TensorDataset(ids.repeat(STEPS, 1), target.repeat(STEPS, 1)), batch_size=BATCH)


class _Capture(Callback):
    """What this rank holds once set up (each tensor's local value and which part of the whole it is), its peak
    memory then, every step's loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.held: dict[str, tuple[Tensor, Cut]] = {}
        self.peak = 0

    def on_fit_start(self, trainer, pl_module):
        self.peak = _peak_rss()
        for name, tensor in [*pl_module.named_parameters(), *pl_module.named_buffers()]:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            self.held[name] = (local.detach().clone(), cut_of(tensor))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit(module: pl.LightningModule, strategy, *, steps: int = STEPS, ckpt_path: str | None = None) -> dict:
    capture = _Capture()
    devices = int(os.environ.get("WORLD_SIZE", "1")) if isinstance(strategy, SMPStrategy) else 1
    trainer = quiet_trainer(strategy, devices=devices, max_steps=steps, callbacks=[capture], **_SAME_BATCHES)
    baseline = _reset_peak_rss()
    trainer.fit(module, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    return {
        "losses": capture.losses,
        "held": capture.held,
        "setup_growth": capture.peak - baseline,
        "kept": sum(value.numel() * value.element_size() for value, _ in capture.held.values()),
        "skipped": getattr(optimizer, "skipped_steps", torch.zeros(())).item(),
    }


def _reset_peak_rss() -> int:
    """Start the process's peak resident memory afresh; the resident memory now (Linux; 0 elsewhere)."""
    if not sys.platform.startswith("linux"):
        return 0
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _status("VmRSS")


def _peak_rss() -> int:
    return _status("VmHWM")


def _status(field: str) -> int:
    if not sys.platform.startswith("linux"):
        return 0
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def _build(model: str, path: str, *, plain: bool = False) -> pl.LightningModule:
    return _Llama(path) if model in ("llama", "tied", "big") else _GPT(path or None, plain=plain)


def _layouts(rank: int, layouts: dict, paths: dict[str, str]) -> dict:
    results = {}
    for name, (model, strategy_kwargs, options) in layouts.items():
        strategy = SMPStrategy(delayed_parameter_initialization=True, **strategy_kwargs)
        results[name] = _fit(_build(model, paths[model]), strategy, **options)
    return results


_REFERENCES: dict = {}


def _reference(model: str, paths: dict[str, str], *, fp16: bool = False) -> dict:
    """One device in plain PyTorch (tests/parity.py), the model loaded by a plain ``from_pretrained`` (or
    ``load_state_dict`` of the file) without delayed initialisation: fp32, or fp16 with fp32 masters; and the whole
    tensors once loaded."""
    key = (model, fp16)
    if key not in _REFERENCES:

        def build() -> pl.LightningModule:
            module = _build(model, paths[model], plain=True)
            module.configure_model()
            return module

        loaded = build()
        whole = {name: (t.detach().clone(), None) for name, t in [*loaded.named_parameters(), *loaded.named_buffers()]}
        run = single_device_run(
            build,
            lambda module, batch, step: module.training_step(batch, step),
            steps=STEPS,
            fp16=fp16,
            init_scale=FP16["dynamic_loss_args"]["init_scale"],
            shuffle=False,
        )
        _REFERENCES[key] = {**run, "held": whole}
    return _REFERENCES[key]


def _check(ranks: list[dict], name: str, reference: dict, *, fp16: bool = False) -> None:
    whole = {key: value for key, (value, _) in reference["held"].items()}
    held = set()
    for result in ranks:
        run = result[name]
        for key, (value, cut) in run["held"].items():
            assert torch.equal(value, cut(whole[key]).to(value.dtype)), f"{name}: {key}"
        held |= set(run["held"])
        if fp16:
            assert run["skipped"] == reference["skipped"] > 0, name
            assert run["losses"] == pytest.approx(reference["losses"], rel=2e-2), name
        else:
            assert run["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-6), name
            assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
    assert held == set(whole), name  # every tensor lives on some rank


# -- two ranks --------------------------------------------------------------------------------------------------------

LAYOUTS_2 = {
    "tp2": ("llama", TP2, {}),
    "pp2": ("llama", PP2, {}),
    "dp2_sharded_optimizer": ("llama", {"shard_optimizer_state": True}, {}),
    "sdp2": ("llama", SDP2, {}),
    "tied_tp2": ("tied", TP2, {}),
    "tied_pp2": ("tied", PP2, {}),
    "pp2_fp16": ("llama", {**PP2, **FP16}, {}),
    "big_pp2": ("big", PP2, {"steps": 1}),  # last: what a load imports and sets up once is in the baseline
}


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    return run_distributed(_layouts, 2, LAYOUTS_2, checkpoints, timeout=600)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("tp2", "llama"),
        ("pp2", "llama"),
        ("dp2_sharded_optimizer", "llama"),
        ("sdp2", "llama"),
        ("tied_tp2", "tied"),
        ("tied_pp2", "tied"),
    ],
)
def test_each_rank_loads_its_slices_of_the_checkpoint_and_trains_as_one_device(two_ranks, checkpoints, name, model):
    _check(two_ranks, name, _reference(model, checkpoints))


@pytest.mark.timeout(900)
def test_fp16_pp2_loads_and_skips_the_steps_one_device_skips(two_ranks, checkpoints):
    _check(two_ranks, "pp2_fp16", _reference("llama", checkpoints, fp16=True), fp16=True)


@pytest.mark.timeout(900)
def test_the_layouts_hold_parts_not_wholes(two_ranks):
    first, last = (set(rank["pp2"]["held"]) for rank in two_ranks)
    assert "model.model.embed_tokens.weight" in first - last and "model.lm_head.weight" in last - first
    for rank in two_ranks:
        cuts = {key: cut for key, (_, cut) in rank["tp2"]["held"].items()}
        assert cuts["model.model.layers.0.self_attn.k_proj.weight"].shape == (8, 32)  # 2 kv heads of 8, split
        assert cuts["model.model.layers.0.mlp.down_proj.weight"].shape == (32, 32)  # rowwise: columns split
        sharded = {key: cut for key, (_, cut) in rank["sdp2"]["held"].items()}
        assert sharded["model.model.layers.1.mlp.up_proj.weight"].shape == (32, 32)  # its rows


@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc")
def test_no_rank_reads_the_whole_model_while_loading(two_ranks, checkpoints):
    whole = sum(4 * torch.Size(source.shape).numel() for source in open_state_dict(checkpoints["big"]).values())
    largest = 4 * 256 * 2048
    for result in two_ranks:
        run = result["big_pp2"]
        assert run["kept"] < 0.6 * whole
        # Reading the whole checkpoint would take the peak past `whole`; what a rank keeps, one tensor and room for
        # the process's own allocations while setting up stay well below it.
        assert run["setup_growth"] <= run["kept"] + largest + 16 * 2**20 < whole, run["setup_growth"]


# -- four ranks: pp2 x tp2, sdp2 x tp2 --------------------------------------------------------------------------------

LAYOUTS_4 = {
    "pp2_tp2": ("llama", {**PP2, **TP2}, {}),
    "sdp2_tp2": ("llama", {**SDP2, **TP2}, {}),
    "plain_pp2_tp2": ("gpt", {**PP2, **TP2}, {}),
    "consolidated_pp2_tp2": ("tiny", {**PP2, **TP2}, {"ckpt_path": "consolidated"}),  # the path: see `_four`
}


def _four(rank: int, paths: dict[str, str]) -> dict:
    layouts = {
        name: (model, kwargs, {"ckpt_path": paths["consolidated"]} if "ckpt_path" in options else options)
        for name, (model, kwargs, options) in LAYOUTS_4.items()
    }
    return _layouts(rank, layouts, {**paths, "tiny": ""})


@pytest.fixture(scope="module")
def four_ranks(checkpoints):
    return run_distributed(_four, 4, checkpoints, timeout=600)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["pp2_tp2", "sdp2_tp2"])
def test_pp2_tp2_and_sdp2_tp2_load_their_slices_and_train_as_one_device(four_ranks, checkpoints, name):
    _check(four_ranks, name, _reference("llama", checkpoints))


@pytest.mark.timeout(900)
def test_a_plain_state_dict_file_loads_into_the_split_model(four_ranks, checkpoints):
    _check(four_ranks, "plain_pp2_tp2", _reference("gpt", checkpoints))


@pytest.mark.timeout(900)
def test_a_consolidated_checkpoint_resumes_under_pp2_tp2(four_ranks, checkpoints):
    unbroken = _fit(_GPT(), SMPStrategy())  # the run the checkpoint was taken from, not stopped
    resumed = _fit(_GPT(), SMPStrategy(), ckpt_path=checkpoints["consolidated"])
    # its first step runs on the weights the checkpoint holds, whatever the optimizer state
    assert resumed["losses"][0] == pytest.approx(unbroken["losses"][2], rel=1e-6)
    for rank in four_ranks:
        assert rank["consolidated_pp2_tp2"]["losses"] == pytest.approx(resumed["losses"], rel=1e-5)


@pytest.mark.timeout(300)
def test_a_consolidated_checkpoint_that_does_not_fit_is_refused_naming_the_entries(checkpoints, tmp_path):
    content = torch.load(checkpoints["consolidated"], map_location="cpu", weights_only=False)
    state = content["state_dict"]
    key = next(name for name, value in state.items() if value.dim() == 2)
    torch.save({**content, "state_dict": {**state, key: torch.zeros(3, 3)}}, tmp_path / "shape.ckpt")
    torch.save({**content, "state_dict": {k: v for k, v in state.items() if k != key}}, tmp_path / "short.ckpt")
    with pytest.raises(CheckpointError, match=rf"1 shapes differ: {key}: \(3, 3\) in the checkpoint"):
        _fit(_GPT(), SMPStrategy(), ckpt_path=str(tmp_path / "shape.ckpt"))
    with pytest.raises(CheckpointError, match=rf"(?s)1 entries the checkpoint lacks: {key}.*strict_loading = False"):
        _fit(_GPT(), SMPStrategy(), ckpt_path=str(tmp_path / "short.ckpt"))


# -- transformers' defaults under delayed initialisation ---------------------------------------------------------------


def test_hub_kernels_stay_off_and_from_pretrained_is_left_as_it_was(checkpoints):
    """transformers 5.25 turned hub kernels on by default: under delayed initialisation nothing is kernelized (it
    would run on the meta device, and download kernels); outside the block from_pretrained is transformers' own."""
    original = vars(transformers.PreTrainedModel)["from_pretrained"]
    with deferred_init():
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoints["llama"])
    assert not getattr(model, "use_kernels", False)
    assert vars(transformers.PreTrainedModel)["from_pretrained"] is original


def test_use_kernels_true_is_refused_with_the_way_out(checkpoints):
    with deferred_init(), pytest.raises(PretrainedLoadingError, match=r"Drop use_kernels=True"):
        transformers.LlamaForCausalLM.from_pretrained(checkpoints["llama"], use_kernels=True)


def test_a_new_default_failing_on_meta_names_transformers_version_and_the_fix(checkpoints, monkeypatch):
    def kernelize_on_meta(self, *args, **kwargs):  # what transformers 5.25's default did under delayed init
        raise ValueError("Unsupported device type 'meta'. Supported device types are: cpu, cuda")

    monkeypatch.setattr(transformers.PreTrainedModel, "set_use_kernels", kernelize_on_meta)
    expected = rf"transformers {transformers.__version__}'s from_pretrained failed on the meta device.*pip install"
    with deferred_init(), pytest.raises(PretrainedLoadingError, match=expected) as caught:
        transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    assert isinstance(caught.value.__cause__, ValueError)


def test_an_error_that_does_not_name_the_meta_device_passes_through(checkpoints, monkeypatch):
    def fails(self, *args, **kwargs):
        raise ValueError("the checkpoint's metadata lacks a format")

    monkeypatch.setattr(transformers.PreTrainedModel, "set_use_kernels", fails)
    with deferred_init(), pytest.raises(ValueError, match="metadata lacks") as caught:
        transformers.LlamaForCausalLM.from_pretrained(checkpoints["llama"])
    assert not isinstance(caught.value, PretrainedLoadingError)
