"""smp.set_activation_checkpointing: the marked modules recompute their forward in backward, training is unchanged
bit for bit (dropout included), and every way to call it does what it says. The pipelined and tensor-parallel
cases run in tests/test_pipeline_distributed.py and tests/test_tensor_parallel_layers.py."""

import pytest
import torch
from torch import nn

from lightning_smp import SMPStrategy, activation_checkpointing, smp
from tests.models import TinyRegressor, quiet_trainer

WIDTH, DEPTH = 16, 4


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
