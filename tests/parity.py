"""The comparison every layout test makes with the single-device run (DESIGN.md §4), written once.

`single_device_run` trains a model for N steps in one process in plain PyTorch (the reference); `one_process`
runs a test's own fit as a one-rank job; the layouts run under `tests/distributed.py::run_distributed`.
`mean_losses` averages the ranks' per-step losses over the data-parallel replicas, and the asserts compare with
the tolerances of DESIGN.md: fp32 within `FP32_REL`; fp16 with the same skipped steps and loss scale, within
`FP16_REL`. The models, layouts and what else a test checks stay in the test files.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from tests.distributed import run_distributed

__all__ = [
    "FP16_REL",
    "FP32_REL",
    "assert_fp16_matches",
    "assert_same_overflow",
    "assert_tensors_close",
    "lightning_batches",
    "mean_losses",
    "one_process",
    "plain_fit",
    "single_device_run",
]

FP32_REL = 1e-5  # fp32 layouts against the single-device fp32 run, relative
FP16_REL = 2e-2  # fp16 layouts against the single-device fp16 run (with the same skipped steps), relative

Record = Mapping[str, Any]


def single_device_run(
    build: Callable[[], Any],
    loss: Callable[[Any, Any, int], Tensor],
    *,
    steps: int,
    replicas: int = 1,
    fp16: bool = False,
    init_scale: float = 2.0**16,
    scale_window: int = 1000,
    clip_norm: float | None = None,
    shuffle: bool = True,
) -> dict[str, Any]:
    """``steps`` steps in plain PyTorch on the global batch (the data-parallel replicas' batches together, in
    Lightning's shuffled order): fp32, or fp16 parameters with fp32 master copies and smp's dynamic loss scale
    (`_master_step`, written here without the package's optimizer; ``init_scale`` and ``scale_window`` as smp's
    ``dynamic_loss_args``); optionally clipping the gradient norm as Lightning's ``gradient_clip_val`` does.
    ``shuffle=False``: the batches in the dataset's order, as a loader with its own sequential sampler gives them to
    a Trainer with ``use_distributed_sampler=False``.

    ``build`` makes the LightningModule after ``torch.manual_seed(0)`` (its optimizer and train dataloader are
    used); ``loss(model, batch, step)`` is one step's loss. Returns ``losses`` (per step), ``weights`` (fp32, by
    name), ``step_weights`` (every parameter flattened into one fp32 vector, after each step), ``skipped`` and
    ``scale`` (fp16's overflow record; 0 and None in fp32).
    """
    torch.manual_seed(0)
    model = build()
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    if fp16:
        model.half()
        params = list(model.parameters())
        masters = [param.detach().float().clone() for param in params]
        master_of = {id(param): master for param, master in zip(params, masters, strict=True)}
        groups = [{**group, "params": [master_of[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
        optimizer = type(optimizer)(groups)  # the model's param groups (weight decay, frozen ones) over the masters
        scale, skipped = _LossScale(init_scale, scale_window), 0
    dataset = model.train_dataloader().dataset
    batch_size = model.train_dataloader().batch_size
    samplers = [
        DistributedSampler(dataset, num_replicas=replicas, rank=r, seed=0, shuffle=shuffle) for r in range(replicas)
    ]
    per_epoch = len(samplers[0]) // batch_size
    losses, step_weights = [], []
    for step in range(steps):
        epoch, index = divmod(step, per_epoch)
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler)[index * batch_size : (index + 1) * batch_size])
        batch = dataset[torch.tensor([i for shard in shards for i in shard])]
        if fp16:
            batch = [t.half() if t.is_floating_point() else t for t in batch] if isinstance(batch, tuple) else batch
        value = loss(model, batch, step)
        losses.append(value.item())
        model.zero_grad()
        if fp16:
            (value.float() * scale.value).backward()
            skipped += _master_step(params, masters, optimizer, scale, clip_norm)
        else:
            value.backward()
            if clip_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            optimizer.step()
        step_weights.append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
    return {
        "losses": losses,
        "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
        "step_weights": step_weights,
        "skipped": skipped if fp16 else 0.0,
        "scale": scale.value if fp16 else None,
    }


class _LossScale:
    """smp's dynamic loss scale with its defaults but ``init_scale`` (and ``scale_window``): halved (down to 1) by a
    step whose gradients overflow, doubled after ``scale_window`` clean steps in a row."""

    def __init__(self, init_scale: float, scale_window: int = 1000) -> None:
        self.value, self._clean, self._window = init_scale, 0, scale_window

    def update(self, overflow: bool) -> None:
        self._clean = 0 if overflow else self._clean + 1
        if overflow:
            self.value = max(self.value / 2, 1.0)
        elif self._clean % self._window == 0:
            self.value *= 2


@torch.no_grad()
def _master_step(
    params: list[Tensor], masters: list[Tensor], optimizer: Any, scale: _LossScale, clip_norm: float | None
) -> bool:
    """One fp16 step: the fp16 grads, unscaled in fp32, become the masters' grads; if any is inf or NaN the step is
    skipped, else they are clipped by their global norm (``clip_norm``), the optimizer updates the masters and
    the fp16 parameters take their rounded values. Returns whether it skipped."""
    for param, master in zip(params, masters, strict=True):
        master.grad = None if param.grad is None else param.grad.float() / scale.value
    grads = [master.grad for master in masters if master.grad is not None]
    overflow = not all(torch.isfinite(grad).all() for grad in grads)
    scale.update(overflow)
    if overflow:
        return True
    if clip_norm is not None:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grad) for grad in grads]))
        for grad in grads:
            grad.mul_(min(1.0, clip_norm / (norm.item() + 1e-6)))
    optimizer.step()
    for param, master in zip(params, masters, strict=True):
        param.copy_(master)
    return False


def lightning_batches(loader: Any, count: int) -> list[Any]:
    """``count`` batches of ``loader`` in the order a Trainer's one replica reads them: its dataset through the
    ``DistributedSampler`` Lightning puts in (shuffled with seed 0, reshuffled each epoch), ``loader.batch_size``
    samples each."""
    sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, seed=0)
    per_epoch = len(sampler) // loader.batch_size
    batches = []
    for step in range(count):
        epoch, index = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        order = list(sampler)[index * loader.batch_size : (index + 1) * loader.batch_size]
        batches.append(loader.dataset[torch.tensor(order)])
    return batches


def plain_fit(
    model: nn.Module,
    loss: Callable[[Any, Any], Tensor],
    batches: Sequence[Any],
    *,
    optimizer: Any,
    accumulate: int = 1,
    fp16: Mapping[str, float] | None = None,
    clip_norm: float | None = None,
    validation: Sequence[Any] = (),
) -> dict[str, Any]:
    """A Trainer's fit written as a plain torch loop, for references that record what a layout test compares: a step
    per ``accumulate`` batches (each batch's loss divided by ``accumulate``), ``optimizer`` built over ``model``.
    ``fp16``: ``{"init_scale": ..., "scale_window": ...}``, fp16 parameters with fp32 masters and smp's dynamic scale.
    ``clip_norm``: each step's gradients clipped to that global norm, as Lightning's ``gradient_clip_val``. Dropout
    draws its masks from the global random stream as in a one-process Trainer's run, where nothing else draws from
    it between the model's build (which seeds it) and the first step.
    Returns ``losses`` (per batch), ``initial`` (the parameters before training, in the trained dtype, as fp32, by
    name), ``grads`` (fp32 runs: each step's gradients by name), ``norms`` (fp16: each step's global norm of the
    unscaled master gradients, -1 where they overflowed), ``skipped`` and ``scale``, and ``val_loss`` (the mean loss
    over ``validation`` after training, in eval mode; None without)."""
    if fp16 is not None:
        model.half()
    named = dict(model.named_parameters())
    initial = {name: param.detach().float().clone() for name, param in named.items()}  # as trained: fp16 rounded
    params = list(named.values())
    if fp16 is not None:
        masters = [param.detach().float().clone() for param in params]
        master_of = {id(param): master for param, master in zip(params, masters, strict=True)}
        groups = [{**group, "params": [master_of[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
        optimizer = type(optimizer)(groups)
        scale = _LossScale(fp16["init_scale"], int(fp16.get("scale_window", 1000)))
    losses, grads, norms, skipped = [], [], [], 0
    for start in range(0, len(batches), accumulate):
        model.zero_grad()
        for batch in batches[start : start + accumulate]:
            value = loss(model, batch)
            losses.append(value.item())
            (value.float() * (scale.value if fp16 is not None else 1.0) / accumulate).backward()
        if fp16 is None:
            grads.append({name: param.grad.detach().float().clone() for name, param in named.items()})
            if clip_norm is not None:
                nn.utils.clip_grad_norm_(params, clip_norm)
            optimizer.step()
            continue
        unscaled = [param.grad.float() / scale.value for param in params]
        finite = all(torch.isfinite(grad).all() for grad in unscaled)
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in unscaled])).item() if finite else -1.0)
        skipped += _master_step(params, masters, optimizer, scale, clip_norm=clip_norm)
    val_loss = None
    if validation:
        model.eval()
        with torch.no_grad():
            val_loss = sum(loss(model, batch).item() for batch in validation) / len(validation)
        model.train()
    return {
        "losses": losses,
        "initial": initial,
        "grads": grads,
        "norms": norms,
        "skipped": skipped if fp16 is not None else 0.0,
        "scale": scale.value if fp16 is not None else None,
        "val_loss": val_loss,
    }


def one_process(target: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """``target(0, *args)`` as a one-rank job (the reference of a test whose fit is a Lightning run)."""
    (record,) = run_distributed(target, 1, *args, timeout=timeout)
    return record


def mean_losses(runs: Sequence[Record], *, replica: str | None = None, steps: int | None = None) -> list[float]:
    """Each step's loss averaged over the data-parallel replicas; ``runs`` are the ranks' records (``losses``).

    ``replica`` names the record's data-parallel index: the ranks of one replica (its stages) must report the same
    losses, and it counts once. Without it every record counts. ``steps``: how many losses every record has.
    """
    by_replica: dict[Any, list[float]] = {}
    for rank, run in enumerate(runs):
        if steps is not None:
            assert len(run["losses"]) == steps, f"rank {rank}"
        key = rank if replica is None else run[replica]
        assert by_replica.setdefault(key, run["losses"]) == run["losses"], f"rank {rank}: its replica disagrees"
    return [sum(values) / len(values) for values in zip(*by_replica.values(), strict=True)]


def assert_same_overflow(run: Record, reference: Record) -> None:
    """fp16: the same number of skipped steps and the same final loss scale as the reference."""
    assert run["skipped"] == reference["skipped"] and run["scale"] == reference["scale"]


def assert_fp16_matches(run: Record, reference: Record) -> None:
    """fp16 parity of one rank's record: the same skipped steps and loss scale, per-step losses within FP16_REL."""
    assert_same_overflow(run, reference)
    assert run["losses"] == pytest.approx(reference["losses"], rel=FP16_REL)


def assert_tensors_close(
    actual: Mapping[str, Tensor], expected: Mapping[str, Tensor], *, rtol: float, atol: float, label: str = ""
) -> None:
    """The same names, and every tensor within the tolerances of the reference's (``rtol=atol=0``: equal)."""
    assert set(actual) == set(expected), label
    for name, value in expected.items():
        torch.testing.assert_close(
            actual[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{label} {n}: {m}".strip()
        )
