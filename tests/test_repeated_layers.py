"""The memory planner's trace of a repeated trunk through its first layers (`lightning_smp.repeated_layers`) keeps the
bytes the whole trace keeps: per bucket, over every run of consecutive children a pipeline stage could hold (storages
shared between neighbours counted once), and what backward adds for a moment; under each layout feature that changes
what a layer keeps. A trunk that does not repeat, or a model that cannot run a cut one, is traced whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.gpt_char import GPTCharLM
from lightning_smp import SMPConfig, smp
from lightning_smp.activation_memory import AFTER, BEFORE, ActivationTrace, trace_activations
from tests.gpt import llama_config

LAYERS, SEQUENCE = 6, 16


def _char_gpt(config: SMPConfig, *, checkpointing: bool = False) -> GPTCharLM:
    """examples/gpt_char.py's model (an nn.Sequential trunk; each layer makes its own causal mask), on meta."""
    model = GPTCharLM(n_layer=LAYERS, n_head=4, d_model=32, block_size=SEQUENCE, activation_checkpointing=checkpointing)
    with smp.preview(config, world_size=config.model_parallel_degree), torch.device("meta"):
        model.configure_model()
    return model


def _llama(config: SMPConfig, *, checkpointing: bool = False) -> nn.Module:
    """A transformers Llama (its mask and rotary tables made before the trunk, passed to every layer), on meta."""
    transformers = pytest.importorskip("transformers")
    split = smp.model_creation(tensor_parallelism=config.tensor_parallel_degree > 1)
    with smp.preview(config, world_size=config.model_parallel_degree), torch.device("meta"), split:
        model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=LAYERS))
    if checkpointing:
        smp.set_activation_checkpointing(model.model.layers)
    return model


def _tokens(samples: int = 4) -> tuple[Tensor, Tensor]:
    ids = torch.zeros(samples, SEQUENCE, dtype=torch.long)
    return ids, ids


def _batch(model: nn.Module) -> object:
    """Four sequences, as the model's training step takes them."""
    ids, target = _tokens()
    return (ids, target) if isinstance(model, GPTCharLM) else {"input_ids": ids, "labels": target}


def _assert_same_bytes(cut: ActivationTrace, whole: ActivationTrace, children: int = LAYERS) -> None:
    assert set(cut.saved) == set(whole.saved)
    for bucket in whole.saved:
        assert sorted(cut.saved[bucket].values()) == sorted(whole.saved[bucket].values()), bucket
    for first in range(children):
        for last in range(first, children):
            stage = [str(child) for child in range(first, last + 1)]
            stage = [BEFORE] * (first == 0) + stage + [AFTER] * (last == children - 1)
            assert cut.kept(stage) == whole.kept(stage), stage
            assert cut.peak_transient(stage) == whole.peak_transient(stage), stage
    assert cut.kept() == whole.kept() > 0
    assert cut.transient == whole.transient


LAYOUTS = {
    "one device": {},
    "fp16": {"fp16": True},
    "tp2": {"tensor_parallel_degree": 2},
    "tp2 sequence parallel": {"tensor_parallel_degree": 2, "sequence_parallel": True},
    "pp3 x tp2 fp16": {"pipeline_parallel_degree": 3, "tensor_parallel_degree": 2, "fp16": True, "microbatches": 2},
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("build", [_char_gpt, _llama], ids=["gpt_char", "llama"])
def test_a_repeated_trunk_traced_through_its_first_layers_keeps_the_bytes_of_the_whole_trace(
    build, layout, checkpointing
):
    config = SMPConfig(**LAYOUTS[layout])
    model = build(config, checkpointing=checkpointing)
    cut = trace_activations(model, _batch(model), config=config)
    whole = trace_activations(model, _batch(model), config=config, extrapolate=False)
    assert cut.cut is not None and cut.cut.kept < LAYERS and whole.cut is None
    _assert_same_bytes(cut, whole)


class _Layer(nn.Module):
    """Keeps its input (which the layer before kept as its output), a scale shared by every layer, and its output."""

    def __init__(self, *, normed: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32) if normed else nn.Identity()

    def forward(self, h: Tensor, scale: Tensor) -> Tensor:
        return torch.tanh(self.norm(self.linear(h) * scale))


class _Chain(nn.Module):
    """A trunk whose neighbours share storages, every layer one made before the trunk; the first or the last layer
    may differ from the others (as under sequence parallelism)."""

    def __init__(self, differs: str | None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_Layer(normed=differs == "first" and i == 0) for i in range(LAYERS))
        if differs == "last":
            self.layers[-1] = _Layer(normed=True)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: Tensor, target: Tensor) -> Tensor:
        h = self.embedding(ids)
        scale = torch.full((32,), 0.5, device=h.device)
        for layer in self.layers:
            h = layer(h, scale)
        return F.cross_entropy(self.head(h).flatten(0, 1), target.flatten())


@pytest.mark.parametrize("differs", [None, "first", "last"])
def test_storages_shared_by_neighbours_and_by_every_layer_are_counted_once(differs):
    with torch.device("meta"):
        model = _Chain(differs)
    config = SMPConfig(pipeline_parallel_degree=2)
    cut = trace_activations(model, _tokens(), config=config)
    whole = trace_activations(model, _tokens(), config=config, extrapolate=False)
    assert cut.cut is not None and cut.cut.last == (differs == "last") and whole.cut is None
    shared = set(whole.saved["2"]) & set(whole.saved["3"])
    assert len(shared) == 2  # what layer 2 hands layer 3, and the scale
    _assert_same_bytes(cut, whole)


def test_offloaded_inputs_loaded_back_ahead_of_backward_are_extended_too():
    config = SMPConfig(tensor_parallel_degree=2, offload_activations=True, activation_loading_horizon=2)
    model = _char_gpt(config, checkpointing=True)
    cut = trace_activations(model, _tokens(), config=config)
    assert cut.cut is not None and any(cut.transient.values())
    _assert_same_bytes(cut, trace_activations(model, _tokens(), config=config, extrapolate=False))


def test_a_trunk_whose_middle_layers_differ_is_traced_whole():
    config = SMPConfig()
    model = _char_gpt(config)
    with torch.device("meta"):  # layer 3 with a narrower feed-forward network
        model.model.blocks[3].layer.linear1 = nn.Linear(32, 64)
        model.model.blocks[3].layer.linear2 = nn.Linear(64, 32)
    trace = trace_activations(model, _tokens(), config=config)
    assert trace.cut is None
    _assert_same_bytes(trace, trace_activations(model, _tokens(), config=config, extrapolate=False))


def test_a_model_that_cannot_run_a_cut_trunk_is_traced_whole():
    class Indexing(nn.Module):  # runs its layers by index, which a trunk of fewer children cannot answer
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(64, 32)
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(LAYERS))

        def forward(self, ids: Tensor, target: Tensor) -> Tensor:
            h = self.embedding(ids)
            for index in range(LAYERS):
                h = torch.tanh(self.layers[index](h))
            return h.square().mean()

    with torch.device("meta"):
        model = Indexing()
    trace = trace_activations(model, _tokens(), config=SMPConfig())
    assert trace.cut is None
    _assert_same_bytes(trace, trace_activations(model, _tokens(), config=SMPConfig(), extrapolate=False))
