"""Tests of `MasterWeightOptimizer`: tier 1 (single process, CPU), then frozen parameters under every layout.

Every numerical test compares the wrapper with a plain fp32 optimizer that steps fp32 copies of the parameters
using the unscaled grads of the same fp16 forward/backward, so only the wrapper's bookkeeping is under test.
"""

import io
import math
import os
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import SGD, Adadelta, AdamW, Optimizer
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy
from lightning_smp.checkpoint.names import state_by_param
from lightning_smp.grad_vote import clip_grad_norm_counted
from lightning_smp.loss_scaler import DynamicLossScaler, StaticLossScaler
from lightning_smp.optimizer import MasterWeightOptimizer
from lightning_smp.placement import mark_norm_duplicate
from lightning_smp.topology import build as build_topology
from tests.distributed import init_gloo, run_distributed
from tests.gpt import TinyGPT, token_batches
from tests.models import quiet_trainer
from tests.parity import FP16_REL, FP32_REL, assert_same_overflow, mean_losses, single_device_run

SCALE = 2.0**10
OptimizerFactory = Callable[[Iterator[Tensor] | list[Tensor]], Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd_momentum": lambda params: SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adadelta": lambda params: Adadelta(params, lr=1.0),
    "adamw_foreach": lambda params: AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda params: AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
}


def _model(seed: int = 0, dtype: torch.dtype = torch.float16, hidden: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2)).to(dtype)


def _batch(step: int, dtype: torch.dtype = torch.float16) -> Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 8, generator=generator).to(dtype)


def _backward(model: nn.Module, wrapper: MasterWeightOptimizer, step: int, *, first_layer_only: bool = False) -> None:
    """One fp16 forward/backward with the loss scaled as the precision plugin does."""
    x = _batch(step, next(model.parameters()).dtype)
    out = model[0](x) if first_layer_only else model(x)
    loss = out.float().pow(2).mean()
    scale = wrapper.scale_tensor
    (loss * scale if scale is not None else loss).backward()
    wrapper.note_backward()


def _fp32_copies(model: nn.Module) -> list[Tensor]:
    return [p.detach().float().clone().requires_grad_() for p in model.parameters()]


def _set_unscaled_grads(reference: list[Tensor], model: nn.Module, scale: float) -> None:
    for ref, param in zip(reference, model.parameters(), strict=True):
        ref.grad = None if param.grad is None else param.grad.float() / scale


def _snapshot(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


def _assert_all_equal(actual: list[Tensor], expected: list[Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


def _step_counts(wrapper: MasterWeightOptimizer) -> list[float]:
    """AdamW's per-param step counters (SGD keeps none)."""
    states = [wrapper.state[m] for m in wrapper.master_params() if m in wrapper.state]
    return [float(state["step"]) for state in states if "step" in state]


def _deep_copy(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ---------------------------------------------------------------- masters and the shared param groups


def test_masters_are_fp32_copies_and_replace_the_half_params_in_the_groups() -> None:
    half = nn.Linear(8, 4).half()
    norm = nn.BatchNorm1d(4)  # kept in fp32, as Lightning's precision plugins do
    inner = SGD([*half.parameters(), *norm.parameters()], lr=0.1)
    wrapper = MasterWeightOptimizer(inner, loss_scaler=StaticLossScaler(SCALE))

    masters = wrapper.master_params()
    assert len(masters) == 4
    for master, param in zip(masters[:2], half.parameters(), strict=True):
        assert master.dtype == torch.float32
        assert master is not param
        assert torch.equal(master, param.float())
    # fp32 params are their own masters, in the same objects.
    assert masters[2] is norm.weight
    assert masters[3] is norm.bias
    group_params = inner.param_groups[0]["params"]
    assert all(a is b for a, b in zip(group_params, masters, strict=True))
    assert all(p.dtype == torch.float32 for p in group_params)
    assert wrapper.param_groups is wrapper.optimizer.param_groups
    assert wrapper.optimizer is inner
    assert wrapper.state is inner.state
    assert wrapper.defaults is inner.defaults


def test_wrapper_equals_its_inner_optimizer_for_lightnings_scheduler_check() -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(SCALE))
    other = MasterWeightOptimizer(SGD(_model(1).parameters(), lr=0.1), loss_scaler=StaticLossScaler(SCALE))
    assert wrapper == wrapper.optimizer
    assert wrapper.optimizer == wrapper  # reflected through the wrapper's __eq__
    assert hash(wrapper) == hash(wrapper.optimizer)
    assert wrapper.optimizer in [wrapper]
    assert wrapper != other
    assert wrapper != other.optimizer


def test_fp32_params_get_their_grads_unscaled() -> None:
    weight = nn.Parameter(torch.ones(3))
    wrapper = MasterWeightOptimizer(SGD([weight], lr=0.5), loss_scaler=StaticLossScaler(SCALE))
    weight.grad = torch.full((3,), 2.0 * SCALE)
    wrapper.step()
    assert torch.equal(weight.detach(), torch.zeros(3))  # 1 - 0.5 * 2


# ---------------------------------------------------------------- LR schedulers


@pytest.mark.parametrize("target", ["wrapper", "inner"])
def test_step_lr_changes_the_lr_the_update_uses(target: str) -> None:
    param = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    wrapper = MasterWeightOptimizer(SGD([param], lr=1.0), loss_scaler=StaticLossScaler(4.0))
    scheduler = StepLR(wrapper if target == "wrapper" else wrapper.optimizer, step_size=1, gamma=0.5)
    assert scheduler.optimizer in [wrapper]
    master = wrapper.master_params()[0]
    for lr in (1.0, 0.5, 0.25):
        param.grad = torch.full((2,), 4.0, dtype=torch.float16)  # unscaled: 1.0
        before = master.detach().clone()
        wrapper.step()
        assert torch.equal(master.detach(), before - lr)
        assert torch.equal(param.detach(), master.detach().half())
        scheduler.step()


# ---------------------------------------------------------------- equivalence with an fp32 optimizer


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_an_fp32_optimizer_on_the_unscaled_grads(name: str) -> None:
    make = OPTIMIZERS[name]
    model = _model()
    reference = _fp32_copies(model)
    ref_optimizer = make(reference)
    wrapper = MasterWeightOptimizer(make(model.parameters()), loss_scaler=StaticLossScaler(SCALE))
    initial = _snapshot(wrapper.master_params())
    for step in range(5):
        wrapper.zero_grad()
        _backward(model, wrapper, step)
        _set_unscaled_grads(reference, model, SCALE)
        ref_optimizer.step()
        wrapper.step()
    masters = wrapper.master_params()
    for master, ref, param, start in zip(masters, reference, model.parameters(), initial, strict=True):
        assert not torch.equal(master, start)  # the test trained something
        # A power-of-two scale unscales exactly, so the same optimizer on the same grads is bit-identical.
        assert torch.equal(master.detach(), ref.detach())
        assert torch.equal(param.detach(), master.detach().half())


def test_fused_and_foreach_adamw_give_the_same_masters() -> None:
    results = []
    for name in ("adamw_foreach", "adamw_fused"):
        model = _model()
        wrapper = MasterWeightOptimizer(OPTIMIZERS[name](model.parameters()), loss_scaler=StaticLossScaler(SCALE))
        for step in range(5):
            wrapper.zero_grad()
            _backward(model, wrapper, step)
            wrapper.step()
        results.append(_snapshot(wrapper.master_params()))
    # Not bit-for-bit: torch's fused CPU AdamW kernel rounds differently from the foreach one (~1e-9 here).
    for foreach, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, foreach, rtol=0, atol=1e-7)


# ---------------------------------------------------------------- overflow


@pytest.mark.parametrize("delayed_shift", [1, 2])
@pytest.mark.parametrize("name", ["adamw_fused", "adamw_foreach", "sgd_momentum"])
def test_overflow_skips_the_step_and_backs_off(name: str, delayed_shift: int) -> None:
    model = _model()
    scaler = DynamicLossScaler(init_scale=SCALE, delayed_shift=delayed_shift)
    wrapper = MasterWeightOptimizer(OPTIMIZERS[name](model.parameters()), loss_scaler=scaler)
    _backward(model, wrapper, 0)
    wrapper.step()
    assert not wrapper.last_step_skipped()
    counts = _step_counts(wrapper)

    wrapper.zero_grad()
    _backward(model, wrapper, 1)
    model[0].weight.grad[0, 0] = math.inf
    masters, params = _snapshot(wrapper.master_params()), _snapshot(list(model.parameters()))
    assert wrapper.overflow
    wrapper.step()
    _assert_all_equal(_snapshot(wrapper.master_params()), masters)
    _assert_all_equal(_snapshot(list(model.parameters())), params)
    assert _step_counts(wrapper) == counts
    assert wrapper.skipped_steps.item() == 1
    assert wrapper.last_step_skipped()
    assert wrapper.overflow
    if delayed_shift == 1:
        assert wrapper.loss_scale == SCALE / 2
    else:
        assert wrapper.loss_scale == SCALE
        assert scaler.state_dict()["cur_hysteresis"] == 1

    wrapper.zero_grad()
    _backward(model, wrapper, 2)
    assert not wrapper.overflow
    wrapper.step()
    assert not wrapper.last_step_skipped()
    assert wrapper.skipped_steps.item() == 1
    for after, before in zip(wrapper.master_params(), masters, strict=True):
        assert not torch.equal(after, before)
    for param, master in zip(model.parameters(), wrapper.master_params(), strict=True):
        assert torch.equal(param.detach(), master.detach().half())
    assert [c - 1 for c in _step_counts(wrapper)] == counts


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw_fused"])
@pytest.mark.parametrize("overflowing", ["half", "fp32"])
def test_overflow_in_a_half_or_an_fp32_param_grad_skips_the_step(name: str, overflowing: str) -> None:
    """Either kind of grad counts in the overflow check, on the ordinary path and on the fused one (which checks
    the half grads and the fp32 ones in two lists)."""
    half = nn.Parameter(torch.ones(2, dtype=torch.float16))
    full = nn.Parameter(torch.ones(2))
    wrapper = MasterWeightOptimizer(OPTIMIZERS[name]([half, full]), loss_scaler=DynamicLossScaler(init_scale=SCALE))
    half.grad = torch.ones(2, dtype=torch.float16)
    full.grad = torch.ones(2)
    (half if overflowing == "half" else full).grad[1] = math.inf
    wrapper.step()
    assert wrapper.last_step_skipped()
    assert torch.equal(half.detach(), torch.ones(2, dtype=torch.float16))
    assert torch.equal(full.detach(), torch.ones(2))


# ---------------------------------------------------------------- clipping


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_master_grads_returns_the_unscaled_norm_and_clips(norm_type: float) -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=DynamicLossScaler(init_scale=SCALE))
    _backward(model, wrapper, 0)
    reference = _fp32_copies(model)
    _set_unscaled_grads(reference, model, SCALE)
    total = torch.nn.utils.get_total_norm([r.grad for r in reference], norm_type)
    max_norm = total.item() / 4
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm, norm_type)

    norm = wrapper.clip_master_grads(max_norm, norm_type)
    assert norm.dim() == 0
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    grads = [m.grad for m in wrapper.master_params()]
    for grad, ref in zip(grads, reference, strict=True):
        torch.testing.assert_close(grad, ref.grad, rtol=1e-6, atol=1e-9)
    clipped = torch.nn.utils.get_total_norm(grads, norm_type)
    torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-5, atol=0)


def test_clip_master_grads_leaves_small_grads_alone() -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(SCALE))
    _backward(model, wrapper, 0)
    reference = _fp32_copies(model)
    _set_unscaled_grads(reference, model, SCALE)
    wrapper.clip_master_grads(1e6)
    for master, ref in zip(wrapper.master_params(), reference, strict=True):
        torch.testing.assert_close(master.grad, ref.grad, rtol=1e-6, atol=0)


def test_clip_master_grads_returns_minus_one_on_overflow() -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=DynamicLossScaler(init_scale=SCALE))
    _backward(model, wrapper, 0)
    model[2].bias.grad[0] = -math.inf
    assert wrapper.clip_master_grads(1.0).item() == -1.0


def test_clip_master_grads_by_value_clamps() -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(SCALE))
    _backward(model, wrapper, 0)
    reference = _fp32_copies(model)
    _set_unscaled_grads(reference, model, SCALE)
    clip_value = max(r.grad.abs().max().item() for r in reference) / 3
    wrapper.clip_master_grads_by_value(clip_value)
    for master, ref in zip(wrapper.master_params(), reference, strict=True):
        assert torch.equal(master.grad, ref.grad.clamp(-clip_value, clip_value))
    assert max(m.grad.abs().max().item() for m in wrapper.master_params()) == pytest.approx(clip_value)


# ---------------------------------------------------------------- unused parameters


@pytest.mark.parametrize("name", ["adamw_foreach", "adamw_fused", "sgd_momentum"])
def test_unused_param_master_is_not_updated_like_in_fp32(name: str) -> None:
    model = _model()
    reference = _fp32_copies(model)
    ref_optimizer = OPTIMIZERS[name](reference)
    wrapper = MasterWeightOptimizer(OPTIMIZERS[name](model.parameters()), loss_scaler=StaticLossScaler(SCALE))
    unused_masters = _snapshot(wrapper.master_params()[2:])
    unused_params = _snapshot(list(model[2].parameters()))
    for step in range(3):
        wrapper.zero_grad()
        _backward(model, wrapper, step, first_layer_only=True)
        assert model[2].weight.grad is None
        _set_unscaled_grads(reference, model, SCALE)
        ref_optimizer.step()
        wrapper.step()
    _assert_all_equal(_snapshot(wrapper.master_params()[2:]), unused_masters)  # no weight decay either
    _assert_all_equal(_snapshot(list(model[2].parameters())), unused_params)
    for master, ref in zip(wrapper.master_params(), reference, strict=True):
        torch.testing.assert_close(master.detach(), ref.detach(), rtol=0, atol=1e-6)
    # The masters get their grads back for the next step that uses them.
    assert all(m.grad is not None for m in wrapper.master_params())


def _overflow_then_unused(wrapper: MasterWeightOptimizer, model: nn.Module) -> None:
    _backward(model, wrapper, 0)
    model[2].weight.grad[0, 0] = math.inf
    wrapper.step()
    assert wrapper.last_step_skipped()
    wrapper.zero_grad()
    _backward(model, wrapper, 1, first_layer_only=True)


@pytest.mark.parametrize("name", ["adamw_foreach", "adamw_fused"])
def test_stale_inf_of_an_unused_param_does_not_overflow(name: str) -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(
        OPTIMIZERS[name](model.parameters()), loss_scaler=DynamicLossScaler(init_scale=SCALE)
    )
    _overflow_then_unused(wrapper, model)
    before = _snapshot(list(model[0].parameters()))
    assert not wrapper.overflow
    wrapper.step()
    assert not wrapper.last_step_skipped()
    assert not torch.equal(model[0].weight.detach(), before[0])


def test_stale_grad_of_an_unused_param_is_not_in_the_norm() -> None:
    model = _model()
    # Scale 1, so the stale grad is not shrunk by being unscaled a second time.
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(1.0))
    _backward(model, wrapper, 0)
    wrapper.step()
    wrapper.zero_grad()
    _backward(model, wrapper, 1, first_layer_only=True)
    reference = _fp32_copies(model)
    _set_unscaled_grads(reference, model, 1.0)
    expected = torch.nn.utils.get_total_norm([r.grad for r in reference if r.grad is not None])
    torch.testing.assert_close(wrapper.clip_master_grads(1e6), expected, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- frozen parameters


def test_a_frozen_param_gets_no_master_and_stays_bit_identical_in_its_own_group() -> None:
    model = _model()
    model[2].weight.requires_grad_(False)
    frozen = model[2].weight.detach().clone()
    rest = [model[0].weight, model[0].bias, model[2].bias]
    inner = AdamW([{"params": [model[2].weight]}, {"params": rest}], lr=1e-2, weight_decay=0.1)
    wrapper = MasterWeightOptimizer(inner, loss_scaler=StaticLossScaler(SCALE))
    assert wrapper.param_groups[0]["params"] == [] and len(wrapper.master_params()) == 3
    assert all(p is not model[2].weight for p in wrapper.model_params())
    before = model[0].weight.detach().clone()
    for step in range(3):
        wrapper.zero_grad()
        _backward(model, wrapper, step)
        wrapper.step()
    assert torch.equal(model[2].weight, frozen) and not torch.equal(model[0].weight, before)
    assert len(wrapper.state) == 3


def test_a_param_unfrozen_after_wrapping_is_refused_with_a_remedy() -> None:
    model = _model()
    model[2].weight.requires_grad_(False)
    wrapper = MasterWeightOptimizer(AdamW(model.parameters(), lr=1e-2), loss_scaler=StaticLossScaler(SCALE))
    model[2].weight.requires_grad_(True)
    _backward(model, wrapper, 0)
    with pytest.raises(ValueError, match=r"did not require grad when the optimizer was wrapped.*before `trainer.fit`"):
        wrapper.step()


# ---------------------------------------------------------------- bf16


def test_bf16_has_no_scaling_never_skips_and_matches_fp32() -> None:
    model = _model(dtype=torch.bfloat16)
    reference = _fp32_copies(model)
    ref_optimizer = OPTIMIZERS["adamw_foreach"](reference)
    wrapper = MasterWeightOptimizer(OPTIMIZERS["adamw_foreach"](model.parameters()), loss_scaler=None)
    assert wrapper.loss_scale == 1.0
    assert wrapper.scale_tensor is None
    assert wrapper.loss_scaler is None
    for step in range(3):
        wrapper.zero_grad()
        _backward(model, wrapper, step, first_layer_only=False)
        _set_unscaled_grads(reference, model, 1.0)
        ref_optimizer.step()
        wrapper.step()
        assert not wrapper.last_step_skipped()
    for master, ref, param in zip(wrapper.master_params(), reference, model.parameters(), strict=True):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.detach(), ref.detach(), rtol=0, atol=1e-6)
        assert torch.equal(param.detach(), master.detach().bfloat16())

    wrapper.zero_grad()
    _backward(model, wrapper, 3)
    model[0].weight.grad[0, 0] = math.inf
    assert not wrapper.overflow
    wrapper.step()
    assert not wrapper.last_step_skipped()
    assert wrapper.skipped_steps.item() == 0


# ---------------------------------------------------------------- checkpoints


def _train(model: nn.Module, wrapper: MasterWeightOptimizer, steps: range, overflow_at: int | None = None) -> None:
    for step in steps:
        wrapper.zero_grad()
        _backward(model, wrapper, step)
        if step == overflow_at:
            model[0].bias.grad[1] = math.nan
        wrapper.step()


def _fp16_adamw(seed: int = 0, hidden: int = 4) -> tuple[nn.Module, MasterWeightOptimizer]:
    model = _model(seed, hidden=hidden)
    scaler = DynamicLossScaler(init_scale=SCALE, scale_window=2, delayed_shift=2)
    return model, MasterWeightOptimizer(OPTIMIZERS["adamw_fused"](model.parameters()), loss_scaler=scaler)


def test_state_dict_round_trip_continues_bit_identically() -> None:
    model, wrapper = _fp16_adamw()
    _train(model, wrapper, range(4), overflow_at=1)
    state = _deep_copy(wrapper.state_dict())
    assert state["skipped_steps"] == 1

    restored_model, restored = _fp16_adamw(seed=1)
    restored.load_state_dict(state)
    _assert_all_equal(_snapshot(list(restored_model.parameters())), _snapshot(list(model.parameters())))
    assert restored.loss_scale == wrapper.loss_scale
    assert restored.skipped_steps.item() == 1

    _train(model, wrapper, range(4, 8), overflow_at=5)
    _train(restored_model, restored, range(4, 8), overflow_at=5)
    _assert_all_equal(_snapshot(restored.master_params()), _snapshot(wrapper.master_params()))
    _assert_all_equal(_snapshot(list(restored_model.parameters())), _snapshot(list(model.parameters())))
    assert restored.loss_scaler.state_dict() == wrapper.loss_scaler.state_dict()
    assert restored.skipped_steps.item() == wrapper.skipped_steps.item() == 2


def test_load_state_dict_from_another_model_raises() -> None:
    model, wrapper = _fp16_adamw()
    _train(model, wrapper, range(1))
    _, other = _fp16_adamw(hidden=5)
    with pytest.raises(ValueError, match="different model or parameter order"):
        other.load_state_dict(wrapper.state_dict())


def test_load_state_dict_without_master_weights_raises() -> None:
    _, wrapper = _fp16_adamw()
    with pytest.raises(ValueError, match=r"not saved by an fp16/bf16 SMP run"):
        wrapper.load_state_dict(wrapper.optimizer.state_dict())


def _bf16_wrapper() -> tuple[nn.Module, MasterWeightOptimizer]:
    model = _model(1, dtype=torch.bfloat16)
    return model, MasterWeightOptimizer(OPTIMIZERS["adamw_fused"](model.parameters()), loss_scaler=None)


def test_fp16_state_into_a_bf16_wrapper_raises() -> None:
    model, wrapper = _fp16_adamw()
    _train(model, wrapper, range(2))
    _, bf16 = _bf16_wrapper()
    with pytest.raises(ValueError, match="same precision"):
        bf16.load_state_dict(wrapper.state_dict())


def test_a_rejected_load_leaves_the_wrapper_unchanged() -> None:
    model, wrapper = _fp16_adamw()
    _train(model, wrapper, range(2))
    bf16_model, bf16 = _bf16_wrapper()
    masters, params = _snapshot(bf16.master_params()), _snapshot(list(bf16_model.parameters()))
    with pytest.raises(ValueError):
        bf16.load_state_dict(wrapper.state_dict())
    _assert_all_equal(_snapshot(list(bf16_model.parameters())), params)
    _assert_all_equal(_snapshot(bf16.master_params()), masters)
    assert not bf16.state


# ---------------------------------------------------------------- host syncs


def _forbid(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    def raise_sync(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"host sync: Tensor.{name}")

    monkeypatch.setattr(torch.Tensor, name, raise_sync)


def test_fused_path_never_reads_the_device() -> None:
    model, wrapper = _fp16_adamw()
    for step in range(3):
        wrapper.zero_grad()
        _backward(model, wrapper, step)
        if step == 1:
            model[0].weight.grad[1, 1] = math.inf
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name in ("item", "__bool__", "__float__", "__int__", "__index__", "tolist"):
                _forbid(monkeypatch, name)
            wrapper.unscale_grads()
            wrapper.clip_master_grads(1.0)
            wrapper.step()
    assert wrapper.skipped_steps.item() == 1
    assert wrapper.loss_scale == SCALE


def test_non_fused_path_reads_the_overflow_flag_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(
        OPTIMIZERS["adamw_foreach"](model.parameters()), loss_scaler=DynamicLossScaler(init_scale=SCALE)
    )
    item = torch.Tensor.item
    calls = []

    def counting_item(tensor: Tensor) -> float:
        # Only the wrapper's reads: torch's foreach AdamW reads its CPU step counters with `.item()` itself.
        if "lightning_smp" in sys._getframe(1).f_code.co_filename:
            calls.append(tensor)
        return item(tensor)

    for step in range(3):
        wrapper.zero_grad()
        _backward(model, wrapper, step)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "item", counting_item)
            for name in ("__bool__", "__float__", "__int__", "tolist"):
                _forbid(patch, name)
            wrapper.unscale_grads()
            wrapper.clip_master_grads(1.0)
            wrapper.step()
        assert len(calls) == step + 1


# ---------------------------------------------------------------- misuse and small API


def test_add_param_group_is_refused_with_a_remedy() -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(SGD(model[0].parameters(), lr=0.1), loss_scaler=StaticLossScaler(SCALE))
    with pytest.raises(NotImplementedError, match="configure_optimizers"):
        wrapper.add_param_group({"params": list(model[2].parameters())})


def test_wrapping_an_optimizer_that_has_state_raises() -> None:
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    inner = AdamW([param], lr=0.1, foreach=True)
    param.grad = torch.ones(2, dtype=torch.float16)
    inner.step()
    with pytest.raises(ValueError, match="already has state"):
        MasterWeightOptimizer(inner, loss_scaler=StaticLossScaler(SCALE))


def test_wrapping_twice_raises() -> None:
    wrapper = MasterWeightOptimizer(SGD(_model().parameters(), lr=0.1), loss_scaler=StaticLossScaler(SCALE))
    with pytest.raises(ValueError, match="already a MasterWeightOptimizer"):
        MasterWeightOptimizer(wrapper, loss_scaler=StaticLossScaler(SCALE))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_the_model_grads(set_to_none: bool) -> None:
    model = _model()
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(SCALE))
    _backward(model, wrapper, 0)
    wrapper.zero_grad(set_to_none=set_to_none)
    for param in model.parameters():
        if set_to_none:
            assert param.grad is None
        else:
            assert torch.equal(param.grad, torch.zeros_like(param))


def test_last_step_skipped_follows_the_last_step() -> None:
    model, wrapper = _fp16_adamw()
    outcomes = []
    for step in range(4):
        wrapper.zero_grad()
        _backward(model, wrapper, step)
        if step in (1, 2):
            model[2].weight.grad[0, 0] = math.inf
        wrapper.step()
        assert wrapper.last_step_skipped_ready()
        outcomes.append(wrapper.last_step_skipped())
    assert outcomes == [False, True, True, False]
    assert wrapper.skipped_steps.item() == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_cuda_step_never_waits_for_the_host() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda().half()
    wrapper = MasterWeightOptimizer(
        AdamW(model.parameters(), lr=1e-3, fused=True), loss_scaler=DynamicLossScaler(init_scale=2.0**24)
    )
    x = torch.randn(32, 64, device="cuda", dtype=torch.float16)
    before = model[0].weight.detach().clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):  # 2**24 overflows fp16 at first: skipped and clean steps both run
            (model(x).float().pow(2).mean() * wrapper.scale_tensor).backward()
            wrapper.note_backward()
            wrapper.clip_master_grads(1.0)
            wrapper.step()
            wrapper.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 1 <= wrapper.skipped_steps.item() < 12
    assert not torch.equal(model[0].weight, before)  # the clean steps updated the fp16 weights


def test_params_marked_as_norm_duplicates_count_once() -> None:
    model = _model()
    mark_norm_duplicate(model[2].weight, axis="tp")  # as if another rank held the same values
    wrapper = MasterWeightOptimizer(SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(1.0))
    _backward(model, wrapper, 0)
    counted = [p.grad.float() for p in (model[0].weight, model[0].bias, model[2].bias)]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in counted]))
    torch.testing.assert_close(wrapper.clip_master_grads(1e9), expected)


@pytest.mark.parametrize("delayed_shift", [1, 2])
def test_the_fused_fast_path_equals_the_explicit_unscale_path(delayed_shift: int) -> None:
    """Handing the scaled grads to the fused optimizer (no separate unscale pass) changes nothing: the same
    skipped steps, scales and masters, bit for bit, as unscaling first."""
    runs = []
    for explicit_unscale in (False, True):
        model = _model()
        scaler = DynamicLossScaler(init_scale=2.0**19, scale_window=3, delayed_shift=delayed_shift)
        wrapper = MasterWeightOptimizer(OPTIMIZERS["adamw_fused"](model.parameters()), loss_scaler=scaler)
        trace = []
        for step in range(12):
            _backward(model, wrapper, step)
            if step == 7:
                model[0].weight.grad[0, 0] = math.nan
            if explicit_unscale:
                wrapper.unscale_grads()
            wrapper.step()
            trace.append((wrapper.last_step_skipped(), wrapper.loss_scale))
            wrapper.zero_grad()
        runs.append((trace, [m.detach().clone() for m in wrapper.master_params()]))
    (fast_trace, fast_masters), (ref_trace, ref_masters) = runs
    assert fast_trace == ref_trace
    assert any(skipped for skipped, _ in fast_trace) and not all(skipped for skipped, _ in fast_trace)
    assert all(torch.equal(a, b) for a, b in zip(fast_masters, ref_masters, strict=True))


def _clip_half_of_a_vector(rank: int) -> list[float]:
    """Rank r holds half r of a tensor-parallel vector plus a replicated scalar (a duplicate on rank 1)."""
    init_gloo()
    topology = build_topology(dp=1, pp=1, tp=2, order="DPT", device_type="cpu")
    full = torch.arange(1.0, 9.0)
    shard = nn.Parameter(torch.zeros(4))
    shard.grad = full[4 * rank : 4 * rank + 4].clone()
    replicated = nn.Parameter(torch.zeros(1))
    replicated.grad = torch.tensor([10.0])
    if rank == 1:
        mark_norm_duplicate(replicated, axis="tp")
    norm = clip_grad_norm_counted([shard, replicated], 1.0, topology=topology)
    return [norm.item(), torch.linalg.vector_norm(shard.grad).item()]


@pytest.mark.timeout(120)
def test_fp32_clipping_takes_the_norm_over_every_rank_counting_replicas_once() -> None:
    results = run_distributed(_clip_half_of_a_vector, 2, timeout=100)
    expected = math.sqrt(sum(v * v for v in range(1, 9)) + 100.0)
    for norm, _ in results:
        assert norm == pytest.approx(expected, rel=1e-6)
    clipped = math.sqrt(sum(shard_norm**2 for _, shard_norm in results))  # the sharded vector after clipping
    assert clipped == pytest.approx(math.sqrt(sum(v * v for v in range(1, 9))) / expected, rel=1e-5)


# ---------------------------------------------------------------- frozen parameters under every layout

FROZEN_STEPS = 6
FROZEN_FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**18}}  # the first steps overflow
ZERO1 = {"shard_optimizer_state": True}
SDP2 = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 1e9}


class _FrozenPositionGPT(TinyGPT):
    """The tiny GPT with its position embedding frozen, yet handed to AdamW(weight_decay=0.1) as users do: with
    every other parameter, or (``own_group``) in a param group of its own."""

    def __init__(self, batch_size: int = 8, *, own_group: bool = False) -> None:
        super().__init__()
        self.batch_size, self.own_group = batch_size, own_group

    def configure_model(self) -> None:
        if self.blocks is None:  # frozen when built; a later fit may find it unfrozen
            super().configure_model()
            self.pos.weight.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        if not self.own_group:
            return AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        named = dict(self.named_parameters())  # a pipeline stage holds its own part
        frozen = [named.pop("pos.weight")] if "pos.weight" in named else []
        return AdamW([{"params": frozen}, {"params": list(named.values())}], lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*token_batches(0, 64)), batch_size=self.batch_size)


def _built_frozen_gpt() -> _FrozenPositionGPT:
    model = _FrozenPositionGPT()
    model.configure_model()
    return model


def _frozen_weight(model: nn.Module) -> Tensor | None:
    """The frozen weight as this rank holds it (a copy); None on a pipeline stage that does not hold it."""
    weight = dict(model.named_parameters()).get("pos.weight")
    if weight is None:
        return None
    return (weight.to_local() if isinstance(weight, DTensor) else weight).detach().clone()


def _fit_frozen(strategy_kwargs: dict, model: _FrozenPositionGPT | None = None, *, own_group: bool = False) -> dict:
    """One fit: every step's loss (the last stage's, on every rank), the frozen weight as this rank holds it before
    the first step and after the last."""
    model = model or _FrozenPositionGPT(own_group=own_group)
    held: dict[str, Tensor] = {}
    losses: list[float] = []

    class _Record(Callback):
        def on_train_start(self, trainer, pl_module):
            held["before"] = _frozen_weight(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    strategy, devices = SMPStrategy(**strategy_kwargs), int(os.environ["WORLD_SIZE"])
    trainer = quiet_trainer(strategy, devices=devices, max_steps=FROZEN_STEPS, callbacks=[_Record()])
    trainer.fit(model)
    optimizer = trainer.strategy.optimizers[0]
    after, frozen = _frozen_weight(model), dict(model.named_parameters()).get("pos.weight")
    # the parameters with a master (wrapped optimizers) or with optimizer state (any)
    kept = optimizer.model_params() if isinstance(optimizer, MasterWeightOptimizer) else []
    kept += [param for param, _ in state_by_param(optimizer)]
    return {
        "losses": losses,
        "dp": trainer.strategy.topology.rank("dp"),
        "unchanged": after is None or torch.equal(held["before"], after),
        "trains_frozen": any(p is frozen for p in kept),
        "skipped": getattr(optimizer, "skipped_steps", torch.zeros(())).item(),
        "scale": getattr(optimizer, "loss_scale", None),
        "model": model,
    }


def _frozen_two_ranks(rank: int) -> dict:
    layouts = {
        "dp2_zero1": ZERO1,
        "dp2_zero1_fp16": {**ZERO1, **FROZEN_FP16},
        "sdp2": SDP2,
        "tp2": {"tensor_parallel_degree": 2},
        "pp2": {"pipeline_parallel_degree": 2, "microbatches": 2},
    }
    runs = {name: _fit_frozen(kwargs) for name, kwargs in layouts.items()}
    runs["dp2_zero1_fp16_own_group"] = _fit_frozen({**ZERO1, **FROZEN_FP16}, own_group=True)
    # the same model unfrozen between fits: the next fit trains it (under ZeRO-1: it gets a share of the masters)
    model = runs["dp2_zero1"]["model"]
    model.pos.weight.requires_grad_(True)
    runs["unfrozen"] = _fit_frozen(ZERO1, model)
    return {name: {k: v for k, v in run.items() if k != "model"} for name, run in runs.items()}


def _frozen_one_rank(rank: int) -> dict:
    runs = {"one": _fit_frozen({}), "one_fp16": _fit_frozen(FROZEN_FP16)}
    return {name: {k: v for k, v in run.items() if k != "model"} for name, run in runs.items()}


def _frozen_four_ranks(rank: int) -> dict:
    runs = {"sdp2tp2": _fit_frozen({**SDP2, "tensor_parallel_degree": 2})}
    return {name: {k: v for k, v in run.items() if k != "model"} for name, run in runs.items()}


def _loss(model, batch, step):
    return model.loss(batch)


@pytest.mark.timeout(900)
def test_a_frozen_param_stays_bit_identical_and_the_rest_trains_as_on_one_device_under_every_layout() -> None:
    ranks = run_distributed(_frozen_two_ranks, 2, timeout=600) + run_distributed(_frozen_four_ranks, 4, timeout=400)
    ranks += run_distributed(_frozen_one_rank, 1, timeout=200)
    # name -> (ranks reading their own batch: dp x tp under smp's prescaled_batch=False, fp16)
    expected = {"dp2_zero1": (2, False), "dp2_zero1_fp16": (2, True), "sdp2": (2, False), "tp2": (2, False)}
    expected |= {"pp2": (1, False), "sdp2tp2": (4, False), "one": (1, False), "one_fp16": (1, True)}
    expected |= {"dp2_zero1_fp16_own_group": (2, True)}
    references = {
        (replicas, fp16): single_device_run(
            _built_frozen_gpt, _loss, steps=FROZEN_STEPS, replicas=replicas, fp16=fp16, init_scale=2.0**18
        )
        for replicas, fp16 in set(expected.values())
    }
    for name, (replicas, fp16) in expected.items():
        runs = [rank[name] for rank in ranks if name in rank]
        for run in runs:
            assert run["unchanged"] and not run["trains_frozen"], name
        reference = references[replicas, fp16]
        losses = mean_losses(runs, replica="dp", steps=FROZEN_STEPS)
        assert losses == pytest.approx(reference["losses"], rel=FP16_REL if fp16 else FP32_REL), name
        if fp16:
            assert_same_overflow(runs[0], reference)
            assert reference["skipped"] >= 1
    for rank in ranks[:2]:
        assert rank["unfrozen"]["trains_frozen"] and not rank["unfrozen"]["unchanged"]
