"""Context parallelism: the head-tail layout, the blockwise attention's math on one process (simulated ranks against
full attention, forward and backward), the topology's cp axis, and layouts trained against the single-process
fp32 run."""

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, smp
from lightning_smp.context_parallel import ring, sequence
from lightning_smp.topology import coordinates, rank_groups
from tests.distributed import init_gloo, launch_once
from tests.gpt import TinyGPT, token_batches
from tests.models import quiet_trainer
from tests.parity import FP32_REL, mean_losses, single_device_run

STEPS, BATCH = 4, 8


def test_head_tail_chunks_and_positions():
    assert [sequence.chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert sequence.positions(4, cp=2, rank=0).tolist() == [0, 1, 6, 7]
    assert sequence.positions(4, cp=2, rank=1).tolist() == [2, 3, 4, 5]
    assert sequence.positions(5, cp=1, rank=0).tolist() == [0, 1, 2, 3, 4]
    whole = torch.arange(16).view(2, 8)
    parts = [sequence.split(whole, cp=2, rank=r) for r in range(2)]
    assert parts[1].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(8))


def test_lengths_that_do_not_split_raise_naming_the_fix():
    with pytest.raises(ValueError, match=r"length 6, which context_parallel_degree=2 cannot split.*multiple of 4"):
        sequence.split(torch.zeros(1, 6), cp=2, rank=0)
    with pytest.raises(ValueError, match="attention_mask hides some tokens"):
        batch = {"input_ids": torch.zeros(1, 4), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
        sequence.split_batch(batch, cp=2, rank=0)


def _simulated(q, k, v, *, cp, causal):
    """Every rank's output and gradients from the block functions, each rank seeing every source's block (what the
    ring passes it), with the full attention's upstream gradient split the same way."""
    results = []
    splits = {
        name: [sequence.split(t, cp=cp, rank=r, dim=2) for r in range(cp)]
        for name, t in zip("qkv", (q, k, v), strict=True)
    }
    kv = [torch.stack([splits["k"][r], splits["v"][r]]) for r in range(cp)]
    for rank in range(cp):
        lq = splits["q"][rank]
        out = torch.zeros(lq.shape)
        lse = torch.full(lq.shape[:-1], float("-inf"))
        for step in range(cp):
            source = (rank - step) % cp
            ring.forward_block(lq, kv[source], out, lse, rows_cols=ring.block(rank, source, causal=causal), scale=None)
        results.append((out, lse))
    return splits, kv, results


@pytest.mark.parametrize(("cp", "causal", "kv_heads"), [(2, True, 4), (4, True, 2), (2, False, 4), (3, True, 1)])
def test_blocks_merged_by_logsumexp_equal_full_attention(cp, causal, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 4 * cp, 8)
    k, v = (torch.randn(2, kv_heads, 4 * cp, 8) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 4)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    splits, kv, results = _simulated(q.detach(), k.detach(), v.detach(), cp=cp, causal=causal)
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    for rank, (out, lse) in enumerate(results):
        torch.testing.assert_close(out, sequence.split(expected.detach(), cp=cp, rank=rank, dim=2))
        grad_out = sequence.split(grad, cp=cp, rank=rank, dim=2)
        grad_q = torch.zeros_like(out)
        for source in range(cp):
            rows_cols = ring.block(rank, source, causal=causal)
            start, width, dq, dk, dv = ring.backward_block(
                grad_out, splits["q"][rank], kv[source], out, lse, rows_cols=rows_cols, scale=None
            )
            grad_q[:, :, start:] += dq
            index = sequence.positions(4 * cp // cp, cp=cp, rank=source)[:width]
            grad_k[:, :, index] += dk
            grad_v[:, :, index] += dv
        torch.testing.assert_close(grad_q, sequence.split(q.grad, cp=cp, rank=rank, dim=2))
    torch.testing.assert_close(grad_k, k.grad)
    torch.testing.assert_close(grad_v, v.grad)


def test_rank_groups_with_a_context_parallel_axis():
    groups = rank_groups("cluster", dp=2, pp=1, tp=2, cp=2)  # DPCT: rank = dp*4 + cp*2 + tp
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["dp_tp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups["mp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert coordinates(6, "DPT", dp=2, pp=1, tp=2, cp=2) == {"dp": 1, "pp": 0, "tp": 0, "cp": 1}
    assert rank_groups("DCPT", dp=1, pp=2, tp=1, cp=2)["cp"] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="optionally with C"):
        rank_groups("DPTX", dp=1, pp=1, tp=1)


# -- layouts against the single-process fp32 run --------------------------------------------------------------------


class _SplitGPT(TinyGPT):
    """`tests.gpt.TinyGPT` (nn.TransformerEncoderLayer blocks) whose positions come from ``smp.cp_positions``, causal
    or bidirectional, trained with AdamW on 32 random sequences of 8 tokens in batches of 8."""

    def __init__(self, *, causal: bool = True, checkpointing: bool = False) -> None:
        super().__init__(checkpointing=checkpointing)
        self.causal = causal
        self.losses: list[float] = []

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(smp.cp_positions(ids.shape[1]))  # (B, T/cp, W)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype) if self.causal else None
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=self.causal)
        return self.head(self.norm(h))  # (B, T/cp, V)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.item())  # sync: fine for tests
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*token_batches(seed=1, samples=STEPS * BATCH)), batch_size=BATCH, shuffle=True)


def _fit(model: _SplitGPT, strategy_kwargs: dict) -> dict:
    trainer = quiet_trainer(SMPStrategy(**strategy_kwargs), devices=int(os.environ["WORLD_SIZE"]), max_steps=STEPS)
    trainer.fit(model)
    return {"losses": model.losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


_CP = {"context_parallel_degree": 2}
_RUNS = {
    2: {
        "cp2": (True, _CP),
        "cp2_bidirectional": (False, _CP),
        "cp2_all_gather_checkpointed": (True, {**_CP, "cp_comm_type": "all_gather"}),
    },
    4: {
        "cp4": (True, {"context_parallel_degree": 4}),
        "cp2_tp2_sp": (True, {**_CP, "tensor_parallel_degree": 2, "sequence_parallel": True, "prescaled_batch": True}),
    },
}


def _layouts(rank: int, world: int) -> dict:
    init_gloo()
    results = {}
    for name, (causal, kwargs) in _RUNS[world].items():
        results[name] = _fit(_SplitGPT(causal=causal, checkpointing="checkpointed" in name), kwargs)
    return results


def _launch(world: int) -> list[dict]:
    return launch_once(_layouts, world, world, timeout=400)


@functools.cache
def _reference(causal: bool) -> dict:
    def build() -> _SplitGPT:
        model = _SplitGPT(causal=causal)
        model.configure_model()
        return model

    return single_device_run(build, lambda model, batch, step: model.loss(batch), steps=STEPS)


@pytest.mark.timeout(450)
@pytest.mark.parametrize(("world", "name"), [(w, n) for w, runs in _RUNS.items() for n in runs])
def test_context_parallel_layouts_match_one_process(world, name):
    causal = _RUNS[world][name][0]
    reference = _reference(causal)
    runs = [rank[name] for rank in _launch(world)]
    assert mean_losses(runs, steps=STEPS) == pytest.approx(reference["losses"], rel=FP32_REL)
    if "tp2" not in name:  # every rank holds the whole model: its weights are the single run's
        for key, value in reference["weights"].items():
            actual = runs[-1]["weights"][key]
            if key.endswith("in_proj_bias"):  # its key third's gradient is rounding noise, which AdamW scales up
                actual, value = actual.chunk(3)[::2], value.chunk(3)[::2]
            torch.testing.assert_close(actual, value, rtol=FP32_REL, atol=1e-6, msg=key)
