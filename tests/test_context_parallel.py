"""Context parallelism: the head-tail layout, the blockwise attention's math on one process (simulated ranks against
full attention, forward and backward), the topology's cp axis, and layouts trained against the single-process
fp32 run."""

import functools
import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPConfig, SMPStrategy, estimate_memory, smp
from lightning_smp.context_parallel import prepare_hugging_face, ring, sequence
from lightning_smp.topology import coordinates, rank_groups
from tests.distributed import init_gloo, launch_once
from tests.gpt import HEADS, SEQ, WIDTH, TinyGPT, TinyLlama, llama_config, token_batches
from tests.models import quiet_trainer
from tests.parity import FP16_REL, FP32_REL, mean_losses, one_process, single_device_run

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


def test_the_settings_default_to_none_check_their_values_and_come_from_smp_v2_options_too():
    assert (SMPConfig().context_parallel_degree, SMPConfig().cp_comm_type) == (1, "p2p")
    options = {"enabled": True, "parameters": {"context_parallel_degree": 2, "pipeline_parallel_degree": 2}}
    assert SMPConfig.from_smp_options(options).context_parallel_degree == 2
    assert "context_parallel_degree" not in SMPConfig().as_smp_parameters()  # smp v1's smp.state.cfg has none
    assert SMPConfig(context_parallel_degree=2, tensor_parallel_degree=2).data_parallel_degree(8) == 2
    with pytest.raises(ValueError, match=r"context_parallel_degree=2 = 4 does not divide the world size 6"):
        SMPConfig(context_parallel_degree=2, tensor_parallel_degree=2).data_parallel_degree(6)
    with pytest.raises(ValueError, match=r"context_parallel_degree=0 is invalid; set it to an int >= 1"):
        SMPConfig(context_parallel_degree=0)
    with pytest.raises(ValueError, match=r"cp_comm_type='ring' is invalid; choose one of 'p2p', 'all_gather'"):
        SMPConfig(cp_comm_type="ring")
    assert SMPConfig(placement_strategy="dpct").placement_order == "DPCT"


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
    or bidirectional, trained with AdamW on ``samples`` random sequences of 8 tokens in shuffled batches of 8."""

    def __init__(
        self, *, causal: bool = True, checkpointing: bool = False, samples: int = STEPS * BATCH, wrong: str = ""
    ) -> None:
        super().__init__(checkpointing=checkpointing)
        self.causal, self.samples = causal, samples
        self.wrong = wrong  # "length": sequences of 6 tokens; "padding": a key padding mask; "no attention"

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(smp.cp_positions(ids.shape[1]))  # (B, T/cp, W)
        if self.wrong == "no attention":
            return self.head(self.norm(h))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype) if self.causal else None
        padding = torch.zeros(ids.shape, dtype=torch.bool) if self.wrong == "padding" else None
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=self.causal, src_key_padding_mask=padding)
        return self.head(self.norm(h))  # (B, T/cp, V)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)  # the mean over the cp ranks: the whole sequences'

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*token_batches(seed=3, samples=BATCH)), batch_size=BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        ids, target = token_batches(seed=1, samples=self.samples)
        if self.wrong == "length":
            ids, target = ids[:, :6], target[:, :6]
        return DataLoader(TensorDataset(ids, target), batch_size=BATCH, shuffle=True)


class _SplitDecoderGPT(_SplitGPT):
    """`_SplitGPT` with ``nn.TransformerDecoderLayer`` blocks: causal self-attention, then attention over a memory
    (the embeddings, split as the sequence is: every query attends to all of it)."""

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(self.vocab, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerDecoderLayer(WIDTH, HEADS, 2 * WIDTH, 0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, self.vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        memory = h = self.tok(ids) + self.pos(smp.cp_positions(ids.shape[1]))  # (B, T/cp, W)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype)
        for block in self.blocks:
            h = block(h, memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(self.norm(h))  # (B, T/cp, V)


class _SplitLlama(TinyLlama):
    """`tests.gpt.TinyLlama` (grouped-query attention) on the same data as `_SplitGPT`; nothing of its own for
    context parallelism: the strategy gives it position ids."""

    def train_dataloader(self) -> DataLoader:
        ids, target = token_batches(seed=1, samples=STEPS * BATCH)
        return DataLoader(TensorDataset(ids, target), batch_size=BATCH, shuffle=True)


class _Losses(Callback):
    """Every step's loss as this rank's step returned it (its part of the sequences; a pipeline's last stage's)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _fit(model: pl.LightningModule, strategy_kwargs: dict, *, save: str | None = None, **trainer_kwargs) -> dict:
    recorder = _Losses()
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    callbacks: list = [recorder]
    if save is not None:  # at the epoch's end, as users save (see test_resume_a_cp2_checkpoint_at_cp1_...)
        where = Path(save)
        callbacks.append(ModelCheckpoint(dirpath=where.parent, filename=where.stem, save_on_train_epoch_end=True))
    trainer = quiet_trainer(
        SMPStrategy(**strategy_kwargs),
        devices=int(os.environ["WORLD_SIZE"]),
        callbacks=callbacks,
        enable_checkpointing=save is not None,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=100,  # validation runs once, after fit, when asked
        **trainer_kwargs,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    # after fit, the validation loop over the split sequences (a second setup of the trained model)
    validate = isinstance(model, _SplitGPT) and save is None and ckpt_path is None
    val_loss = trainer.validate(model, verbose=False)[0]["val_loss"] if validate else None
    optimizer = trainer.strategy.optimizers[0]
    whole = not any(key in strategy_kwargs for key in ("tensor_parallel_degree", "pipeline_parallel_degree"))
    whole = whole and "sharded_data_parallel_degree" not in strategy_kwargs
    return {
        "losses": recorder.losses,
        "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items()} if whole else None,
        "skipped": optimizer.skipped_steps.item() if hasattr(optimizer, "skipped_steps") else 0.0,
        "scale": optimizer.loss_scale if strategy_kwargs.get("fp16") else None,
        "val_loss": val_loss,
    }


_CP = {"context_parallel_degree": 2}
_FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**20}}
# name -> (model, strategy settings, replicas of the reference, its fp16, its clipping)
_RUNS = {
    2: {
        "cp2": ("gpt", _CP, 1, False, None),
        "cp2_bidirectional": ("gpt_bidirectional", _CP, 1, False, None),
        "cp2_decoder_layers": ("gpt_decoder", _CP, 1, False, None),
        "cp2_all_gather_checkpointed": ("gpt_checkpointed", {**_CP, "cp_comm_type": "all_gather"}, 1, False, None),
        "cp2_checkpointed_offloaded": ("gpt_checkpointed", {**_CP, "offload_activations": True}, 1, False, None),
        "sdp2_cp2": (
            "gpt",
            {**_CP, "sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0},
            1,
            False,
            1.0,
        ),
        "cp2_llama_eager": ("llama_eager", _CP, 1, False, None),
        "cp2_llama_pretrained_delayed": (
            "llama_pretrained",
            {**_CP, "delayed_parameter_initialization": True},
            1,
            False,
            None,
        ),
    },
    4: {
        "cp4": ("gpt", {"context_parallel_degree": 4}, 1, False, None),
        "cp2_tp2": ("gpt", {**_CP, "tensor_parallel_degree": 2}, 2, False, None),  # each tp rank reads its own
        "cp2_tp2_sp": (
            "gpt",
            {**_CP, "tensor_parallel_degree": 2, "sequence_parallel": True, "prescaled_batch": True},
            1,
            False,
            None,
        ),
        "pp2_cp2_fp16": ("gpt", {**_CP, **_FP16, "pipeline_parallel_degree": 2, "microbatches": 2}, 1, True, None),
        "dp2_cp2_zero1": ("gpt", {**_CP, "shard_optimizer_state": True}, 2, False, None),
        "pp2_cp2_zero_bubble": (
            "gpt",
            {**_CP, "pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "zero_bubble"},
            1,
            False,
            None,
        ),
        "pp2_cp2_simple": (
            "gpt",
            {**_CP, "pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "simple"},
            1,
            False,
            None,
        ),
    },
}


def _model(kind: str, pretrained: str) -> pl.LightningModule:
    if kind.startswith("llama"):
        return _SplitLlama(pretrained) if kind == "llama_pretrained" else _SplitLlama(attn_implementation="eager")
    if kind == "gpt_decoder":
        return _SplitDecoderGPT()
    return _SplitGPT(causal=kind != "gpt_bidirectional", checkpointing=kind == "gpt_checkpointed")


@functools.cache
def _pretrained() -> str:
    """A tiny Llama saved with ``save_pretrained`` (random, seeded), for ``from_pretrained`` under delayed init."""
    path = tempfile.mkdtemp(prefix="lightning_smp_cp_llama_")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(path)
    return path


def _layouts(rank: int, world: int, pretrained: str, resume: str) -> dict:
    init_gloo()
    results = {}
    for name, (kind, kwargs, *_) in _RUNS[world].items():
        results[name] = _fit(_model(kind, pretrained), kwargs, max_steps=STEPS)
    if world == 2:  # an epoch of two steps at cp2, saved, for the resume at cp1
        results["cp2_first_epoch"] = _fit(_SplitGPT(samples=2 * BATCH), _CP, max_epochs=1, save=resume)
        results["errors"] = {}
        for wrong in ("length", "padding", "no attention"):
            try:
                _fit(_SplitGPT(wrong=wrong), _CP, max_steps=1)
            except ValueError as error:
                results["errors"][wrong] = str(error)
    return results


def _resume_at_cp1(rank: int, resume: str) -> dict:
    # The second epoch, to its end (max_epochs, not max_steps: Lightning 2.6.6 resumes an epoch-end checkpoint under
    # max_steps alone with one batch of the next epoch and then the order of the epoch after, under any strategy,
    # DDPStrategy's too, so samples repeat; docs/preemption.md says so).
    return _fit(_SplitGPT(samples=2 * BATCH), {}, max_epochs=STEPS // 2, ckpt_path=resume)


@functools.cache
def _resume_path() -> str:
    return str(Path(tempfile.mkdtemp(prefix="lightning_smp_cp_resume_")) / "cp2.ckpt")


def _launch(world: int) -> list[dict]:
    return launch_once(_layouts, world, world, _pretrained(), _resume_path(), timeout=500)


@functools.cache
def _reference(
    kind: str, replicas: int = 1, fp16: bool = False, clip: float | None = None, samples: int = 0, steps: int = STEPS
) -> dict:
    def build() -> pl.LightningModule:
        model = _model(kind, _pretrained()) if not samples else _SplitGPT(samples=samples)
        model.configure_model()
        return model

    return single_device_run(
        build, lambda model, batch, step: model.loss(batch), steps=steps, replicas=replicas, fp16=fp16,
        init_scale=2.0**20, clip_norm=clip,
    )  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "name"), [(w, n) for w, runs in _RUNS.items() for n in runs])
def test_context_parallel_layouts_match_one_process(world, name):
    kind, _, replicas, fp16, clip = _RUNS[world][name]
    reference = _reference(kind, replicas, fp16, clip)
    runs = [rank[name] for rank in _launch(world)]
    losses = mean_losses(runs, steps=STEPS)  # each rank's loss is over its part of the sequences: their mean
    if fp16:
        assert all((run["skipped"], run["scale"]) == (reference["skipped"], reference["scale"]) for run in runs)
        assert losses == pytest.approx(reference["losses"], rel=FP16_REL)
        return
    assert losses == pytest.approx(reference["losses"], rel=FP32_REL)
    if runs[-1]["weights"] is not None:  # every rank holds the whole model: its weights are the single run's
        _assert_weights(runs[-1]["weights"], reference["weights"])
    if kind == "gpt":  # validation after fit: the trained weights' loss on the whole validation sequences
        assert all(run["val_loss"] == pytest.approx(_validation_loss(reference), rel=FP32_REL) for run in runs)


def _validation_loss(reference: dict) -> float:
    model = _SplitGPT()
    model.configure_model()
    model.load_state_dict(reference["weights"])
    with torch.no_grad():
        return model.loss(next(iter(model.val_dataloader()))).item()


def _assert_weights(actual: dict, expected: dict) -> None:
    for key, value in expected.items():
        mine = actual[key]
        if key.endswith("in_proj_bias"):  # its key third's gradient is rounding noise, which AdamW scales up
            mine, value = mine.chunk(3)[::2], value.chunk(3)[::2]
        torch.testing.assert_close(mine, value, rtol=FP32_REL, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.timeout(600)
def test_resume_a_cp2_checkpoint_at_cp1_equals_the_uninterrupted_run():
    first = [rank["cp2_first_epoch"] for rank in _launch(2)]
    resumed = one_process(_resume_at_cp1, _resume_path(), timeout=300)
    reference = _reference("gpt", samples=2 * BATCH, steps=STEPS)
    losses = mean_losses(first, steps=STEPS // 2) + resumed["losses"]
    assert losses == pytest.approx(reference["losses"], rel=FP32_REL)
    _assert_weights(resumed["weights"], reference["weights"])


def test_the_planner_counts_one_ranks_part_of_the_sequences():
    with torch.device("meta"):
        model = _SplitGPT()
        model.configure_model()
    batch = token_batches(seed=1, samples=BATCH)
    one, cp2, cp4 = (
        estimate_memory(model, config={"context_parallel_degree": cp}, batch=batch).largest for cp in (1, 2, 4)
    )
    assert one.activations > 0 and one.parameters == cp2.parameters == cp4.parameters  # parameters are replicated
    assert 0.45 < cp2.activations / one.activations < 0.55 and 0.2 < cp4.activations / one.activations < 0.3
    with pytest.raises(ValueError, match="length 8, which context_parallel_degree=3 cannot split"):
        estimate_memory(model, config={"context_parallel_degree": 3}, batch=batch)


@pytest.mark.timeout(600)
def test_what_context_parallelism_cannot_split_raises_at_the_first_step_naming_the_fix():
    for rank in _launch(2):
        errors = rank["errors"]
        assert "has length 6, which context_parallel_degree=2 cannot split" in errors["length"]
        assert "multiple of 4 (e.g. 8)" in errors["length"]
        assert "an attention mask of shape" in errors["padding"] and "is_causal=True" in errors["padding"]
        assert "ran no attention lightning_smp can split" in errors["no attention"]
        assert "set context_parallel_degree=1" in errors["no attention"]


def test_a_hugging_face_model_prepared_for_context_parallelism_still_generates_as_before_outside_a_step():
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(llama_config()).eval()
    ids = token_batches(seed=3, samples=2)[0][:, :6]
    before = llama.generate(ids, max_new_tokens=3, do_sample=False), llama(ids).logits
    assert prepare_hugging_face(llama) == 1
    assert torch.equal(llama.generate(ids, max_new_tokens=3, do_sample=False), before[0])
    torch.testing.assert_close(llama(ids).logits, before[1])
