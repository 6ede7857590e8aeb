"""Hugging Face transformers models split by their own tensor-parallel plans, against one process (gloo, CPU).

Tiny random-init models built in ``configure_model`` under ``smp.model_creation(tensor_parallelism=...)``, with no
``tensor_parallel_plan``: a Llama with grouped-query attention (4 heads, 2 key/value heads; its plan: q/k/v/gate/up
"colwise", o/down "rowwise", the embedding "embedding_rowwise", the head "colwise_gather_output"), GPT-2 (no plan of
its own, ``Conv1D`` layers: lightning_smp's built-in plan), Qwen3 (per-head norms "replicated_with_grad_allreduce"),
Phi-3 (a fused gate_up projection, its plan overridden by the user's: "packed_colwise") and BERT (built-in plan).
Three launches: one process (the references), two (tp=2), four (pp=2 x tp=2, fp16). Pure planning checks run without
processes.
"""

import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import SMPStrategy, smp
from lightning_smp import topology as topology_builder
from lightning_smp.config import SMPConfig
from lightning_smp.pipeline.stage import StandIn
from lightning_smp.tensor_parallel import parallelize, plan_tensor_parallel, shard_of
from lightning_smp.tensor_parallel.plan import match_pattern
from tests.distributed import init_gloo, launch_once
from tests.models import quiet_trainer

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 10, 4, 8, 64
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**20, "scale_window": 4}}
PP2_TP2 = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
TOKENS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
PHI3_PLAN = {"model.model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.model.layers.*.mlp.down_proj": "rowwise"}


def _build(kind: str) -> torch.nn.Module:
    if kind == "llama":
        config = transformers.LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, **TOKENS)
        return transformers.LlamaForCausalLM(config)
    if kind == "qwen3":
        config = transformers.Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **TOKENS)
        return transformers.Qwen3ForCausalLM(config)
    if kind == "phi3":
        config = transformers.Phi3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, **TOKENS)
        return transformers.Phi3ForCausalLM(config)
    if kind == "bert":
        dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        config = transformers.BertConfig(**SMALL, num_attention_heads=4, max_position_embeddings=SEQ, **dropout)
        return transformers.BertForMaskedLM(config)
    assert kind == "gpt2"
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, **TOKENS, **dict.fromkeys(_GPT2_DROPOUT, 0.0)
    )
    return transformers.GPT2LMHeadModel(config)


_GPT2_DROPOUT = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


class _CausalLM(pl.LightningModule):
    """A transformers causal LM trained on fixed random tokens; ``extra_plan`` adds entries to the model's own plan,
    ``checkpointing`` checkpoints its decoder layers, ``attention_dropout`` sets the Llama's."""

    def __init__(
        self,
        kind: str,
        extra_plan: dict[str, str] | None = None,
        *,
        checkpointing: bool = False,
        attention_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.kind, self.extra_plan = kind, extra_plan
        self.checkpointing, self.attention_dropout = checkpointing, attention_dropout
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.model = _build(self.kind)
        if self.extra_plan:
            self.model.tp_plan = {**self.model.tp_plan, **self.extra_plan}
        if self.attention_dropout:
            self.model.config.attention_dropout = self.attention_dropout
            for layer in self.model.model.layers:
                layer.self_attn.attention_dropout = self.attention_dropout
        if self.checkpointing:
            smp.set_activation_checkpointing(self.model.model.layers)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        # each tensor-parallel rank reads its share (prescaled_batch=False): a step trains on BATCH samples
        return DataLoader(TensorDataset(ids), batch_size=BATCH // smp.tp_size())


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit(
    rank: int,
    kind: str,
    strategy_kwargs: dict,
    extra_plan: dict[str, str] | None = None,
    options: dict | None = None,
) -> dict:
    options = dict(options or {})
    clip = options.pop("gradient_clip_val", None)
    model, recorder = _CausalLM(kind, extra_plan, **options), _Losses()
    trainer = quiet_trainer(
        SMPStrategy(**strategy_kwargs), devices=int(os.environ.get("WORLD_SIZE", "1")), max_steps=STEPS,
        callbacks=[recorder], num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=clip,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    optimizer = trainer.strategy.optimizers[0]
    plan = [f"model.{pattern}" for pattern, style in model.model.tp_plan.items() if style in _SPLITTING]
    named = [  # the planned modules this rank holds (another pipeline stage holds those a StandIn replaced)
        name
        for name, module in model.named_modules()
        if any(match_pattern(p, name) for p in plan or _GPT2_PLAN) and not isinstance(module, StandIn)
    ]
    return {
        "losses": recorder.losses,
        "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "planned": named,
        "whole": [name for name in named if shard_of(model.get_submodule(name).weight) is None],
        "sharded": sorted(name for name, p in model.named_parameters() if shard_of(p) is not None),
        "warnings": [
            str(w.message) for w in caught if "tensor parallelism" in str(w.message) or "sequence" in str(w.message)
        ],
        "classes": {name: type(module).__name__ for name, module in model.named_modules()},
        "skipped": optimizer.skipped_steps.item() if hasattr(optimizer, "skipped_steps") else None,
    }


_SPLITTING = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise"}
# what lightning_smp's built-in plan splits of GPT-2, as module paths in the LightningModule
_GPT2_PLAN = [f"model.transformer.h.*.{layer}" for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
_GPT2_PLAN += ["model.transformer.wte", "model.lm_head"]
_NORM_ON_SLICES = {"model.norm": "sequence_parallel"}
# sequence parallelism: with activation checkpointing and clipping; dropout (the attention's) with and without it
SP, TP2 = {"sequence_parallel": True}, {"tensor_parallel_degree": 2}
CHECKPOINTED_CLIPPED = {"checkpointing": True, "gradient_clip_val": 0.5}
DROPOUT = {**CHECKPOINTED_CLIPPED, "attention_dropout": 0.2}
_RUNS = {
    1: {
        "llama": ("llama", {}),
        "llama_fp16": ("llama", FP16),
        "gpt2": ("gpt2", {}),
        "qwen3": ("qwen3", {}),
        "phi3": ("phi3", {}),
        "bert": ("bert", {}),
        "llama_clipped": ("llama", {}, None, CHECKPOINTED_CLIPPED),
        "llama_clipped_fp16": ("llama", FP16, None, CHECKPOINTED_CLIPPED),
    },
    2: {
        "llama": ("llama", TP2),
        "llama_norm_on_slices": ("llama", TP2, _NORM_ON_SLICES),
        "gpt2": ("gpt2", TP2),
        "qwen3": ("qwen3", TP2),
        "phi3": ("phi3", {**TP2, "tensor_parallel_plan": PHI3_PLAN}),
        "bert": ("bert", TP2),
        "llama_sp": ("llama", {**TP2, **SP}, None, CHECKPOINTED_CLIPPED),
        "llama_sp_fp16": ("llama", {**TP2, **SP, **FP16}, None, CHECKPOINTED_CLIPPED),
        "llama_sp_dropout": ("llama", {**TP2, **SP}, None, DROPOUT),
        "llama_dropout": ("llama", TP2, None, DROPOUT),
    },
    4: {
        "llama_fp16": ("llama", {**PP2_TP2, **FP16}),
        "llama_sp": ("llama", {**PP2_TP2, **SP}, None, CHECKPOINTED_CLIPPED),
        "llama_sp_fp16": ("llama", {**PP2_TP2, **SP, **FP16}, None, CHECKPOINTED_CLIPPED),
    },
}


def _gpt2_attention_dropout() -> dict:
    """GPT-2's split attention in training with dropout: the heads of each rank draw their own dropout masks, and the
    output (after the residual dropout, on the whole activation) is the same on every rank."""
    world = dist.get_world_size()
    topology = topology_builder.build(dp=1, pp=1, tp=world, order="DPT", device_type="cpu")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, attn_pdrop=0.5, resid_pdrop=0.5, **TOKENS
    )
    config._attn_implementation = "eager"  # returns the attention probabilities after their dropout
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = transformers.GPT2Model(config)
    parallelize(model, topology=topology, config=SMPConfig(tensor_parallel_degree=world))
    output, weights = model.h[0].attn(torch.ones(2, SEQ, 32))  # weights: (2, 4 / tp, SEQ, SEQ)
    outputs, masks = [torch.empty_like(output) for _ in range(world)], [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(outputs, output.detach())
    dist.all_gather(masks, (weights == 0).float())
    return {
        "outputs_equal": all(torch.equal(other, outputs[0]) for other in outputs),
        "masks_differ": not torch.equal(masks[0], masks[1]),
        "dropped": masks[0].mean().item(),
    }


def _run_all(rank: int, world: int) -> dict:
    results = {}
    if world > 1:
        init_gloo()
        results["gpt2_attention_dropout"] = _gpt2_attention_dropout()
    return results | {name: _fit(rank, *args) for name, *args in ((name, *run) for name, run in _RUNS[world].items())}


def launch(world: int) -> list[dict]:
    return launch_once(_run_all, world, world, timeout=500)


def _check_tp2(name: str) -> list[dict]:
    reference, runs = launch(1)[0][name.removesuffix("_norm_on_slices")], [rank[name] for rank in launch(2)]
    for run in runs:
        assert len(run["losses"]) == STEPS
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert run["bytes"] <= 0.55 * reference["bytes"]
        assert run["planned"] and not run["whole"], f"kept whole: {run['whole']}"
    return runs


@pytest.mark.timeout(600)
def test_llama_with_grouped_query_attention_splits_by_its_own_plan_and_matches_one_process():
    runs = _check_tp2("llama")
    assert len(runs[0]["planned"]) == 2 + 2 * 7  # embedding, head, q/k/v/o/gate/up/down of both layers
    assert runs[0]["warnings"] == []


@pytest.mark.timeout(600)
def test_gpt2_splits_by_the_built_in_plan_and_matches_one_process():
    runs = _check_tp2("gpt2")
    assert (
        len(runs[0]["planned"]) == 2 + 2 * 4
    )  # embedding (tied to the head), c_attn/c_proj/c_fc/c_proj of both layers
    assert runs[0]["warnings"] == []


@pytest.mark.timeout(600)
def test_gpt2_attention_dropout_draws_each_ranks_heads_from_its_own_stream():
    for rank in launch(2):
        check = rank["gpt2_attention_dropout"]
        assert check["outputs_equal"] and check["masks_differ"]
        assert 0.3 < check["dropped"] < 0.7  # attn_pdrop=0.5: the masks are dropout masks


@pytest.mark.timeout(600)
def test_per_head_norms_sum_their_gradients_and_match_one_process():
    _check_tp2("qwen3")


@pytest.mark.timeout(600)
def test_a_user_plan_overrides_the_models_entries_with_a_packed_split():
    _check_tp2("phi3")


@pytest.mark.timeout(600)
def test_bert_encoder_splits_by_the_built_in_plan_and_matches_one_process():
    reference, runs = launch(1)[0]["bert"], [rank["bert"] for rank in launch(2)]
    for run in runs:
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        # per layer: q, k, v and intermediate weights and biases, the two output weights (their biases are added
        # once, replicated); the masked-LM head shares its bias, so it and the tied word embedding stay whole
        assert len(run["sharded"]) == 2 * 10
    assert "cls.predictions.decoder" in runs[0]["warnings"][0]


@pytest.mark.timeout(600)
def test_a_norm_of_the_style_sequence_parallel_runs_on_a_slice_of_the_sequence_and_matches_one_process():
    runs = _check_tp2("llama_norm_on_slices")
    assert runs[0]["warnings"] == []
    assert runs[0]["classes"]["model.model.norm"] == "SequenceParallelLlamaRMSNorm"


@pytest.mark.timeout(900)
def test_llama_with_sequence_parallelism_matches_one_process_at_tp2_and_pp2_tp2():
    reference, reference_fp16 = launch(1)[0]["llama_clipped"], launch(1)[0]["llama_clipped_fp16"]
    assert 1 <= reference_fp16["skipped"] < STEPS
    for world in (2, 4):
        for run in (rank["llama_sp"] for rank in launch(world)):
            assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
            assert run["warnings"] == []  # every layer runs sequence-parallel
            assert "SequenceParallelLlamaDecoderLayer" in run["classes"].values()  # under pp2 one per stage
        for run in (rank["llama_sp_fp16"] for rank in launch(world)):
            assert run["skipped"] == reference_fp16["skipped"]
            assert run["losses"] == pytest.approx(reference_fp16["losses"], rel=2e-2)
    # the attention's dropout (inside the blocks, on whole sequences) draws the same with and without it
    for rank in launch(2):
        assert rank["llama_sp_dropout"]["losses"] == pytest.approx(rank["llama_dropout"]["losses"], rel=1e-5)
        assert rank["llama_dropout"]["losses"] != pytest.approx(rank["llama_sp"]["losses"], rel=1e-3)


@pytest.mark.timeout(900)
def test_llama_pp2_tp2_fp16_matches_one_process_with_the_same_skipped_steps():
    reference = launch(1)[0]["llama_fp16"]
    assert 1 <= reference["skipped"] < STEPS  # the comparison covers the overflow path
    for rank in launch(4):
        run = rank["llama_fp16"]
        assert run["skipped"] == reference["skipped"]
        assert run["losses"] == pytest.approx(reference["losses"], rel=2e-2)


# -- planning, without processes ---------------------------------------------------------------------------------


def _created(kind: str) -> torch.nn.Module:
    with smp.model_creation(tensor_parallelism=True):
        return _build(kind)


def test_grouped_query_attention_stays_whole_where_its_key_value_heads_do_not_divide():
    plan = plan_tensor_parallel(_created("llama"), tp_size=4)  # 2 key/value heads over 4 ranks
    split = {unit.name.rpartition(".")[2] for unit in plan.units}
    assert split == {"embed_tokens", "lm_head", "gate_proj", "up_proj", "down_proj"}
    ((label, reason),) = plan.kept_whole
    assert label == "model.layers.*.self_attn.{k_proj, o_proj, q_proj, v_proj}"
    assert "k_proj (Linear): its out_features=16 hold 2 heads of 8, not divisible by tensor_parallel_degree=4" in reason


def test_a_model_created_without_tensor_parallelism_is_not_split():
    torch.manual_seed(0)
    assert plan_tensor_parallel(_build("llama"), tp_size=2).units == ()


def test_bert_encoder_layers_split_by_the_built_in_plan():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    with smp.model_creation(tensor_parallelism=True):
        model = transformers.BertModel(config)
    names = [unit.name for unit in plan_tensor_parallel(model, tp_size=2).units]
    assert names == [
        "embeddings.word_embeddings",
        "encoder.layer.0.attention.self.query",
        "encoder.layer.0.attention.self.key",
        "encoder.layer.0.attention.self.value",
        "encoder.layer.0.attention.output.dense",
        "encoder.layer.0.intermediate.dense",
        "encoder.layer.0.output.dense",
    ]


def test_every_plan_style_is_in_the_configuration_reference_and_explained_in_the_tensor_parallelism_page():
    from pathlib import Path

    from lightning_smp.config import TENSOR_PARALLEL_STYLES

    docs = Path(__file__).resolve().parents[1] / "docs"
    reference = next(
        line for line in (docs / "configuration.md").read_text().splitlines() if "tensor_parallel_plan" in line
    )
    concepts = (docs / "tensor-parallelism.md").read_text()
    for style in TENSOR_PARALLEL_STYLES:
        assert style in reference, style
        assert f"`{style}`" in concepts.partition("## Plan styles")[2].partition("\n## ")[0], style


def test_set_tensor_parallelism_marks_a_model_built_outside_the_context():
    torch.manual_seed(0)
    model = _build("llama")
    smp.set_tensor_parallelism(model)
    assert len(plan_tensor_parallel(model, tp_size=2).units) == 2 + 2 * 7


def test_a_user_plan_entry_overrides_the_model_entry_for_the_same_module():
    model = _created("llama")
    plan = plan_tensor_parallel(model, tp_size=2, patterns={"model.layers.*.mlp": "replicate", "lm_head": "colwise"})
    targets = {unit.name: (unit.target.__name__, unit.source) for unit in plan.units}
    assert not any(".mlp." in name for name in targets)
    assert targets["lm_head"] == ("ColumnParallelLinear", "plan")  # its output stays split: the user's choice


def test_attention_with_q_k_v_packed_per_head_splits_only_where_the_heads_divide():
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96
    )
    with smp.model_creation(tensor_parallelism=True):
        model = transformers.GPTNeoXModel(config)  # query_key_value: 3 x 48 rows, [q, k, v] of each head in turn
    assert len(plan_tensor_parallel(model, tp_size=2).units) == 5
    plan = plan_tensor_parallel(model, tp_size=3)  # 144 rows split 3 ways, but 4 heads do not
    assert [unit.name for unit in plan.units] == ["layers.0.mlp.dense_h_to_4h", "layers.0.mlp.dense_4h_to_h"]
    kept = dict(plan.kept_whole)  # the embedding's 64 rows do not split 3 ways either
    assert (
        "num_attention_heads=4, not divisible by tensor_parallel_degree=3"
        in kept["layers.*.attention.{dense, query_key_value}"]
    )
