"""The Lightning Fabric door (`SMPFabricStrategy`): a plain Fabric loop (``fabric.setup``, ``model(x)``,
``fabric.backward``, ``optimizer.step``) under each layout against the single-process run of the same model and
data in plain PyTorch (`tests.parity.single_device_run`), and ``fabric.save`` / ``fabric.load`` across layouts.

Each rank reads what the strategy's ``distributed_sampler_kwargs`` give it, through torch's ``DistributedSampler``
without shuffling, the order `single_device_run(shuffle=False)` assembles its global batches in.

Models no test here wrote train the same way: a Hugging Face transformers Llama, and LitGPT's ``litgpt.GPT`` (at
dp2 in fp16, at tp2 under the plan a user writes for it, in two fp16 pipeline stages; skipped without litgpt, which
``scripts/setup.sh`` installs).
"""

import importlib.util
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_smp
from lightning_smp import SMPFabricStrategy, smp
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.tensor_parallel import TensorParallelModule
from tests.distributed import run_distributed
from tests.gpt import VOCAB, ScriptGPT, ScriptLlama, TinyGPT, lit_gpt, token_batches
from tests.models import mlp, random_dataset
from tests.parity import FP16_REL, FP32_REL, assert_same_overflow, mean_losses, single_device_run

BATCH = 4  # samples per rank and step
_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fabric" / "train.py"
STEPS = 6
PIPELINE_STEPS = 4
LR = 1e-2  # AdamW's, in `_AdamWTokens` and the pipelined loop
INIT_SCALE = 2.0**17  # fp16: high enough that the first step overflows and is skipped, on every layout (see `_mse`)
SCALES = {"script_gpt": 2.0**17, "llama": 2.0**18, "litgpt": 2.0**20}
"""fp16's initial loss scale where a model's differs from `INIT_SCALE`: its first steps overflow and are skipped, in
plain torch too, and later ones are not."""


class Regressor(nn.Module):
    """A two-layer MLP with its optimizer and data, as `single_device_run` reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(random_dataset(), batch_size=BATCH)


class FabricGPT(TinyGPT):
    """`TinyGPT` built at construction (under tensor parallelism when the run has it), with SGD and token data."""

    def __init__(self) -> None:
        super().__init__()
        self.configure_model()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*token_batches(seed=1, samples=64)), batch_size=BATCH)


class _AdamWTokens:
    """The recipe of the models no test here wrote, as `_train` and `single_device_run` read it: AdamW and 64 random
    token sequences in batches of `BATCH`."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*token_batches(seed=2, samples=64)), batch_size=BATCH)


class FabricLlama(_AdamWTokens, ScriptLlama):
    """`tests.gpt.ScriptLlama` (a transformers Llama, split by its own ``tp_plan``) with `_AdamWTokens`."""


class FabricScriptGPT(_AdamWTokens, ScriptGPT):
    """`tests.gpt.ScriptGPT` (a plain torch GPT as smp scripts build one) with `_AdamWTokens`."""


def _fabric_litgpt() -> nn.Module:
    """LitGPT's own ``litgpt.GPT`` (`tests.gpt.lit_gpt`) with `_AdamWTokens`."""
    return lit_gpt(_AdamWTokens)


def _mse(model: Any, batch: Any, step: int = 0) -> Tensor:
    """The mean squared error, times 0.6. In fp16 each replica's gradients (of its share of the batch) can be up to
    twice the global batch's, so at a loss scale near the edge a replica overflows where one device does not (smp's
    data parallelism too); 0.6 keeps this data's scales clear of that edge (at 2**17 the first step overflows in
    both, at 2**16 no step does)."""
    x, y = batch
    return 0.6 * F.mse_loss(model(x).float(), y.float())


def _next_token(model: Any, batch: Any, step: int = 0) -> Tensor:
    ids, target = batch
    return F.cross_entropy(model(ids).float().reshape(-1, VOCAB), target.reshape(-1))


_MODELS = {
    "mlp": (Regressor, _mse),
    "gpt": (FabricGPT, _next_token),
    "llama": (FabricLlama, _next_token),
    "litgpt": (_fabric_litgpt, _next_token),
    "script_gpt": (FabricScriptGPT, _next_token),
}


def _fabric(settings: dict[str, Any]) -> tuple[L.Fabric, SMPFabricStrategy]:
    strategy = SMPFabricStrategy(**settings)
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy)
    fabric.launch()
    return fabric, strategy


def _train(
    rank: int,
    settings: dict[str, Any],
    model_name: str,
    steps: int = STEPS,
    clip: float | None = None,
    save_to: str | None = None,
    empty_init: bool = False,
) -> dict[str, Any]:
    """One rank of a Fabric run: ``steps`` steps of the loop, its losses, overflow record and final weights;
    ``empty_init``: the model built on the meta device (``fabric.init_module(empty_init=True)``)."""
    fabric, strategy = _fabric(settings)
    build, loss_of = _MODELS[model_name]
    torch.manual_seed(0)
    with fabric.init_module(empty_init=empty_init):
        model = build()
        built_on_meta = next(model.parameters()).is_meta
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    dataset = model.train_dataloader().dataset
    sampler = DistributedSampler(dataset, shuffle=False, **strategy.distributed_sampler_kwargs)
    losses = []
    for _, batch in zip(range(steps), DataLoader(dataset, batch_size=BATCH, sampler=sampler), strict=False):
        loss = loss_of(model, batch)
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    inner = optimizer.optimizer
    record = {
        "losses": losses,
        "wrapped": isinstance(inner, MasterWeightOptimizer),
        "skipped": float(inner.skipped_steps.item()) if isinstance(inner, MasterWeightOptimizer) else 0.0,
        "scale": inner.loss_scale if isinstance(inner, MasterWeightOptimizer) and inner.loss_scaler else None,
        "weights": {k: v.detach().float().clone() for k, v in strategy.split_model.state_dict().items()},
        "ddp": isinstance(model._forward_module, nn.parallel.DistributedDataParallel),
        "built_on_meta": built_on_meta,
        "split": [
            name for name, module in strategy.split_model.named_modules() if isinstance(module, TensorParallelModule)
        ],
    }
    if save_to is not None:
        fabric.save(save_to, {"model": model, "optimizer": optimizer, "step": steps})
        record["state"] = _adam_state(strategy, inner)
    return record


def _adam_state(strategy: SMPFabricStrategy, optimizer: Any) -> dict[str, Tensor]:
    """Adam's ``exp_avg`` of every parameter, by name (none for SGD, or over fp32 masters)."""
    if isinstance(optimizer, MasterWeightOptimizer):
        return {}
    names = {id(p): n for n, p in strategy.split_model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"] if "exp_avg" in optimizer.state[p]]
    return {names[id(p)]: optimizer.state[p]["exp_avg"].clone() for p in params}


def _load(rank: int, settings: dict[str, Any], path: str, model_name: str = "mlp") -> dict[str, Any]:
    """One rank of a fresh run that loads ``path``: its weights, optimizer state and what the state got back."""
    fabric, strategy = _fabric(settings)
    model = _MODELS[model_name][0]()
    with torch.no_grad():  # other weights than the saved run's: the load must replace them
        for param in model.parameters():
            param.add_(1.0)
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    return {
        "weights": {k: v.detach().float().clone() for k, v in strategy.split_model.state_dict().items()},
        "state": _adam_state(strategy, optimizer.optimizer),
        "step": state["step"],
        "remainder": sorted(remainder),
        "scale": optimizer.loss_scale if isinstance(optimizer.optimizer, MasterWeightOptimizer) else None,
    }


def _reference(
    model_name: str,
    *,
    replicas: int,
    fp16: bool = False,
    clip: float | None = None,
    steps: int = STEPS,
) -> dict[str, Any]:
    build, loss_of = _MODELS[model_name]
    return single_device_run(
        build,
        loss_of,
        steps=steps,
        replicas=replicas,
        fp16=fp16,
        init_scale=SCALES.get(model_name, INIT_SCALE),
        clip_norm=clip,
        shuffle=False,
    )


def _assert_fp32_matches(runs: list[dict[str, Any]], reference: dict[str, Any], *, weights: bool = True) -> None:
    assert mean_losses(runs, steps=STEPS) == pytest.approx(reference["losses"], rel=FP32_REL)
    if weights:
        for run in runs:
            for name, value in reference["weights"].items():
                torch.testing.assert_close(run["weights"][name], value, rtol=FP32_REL, atol=1e-6, msg=name)


def test_one_process_fp32_matches_plain_torch():
    (run,) = run_distributed(_train, 1, {}, "mlp", timeout=60)
    assert not run["wrapped"] and not run["ddp"]
    _assert_fp32_matches([run], _reference("mlp", replicas=1))


def test_dp2_fp32_wraps_ddp_and_matches_plain_torch():
    runs = run_distributed(_train, 2, {}, "mlp", timeout=60)
    assert all(run["ddp"] for run in runs)
    _assert_fp32_matches(runs, _reference("mlp", replicas=2))


def test_dp2_fp16_skips_the_same_steps_as_plain_torch_with_masters():
    settings = {"fp16": True, "dynamic_loss_args": {"init_scale": INIT_SCALE}}
    runs = run_distributed(_train, 2, settings, "mlp", timeout=60)
    reference = _reference("mlp", replicas=2, fp16=True)
    assert reference["skipped"] > 0, "the test should see skipped steps"
    for run in runs:
        assert run["wrapped"]
        assert_same_overflow(run, reference)
    assert mean_losses(runs, steps=STEPS) == pytest.approx(reference["losses"], rel=FP16_REL)


def test_dp2_zero1_fp32_clipped_matches_plain_torch():
    runs = run_distributed(_train, 2, {"shard_optimizer_state": True}, "mlp", STEPS, 0.5, timeout=60)
    assert all(run["wrapped"] and not run["ddp"] for run in runs)  # the optimizer reduce-scatters, not DDP
    _assert_fp32_matches(runs, _reference("mlp", replicas=2, clip=0.5))


def test_sdp2_fp32_matches_plain_torch():
    runs = run_distributed(_train, 2, {"sharded_data_parallel_degree": 2}, "mlp", timeout=60)
    # sharded data parallelism clips to sdp_gradient_clipping (1.0) at every step, as smp did
    _assert_fp32_matches(runs, _reference("mlp", replicas=2, clip=1.0), weights=False)


def test_tp2_gpt_matches_plain_torch():
    runs = run_distributed(_train, 2, {"tensor_parallel_degree": 2}, "gpt", timeout=90)
    assert all(run["split"] for run in runs)  # the optimizer followed the split layers' new parameters
    # each tensor-parallel rank reads its own batch (prescaled_batch=False): the group trains on their union
    _assert_fp32_matches(runs, _reference("gpt", replicas=2), weights=False)


def test_save_at_dp2_loads_at_dp1(tmp_path):
    path = str(tmp_path / "fabric.ckpt")
    saved = run_distributed(_train, 2, {}, "mlp", 3, None, path, timeout=60)
    (loaded,) = run_distributed(_load, 1, {}, path, timeout=60)
    assert loaded["step"] == 3 and loaded["remainder"] == []
    for name, value in saved[0]["weights"].items():
        torch.testing.assert_close(loaded["weights"][name], value, rtol=0, atol=0, msg=name)
    assert saved[0]["state"], "Adam has state after three steps"
    for name, value in saved[0]["state"].items():
        torch.testing.assert_close(loaded["state"][name], value, rtol=0, atol=0, msg=name)


def test_save_at_tp2_loads_at_dp1_as_one_device_trained_it(tmp_path):
    path = str(tmp_path / "tp2.ckpt")
    run_distributed(_train, 2, {"tensor_parallel_degree": 2}, "gpt", 3, None, path, timeout=90)
    (loaded,) = run_distributed(_load, 1, {}, path, "gpt", timeout=60)
    assert loaded["step"] == 3
    reference = _reference("gpt", replicas=2, steps=3)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(loaded["weights"][name], value, rtol=FP32_REL, atol=1e-6, msg=name)


def test_save_at_dp2_zero1_fp16_loads_at_dp1_fp16_with_its_loss_scale(tmp_path):
    path = str(tmp_path / "zero1.ckpt")
    settings = {"fp16": True, "shard_optimizer_state": True, "dynamic_loss_args": {"init_scale": INIT_SCALE}}
    saved = run_distributed(_train, 2, settings, "mlp", 3, None, path, timeout=60)
    (loaded,) = run_distributed(_load, 1, {"fp16": True}, path, timeout=60)
    assert saved[0]["skipped"] == 1 and loaded["scale"] == saved[0]["scale"] == INIT_SCALE / 2
    for name, value in saved[0]["weights"].items():  # fp16 parameters, from the same fp32 masters
        torch.testing.assert_close(loaded["weights"][name], value, rtol=0, atol=0, msg=name)


def test_delayed_initialisation_gives_the_single_device_values():
    runs = run_distributed(_train, 2, {"delayed_parameter_initialization": True}, "mlp", timeout=60)
    assert all(run["built_on_meta"] and run["ddp"] for run in runs)
    _assert_fp32_matches(runs, _reference("mlp", replicas=2))


def _setup_apart(rank: int) -> dict[str, Any]:
    """``fabric.setup_module`` then an optimizer over the set-up model; and one over the unsplit model, refused."""
    fabric, _ = _fabric({"tensor_parallel_degree": 2, "fp16": True})
    torch.manual_seed(0)
    model = FabricGPT()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # over the parameters tensor parallelism replaces
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        fabric.setup_optimizers(stale)
    except ValueError as error:
        refusal = str(error)
    return {"wrapped": isinstance(optimizer.optimizer, MasterWeightOptimizer), "refusal": refusal}


def test_setup_module_then_setup_optimizers_and_an_optimizer_over_the_unsplit_model_is_refused():
    for run in run_distributed(_setup_apart, 2, timeout=60):
        assert run["wrapped"]
        assert "Build the optimizer over the set-up model's `model.parameters()`" in run["refusal"]


def _pipeline(rank: int) -> None:
    fabric, _ = _fabric({"pipeline_parallel_degree": 2})
    fabric.setup(Regressor())


def test_fabric_setup_under_a_pipeline_is_refused_naming_smp_step():
    with pytest.raises(pytest.fail.Exception, match=r"an @smp\.step function calling model\.backward"):
        run_distributed(_pipeline, 2, timeout=60)


def test_names_are_registered_with_fabric_and_settings_are_checked():
    assert {"smp", "smp_fp16", "smp_bf16"} <= set(STRATEGY_REGISTRY)
    assert STRATEGY_REGISTRY["smp_fp16"]["strategy"] is lightning_smp.SMPFabricStrategy
    with pytest.raises(ValueError, match="did you mean 'tensor_parallel_degree'"):
        SMPFabricStrategy(tensor_paralel_degree=2)
    with pytest.raises(ValueError, match="Remove `precision=`"):
        L.Fabric(accelerator="cpu", devices=1, strategy="smp_fp16", precision="bf16-mixed")


def _example(rank: int, argv: list[str]) -> float:
    spec = importlib.util.spec_from_file_location("fabric_train", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(argv)


def test_the_fabric_example_learns_at_tp2_in_fp16():
    losses = run_distributed(_example, 2, ["--devices", "2", "--tp", "2", "--steps", "40"], timeout=90)
    assert losses[0] == losses[1] < 3.5  # from ln(64) = 4.16; fp16's first steps are skipped while the scale falls


@smp.step
def _pipelined_step(model: smp.DistributedModel, ids: Tensor, target: Tensor) -> Tensor:
    loss = _next_token(model, (ids, target))
    model.backward(loss)
    return loss


def _pipelined_model(model_name: str) -> nn.Module:
    model = _MODELS[model_name][0]()
    if model_name == "litgpt":  # LitGPT registers its lm_head before its blocks; it runs after them
        smp.set_partition(model.lm_head, smp.pp_size() - 1)
    return model


def _pipelined_loop(rank: int, directory: str, model_name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A Fabric loop over two pipeline stages in fp16 (and ``settings``): the model built in ``fabric.init_module``,
    smp's API in the loop (``smp.DistributedModel``, ``smp.DistributedOptimizer``, an ``@smp.step`` function with
    ``model.backward(loss)``), then ``fabric.save``."""
    fabric, _ = _fabric({"pipeline_parallel_degree": 2, "microbatches": 2, "fp16": True, **settings})
    torch.manual_seed(0)
    with fabric.init_module():
        module = _pipelined_model(model_name)
    built_on_meta = next(module.parameters()).is_meta
    model = smp.DistributedModel(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaling = {"init_scale": SCALES[model_name]}
    optimizer = smp.DistributedOptimizer(optimizer, dynamic_loss_scale=True, dynamic_loss_args=scaling)
    losses = []
    for _, (ids, target) in zip(range(PIPELINE_STEPS), module.train_dataloader(), strict=False):
        optimizer.zero_grad()
        losses.append(_pipelined_step(model, ids, target).reduce_mean().item())
        optimizer.step()
    fabric.save(directory, {"model": model, "optimizer": optimizer, "steps": len(losses)})
    return {
        "losses": losses,
        "skipped": float(optimizer.skipped_steps),
        "scale": optimizer.loss_scale,
        "held": {name: value.detach().clone() for name, value in model.local_state_dict().items()},
        "buffers": {name: value.clone() for name, value in model.get_module().named_buffers()},
        "built_on_meta": built_on_meta,
    }


def _load_pipelined_save(rank: int, directory: str, model_name: str) -> dict[str, Tensor]:
    """The pipelined run's checkpoint loaded into the whole model set up by ``fabric.setup`` on one process."""
    fabric, _ = _fabric({})
    torch.manual_seed(1)  # other initial values: the load must replace them all
    model = fabric.setup_module(_MODELS[model_name][0]())
    state = {"model": model, "steps": 0}
    fabric.load(directory, state)
    assert state["steps"] == PIPELINE_STEPS
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _assert_pipelined_run(tmp_path: Path, model_name: str, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Two fp16 stages in a Fabric loop (`_pipelined_loop`) train as plain torch (the same skipped steps) and
    their save loads into the whole model; returns the two stages' records."""
    directory = str(tmp_path / "ckpt")
    runs = run_distributed(_pipelined_loop, 2, directory, model_name, settings, timeout=120)
    reference = _reference(model_name, replicas=1, fp16=True, steps=PIPELINE_STEPS)
    assert reference["skipped"] > 0, "the test should see skipped steps"
    for run in runs:  # both stages report the last stage's losses, and skip the same steps
        assert run["losses"] == pytest.approx(reference["losses"], rel=FP16_REL)
        assert_same_overflow(run, reference)
    (weights,) = run_distributed(_load_pipelined_save, 1, directory, model_name, timeout=120)
    assert set(weights) == set(reference["weights"])
    for run in runs:  # the fp32 masters, each from its owning stage: in fp16, the stage's parameters
        assert run["held"] and all(torch.equal(weights[name].half(), value) for name, value in run["held"].items())
    return runs


@pytest.mark.parametrize("model_name", ["script_gpt", "llama"])
def test_a_pipeline_in_a_fabric_loop_runs_through_smp_step_and_its_save_loads_whole(tmp_path, model_name):
    if model_name == "llama":
        pytest.importorskip("transformers")
    _assert_pipelined_run(tmp_path, model_name, {})


def test_a_transformers_llama_in_a_fabric_loop_splits_by_its_own_plan_and_trains_as_plain_torch():
    pytest.importorskip("transformers")
    runs = run_distributed(_train, 2, {"tensor_parallel_degree": 2}, "llama", timeout=180)
    assert all(run["split"] for run in runs)  # the transformers model's own tp_plan split it
    _assert_fp32_matches(runs, _reference("llama", replicas=2), weights=False)


# -- a LitGPT model: `litgpt.GPT`, a third-party model with its own module layout ---------------------------------

# What a user writes to split LitGPT's GPT two ways. Its attention reshapes q, k and v by `config.n_head` and
# `config.n_query_groups` (the whole model's), and `qkv` packs the query heads and the fewer key/value heads in one
# weight, so the heads cannot be split across ranks without changing LitGPT. Its two projections still split with
# whole activations around them ("colwise_gather_output" all-gathers qkv's output, "rowwise_split_input" takes the
# whole input): each rank holds half of their weights, the attention itself runs whole on every rank. The MLP splits
# as Megatron splits it, the embedding by vocabulary, the untied head by vocabulary with its logits gathered.
LITGPT_TP_PLAN = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.qkv": "colwise_gather_output",
    "transformer.h.*.attn.proj": "rowwise_split_input",
    "transformer.h.*.mlp.fc_1": "colwise",
    "transformer.h.*.mlp.fc_2": "colwise",
    "transformer.h.*.mlp.proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


def test_a_litgpt_model_trains_in_a_fabric_loop_at_dp2_in_fp16_as_plain_torch_with_masters():
    pytest.importorskip("litgpt")
    settings = {"fp16": True, "dynamic_loss_args": {"init_scale": SCALES["litgpt"]}}
    runs = run_distributed(_train, 2, settings, "litgpt", timeout=90)
    reference = _reference("litgpt", replicas=2, fp16=True)
    assert reference["skipped"] > 0, "the test should see skipped steps"
    for run in runs:
        assert run["wrapped"] and run["ddp"]
        assert_same_overflow(run, reference)
    assert mean_losses(runs, steps=STEPS) == pytest.approx(reference["losses"], rel=FP16_REL)


def test_a_litgpt_model_in_a_fabric_loop_splits_by_a_users_plan_at_tp2_and_trains_as_plain_torch():
    """The plan `LITGPT_TP_PLAN` (see there why LitGPT's attention heads stay whole) splits every layer it names."""
    pytest.importorskip("litgpt")
    settings = {"tensor_parallel_degree": 2, "tensor_parallel_plan": LITGPT_TP_PLAN}
    runs = run_distributed(_train, 2, settings, "litgpt", timeout=90)
    blocks = [f"transformer.h.{i}.{layer}" for i in range(2) for layer in ("attn.qkv", "attn.proj", "mlp.fc_1")]
    blocks += [f"transformer.h.{i}.{layer}" for i in range(2) for layer in ("mlp.fc_2", "mlp.proj")]
    for run in runs:
        assert sorted(run["split"]) == sorted(["transformer.wte", "lm_head", *blocks])
    _assert_fp32_matches(runs, _reference("litgpt", replicas=2), weights=False)


def test_a_litgpt_model_built_on_the_meta_device_trains_in_two_fp16_stages_as_plain_torch(tmp_path):
    """pp2 through ``smp.DistributedModel`` and ``@smp.step``, its ``lm_head`` placed on the last stage with
    ``smp.set_partition`` (LitGPT registers it before the blocks); built under delayed initialisation, its rotary
    tables (``cos``, ``sin``: buffers computed at construction) are on every stage as an eager build makes them."""
    pytest.importorskip("litgpt")
    runs = _assert_pipelined_run(tmp_path, "litgpt", {"delayed_parameter_initialization": True})
    torch.manual_seed(0)
    eager = lit_gpt()
    for run in runs:
        assert run["built_on_meta"] and set(run["buffers"]) == {"cos", "sin"}
        for name, value in run["buffers"].items():
            assert torch.equal(value, getattr(eager, name).half()), name
