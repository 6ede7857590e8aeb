"""`lightning_smp._compat`: every private name of another library we use, checked against the installed ones, and
the rule that no other module of the package touches one.

Each test names the entry it checks, so an upgrade that renames or changes one fails here, by name.
"""

import ast
import importlib.util
import inspect
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from packaging.specifiers import SpecifierSet
from torch import nn
from torchmetrics.aggregation import SumMetric

from lightning_smp import SMPStrategy, _compat

PACKAGE = Path(_compat.__file__).parent

# Private names of other libraries that we also use for attributes of our own, so that the rule's "is it ours"
# test below cannot tell them apart: they are always foreign.
_FOREIGN = {
    "_buffers",
    "_checkpoint_connector",
    "_computed",
    "_forward_cache",
    "_modules",
    "_move_missing_keys_from_meta_to_device",
    "_optimizer",
    "_parameters",
    "_signal_connector",
    "_trainer",
    "_update_count",
}
# Names with a leading underscore that are a library's documented API, not private: a namedtuple's fields.
_DOCUMENTED = {"_fields", "_asdict", "_replace"}


# -- the versions the entries were checked on --------------------------------------------------------------------------


@pytest.mark.parametrize("library", sorted(_compat.CHECKED_VERSIONS))
def test_the_installed_version_is_one_the_entries_were_checked_on(library):
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    version, checked = _compat.installed_version(library), _compat.CHECKED_VERSIONS[library]
    assert SpecifierSet(checked).contains(version, prereleases=True), (
        f"{library} {version} is installed, but lightning_smp/_compat.py's entries were checked on {library}{checked}: "
        f"run this file and the `--oldest` job with {library} {version}, mend what fails, then raise the bound in "
        "_compat.CHECKED_VERSIONS and setup.cfg together (docs/contributing.md, 'Raising a dependency's bound')"
    )


# -- the rule ------------------------------------------------------------------------------------------------------


def _our_private_names() -> set[str]:
    """Every ``_name`` the package defines: functions, classes, module globals, attributes it assigns."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
            elif isinstance(node, ast.Call) and _is_setattr(node.func) and _constant_name(node):
                names.add(node.args[1].value)  # object.__setattr__(module, "_name", ...)
    return {name for name in names if name.startswith("_")} - _FOREIGN


def _constant_name(call: ast.Call) -> bool:
    return len(call.args) > 1 and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str)


def _is_setattr(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "setattr") or (
        isinstance(func, ast.Attribute) and func.attr == "__setattr__"
    )


def _private_uses(path: Path, ours: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lightning_smp"):
            parts = node.module.split(".")
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if any(part.startswith("_") and part != "__future__" for part in parts) or private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import {', '.join(private) or '...'}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(part.startswith("_") for part in alias.name.split(".")):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            attr = node.attr
            if attr.startswith("_") and not attr.startswith("__") and attr not in ours:
                found.append(f"{path.name}:{node.lineno} .{attr}")
        elif isinstance(node, ast.Call) and _reads_attribute_by_name(node.func) and _constant_name(node):
            attr = node.args[1].value  # getattr(obj, "_name"), hasattr(...), setattr(...), delattr(...)
            if attr.startswith("_") and not attr.startswith("__") and attr not in ours | _DOCUMENTED:
                found.append(f'{path.name}:{node.lineno} "{attr}"')
    return found


def _reads_attribute_by_name(func: ast.expr) -> bool:
    return isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr")


def test_no_module_but_compat_touches_another_librarys_private_names():
    ours = _our_private_names()
    found = [
        use for path in sorted(PACKAGE.rglob("*.py")) if path.name != "_compat.py" for use in _private_uses(path, ours)
    ]
    assert found == [], "move these into lightning_smp/_compat.py (with the version checked and a test here)"


def test_the_rule_finds_a_private_access(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nfrom torch.utils._pytree import tree_map\nx = torch._foreach_norm\ny = m._parameters\n"
        'z = getattr(m, "_trainer", None)\nw = hasattr(t, "_fields")\n'
    )
    assert len(_private_uses(sample, _our_private_names())) == 4


# -- torch (2.13.0) ------------------------------------------------------------------------------------------------


def test_torch_foreach_kernels():
    a, b = [torch.ones(2), torch.full((3,), 2.0)], [torch.zeros(2), torch.zeros(3)]
    _compat.foreach_copy_(b, a)
    assert torch.equal(b[1], a[1])
    _compat.foreach_mul_(b, 3.0)
    _compat.foreach_clamp_max_(b, 5.0)
    _compat.foreach_clamp_min_(b, 3.5)
    assert b[0].tolist() == [3.5, 3.5] and b[1].tolist() == [5.0, 5.0, 5.0]
    assert [n.item() for n in _compat.foreach_norm(a, dtype=torch.float32)] == pytest.approx(
        [math.sqrt(2), math.sqrt(12)]
    )
    _compat.foreach_zero_(b)
    assert all(not t.any() for t in b)


def test_torch_non_finite_check_and_unscale():
    grads, found = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])], torch.zeros(())
    _compat.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert grads[0].tolist() == [1.0, 2.0] and found.item() == 1.0


def test_torch_autograd_engine_call_accumulates_like_backward():
    """`accumulate_gradients` is ``torch.autograd.backward`` from a node's gradient edge with ``inputs=``, hooks
    included, less its checks of the gradients."""
    from torch.autograd.graph import GradientEdge

    layer = nn.Linear(3, 2)
    layer.bias.register_hook(lambda grad: 2 * grad)
    x = torch.randn(4, 3, requires_grad=True)
    out = layer(x)
    grad = torch.randn(4, 2)
    _compat.accumulate_gradients([GradientEdge(out.grad_fn, 0)], [grad], [layer.weight, layer.bias], retain_graph=True)
    assert x.grad is None
    torch.testing.assert_close(layer.weight.grad, grad.t() @ x)
    torch.testing.assert_close(layer.bias.grad, 2 * grad.sum(0))
    _compat.accumulate_gradients([out], [grad], [x], retain_graph=False)
    torch.testing.assert_close(x.grad, grad @ layer.weight)
    assert list(inspect.signature(torch.autograd.graph._engine_run_backward).parameters)[:1] == ["t_outputs"]


def test_torch_flat_buffers_and_module_state_sync():
    tensors = [torch.ones(2), torch.zeros(1, 3)]
    flat = _compat.flatten_dense_tensors(tensors)
    assert flat.numel() == 5
    assert [t.shape for t in _compat.unflatten_dense_tensors(flat, tensors)] == [(2,), (1, 3)]
    parameters = inspect.signature(_compat.sync_module_states).parameters
    assert list(parameters)[:5] == [
        "module",
        "process_group",
        "broadcast_bucket_size",
        "src",
        "params_and_buffers_to_ignore",
    ]
    assert list(inspect.signature(_compat.set_process_group_timeout).parameters)[:2] == ["timeout", "group"]
    from torch.distributed.device_mesh import DeviceMesh

    assert list(inspect.signature(DeviceMesh._unflatten).parameters)[1:4] == ["dim", "mesh_sizes", "mesh_dim_names"]


def test_torch_fsdp_per_parameter_placement():
    from torch.distributed.fsdp import fully_shard

    assert "shard_placement_fn" in inspect.signature(fully_shard).parameters
    fields = {"mesh", "shard_mesh_dim", "replicate_mesh_dim"}
    assert fields <= set(inspect.signature(_compat.HSDPMeshInfo).parameters)
    assert set(inspect.signature(_compat.ShardPlacementResult).parameters) == {"placement", "mesh_info"}


def test_torch_flash_attention_for_cpu_keeps_the_output_and_a_logsumexp():
    q = k = v = torch.empty(2, 4, 8, 16, device="meta")  # batch, heads, sequence, head dim
    output, logsumexp = _compat.flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=None, scale=None)
    assert output.shape == (2, 4, 8, 16) and logsumexp.shape == (2, 4, 8)


def test_torch_flash_attention_kernels_and_backwards_the_ring_calls():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    output, logsumexp = _compat.flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=None, scale=None)
    grad = torch.randn_like(output)
    grads = _compat.flash_attention_for_cpu_backward(
        grad, q, k, v, output, logsumexp, 0.0, True, attn_mask=None, scale=None
    )
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    for mine, torchs in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(mine, torchs)
    cuda = [
        str(op._schema) for op in (_compat.flash_attention_cuda.default, _compat.flash_attention_cuda_backward.default)
    ]
    assert "bool return_debug_mask=False, *, float? scale=None" in cuda[0]
    assert "Tensor philox_seed, Tensor philox_offset, *, float? scale=None" in cuda[1]


def test_torch_scaled_dot_product_attention_replaced_inside_multi_head_attention():
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def replacement(*args, **kwargs):
        seen.append(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        return original(*args, **kwargs)

    layer = nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    with _compat.replaced_scaled_dot_product_attention(replacement):
        layer(torch.randn(2, 4, 8), src_mask=mask, is_causal=True)
    assert seen == [True] and torch.nn.functional.scaled_dot_product_attention is original


def test_transformers_attention_implementation_reader():
    import transformers

    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    model = transformers.LlamaModel(config)
    model.set_attn_implementation("eager")
    assert _compat.hf_attention_implementation(model) == "eager"


def test_torch_modules_and_their_tables():
    assert all(issubclass(c, _compat.BatchNormBase) for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm))
    linear = nn.Linear(2, 3)
    linear.register_buffer("scale", torch.ones(1))
    assert set(_compat.parameter_table(linear)) == {"weight", "bias"}
    assert set(_compat.buffer_table(linear)) == {"scale"}
    assert _compat.module_table(nn.Sequential(linear))["0"] is linear
    assert set(_compat.MODULE_TABLES) <= set(vars(linear))
    replaced = nn.Parameter(torch.zeros(3))
    _compat.parameter_table(linear)["bias"] = replaced
    assert linear.bias is replaced  # the live table


def test_torch_attention_masks():
    mask = torch.tensor([[True, False]])
    canonical = _compat.canonical_mask(
        mask=mask, mask_name="m", other_type=_compat.none_or_dtype(None), other_name="o", target_type=torch.float32
    )
    assert canonical.dtype == torch.float32 and canonical[0, 0] == -math.inf and canonical[0, 1] == 0
    assert _compat.none_or_dtype(torch.ones(1, dtype=torch.float16)) == torch.float16


def test_torch_dispatch_internals():
    assert issubclass(_compat.TorchDispatchMode, object) and hasattr(_compat.TorchDispatchMode, "__torch_dispatch__")
    assert {torch.empty, torch.randn, torch.zeros} <= _compat.device_constructors()
    assert str(_compat.ATEN_TO_COPY) == "aten._to_copy.default"
    schema = _compat.op_schema(torch.ops.aten.mul_.Tensor)
    assert schema.is_mutable and schema.arguments[0].alias_info.is_write
    a = torch.empty(2, device="meta")
    assert _compat.storage_key(a.untyped_storage()) == _compat.storage_key(a[1:].untyped_storage())
    assert _compat.storage_key(a.untyped_storage()) != _compat.storage_key(
        torch.empty(2, device="meta").untyped_storage()
    )
    assert all(name in vars(torch.nn.init) for name in _compat.INITS_THAT_SKIP_META)
    assert "_no_grad_trunc_normal_" in inspect.getsource(torch.nn.init.trunc_normal_)  # looked up at each call


def test_torch_pytree():
    leaves, spec = _compat.tree_flatten({"a": (1, torch.ones(1)), "b": [2]})
    assert _compat.tree_unflatten(leaves, spec)["b"] == [2]
    assert _compat.tree_leaves([1, (2, 3)]) == [1, 2, 3]
    assert _compat.tree_map(lambda x: x * 2, {"a": [1]}) == {"a": [2]}


# -- Lightning (2.6.6) -----------------------------------------------------------------------------------------------


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)


def test_lightning_checkpoint_dump_and_reduce():
    trainer = _trainer()
    assert "weights_only" in inspect.signature(trainer._checkpoint_connector.dump_checkpoint).parameters
    assert list(inspect.signature(_compat.sync_ddp_if_available).parameters)[:3] == ["result", "group", "reduce_op"]


def test_lightning_strategy_and_precision_internals():
    from datetime import timedelta

    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(timeout=timedelta(seconds=7), find_unused_parameters=True)
    assert _compat.strategy_timeout(strategy) == timedelta(seconds=7)
    assert _compat.ddp_kwargs(strategy) == {"find_unused_parameters": True}
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    fabric_strategy = FabricDDP(timeout=timedelta(seconds=5), find_unused_parameters=True)
    assert _compat.strategy_timeout(fabric_strategy) == timedelta(seconds=5)
    assert _compat.ddp_kwargs(fabric_strategy) == {"find_unused_parameters": True}
    control = type("Control", (_compat.BackwardSyncControl,), {"no_backward_sync": lambda self, module, enabled: None})
    _compat.set_backward_sync_control(fabric_strategy, control())
    assert isinstance(fabric_strategy._backward_sync_control, control)
    assert callable(_compat.forward_redirection(strategy))
    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    # the protected hooks our subclasses override (see _compat's docstring)
    assert "self._setup_model(" in inspect.getsource(DDPStrategy)
    assert "self._precision_plugin" in inspect.getsource(DDPStrategy.__mro__[2])  # Strategy
    assert "_apply" in vars(nn.Module) and "self._apply(" in inspect.getsource(nn.Module.to)


def test_transformers_missing_keys_mover_replaced_for_the_block():
    modeling_utils = pytest.importorskip("transformers.modeling_utils")
    model_class = modeling_utils.PreTrainedModel
    original = model_class._move_missing_keys_from_meta_to_device
    assert "self" in inspect.signature(original).parameters
    with _compat.hf_missing_keys_moved_by(lambda move: ("wrapped", move)) as moved:
        assert moved
        assert model_class._move_missing_keys_from_meta_to_device == ("wrapped", original)
    assert model_class._move_missing_keys_from_meta_to_device is original


def test_transformers_turns_hub_kernels_on_unless_told_not_to():
    modeling_utils = pytest.importorskip("transformers.modeling_utils")
    source = inspect.getsource(modeling_utils.PreTrainedModel.from_pretrained)
    assert f'kwargs.pop("{_compat.HF_USE_KERNELS}"' in source  # the keyword `delayed_init.huggingface` passes


def test_lightning_sigterm_hooks():
    from lightning.pytorch.loops import training_epoch_loop
    from lightning.pytorch.trainer.connectors import signal_connector

    trainer = _trainer()
    registration = inspect.getsource(signal_connector._SignalConnector.register_signal_handlers)
    assert "self._sigterm_notifier_fn" in registration and "self._slurm_sigusr_handler_fn" in registration
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(training_epoch_loop)
    calls = []
    _compat.install_sigterm_hooks(trainer, on_signal=lambda *a: calls.append(a), before_step=lambda: calls.append(0))
    trainer._signal_connector._sigterm_notifier_fn(15, None)
    trainer._signal_connector._slurm_sigusr_handler_fn(10, None)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == [(15, None), (10, None), 0]
    assert not trainer.received_sigterm
    _compat.mark_sigterm_received(trainer)
    assert trainer.received_sigterm


def test_lightning_last_checkpoint_routed(tmp_path):
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.states import TrainerFn

    smp_trainer = pl.Trainer(strategy=SMPStrategy(), accelerator="cpu", devices=1, default_root_dir=tmp_path)
    assert getattr(_CheckpointConnector._parse_ckpt_path, "__wrapped_by_lightning_smp__", False)  # by SMPStrategy
    source = inspect.getsource(_CheckpointConnector._select_ckpt_path)
    assert "self._parse_ckpt_path(" in source and "model_connected=model_connected" in source
    (tmp_path / "checkpoints" / "preempted-step=3.ckpt").mkdir(parents=True)
    (tmp_path / "checkpoints" / "preempted-step=3.ckpt" / "meta.pt").write_bytes(b"")
    arguments = (TrainerFn.FITTING, "last", True, True)
    assert smp_trainer._checkpoint_connector._parse_ckpt_path(*arguments) == str(
        tmp_path / "checkpoints" / "preempted-step=3.ckpt"
    )
    plain = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, logger=False)
    assert plain._checkpoint_connector._parse_ckpt_path(*arguments) is None  # Lightning's own: last*.ckpt only


def test_lightning_child_process_observer():
    from lightning.fabric.strategies.launchers import subprocess_script

    source = inspect.getsource(subprocess_script._ChildProcessObserver)
    assert 'name="child-process-observer"' in source and "self._finished = self._run()" in source
    _compat.stop_child_process_observer()  # none running here: a no-op


def test_lightning_log_replaced_on_the_instance():
    module = pl.LightningModule()
    calls = []
    with _compat.replaced_log(module, lambda *args, **kwargs: calls.append(args)):
        module.log("x", 1.0)
    assert calls == [("x", 1.0)] and "log" not in vars(module)


# -- torchmetrics (1.9.0) ------------------------------------------------------------------------------------------


def test_torchmetrics_step_value_lightning_reads_and_update_count():
    from lightning.pytorch.trainer.connectors.logger_connector import result

    assert "value._forward_cache" in inspect.getsource(result._ResultMetric.update)
    metric = SumMetric()
    assert metric(torch.tensor(2.0)) is metric._forward_cache  # what forward leaves there
    _compat.set_metric_step_value(metric, torch.tensor(7.0))
    assert metric._forward_cache.item() == 7.0
    metric.reset()
    _compat.set_metric_update_count(metric, 3)
    assert metric.update_count == 3 and metric.update_called


# -- torch.optim.lr_scheduler (torch 2.13.0) -------------------------------------------------------------------------


def test_scheduler_methods_replaced_and_left_out_of_its_state():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    steps = []
    step, state_dict = _compat.replace_scheduler_methods(scheduler, step=lambda: steps.append(1), state_dict=dict)
    scheduler.step()
    assert steps == [1] and optimizer.param_groups[0]["lr"] == 1.0
    state = state_dict()
    assert {"step", "state_dict"} <= set(state)  # torch saves the instance's __dict__, replaced methods included
    assert not {"step", "state_dict"} & set(_compat.scheduler_state_without(state, ("step", "state_dict")))
    optimizer.step()
    step()
    assert optimizer.param_groups[0]["lr"] == 0.5
