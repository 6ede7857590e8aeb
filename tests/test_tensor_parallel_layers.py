"""Tensor-parallel layers against the whole torch layer they split: outputs, input grads and gathered parameter
grads, on gloo groups of 2 and 4 ranks, plus the dropout streams.

Each case builds the whole module once (seeded, the same on every rank), deep-copies it, splits the copy with
`parallelize` and runs both on the same inputs. One launch per world size runs every check (`_run_checks`); the
tests here assert on what it returned. The sequence-parallel cases run twice: with the point-to-point exchanges
gloo takes, and inside `collectives.native_on_cpu` with the all-gathers and reduce-scatters NCCL takes.
"""

import contextlib
import copy
import itertools
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_smp import activation_checkpointing, collectives
from lightning_smp import topology as topology_builder
from lightning_smp.activation_checkpointing import set_activation_checkpointing
from lightning_smp.config import SMPConfig
from lightning_smp.tensor_parallel import (
    ColumnParallelLinear,
    DistributedEmbedding,
    DistributedLinear,
    DistributedLMHead,
    RowParallelLinear,
    TensorParallelDropout,
    gather_shards,
    parallelize,
    shard_of,
    vocab_parallel_cross_entropy,
)
from lightning_smp.tensor_parallel.creation import scope
from tests.distributed import init_gloo, launch_once

D, HEADS, FF, B, T, VOCAB = 16, 4, 32, 2, 8, 64

Forward = Callable[[nn.Module, list[Tensor]], Tensor]


def _causal() -> Tensor:
    return nn.Transformer.generate_square_subsequent_mask(T)


def _padding() -> Tensor:
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, -3:] = True  # the first sequence has 3 padded keys
    return mask


def _encoder_cases() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], list[Tensor]], Forward]]:
    masks: dict[str, Callable[[nn.Module, Tensor], Tensor]] = {
        "causal+is_causal": lambda m, x: m(x, src_mask=_causal(), is_causal=True),
        "causal": lambda m, x: m(x, src_mask=_causal()),
        "bool_mask": lambda m, x: m(x, src_mask=torch.rand(T, T, generator=torch.Generator().manual_seed(1)) > 0.7),
        "key_padding": lambda m, x: m(x, src_key_padding_mask=_padding()),
        "causal+key_padding": lambda m, x: m(
            x, src_mask=_causal().isinf(), src_key_padding_mask=_padding(), is_causal=True
        ),
        "per_head_3d": lambda m, x: m(
            x, src_mask=torch.randn(B * HEADS, T, T, generator=torch.Generator().manual_seed(2))
        ),
    }
    cases = {}
    every_mask = {(False, "relu", True), (True, "gelu", False)}  # the other layouts run with the causal mask
    for norm_first, activation, batch_first in itertools.product((False, True), ("relu", "gelu"), (True, False)):
        for mask_name, call in masks.items():
            if (norm_first, activation, batch_first) not in every_mask and mask_name != "causal+is_causal":
                continue

            def build(norm_first=norm_first, activation=activation, batch_first=batch_first):
                return nn.TransformerEncoderLayer(
                    D, HEADS, FF, dropout=0.0, activation=activation, batch_first=batch_first, norm_first=norm_first
                )

            def inputs(batch_first=batch_first):
                return [torch.randn((B, T, D) if batch_first else (T, B, D))]

            def forward(m, xs, call=call):
                return call(m, xs[0])

            name = f"encoder[norm_first={norm_first},{activation},batch_first={batch_first},{mask_name}]"
            cases[name] = (build, inputs, forward)
    return cases


def _decoder_case(norm_first: bool):
    def build():
        return nn.TransformerDecoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, norm_first=norm_first)

    def inputs():
        return [torch.randn(B, T, D), torch.randn(B, T + 2, D)]

    def forward(m, xs):
        memory_padding = torch.zeros(B, T + 2, dtype=torch.bool)
        memory_padding[1, -2:] = True
        return m(xs[0], xs[1], tgt_mask=_causal(), tgt_is_causal=True, memory_key_padding_mask=memory_padding)

    return build, inputs, forward


def _attention_cases():
    def first_output(m, *args, **kwargs):
        output, weights = m(*args, **kwargs)
        return output if weights is None else torch.cat([output.flatten(), weights.flatten()])

    return {
        "mha[need_weights,average]": (
            lambda: nn.MultiheadAttention(D, HEADS, batch_first=True),
            lambda: [torch.randn(B, T, D)],
            lambda m, xs: first_output(m, xs[0], xs[0], xs[0], key_padding_mask=_padding()),
        ),
        "mha[need_weights,per_head,causal]": (
            lambda: nn.MultiheadAttention(D, HEADS, batch_first=True),
            lambda: [torch.randn(B, T, D)],
            lambda m, xs: first_output(m, xs[0], xs[0], xs[0], attn_mask=_causal(), average_attn_weights=False),
        ),
        "mha[kdim,vdim,bias_kv,zero_attn,seq_first]": (
            lambda: nn.MultiheadAttention(D, HEADS, kdim=12, vdim=10, add_bias_kv=True, add_zero_attn=True),
            lambda: [torch.randn(T, B, D), torch.randn(T + 1, B, 12), torch.randn(T + 1, B, 10)],
            lambda m, xs: first_output(m, xs[0], xs[1], xs[2], need_weights=False),
        ),
        "mha[cross,key_is_value,no_bias]": (
            lambda: nn.MultiheadAttention(D, HEADS, bias=False, batch_first=True),
            lambda: [torch.randn(B, T, D), torch.randn(B, T + 3, D)],
            lambda m, xs: first_output(m, xs[0], xs[1], xs[1], need_weights=False),
        ),
        "mha[unbatched]": (
            lambda: nn.MultiheadAttention(D, HEADS),
            lambda: [torch.randn(T, D)],
            lambda m, xs: first_output(m, xs[0], xs[0], xs[0], attn_mask=_causal(), is_causal=True, need_weights=False),
        ),
    }


def _plain_cases():
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = ColumnParallelLinear(D, FF)
            self.proj = RowParallelLinear(FF, D)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))

    class TiedLm(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = DistributedEmbedding(VOCAB, D, padding_idx=3)
            self.head = DistributedLMHead(D, VOCAB)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            target = ids.roll(1, dims=-1)
            target[0, 0] = -100  # ignored
            return self.head.loss(self.head(torch.tanh(self.embed(ids))), target)

    def ids():
        return [torch.randint(0, VOCAB, (B, T))]

    return {
        "column[gather_output]": (
            lambda: ColumnParallelLinear(D, FF, gather_output=True),
            lambda: [torch.randn(B, T, D)],
            lambda m, xs: m(xs[0]),
        ),
        "distributed_linear": (lambda: DistributedLinear(FF, D), lambda: [torch.randn(B, FF)], lambda m, xs: m(xs[0])),
        "column->row mlp": (Mlp, lambda: [torch.randn(B, T, D)], lambda m, xs: m(xs[0])),
        "embedding[padding_idx]": (
            lambda: nn.Embedding(VOCAB, D, padding_idx=VOCAB - 1),
            lambda: [torch.cat([torch.randint(0, VOCAB, (B, T)), torch.full((B, 1), VOCAB - 1)], dim=1)],
            lambda m, xs: m(xs[0]),
        ),
        "tied embedding + lm head loss": (TiedLm, ids, lambda m, xs: m(xs[0])),
    }


def _all_cases():
    cases = {**_encoder_cases(), **_attention_cases(), **_plain_cases()}
    cases["decoder[post-norm]"] = _decoder_case(False)
    cases["decoder[pre-norm]"] = _decoder_case(True)
    return cases


def _compare_case(build, inputs, forward, *, topology, config) -> float:
    torch.manual_seed(0)
    with scope(True, {}):  # created tensor-parallel, as under smp.tensor_parallelism()
        whole = build()
    split = parallelize(copy.deepcopy(whole), topology=topology, config=config)
    xs_whole = [x.requires_grad_() if x.is_floating_point() else x for x in inputs()]
    xs_split = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs_whole]
    out_whole, out_split = forward(whole, xs_whole), forward(split, xs_split)
    torch.testing.assert_close(out_split, out_whole, rtol=1e-5, atol=1e-5)
    weight = torch.randn_like(out_whole)
    (out_whole * weight).sum().backward()
    (out_split * weight).sum().backward()
    for x_whole, x_split in zip(xs_whole, xs_split, strict=True):
        if x_whole.requires_grad:
            torch.testing.assert_close(x_split.grad, x_whole.grad, rtol=1e-5, atol=1e-5)
    whole_params = dict(whole.named_parameters())
    sharded = 0
    for name, param in split.named_parameters():
        sharded += shard_of(param) is not None
        gathered = gather_shards(param.grad, shard_of(param), topology.group("tp"))
        torch.testing.assert_close(
            gathered, whole_params[name].grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert sharded, "nothing was split"
    return (out_split - out_whole).abs().max().item()


def _sequence_region_case():
    """Three pre-norm layers in a ModuleList (one sequence-parallel region), residual dropout on: the same masks."""

    def build():
        layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.3, batch_first=True, norm_first=True) for _ in range(3)
        )
        for layer in layers:  # dropout on the residual stream only, where one device draws the same masks
            layer.dropout.p, layer.self_attn.dropout = 0.0, 0.0
        return layers

    def forward(m, xs):
        torch.manual_seed(7)
        x = xs[0]
        for layer in m:
            x = layer(x, src_mask=_causal(), is_causal=True)
        return x

    return build, lambda: [torch.randn(B, T, D)], forward


def check_layers() -> dict[str, float]:
    """Every case on a tensor-parallel group spanning the job, then the transformer layers again with sequence
    parallelism; returns each case's largest output error."""
    world = dist.get_world_size()
    topology = topology_builder.build(dp=1, pp=1, tp=world, order="DPT", device_type="cpu")
    config = SMPConfig(tensor_parallel_degree=world)
    sequence_parallel = SMPConfig(tensor_parallel_degree=world, sequence_parallel=True)
    cases = {name: (case, config) for name, case in _all_cases().items()}
    layers = {name: case for name, case in _all_cases().items() if name.startswith(("encoder", "decoder"))}
    cases.update({f"{name}[sequence_parallel]": (case, sequence_parallel) for name, case in layers.items()})
    cases["region[sequence_parallel,dropout]"] = (_sequence_region_case(), sequence_parallel)
    native = {name.replace("sequence_parallel", "sequence_parallel,native"): case for name, case in cases.items()}
    cases.update({name: case for name, case in native.items() if "native" in name})
    errors, calls = {}, {}
    for name, ((build, inputs, forward), case_config) in cases.items():
        with _counted_collectives() as counted, collectives.native_on_cpu() if "native" in name else _nothing():
            try:
                errors[name] = _compare_case(build, inputs, forward, topology=topology, config=case_config)
            except Exception as error:
                raise AssertionError(f"case {name}: {error}") from error
        calls[name] = counted
    errors.update(_eval_encoder_skips_fused_kernels(topology, config))
    errors.update(_vocab_cross_entropy_reductions(topology))
    return {"errors": errors, "collectives": calls}


_nothing = contextlib.nullcontext


@contextlib.contextmanager
def _counted_collectives():
    """Counts the calls of the backend's own all-gather and reduce-scatter (`collectives`) in the block."""
    counted = {"all_gather": 0, "reduce_scatter": 0}

    def counting(kind, collective):
        def call(*args, **kwargs):
            counted[kind] += 1
            return collective(*args, **kwargs)

        return call

    gather = counting("all_gather", collectives.all_gather_single)
    scatter = counting("reduce_scatter", collectives.reduce_scatter_single)
    patched = mock.patch.object(collectives, "all_gather_single", gather)
    with patched, mock.patch.object(collectives, "reduce_scatter_single", scatter):
        yield counted


def _eval_encoder_skips_fused_kernels(topology, config) -> dict[str, float]:
    """In eval under no_grad torch would pack the batch into nested tensors and run fused kernels on the whole
    layer; a split encoder must stay on the ordinary path and give the same numbers."""
    torch.manual_seed(0)
    with scope(True, {}):
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, batch_first=True)
    whole = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    split = parallelize(copy.deepcopy(whole), topology=topology, config=config)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        expected = whole(x, src_key_padding_mask=_padding())
        actual = split(x, src_key_padding_mask=_padding())
    kept = ~_padding()  # torch's nested-tensor path writes zeros at padded positions, the ordinary path does not
    torch.testing.assert_close(actual[kept], expected[kept], rtol=1e-5, atol=1e-5)
    return {"encoder[eval,no_grad,nested]": (actual[kept] - expected[kept]).abs().max().item()}


def _vocab_cross_entropy_reductions(topology) -> dict[str, float]:
    group = topology.group("tp")
    torch.manual_seed(0)
    logits = torch.randn(B, T, VOCAB, requires_grad=True)
    target = torch.randint(0, VOCAB, (B, T))
    target[1, :3] = -100
    size, rank = group.size(), group.rank()
    errors = {}
    for reduction in ("mean", "sum", "none"):
        expected = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction=reduction)
        local = logits.detach().chunk(size, dim=-1)[rank].clone().requires_grad_()
        actual = vocab_parallel_cross_entropy(local, target, group=group, reduction=reduction)
        torch.testing.assert_close(actual.flatten(), expected.flatten(), rtol=1e-5, atol=1e-6)
        (expected.sum() if reduction == "none" else expected).backward()
        (actual.sum() if reduction == "none" else actual).backward()
        torch.testing.assert_close(local.grad, logits.grad.chunk(size, dim=-1)[rank], rtol=1e-5, atol=1e-6)
        logits.grad = None
        errors[f"vocab_cross_entropy[{reduction}]"] = (actual.flatten() - expected.flatten()).abs().max().item()
    return errors


def check_dropout() -> dict:
    """Replicated-region dropout: the same on every tp rank; sharded-region dropout: different; both reproducible
    (two runs in a row from the same seeds)."""
    first, again = _dropout_streams(), _dropout_streams()
    return {**first, "reproducible": torch.equal(first["output"], again["output"])}


def _dropout_streams() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = topology_builder.build(dp=1, pp=1, tp=world, order="DPT", device_type="cpu")
    config = SMPConfig(tensor_parallel_degree=world, tensor_parallel_seed=7)
    torch.manual_seed(100 + rank)  # unseeded-looking run: parallelize makes the tp ranks agree
    with scope(True, {}):
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.5, batch_first=True)
    parallelize(layer, topology=topology, config=config)
    assert isinstance(layer.dropout, TensorParallelDropout)
    x = torch.ones(B, T, D)
    outputs = [layer(x) for _ in range(2)]
    gathered = [torch.empty_like(outputs[0]) for _ in range(world)]
    dist.all_gather(gathered, outputs[0])
    sharded_mask = layer.dropout(torch.ones(B, 4 * D // world))
    masks = [torch.empty_like(sharded_mask) for _ in range(world)]
    dist.all_gather(masks, sharded_mask)
    return {
        "replicated_equal": all(torch.equal(g, gathered[0]) for g in gathered),
        "steps_differ": not torch.equal(outputs[0], outputs[1]),
        "sharded_masks_differ": not torch.equal(masks[0], masks[1]),
        "output": outputs[1],
        "default_state": torch.get_rng_state(),
    }


def check_checkpointed_dropout() -> dict:
    """A checkpointed split layer with dropout recomputes the same masks in backward, the sharded-region stream
    included (torch.utils.checkpoint replays only the default generator): its grads equal the plain layer's."""
    world = dist.get_world_size()
    topology = topology_builder.build(dp=1, pp=1, tp=world, order="DPT", device_type="cpu")
    config = SMPConfig(tensor_parallel_degree=world, tensor_parallel_seed=7)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(5)
        with scope(True, {}):
            layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.5, batch_first=True)
        parallelize(layer, topology=topology, config=config)
        if checkpointed:
            set_activation_checkpointing(layer)
            activation_checkpointing.apply(layer)
        x = torch.ones(B, T, D, requires_grad=True)
        for _ in range(2):  # the second step starts from streams the first one advanced
            layer(x).square().sum().backward()
        grads.append([x.grad, *(p.grad for p in layer.parameters())])
    return {"equal": all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), "count": len(grads[0])}


def _run_checks(rank: int) -> dict:
    init_gloo()
    results = {"layers": check_layers()}
    if dist.get_world_size() == 2:
        results.update(dropout=check_dropout(), checkpointed_dropout=check_checkpointed_dropout())
    return results


def launch(world: int) -> list[dict]:
    return launch_once(_run_checks, world, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_split_layers_match_the_whole_layer(world):
    results = [rank["layers"]["errors"] for rank in launch(world)]
    assert results[0].keys() == results[-1].keys()
    assert len(results[0]) > 40
    assert sum(name.endswith("[sequence_parallel]") for name in results[0]) >= 14
    assert max(results[0].values()) < 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_layers_match_the_whole_layer_through_the_collectives_nccl_runs(world):
    """On gloo, a CPU run's all-gathers and reduce-scatters are point-to-point exchanges; inside
    `collectives.native_on_cpu` they are the backend's own collectives, the code NCCL runs on a GPU cluster."""
    for rank in launch(world):
        errors, calls = rank["layers"]["errors"], rank["layers"]["collectives"]
        native = [name for name in errors if "sequence_parallel,native" in name]
        assert len(native) == sum("[sequence_parallel" in name for name in errors) // 2 >= 15
        assert max(errors[name] for name in native) < 1e-5
        for name in native:
            assert calls[name]["all_gather"] > 0 and calls[name]["reduce_scatter"] > 0, name
        exchanged = [counts for name, counts in calls.items() if "native" not in name]
        assert all(counts == {"all_gather": 0, "reduce_scatter": 0} for counts in exchanged)


@pytest.mark.timeout(300)
def test_dropout_is_replicated_where_activations_are_and_independent_where_they_are_split():
    results = [rank["dropout"] for rank in launch(2)]
    for result in results:
        assert result["replicated_equal"] and result["steps_differ"] and result["sharded_masks_differ"]
        assert result["reproducible"]
    assert torch.equal(results[0]["default_state"], results[1]["default_state"])


@pytest.mark.timeout(300)
def test_a_checkpointed_split_layer_replays_its_dropout_masks():
    for result in (rank["checkpointed_dropout"] for rank in launch(2)):
        assert result["equal"] and result["count"] > 8
