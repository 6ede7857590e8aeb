"""Tier 1 (one process): a model built under ``deferred_init()`` and materialised equals, bit for bit, the eager build
with the same seed (whole, cut into slices, tied); the generator ends where the eager build leaves it; the peak while
materialising is what is kept plus one tensor; values from a source (a checkpoint file) are read only as cut when
only copied and cast; and what cannot be materialised fails with an error naming the fix."""

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_smp.delayed_init import deferred_from, deferred_init, is_deferred, materialize, materialize_module
from lightning_smp.delayed_init.recording import cpu_as_deferred
from lightning_smp.placement import Cut, TPShard
from tests.gpt import llama_config

_CPU = torch.device("cpu")


def _build_both(build: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The eager build and the deferred one (not yet materialised); the generator must end in the same state."""
    torch.manual_seed(seed)
    eager = build()
    after_eager = torch.get_rng_state()
    torch.manual_seed(seed)
    with deferred_init():
        deferred = build()
    assert torch.equal(torch.get_rng_state(), after_eager)
    return eager, deferred


def _assert_same_tensors(eager: nn.Module, materialized: nn.Module) -> None:
    expected = dict(eager.named_parameters(remove_duplicate=False)) | dict(eager.named_buffers(remove_duplicate=False))
    got = dict(materialized.named_parameters(remove_duplicate=False))
    got |= dict(materialized.named_buffers(remove_duplicate=False))
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert got[name].device == _CPU and got[name].dtype == value.dtype and torch.equal(got[name], value), name


# -- modules whose constructors initialise themselves ----------------------------------------------------------


class _ReInitialised(nn.Module):
    """Initialises twice, as Hugging Face's ``post_init`` does: the layers' own init, then ``self.apply``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)


class _TruncNormal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(16, 8))
        nn.init.trunc_normal_(self.weight, std=0.02, a=-0.04, b=0.04)


class _ViewInit(nn.Module):
    """In-place init of slices of one parameter, and of a row that is overwritten afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(6, 4))
        with torch.no_grad():
            self.weight[:, :2].normal_()
            self.weight[1].uniform_(-1, 1)
            self.weight[2:4].mul_(3).add_(1)
            self.weight.t()[0].fill_(7)


class _Rotary(nn.Module):
    """A rotary table computed from ``arange`` and ``pow``, a constant made by ``torch.tensor`` and a generator."""

    def __init__(self, dim: int = 8, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        positions = torch.arange(12, dtype=torch.float32)
        self.register_buffer("cos", torch.outer(positions, inv_freq).cos(), persistent=False)
        self.register_buffer("inv_freq", inv_freq)
        self.scale = nn.Parameter(torch.ones(dim) * torch.tensor([0.5]))
        generator = torch.Generator().manual_seed(3)
        self.noise = nn.Parameter(torch.randn(dim, generator=generator))


class _Reseeded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        torch.manual_seed(123)
        self.second = nn.Linear(4, 4)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)


class _Orthogonal(nn.Module):
    """Initialisers torch skips for meta tensors (they need values): recorded whole."""

    def __init__(self) -> None:
        super().__init__()
        self.rotation = nn.Parameter(torch.empty(6, 4))
        self.conv = nn.Conv1d(4, 4, 3)
        self.sparse = nn.Parameter(torch.empty(8, 5))
        nn.init.orthogonal_(self.rotation, 1.0, torch.Generator().manual_seed(5))  # a generator passed by position
        nn.init.dirac_(self.conv.weight)
        nn.init.sparse_(self.sparse, sparsity=0.5)


class _Converted(nn.Module):
    """Dtype conversions, an ``out=`` op, ``x.add_(x)`` and a real tensor copied in and changed afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.bf16 = nn.Linear(4, 3).to(torch.bfloat16)
        self.register_buffer("total", torch.empty(3))
        torch.add(self.bf16.bias.detach().float(), 1.0, out=self.total)
        constant = torch.tensor([1.0, 2.0, 3.0])
        self.doubled = nn.Parameter(torch.empty(3))
        with torch.no_grad():
            self.doubled.copy_(constant)
            self.doubled.add_(self.doubled)
        constant.mul_(10)  # after the copy: the parameter keeps the earlier values


class _CopiedThenChanged(nn.Module):
    """A copy taken before its source changes in place: the copy keeps the earlier value."""

    def __init__(self) -> None:
        super().__init__()
        self.source = nn.Linear(4, 4)
        self.copy = copy.deepcopy(self.source)
        with torch.no_grad():
            self.source.weight.mul_(2)
            self.copy.bias.add_(self.source.bias)
        nn.init.normal_(self.source.bias)


_CASES = {
    "linear": lambda: nn.Linear(5, 7),
    "embedding": lambda: nn.Embedding(10, 4, padding_idx=2),
    "layer_norm": lambda: nn.LayerNorm(6),
    "conv2d": lambda: nn.Conv2d(3, 4, 3),
    "multihead_attention": lambda: nn.MultiheadAttention(8, 2),
    "transformer_encoder_layer": lambda: nn.TransformerEncoderLayer(8, 2, 16),
    "transformer_encoder_deep_copies": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16), 3, enable_nested_tensor=False
    ),
    "re_initialised_with_apply": _ReInitialised,
    "trunc_normal": _TruncNormal,
    "init_on_views": _ViewInit,
    "buffers_from_arange_and_pow": _Rotary,
    "manual_seed_inside": _Reseeded,
    "tied": _Tied,
    "initialisers_that_need_values": _Orthogonal,
    "conversions_out_and_aliasing": _Converted,
    "copy_then_source_changed": _CopiedThenChanged,
}


@pytest.mark.parametrize("name", list(_CASES))
def test_materialized_module_equals_the_eager_build(name):
    eager, deferred = _build_both(_CASES[name])
    assert all(is_deferred(tensor) for tensor in deferred.parameters())
    materialize_module(deferred, device=_CPU)
    _assert_same_tensors(eager, deferred)
    for expected, got in zip(eager.parameters(), deferred.parameters(), strict=True):
        assert type(got) is nn.Parameter and got.requires_grad == expected.requires_grad
    assert not any(is_deferred(tensor) for tensor in deferred.state_dict().values())


def test_tied_parameters_stay_tied_and_buffers_keep_their_kind():
    _, deferred = _build_both(_Tied)
    materialize_module(deferred, device=_CPU)
    assert deferred.head.weight is deferred.embed.weight
    assert [name for name, _ in deferred.named_parameters()] == ["frozen", "embed.weight"]

    _, rotary = _build_both(_Rotary)
    materialize_module(rotary, device=_CPU)
    assert set(rotary.state_dict()) == {"inv_freq", "scale", "noise"}  # "cos" stays non-persistent


@pytest.mark.parametrize("order", [["copy.weight", "source.weight"], ["source.weight", "copy.weight", "copy.bias"]])
def test_any_subset_in_any_order_gets_the_eager_values(order):
    eager, deferred = _build_both(_CopiedThenChanged)
    pieces = materialize([(deferred.get_parameter(name), lambda value: value) for name in order], device=_CPU)
    for name, piece in zip(order, pieces, strict=True):
        assert torch.equal(piece, eager.get_parameter(name)), name


def test_materializing_under_another_default_dtype_gives_the_dtypes_of_the_build():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as a precision plugin may around model creation
    try:
        eager, deferred = _build_both(_Rotary)
    finally:
        torch.set_default_dtype(previous)
    materialize_module(deferred, device=_CPU)
    _assert_same_tensors(eager, deferred)
    assert deferred.scale.dtype == deferred.noise.dtype == torch.float64


def test_blocks_materialize_together_and_a_later_block_cannot_read_an_earlier_one():
    torch.manual_seed(0)
    eager = nn.Linear(3, 3), nn.Linear(3, 3)
    torch.manual_seed(0)
    with deferred_init():
        first = nn.Linear(3, 3)
    with deferred_init():
        second = nn.Linear(3, 3)
        second.register_buffer("from_first", first.weight * 2)
    pieces = materialize([(first.weight, _whole), (second.weight, _whole)], device=_CPU)
    assert torch.equal(pieces[0], eager[0].weight) and torch.equal(pieces[1], eager[1].weight)
    with pytest.raises(ValueError, match=r"from_first is computed from a meta tensor made outside its deferred_init"):
        materialize_module(second, device=_CPU)


def _whole(value: Tensor) -> Tensor:
    return value


class _Stateful(nn.Module):
    """Tensors kept as plain attributes, directly and in a dict and a list (as torchmetrics keeps metric states)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.counts = torch.zeros(3, dtype=torch.long)
        self.defaults = {"total": torch.ones(2) * 3}
        self.history = [torch.arange(4.0), "not a tensor"]
        self.alias = self.linear.weight.detach()
        self.placeholder = torch.empty(2, device="meta")  # not recorded: a hand-made meta attribute stays as it is


def test_tensors_kept_as_attributes_are_materialized_too():
    eager, deferred = _build_both(_Stateful)
    materialize_module(deferred, device=_CPU)
    assert torch.equal(deferred.counts, eager.counts) and deferred.counts.dtype == torch.long
    assert torch.equal(deferred.defaults["total"], eager.defaults["total"])
    assert torch.equal(deferred.history[0], eager.history[0]) and deferred.history[1] == "not a tensor"
    assert torch.equal(deferred.alias, eager.alias) and torch.equal(deferred.linear.weight, eager.linear.weight)
    assert deferred.placeholder.is_meta


def test_torchmetrics_states_are_materialized():
    torchmetrics = pytest.importorskip("torchmetrics")
    eager = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    with deferred_init():
        metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    materialize_module(metric, device=_CPU)
    for _ in range(2):  # the second round starts from the materialised defaults
        for accuracy in (eager, metric):
            accuracy.update(torch.tensor([0, 2, 1]), torch.tensor([0, 2, 2]))
        assert torch.equal(metric.compute(), eager.compute())
        eager.reset()
        metric.reset()


def test_a_module_built_before_the_eager_one_does_not_change_its_values():
    torch.manual_seed(0)
    with deferred_init():
        first = nn.Linear(4, 4)
    second = nn.Linear(4, 4)  # eager, after the deferred build: draws where an eager `first` would have left it
    torch.manual_seed(0)
    nn.Linear(4, 4)
    expected = nn.Linear(4, 4)
    assert torch.equal(second.weight, expected.weight)
    materialize_module(first, device=_CPU)
    torch.manual_seed(0)
    assert torch.equal(first.weight, nn.Linear(4, 4).weight)


@pytest.mark.parametrize("tied", [True, False])
def test_llama_equals_the_eager_build_with_its_rotary_buffers(tied):
    transformers = pytest.importorskip("transformers")
    config = llama_config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        tie_word_embeddings=tied,
        pad_token_id=None,
        max_position_embeddings=2048,
    )
    eager, deferred = _build_both(lambda: transformers.LlamaForCausalLM(config))
    assert is_deferred(deferred.model.rotary_emb.inv_freq)
    materialize_module(deferred, device=_CPU)
    _assert_same_tensors(eager, deferred)
    assert (deferred.lm_head.weight is deferred.model.embed_tokens.weight) == tied
    tokens = torch.randint(0, 64, (2, 5))
    assert torch.equal(deferred(tokens).logits, eager(tokens).logits)


def test_hugging_face_initialisers_that_torch_skips_on_meta_are_recorded():
    initialization = pytest.importorskip("transformers.initialization")

    def build() -> nn.Module:
        module = nn.Linear(6, 4)
        initialization.orthogonal_(module.weight)
        initialization.trunc_normal_(module.bias, std=0.5)
        return module

    eager, deferred = _build_both(build)
    materialize_module(deferred, device=_CPU)
    _assert_same_tensors(eager, deferred)


# -- cuts ------------------------------------------------------------------------------------------------------


def test_cuts_equal_the_slices_of_the_eager_values_and_are_new_contiguous_tensors():
    eager, deferred = _build_both(lambda: nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4)))
    rows = lambda value: value[2:4]  # noqa: E731
    columns = lambda value: value[:, 1::2]  # noqa: E731
    wanted = [(deferred[0].weight, rows), (deferred[0].weight, columns), (deferred[1].bias, rows)]
    pieces = materialize(wanted, device=_CPU)
    assert torch.equal(pieces[0], eager[0].weight[2:4])
    assert torch.equal(pieces[1], eager[0].weight[:, 1::2])
    assert torch.equal(pieces[2], eager[1].bias[2:4])
    assert all(piece.is_contiguous() and piece.untyped_storage().nbytes() == piece.nbytes for piece in pieces)


def test_views_taken_after_the_block_materialize_to_the_view_of_the_eager_value():
    eager, deferred = _build_both(lambda: nn.Linear(6, 4))
    rows, transposed = deferred.weight[1:3], nn.Parameter(deferred.weight.t())
    assert is_deferred(rows) and is_deferred(transposed)
    pieces = materialize([(rows, _whole), (transposed, lambda value: value[:2])], device=_CPU)
    assert torch.equal(pieces[0], eager.weight[1:3]) and torch.equal(pieces[1], eager.weight.t()[:2])


def test_materialize_module_cuts_by_qualified_name_and_keeps_tied_parameters_tied():
    eager, deferred = _build_both(_Tied)
    seen = []

    def cut(name: str, tensor: Tensor):
        seen.append(name)
        return (lambda value: value[:6]) if name == "embed.weight" else None

    materialize_module(deferred, device=_CPU, cut=cut)
    assert seen == ["frozen", "embed.weight"]  # the tied head is the same tensor: cut once
    assert deferred.head.weight is deferred.embed.weight
    assert torch.equal(deferred.embed.weight, eager.embed.weight[:6])
    assert torch.equal(deferred.frozen, eager.frozen) and not deferred.frozen.requires_grad


# -- memory ----------------------------------------------------------------------------------------------------


class _LiveBytes(TorchDispatchMode):
    """The most bytes of real tensor storage alive at once, checked after every aten op (materialisation runs every
    op through here, so anything it builds, whole or cut, counts until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, Tensor) and not leaf.is_meta:
                storage = leaf.untyped_storage()
                self._storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for ref, nbytes in self._storages.values() if not ref.expired()))
        return out


def _big_model() -> nn.Module:
    """Deep copies of a two-layer block, then (like ``post_init``) a re-initialisation of every weight at the end."""
    block = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    model = nn.Sequential(*[copy.deepcopy(block) for _ in range(3)], nn.Linear(128, 256))
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features == 256:
            nn.init.normal_(module.weight, std=0.02)
    return model


def test_materializing_holds_what_is_kept_plus_one_whole_tensor_at_most():
    eager, deferred = _build_both(_big_model)
    largest = max(tensor.nbytes for tensor in eager.parameters())
    half_rows = lambda name, tensor: lambda value: value[: value.shape[0] // 2]  # noqa: E731
    with _LiveBytes() as materializing:
        materialize_module(deferred, device=_CPU, cut=half_rows)
    kept = sum(tensor.nbytes for tensor in deferred.parameters())
    assert materializing.peak <= kept + largest
    for name, tensor in eager.named_parameters():
        assert torch.equal(deferred.get_parameter(name), tensor[: tensor.shape[0] // 2]), name

    # The same measure catches building the whole model before cutting it.
    with _LiveBytes() as eager_then_cut:
        torch.manual_seed(0)
        [tensor[: tensor.shape[0] // 2].clone() for tensor in _big_model().parameters()]
    assert eager_then_cut.peak > kept + largest


# -- errors ----------------------------------------------------------------------------------------------------


class _ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.scale = math.sqrt(self.weight.abs().max().item())


def test_reading_a_value_while_building_names_the_op_and_the_fix():
    with (
        pytest.raises(RuntimeError, match=r"_local_scalar_dense.*Compute that value from Python numbers"),
        deferred_init(),
    ):
        _ReadsAValue()


def test_materializing_what_is_not_deferred_names_the_tensor_and_the_fix():
    with pytest.raises(ValueError, match=r"wanted\[0\] is not a deferred tensor \(it is on cpu\)"):
        materialize([(torch.zeros(2), lambda value: value)], device=_CPU)
    by_hand = nn.Linear(2, 2, device="meta")
    assert not is_deferred(by_hand.weight)
    with pytest.raises(
        ValueError,
        match=r"weight \(shape \(2, 2\)\) is a meta tensor made outside deferred_init\(\) \(device='meta' by hand",
    ):
        materialize_module(by_hand, device=_CPU)


def test_a_value_computed_from_a_hand_made_meta_tensor_names_the_tensor():
    outside = torch.empty(3, device="meta")
    with deferred_init():
        module = nn.Linear(3, 3)
        module.register_buffer("mixed", module.bias + outside)
    assert is_deferred(module.mixed)
    with pytest.raises(ValueError, match=r"mixed is computed from a meta tensor made outside its deferred_init"):
        materialize_module(module, device=_CPU)


def test_hand_made_meta_modules_inside_the_block_stay_meta_and_draw_nothing():
    def build() -> nn.Module:
        module = nn.Module()
        module.before = nn.Linear(3, 3)
        module.placeholder = nn.Linear(3, 3, device="meta")  # eagerly: meta, and its init draws nothing
        module.after = nn.Linear(3, 3)
        return module

    eager, deferred = _build_both(build)
    assert not is_deferred(deferred.placeholder.weight)
    materialize_module(deferred.before, device=_CPU)
    materialize_module(deferred.after, device=_CPU)
    assert torch.equal(deferred.after.weight, eager.after.weight) and deferred.placeholder.weight.is_meta


def test_a_copy_made_after_the_block_names_the_fix():
    with deferred_init():
        linear = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"a copy or conversion made after the block: copy.deepcopy"):
        materialize_module(copy.deepcopy(linear), device=_CPU)


def test_materializing_inside_the_block_is_refused():
    with deferred_init():
        linear = nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match="leave the `with deferred_init\\(\\):` block first"):
            materialize_module(linear, device=_CPU)


def test_writing_a_real_tensor_from_a_deferred_one_names_the_fix():
    real = torch.zeros(3, device="cpu")
    with pytest.raises(RuntimeError, match=r"writes into a real cpu tensor from a deferred"), deferred_init():
        real.copy_(nn.Linear(3, 3).bias)


def test_a_nested_block_joins_the_outer_one_and_real_tensors_stay_real():
    eager, _ = _build_both(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    torch.manual_seed(0)
    with deferred_init():
        outer = nn.Linear(3, 3)
        with deferred_init():
            inner = nn.Linear(3, 3)
        real = nn.init.orthogonal_(torch.empty(3, 3, device="cpu"))  # explicit device: eager, as outside the block
        outer.register_buffer("from_inner", inner.weight + 1)
    assert not real.is_meta and torch.linalg.matrix_rank(real) == 3
    materialize_module(outer, device=_CPU)
    assert torch.equal(outer.from_inner, eager[1].weight + 1)


def test_a_cut_that_returns_no_tensor_names_the_tensor():
    with deferred_init():
        linear = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="the cut for weight returned list, not a tensor"):
        materialize_module(linear, device=_CPU, cut=lambda name, tensor: lambda value: value.tolist())


# -- values from sources (checkpoint files) ------------------------------------------------------------------------


class _Source:
    """A source that records what it is asked to read."""

    def __init__(self, value: Tensor) -> None:
        self.value, self.shape, self.dtype = value, tuple(value.shape), value.dtype
        self.reads: list[Cut | None] = []

    def read(self, cut: Cut | None) -> Tensor:
        self.reads.append(cut)
        return (self.value if cut is None else cut(self.value)).clone()


def test_a_source_copied_and_cast_is_read_only_as_cut():
    source = _Source(torch.arange(24.0).reshape(6, 4))
    with deferred_init():
        linear = nn.Linear(4, 6).half()
        with torch.no_grad():
            linear.weight.copy_(deferred_from(source))  # a cast to fp16 on the way
    cut = Cut.of_shard((6, 4), TPShard(dim=1, index=1, parts=2))
    [piece] = materialize([(linear.weight, cut)], device=_CPU)
    assert source.reads == [cut]  # never the whole
    assert piece.dtype == torch.float16 and torch.equal(piece, cut(source.value).half())


def test_a_source_computed_with_is_read_whole_and_replayed():
    source = _Source(torch.arange(6.0))
    with deferred_init():
        doubled = deferred_from(source) * 2
    cut = Cut((((2, 4),),))
    [piece] = materialize([(doubled, cut)], device=_CPU)
    assert source.reads == [None] and torch.equal(piece, torch.tensor([4.0, 6.0]))


def test_deferred_from_outside_a_block_names_the_fix():
    with pytest.raises(RuntimeError, match=r"call it inside a `with deferred_init\(\):` block"):
        deferred_from(_Source(torch.zeros(2)))


def test_a_hand_made_meta_tensor_written_whole_in_a_block_is_known_from_then_on():
    by_hand = nn.Linear(3, 2, device="meta")
    source = _Source(torch.ones(2, 3))
    with deferred_init(), torch.no_grad():
        by_hand.weight.copy_(deferred_from(source))
        by_hand.bias.add_(deferred_from(_Source(torch.ones(2))))  # read, not written whole: still unknown
    assert is_deferred(by_hand.weight)
    [weight] = materialize([(by_hand.weight, _whole)], device=_CPU)
    assert torch.equal(weight, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"is a meta tensor made outside deferred_init\(\)"):
        materialize([(by_hand.bias, _whole)], device=_CPU)


def test_cpu_factories_make_deferred_tensors_inside_cpu_as_deferred():
    with deferred_init():
        template = torch.empty(2, 3)
        with cpu_as_deferred():
            placed = torch.empty_like(template, device="cpu")
            zeros = torch.zeros(4, device="cpu")
        real = torch.zeros(4, device="cpu")
        placed.fill_(3.0)
    assert is_deferred(placed) and is_deferred(zeros) and not real.is_meta
    assert torch.equal(materialize([(placed, _whole)], device=_CPU)[0], torch.full((2, 3), 3.0))
