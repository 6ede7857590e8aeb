"""Weights from files (one process): the state-dict formats `open_state_dict` reads, a rank's cut read from a
safetensors file, and `load_weights` into a module built eagerly or on the meta device, against torch's
``load_state_dict``; a file that does not fit the module is refused naming the fix."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_smp import load_weights
from lightning_smp.delayed_init import deferred_init, materialize_module
from lightning_smp.placement import Cut, TPShard
from lightning_smp.weight_files import open_state_dict


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {key: value.clone() for key, value in _model().state_dict().items()}


def _write_every_format(root, state) -> dict[str, str]:
    """The same state dict as one safetensors file, as shards with an index, with torch.save, inside a Lightning
    checkpoint, and as a directory holding model.safetensors."""
    save_file(state, root / "one.safetensors")
    keys = list(state)
    save_file({k: state[k] for k in keys[:3]}, root / "a.safetensors")
    save_file({k: state[k] for k in keys[3:]}, root / "b.safetensors")
    weight_map = {k: "a.safetensors" if i < 3 else "b.safetensors" for i, k in enumerate(keys)}
    (root / "m.safetensors.index.json").write_text(__import__("json").dumps({"weight_map": weight_map}))
    torch.save(state, root / "state.pt")
    torch.save({"state_dict": state, "epoch": 3}, root / "lightning.ckpt")
    (root / "directory").mkdir()
    save_file(state, root / "directory" / "model.safetensors")
    names = ("one.safetensors", "m.safetensors.index.json", "state.pt", "lightning.ckpt", "directory")
    return {name: str(root / name) for name in names}


def test_every_format_reads_the_same_tensors_whole_and_as_cut(tmp_path):
    state = _state()
    cut = Cut.of_shard((6, 4), TPShard(dim=1, index=1, parts=2))
    for name, path in _write_every_format(tmp_path, state).items():
        sources = open_state_dict(path)
        assert set(sources) == set(state), name
        for key, value in state.items():
            assert sources[key].shape == tuple(value.shape) and sources[key].dtype == value.dtype, (name, key)
            assert torch.equal(sources[key].read(None), value), (name, key)
        assert torch.equal(sources["0.weight"].read(cut), cut(state["0.weight"])), name


def test_a_bfloat16_safetensors_tensor_keeps_its_dtype(tmp_path):
    save_file({"w": torch.randn(3, 2).to(torch.bfloat16)}, tmp_path / "bf16.safetensors")
    source = open_state_dict(tmp_path / "bf16.safetensors")["w"]
    assert source.dtype == torch.bfloat16 and source.code == "BF16" and source.read(None).dtype == torch.bfloat16


def test_load_weights_equals_load_state_dict_eagerly_and_on_the_meta_device(tmp_path):
    state = _state()
    save_file(state, tmp_path / "w.safetensors")
    expected = _model()
    expected.load_state_dict(state)
    eager = _model()
    load_weights(eager, tmp_path / "w.safetensors")
    with deferred_init():
        deferred = _model().half()
        load_weights(deferred, tmp_path / "w.safetensors")  # inside the block: recorded, read when materialised
    materialize_module(deferred, device=torch.device("cpu"))
    for key, value in expected.state_dict().items():
        assert torch.equal(eager.state_dict()[key], value), key
        assert torch.equal(deferred.state_dict()[key], value.half()), key  # cast to the parameter's dtype


def test_load_weights_after_the_block_still_defers(tmp_path):
    state = _state()
    save_file(state, tmp_path / "w.safetensors")
    with deferred_init():
        model = _model()
    load_weights(model, tmp_path / "w.safetensors")  # e.g. after `trainer.init_module(empty_init=True)`
    assert model[0].weight.is_meta
    materialize_module(model, device=torch.device("cpu"))
    assert torch.equal(model[0].weight, state["0.weight"])


def test_a_file_that_does_not_fit_is_refused_naming_the_fix(tmp_path):
    state = _state()
    save_file({**state, "extra": torch.zeros(1)}, tmp_path / "extra.safetensors")
    save_file({k: v for k, v in state.items() if k != "2.bias"}, tmp_path / "short.safetensors")
    save_file({**state, "0.weight": torch.zeros(6, 5)}, tmp_path / "shape.safetensors")
    with pytest.raises(ValueError, match=r"(?s)the module lacks 1 of the file's entries: extra.*strict=False"):
        load_weights(_model(), tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match=r"the file lacks 1 of the module's entries: 2.bias"):
        load_weights(_model(), tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match=r"0.weight: \(6, 5\) in the file, \(6, 4\) in the module"):
        load_weights(_model(), tmp_path / "shape.safetensors", strict=False)
    model = _model()
    load_weights(model, tmp_path / "short.safetensors", strict=False)  # the rest loads
    assert torch.equal(model[0].weight, state["0.weight"])
    with pytest.raises(FileNotFoundError, match=r"holds none of model\.safetensors"):
        load_weights(_model(), tmp_path)
