"""smp.set_activation_checkpointing: the marked modules recompute their forward in backward, training is unchanged
bit for bit (dropout included), and every way to call it does what it says. The pipelined and tensor-parallel
cases run in tests/test_pipeline_distributed.py and tests/test_tensor_parallel_layers.py. Offloading
(``offload_activations``) trains exactly as plain checkpointing does, alone and pipelined, keeps no device tensor
between forward and backward, and loads ``activation_loading_horizon`` modules ahead."""

import gc
import weakref

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_smp.build
from lightning_smp import SMPStrategy, activation_checkpointing, smp
from lightning_smp.activation_offloading import ActivationOffloader
from tests.distributed import run_distributed
from tests.gpt import BLOCKS, SEQ, VOCAB, BlockGPT
from tests.models import TinyRegressor, quiet_trainer

WIDTH, DEPTH, STEPS = 16, BLOCKS, 6


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x):
        return self.dropout(torch.tanh(self.linear(x)))


def _blocks() -> nn.Sequential:
    return nn.Sequential(*(_Block() for _ in range(DEPTH)), nn.Linear(WIDTH, 1))


class _Deep(TinyRegressor):
    """TinyRegressor with dropout blocks; ``checkpoint`` marks ``net`` (or, with "block", its first block alone)
    in ``configure_model``; ``forwards`` counts each block's forward runs (recomputations included)."""

    def __init__(self, checkpoint: str | None = None) -> None:
        super().__init__(in_features=WIDTH, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
        self.net = _blocks()
        self._checkpoint = checkpoint
        self.forwards = [0] * DEPTH
        for index, block in enumerate(self.net[:DEPTH]):  # a recomputation calls the block's own forward, then
            block.linear.register_forward_pre_hook(lambda *_, index=index: self._count(index))  # its layers' __call__

    def _count(self, index: int) -> None:
        self.forwards[index] += 1

    def configure_model(self) -> None:
        if self._checkpoint == "block":
            smp.set_activation_checkpointing(self.net[0])
        elif self._checkpoint is not None:
            smp.set_activation_checkpointing(self.net, strategy=self._checkpoint)


def _fit(checkpoint: str | None, fp16: bool = False) -> _Deep:
    torch.manual_seed(0)
    model = _Deep(checkpoint)
    quiet_trainer(SMPStrategy(fp16=fp16), max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0).fit(model)
    return model


@pytest.mark.parametrize("checkpoint", ["each", "group_2", "contiguous", "block"])
def test_checkpointed_training_is_bit_identical_and_recomputes_the_marked_blocks(checkpoint):
    plain, marked = _fit(None), _fit(checkpoint)
    assert marked.losses == plain.losses  # dropout drew the same masks again in the recomputation
    for a, b in zip(plain.parameters(), marked.parameters(), strict=True):
        assert torch.equal(a, b)
    steps = len(plain.losses)
    assert plain.forwards == [steps] * DEPTH
    recomputed = [True] + [checkpoint != "block"] * (DEPTH - 1)
    assert marked.forwards == [steps * (2 if again else 1) for again in recomputed]


def test_fp16_checkpointed_training_matches_the_plain_fp16_run():
    plain, marked = _fit(None, fp16=True), _fit("each", fp16=True)
    assert marked.losses == plain.losses
    assert marked.forwards == [2 * len(plain.losses)] * DEPTH


def test_evaluation_runs_each_forward_once():
    model = _Deep("each")
    smp.set_activation_checkpointing(model.net)
    activation_checkpointing.apply(model)
    with torch.no_grad():
        model(torch.randn(3, WIDTH))
    assert model.forwards == [1] * DEPTH


def test_a_module_list_checkpoints_its_children_one_by_one_and_says_so_for_a_group_strategy():
    blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
    smp.set_activation_checkpointing(blocks, strategy="contiguous")
    with pytest.warns(UserWarning, match="no forward, so lightning_smp checkpoints each of its children on its own"):
        activation_checkpointing.apply(blocks)
    x = torch.randn(2, WIDTH, requires_grad=True)
    y = x
    for block in blocks:
        y = block(y)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_applying_twice_wraps_once():
    model = _Deep("each")
    smp.set_activation_checkpointing(model.net)
    activation_checkpointing.apply(model)
    activation_checkpointing.apply(model)  # trainer.validate after fit sets the model up again
    model(torch.randn(3, WIDTH)).sum().backward()
    assert model.forwards == [2] * DEPTH  # one recomputation, not a checkpoint inside a checkpoint


class _MarksTooLate(_Deep):
    def on_fit_start(self) -> None:
        smp.set_activation_checkpointing(self.net)


def test_a_mark_after_setup_is_refused_instead_of_ignored():
    with pytest.raises(RuntimeError, match=r"came after the strategy set the model up.*in the LightningModule's"):
        quiet_trainer(SMPStrategy(), max_steps=1).fit(_MarksTooLate())


def test_validate_after_fit_may_mark_the_same_modules_again():
    model = _Deep("each")  # its configure_model marks net at every fit / validate
    trainer = quiet_trainer(SMPStrategy(), max_steps=2)
    trainer.fit(model)
    trainer.validate(model)
    model.forwards = [0] * DEPTH
    model(torch.randn(3, WIDTH)).sum().backward()
    assert model.forwards == [2] * DEPTH  # still checkpointed once, not twice


@pytest.mark.parametrize("strategy", ["every", "group_0", "group_x", 2])
def test_an_unknown_strategy_is_a_clear_error(strategy):
    with pytest.raises(ValueError, match=r"is not a strategy; use 'each'.*'group_N' with N >= 1.*'contiguous'"):
        smp.set_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), strategy=strategy)


def test_only_modules_can_be_checkpointed():
    with pytest.raises(ValueError, match=r"takes an nn\.Module, got function"):
        smp.set_activation_checkpointing(lambda x: x)


# -- offloading -------------------------------------------------------------------------------------------------


class _GPT(BlockGPT):
    """`tests.gpt.BlockGPT` with dropout in its blocks and an untied head, its trunk checkpointed block by block
    unless ``checkpoint=False``."""

    def __init__(self, checkpoint: bool = True) -> None:
        super().__init__(tied=False, dropout=0.1)
        self.tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(1))
        self._checkpoint = checkpoint

    def configure_model(self) -> None:
        if self._checkpoint:
            smp.set_activation_checkpointing(self.blocks)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.tokens, batch_size=8)


class _Losses(Callback):
    """Every step's loss as Lightning saw it (on every pipeline stage: the last stage's)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def _fit_gpt(devices: int = 1, **strategy_kwargs) -> tuple[list[float], dict[str, Tensor]]:
    """Losses of STEPS steps and the weights this rank owns at the end."""
    torch.manual_seed(0)
    model, recorder = _GPT(), _Losses()
    strategy = SMPStrategy(**strategy_kwargs)
    trainer = quiet_trainer(strategy, devices=devices, max_steps=STEPS, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(model)
    owned = strategy.pipeline.owned_parameter_names() if strategy.pipeline is not None else model.state_dict()
    return recorder.losses, {k: v.detach().clone() for k, v in model.state_dict().items() if k in owned}


def _assert_same_training(offloaded: tuple, checkpointed: tuple) -> None:
    (losses, weights), (reference_losses, reference_weights) = offloaded, checkpointed
    assert len(losses) == STEPS and losses == reference_losses
    assert weights.keys() == reference_weights.keys() and weights
    for name, value in weights.items():
        assert torch.equal(value, reference_weights[name]), name


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_offloaded_training_is_bit_identical_to_plain_checkpointing(fp16):
    checkpointed = _fit_gpt(fp16=fp16)
    _assert_same_training(_fit_gpt(fp16=fp16, offload_activations=True), checkpointed)


def _offloaded_module(horizon: int) -> tuple[_GPT, ActivationOffloader]:
    torch.manual_seed(0)
    model = _GPT()
    model.configure_model()
    offloader = ActivationOffloader(horizon)
    activation_checkpointing.apply(model, offloader=offloader)
    return model, offloader


def test_offloaded_gradients_are_the_checkpointed_ones():
    torch.manual_seed(0)
    checkpointed = _GPT()
    checkpointed.configure_model()
    activation_checkpointing.apply(checkpointed)
    offloaded, _ = _offloaded_module(horizon=2)
    for model in (checkpointed, offloaded):
        torch.manual_seed(1)  # the same dropout masks
        model.training_step(model.tokens[:8], 0).backward()
    for (name, a), b in zip(checkpointed.named_parameters(), offloaded.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("offload", [False, True])
def test_offloading_keeps_no_block_input_between_forward_and_backward(offload):
    model, _ = _offloaded_module(horizon=2) if offload else (_GPT(), None)
    if not offload:
        model.configure_model()
        activation_checkpointing.apply(model)
    inputs: list[weakref.ref[Tensor]] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    loss = model.training_step(model.tokens[:8], 0)
    gc.collect()
    assert len(inputs) == DEPTH
    # Plain checkpointing keeps each block's input for the recomputation; offloading keeps host copies only.
    assert [ref() is not None for ref in inputs] == [not offload] * DEPTH
    loss.backward()


@pytest.mark.parametrize("horizon", [0, 2, DEPTH])
def test_backward_loads_activation_loading_horizon_modules_ahead(horizon):
    model, offloader = _offloaded_module(horizon)
    waiting: list[int] = []  # modules back on the device as each block's backward ends, last block first

    def count_when_its_backward_ends(block: nn.Module, args: tuple[Tensor, Tensor]) -> None:
        args[0].register_hook(lambda grad: waiting.append(offloader.modules_on_device))

    for block in model.blocks:
        block.register_forward_pre_hook(count_when_its_backward_ends)
    loss = model.training_step(model.tokens[:8], 0)
    assert offloader.modules_on_device == 0  # every block's input is in host memory
    loss.backward()
    assert waiting == [min(horizon, earlier) for earlier in reversed(range(DEPTH))]


class _CountingOffloader(ActivationOffloader):
    forwards = 0  # checkpointed forwards offloaded in this process

    def offloading(self):
        _CountingOffloader.forwards += 1
        return super().offloading()


def _fit_pipelined(rank: int) -> dict:
    torch.set_num_threads(1)
    lightning_smp.build.ActivationOffloader = _CountingOffloader  # this rank process only (the build makes it)
    options = dict(devices=2, pipeline_parallel_degree=2, microbatches=2)
    results = {"checkpointed": _fit_gpt(**options), "offloaded": _fit_gpt(**options, offload_activations=True)}
    # zero bubble: the last stage's split backward recomputes each block twice, loading its inputs back twice
    zero_bubble = dict(options, pipeline="zero_bubble")
    results["checkpointed_zb"] = _fit_gpt(**zero_bubble)
    results["offloaded_zb"] = _fit_gpt(**zero_bubble, offload_activations=True)
    return {**results, "forwards": _CountingOffloader.forwards}


@pytest.mark.timeout(480)
def test_pipelined_offloaded_training_matches_plain_checkpointing():
    for rank in run_distributed(_fit_pipelined, 2, timeout=420):
        _assert_same_training(rank["offloaded"], rank["checkpointed"])
        _assert_same_training(rank["offloaded_zb"], rank["checkpointed_zb"])
        assert rank["forwards"] == 2 * STEPS * 2 * (DEPTH // 2)  # two runs × microbatches × the blocks of a stage


def test_offloading_without_checkpointed_modules_is_a_clear_error():
    with pytest.raises(ValueError, match=r"offload_activations=True .* no module of _GPT is marked for activation "):
        quiet_trainer(SMPStrategy(offload_activations=True), max_steps=1).fit(_GPT(checkpoint=False))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloading_lowers_peak_cuda_memory_with_the_same_gradients():
    block_input = 8192 * 1024 * 4  # bytes of one block's fp32 input

    def run(offloader: ActivationOffloader | None) -> tuple[int, int, list[Tensor]]:
        torch.manual_seed(0)
        blocks = nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(16))).cuda()
        smp.set_activation_checkpointing(blocks)
        activation_checkpointing.apply(blocks, offloader=offloader)
        x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        y = blocks(x)
        pinned = torch.cuda.host_memory_stats()["active_bytes.current"]
        y.pow(2).mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, pinned, [x.grad, *(p.grad for p in blocks.parameters())]

    plain_peak, _, plain_grads = run(None)
    peak, pinned, grads = run(ActivationOffloader(horizon=2))
    assert pinned >= 16 * block_input  # every block's input went to pinned host memory
    assert peak < plain_peak - 8 * block_input  # 16 inputs kept on the device against 3 (+ the recomputation)
    for a, b in zip(plain_grads, grads, strict=True):
        torch.testing.assert_close(b, a)
