"""LoRA fine-tunes with peft under dp2, pp2 and sdp2, against one device; under tensor parallelism, refused.

A tiny pretrained Llama (`tests.gpt.TinyLlama` saved with ``save_pretrained``) is loaded with ``from_pretrained``
and wrapped by peft's ``get_peft_model`` (LoRA on q_proj and v_proj, random B so the adapters act from the first
step) in ``configure_model`` under ``smp.model_creation``, with and without delayed parameter initialisation, as a
user writes it, and trained a few steps with AdamW over ``self.parameters()``. Each layout's losses equal the
plain-PyTorch single-device run's of the same peft model (fp32 within 1e-5; fp16: the same skipped steps, 2e-2);
only the adapters train (the optimizer's state, and fp16's fp32 masters, are exactly this rank's adapters'; the
base weights in the saved checkpoint are the pretrained ones, bit for bit); ``export_hf`` of each checkpoint writes
what peft's own ``save_pretrained`` writes, ``PeftModel.from_pretrained(base, out)`` loads it, and its adapters
equal the single-device run's. Under tensor parallelism the plan refuses the adapters and names the fix, and the
fix (the wrapped attention kept whole) trains as one device does. One launch of two ranks runs every layout.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_smp import SMPStrategy, cli, consolidate_checkpoint, consolidated_state_dict, export_hf, smp
from lightning_smp.optimizer import MasterWeightOptimizer
from tests.distributed import launch_once
from tests.gpt import TinyLlama
from tests.models import quiet_trainer
from tests.parity import FP32_REL, assert_fp16_matches, mean_losses, single_device_run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS = 3
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
LORA_RANDOM_B = {**LORA, "init_lora_weights": False}  # B = 0 (peft's default) would hide A until a step moved B
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
SDP2 = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}
DELAYED = {"delayed_parameter_initialization": True}
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**16}}
KEEP_ATTENTION_WHOLE = {"tensor_parallel_plan": {"model.base_model.model.model.layers.*.self_attn": "replicate"}}
# name: (strategy, how many replicas read their own batch: smp.dp_size(), each tensor-parallel rank one too)
LAYOUTS = {
    "dp2": ({}, 2),
    "dp2_fp16": (FP16, 2),
    "pp2": (PP2, 1),
    "pp2_delayed": ({**PP2, **DELAYED}, 1),
    "sdp2": (SDP2, 2),
    "sdp2_delayed": ({**SDP2, **DELAYED}, 2),
    "tp2_attention_whole": ({"tensor_parallel_degree": 2, **KEEP_ATTENTION_WHOLE}, 2),
}
REFUSED = {"tensor_parallel_degree": 2, **DELAYED}  # last in the launch: it fails at setup


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _two_ranks(rank: int, root: str) -> dict:
    pretrained = str(Path(root) / "pretrained")
    results: dict = {}
    for name, (strategy, _) in LAYOUTS.items():
        module = TinyLlama(pretrained, lora=LORA_RANDOM_B)
        losses = _Losses()
        trainer = quiet_trainer(SMPStrategy(**strategy), devices=2, max_steps=STEPS, callbacks=[losses])
        trainer.fit(module)
        trainer.save_checkpoint(Path(root) / f"{name}.ckpt")
        optimizer = trainer.strategy.optimizers[0]
        optimized = [p for group in optimizer.param_groups for p in group["params"]]
        adapters = [p for n, p in module.named_parameters() if "lora_" in n]
        results[name] = {
            "dp_rank": smp.dp_rank(),
            "losses": losses.losses,
            "skipped": getattr(optimizer, "skipped_steps", torch.zeros(())).item(),
            "scale": getattr(optimizer, "loss_scale", None),
            "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
            "adapter_numel": sum(_local(p).numel() for p in adapters),
            "masters": isinstance(optimizer, MasterWeightOptimizer),
            "optimized_numel": sum(_local(p).numel() for p in optimized),
            "optimized_dtypes": sorted({str(p.dtype) for p in optimized}),
            "state_numel": sum(_local(t).numel() for s in optimizer.state.values() for t in s.values() if t.dim() > 0),
        }
    trainer = quiet_trainer(SMPStrategy(**REFUSED), devices=2, max_steps=STEPS)
    try:
        trainer.fit(TinyLlama(pretrained, lora=LORA_RANDOM_B))
        results["refused"] = None
    except ValueError as error:  # the setup's own error (not one from tearing down a model still on meta)
        results["refused"] = str(error)
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    llama = TinyLlama()
    llama.configure_model()
    llama.model.save_pretrained(root / "pretrained")
    return root


@pytest.fixture(scope="module")
def ranks(root) -> list[dict]:
    return launch_once(_two_ranks, 2, str(root), timeout=600)


_REFERENCES: dict = {}


def _reference(root: Path, replicas: int, fp16: bool = False) -> dict:
    """The same peft model trained in plain PyTorch on one device, on the replicas' batches together."""
    key = (replicas, fp16)
    if key not in _REFERENCES:

        def build() -> TinyLlama:
            module = TinyLlama(str(root / "pretrained"), lora=LORA_RANDOM_B)
            module.configure_model()
            return module

        _REFERENCES[key] = single_device_run(
            build, lambda model, batch, step: model.loss(batch), steps=STEPS, replicas=replicas, fp16=fp16
        )
    return _REFERENCES[key]


def _pretrained(root: Path) -> dict[str, torch.Tensor]:
    """The peft model's state dict before training, by its own names (the base's values are the checkpoint's)."""
    module = TinyLlama(str(root / "pretrained"), lora=LORA_RANDOM_B)
    module.configure_model()
    return module.model.state_dict()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_only_the_adapters_train_and_the_losses_are_one_devices(root, ranks, name):
    _, replicas = LAYOUTS[name]
    fp16 = "fp16" in name
    reference = _reference(root, replicas, fp16)
    runs = [rank[name] for rank in ranks]
    if fp16:
        assert_fp16_matches({**runs[0], "losses": mean_losses(runs, replica="dp_rank", steps=STEPS)}, reference)
    else:
        losses = mean_losses(runs, replica="dp_rank", steps=STEPS)
        assert losses == pytest.approx(reference["losses"], rel=FP32_REL)
    for run in runs:
        assert run["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in run["trainable"]), name
        assert run["state_numel"] == 2 * run["adapter_numel"] > 0, name  # AdamW's two moments (and step counts)
        if fp16:  # the masters: fp32 copies of the adapters alone
            assert run["masters"] and run["optimized_dtypes"] == ["torch.float32"], name
            assert run["optimized_numel"] == run["adapter_numel"], name
    trained = consolidated_state_dict(consolidate_checkpoint(root / f"{name}.ckpt"), "model")
    before = _pretrained(root)
    assert set(trained) == set(before)
    base = [key for key in before if "lora_" not in key]
    for key in base:
        expected = before[key].half().float() if fp16 else before[key]  # an fp16 run holds its frozen weights so
        assert torch.equal(trained[key].float(), expected), f"{name}: {key} changed"
    for key in set(before) - set(base):
        assert not torch.equal(trained[key], before[key]), f"{name}: {key} did not train"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["dp2", "pp2_delayed", "sdp2_delayed"])
def test_the_adapters_export_as_peft_saves_them_and_equal_one_devices(root, ranks, name, tmp_path):
    _, replicas = LAYOUTS[name]
    out = export_hf(root / f"{name}.ckpt", tmp_path / "adapters")
    cli.main(["export-hf", str(root / f"{name}.ckpt"), str(tmp_path / "by_command")])
    assert sorted(os.listdir(tmp_path / "by_command")) == sorted(os.listdir(out))
    reference = _reference(root, replicas)
    theirs = TinyLlama(str(root / "pretrained"), lora=LORA_RANDOM_B)
    theirs.configure_model()
    theirs.load_state_dict(reference["weights"])
    theirs.model.save_pretrained(tmp_path / "theirs")
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "theirs"))
    assert sorted(os.listdir(out)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    base = transformers.LlamaForCausalLM.from_pretrained(root / "pretrained")
    loaded = peft.PeftModel.from_pretrained(base, out).state_dict()
    for key, value in theirs.model.state_dict().items():
        torch.testing.assert_close(loaded[key], value, rtol=FP32_REL, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.timeout(900)
def test_lora_under_tensor_parallelism_is_refused_naming_the_fix(ranks):
    message = ranks[0]["refused"]
    assert message is not None, "tensor_parallel_degree=2 trained LoRA adapters instead of refusing them"
    assert message.startswith("LoRA under tensor parallelism is not supported: model.base_model.model.model.layers.")
    assert "pipeline_parallel_degree, sharded_data_parallel_degree or data parallelism" in message
    assert "tensor_parallel_plan={'model.base_model.model.model.layers.*.self_attn': 'replicate'}" in message
