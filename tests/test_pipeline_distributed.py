"""Pipeline parallelism through Lightning's loops, checked against the single-process fp32 run (gloo, CPU).

Each `run_distributed` call starts its ranks once and trains several layouts one after another (process start-up
dominates on two shared cores); the module-scoped fixtures hold their results and the tests compare them.
"""

import os
import weakref
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_smp import SMPStrategy, smp
from tests.distributed import run_distributed
from tests.gpt import SEQ, VOCAB, WIDTH, BlockGPT
from tests.models import quiet_trainer, small_cnn
from tests.parity import (
    FP16_REL,
    FP32_REL,
    assert_fp16_matches,
    assert_same_overflow,
    assert_tensors_close,
    mean_losses,
    single_device_run,
)

STEPS = 10

# -- models ----------------------------------------------------------------------------------------------------


class TinyGPT(BlockGPT):
    """`tests.gpt.BlockGPT` (tied head unless ``tied=False``) with its data, steps and optimizer; ``checkpoint``: the
    trunk's activation-checkpointing strategy, if any."""

    def __init__(
        self,
        *,
        lr: float = 0.05,
        optimizer: str = "sgd",
        batch_size: int = 8,
        samples: int = 80,
        checkpoint: str | None = None,
        tied: bool = True,
    ) -> None:
        super().__init__(tied=tied)
        if checkpoint:
            smp.set_activation_checkpointing(self.blocks, strategy=checkpoint)
        self.lr, self.optimizer_name, self.batch_size = lr, optimizer, batch_size
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch[:, :-1]).argmax(-1)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)}
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.tokens, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.tokens[:32], batch_size=self.batch_size)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class TinyCNN(pl.LightningModule):
    """The whole model is one nn.Sequential: the trunk, with nothing before or after it; ``checkpoint``: the
    trunk's activation-checkpointing strategy, if any."""

    def __init__(self, *, batch_size: int = 8, samples: int = 80, checkpoint: str | None = None) -> None:
        super().__init__()
        self.net = small_cnn()
        if checkpoint:
            smp.set_activation_checkpointing(self.net, strategy=checkpoint)
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(2)
        self.data = TensorDataset(
            torch.randn(samples, 1, 8, 8, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


MODELS = {"gpt": TinyGPT, "cnn": TinyCNN}


class _Losses(Callback):
    """Every step's loss as Lightning saw it (the step output), and the LR after each step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _trainer(strategy, **kwargs) -> pl.Trainer:
    defaults = dict(
        devices=int(os.environ.get("WORLD_SIZE", "1")), max_steps=STEPS, num_sanity_val_steps=0, limit_val_batches=0
    )
    return quiet_trainer(strategy, **{**defaults, **kwargs})


# -- the distributed runs ---------------------------------------------------------------------------------------


_WEIGHT_ACTIONS = [0]  # W actions (split backwards' weight gradients) this rank ran


def _count_weight_actions() -> None:
    from lightning_smp.pipeline.runtime import PipelineEngine

    run = PipelineEngine._weight

    def counted(self, action, state):
        _WEIGHT_ACTIONS[0] += 1
        return run(self, action, state)

    PipelineEngine._weight = counted


_REDUCTIONS: list[tuple[int, int]] = []  # per overlapped reduction: (buckets started during backward, buckets)


def _count_overlapped_reductions() -> None:
    from lightning_smp.overlap import ReadyBuckets
    from lightning_smp.pipeline.reduction import StageGradientReduction

    start, launch_rest = StageGradientReduction.start, ReadyBuckets.launch_rest
    engines = weakref.WeakSet()  # the engine's reductions (ZeRO-1's optimizer has its own ReadyBuckets)

    def started(self, **kwargs):
        ready = start(self, **kwargs)
        if ready is not None:
            engines.add(ready)
        return ready

    def counted(self):  # first called after the schedule, then again by `finish`
        if self in engines and not hasattr(self, "counted"):
            self.counted = True
            _REDUCTIONS.append((self.launched, len(self._buckets)))
        return launch_rest(self)

    StageGradientReduction.start = started
    ReadyBuckets.launch_rest = counted


def _fit_layouts(rank: int, layouts: dict[str, tuple]) -> dict:
    """Train each layout (model name, model kwargs, strategy kwargs[, trainer kwargs, where ``compile_backend``
    hands ``fit`` the model through ``torch.compile``]); return losses and the weights this rank owns."""
    _count_weight_actions()
    _count_overlapped_reductions()
    results = {}
    for name, (model_name, model_kwargs, strategy_kwargs, *trainer_kwargs) in layouts.items():
        torch.manual_seed(0)
        weight_actions = _WEIGHT_ACTIONS[0]
        del _REDUCTIONS[:]
        model = MODELS[model_name](**model_kwargs)
        recorder = _Losses()
        options = dict(*trainer_kwargs)
        backend = options.pop("compile_backend", None)
        trainer = _trainer(SMPStrategy(**strategy_kwargs), callbacks=[recorder], **options)
        trainer.fit(torch.compile(model, backend=backend) if backend else model)
        optimizer = trainer.strategy.optimizers[0]
        owned = trainer.strategy.pipeline.owned_parameter_names()
        results[name] = {
            "dp": trainer.strategy.topology.rank("dp"),
            "losses": recorder.losses,
            "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items() if k in owned},
            "held": {name: param.numel() * param.element_size() for name, param in model.named_parameters()},
            "skipped": getattr(optimizer, "skipped_steps", torch.zeros(())).item(),
            "scale": getattr(optimizer, "loss_scale", None),
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],  # compiled so far in this rank
            "weight_actions": _WEIGHT_ACTIONS[0] - weight_actions,
            "reductions": list(_REDUCTIONS),
        }
    return results


_REFERENCES: dict[tuple, dict] = {}


_LOSSES = {
    "gpt": lambda model, batch, step: model.loss(batch),
    "cnn": lambda model, batch, step: model.training_step(batch, step),
}


def _reference(model_name: str, model_kwargs: dict, **options) -> dict:
    """The single-process run in plain PyTorch on the global batch (memoised: several tests compare with it)."""
    key = (model_name, tuple(sorted(model_kwargs.items())), tuple(sorted(options.items())))
    if key not in _REFERENCES:
        build = partial(MODELS[model_name], **model_kwargs)
        _REFERENCES[key] = single_device_run(build, _LOSSES[model_name], steps=STEPS, **options)
    return _REFERENCES[key]


def _check_against(
    reference: dict, ranks: list[dict], name: str, *, rel: float = FP32_REL, weights: bool = True
) -> None:
    """Every rank reports its replica's losses; their mean over replicas is the reference's; every parameter
    lives on exactly one stage and matches the reference's."""
    runs = [result[name] for result in ranks]
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(reference["losses"], rel=rel), name
    if not weights:
        return
    for replica in {run["dp"] for run in runs}:
        held = {}
        for run in runs:
            if run["dp"] == replica:
                assert not set(held) & set(run["weights"]), name  # owned by one stage only
                held.update(run["weights"])
        # every parameter lives on some stage, and matches
        assert_tensors_close(held, reference["weights"], rtol=max(rel, 1e-4), atol=1e-5, label=name)


# -- Lightning's features under pp=2 -------------------------------------------------------------------------------


class _MetricGPT(TinyGPT):
    """TinyGPT that also logs torchmetrics accuracies, as objects (Lightning computes their epoch values)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # macro: the mean over microbatches of their values is not the batch's value; the step value must be
        self.train_acc = MulticlassAccuracy(VOCAB, average="macro")
        self.val_acc = MulticlassAccuracy(VOCAB, average="macro")

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        self.train_acc(logits.argmax(-1), batch[:, 1:])
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        logits = self(batch[:, :-1])
        self.val_acc(logits.argmax(-1), batch[:, 1:])
        self.log("val_acc", self.val_acc)
        self.log(
            "val_loss", F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1)), sync_dist=True
        )


class _History(Callback):
    """What the loops and callbacks saw: step losses, each validation's val_loss, the LR, the logged train_loss and
    the accuracies logged as Metric objects."""

    def __init__(self) -> None:
        self.losses, self.val, self.lrs, self.train_logged = [], [], [], []
        self.train_acc_step, self.train_acc_epoch, self.val_acc = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.train_logged.append(trainer.callback_metrics["train_loss"].item())
        self.train_acc_step.append(trainer.callback_metrics["train_acc_step"].item())

    def on_train_epoch_end(self, trainer, pl_module):
        self.train_acc_epoch.append(trainer.callback_metrics["train_acc_epoch"].item())

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(trainer.callback_metrics["val_loss"].item())
            self.val_acc.append(trainer.callback_metrics["val_acc"].item())
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _fit_features(dirpath: str, strategy) -> dict:
    """Validation every epoch, ModelCheckpoint and EarlyStopping on val_loss, value clipping, accumulation over 2
    batches, AdamW with StepLR, torchmetrics accuracies logged as objects; then test and predict."""
    torch.manual_seed(0)
    model = _MetricGPT(optimizer="adamw", lr=0.02)
    history = _History()
    checkpoint = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1)
    stopper = EarlyStopping(monitor="val_loss", min_delta=0.2, patience=1)
    trainer = quiet_trainer(
        strategy,
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        max_epochs=6,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
        gradient_clip_algorithm="value",
        use_distributed_sampler=False,
        enable_checkpointing=True,
        callbacks=[history, checkpoint, stopper],
    )
    trainer.fit(model)
    tested = trainer.test(model, verbose=False)
    predictions = trainer.predict(model)
    return {
        "losses": history.losses,
        "train_logged": history.train_logged,
        "val": history.val,
        "lrs": history.lrs,
        "train_acc_step": history.train_acc_step,
        "train_acc_epoch": history.train_acc_epoch,
        "val_acc": history.val_acc,
        "best": checkpoint.best_model_score.item(),
        "best_path": os.path.basename(checkpoint.best_model_path),
        "stopped_epoch": stopper.stopped_epoch,
        "global_step": trainer.global_step,
        "test_loss": tested[0]["test_loss"],
        "predictions": torch.cat(predictions),
    }


def _errors() -> dict:
    """The errors a user can cause, each on every rank at the same point."""
    found = {}

    class NoTrunk(TinyCNN):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(64, 10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x.flatten(1)), y)

    class SkipConnection(TinyGPT):
        def forward(self, idx):
            mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).triu(1)
            x = first = self.wte(idx)
            for block in self.blocks:
                x = block(x, mask) + first  # the embedding output would have to cross every stage boundary
            return self.head(self.norm(x))

    class SkipConnectionTraced(SkipConnection):
        def __init__(self):
            super().__init__()
            self.example_input_array = torch.zeros(2, SEQ, dtype=torch.long)  # traced at setup, as smp did

    class OneBlock(TinyGPT):
        def __init__(self):
            super().__init__()
            self.blocks = self.blocks[:1]

    cases = {
        "no_trunk": (NoTrunk, {}, PP2),
        "too_many_stages": (OneBlock, {}, PP2),
        "indivisible": (TinyGPT, {"batch_size": 6}, PP2),
        "skip_at_setup": (SkipConnectionTraced, {}, PP2),
        "skip": (SkipConnection, {}, PP2),  # last: it breaks the connection between the ranks
    }
    for name, (cls, model_kwargs, strategy_kwargs) in cases.items():
        torch.manual_seed(0)
        try:
            _trainer(SMPStrategy(**strategy_kwargs), max_steps=1).fit(cls(**model_kwargs))
        except Exception as error:  # the message is what the test checks
            found[name] = f"{type(error).__name__}: {error}"
    return found


# -- world of 2: pp=2 ----------------------------------------------------------------------------------------------

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 4}
ZB = {"pipeline": "zero_bubble"}
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**16}}  # one overflow, at the first step
CLIP = 0.5
LAYOUTS_2 = {
    "gpt_1f1b": ("gpt", {}, PP2),
    "gpt_simple": ("gpt", {}, {**PP2, "pipeline": "simple", "partition": [1, 3]}),  # manual stage sizes
    "gpt_untied": ("gpt", {"tied": False}, PP2),
    "cnn_1f1b": ("cnn", {}, PP2),
    "cnn_simple": ("cnn", {}, {**PP2, "pipeline": "simple", "active_microbatches": 2}),
    "gpt_fp16": ("gpt", {}, {**PP2, **FP16}),
    # the global norm over both stages, the tied embedding counted once (the last stage's copy is a duplicate)
    "gpt_fp16_clip": ("gpt", {}, {**PP2, **FP16}, {"gradient_clip_val": CLIP}),
    "gpt_fp32_clip": ("gpt", {}, PP2, {"gradient_clip_val": CLIP}),
    "gpt_virtual": ("gpt", {}, {**PP2, "virtual_stages": 2}),  # chunks of one block: stage 0 runs blocks 0 and 2
    # `fit(torch.compile(model))`: Lightning compiles training_step, which the schedule runs per microbatch
    "gpt_compiled": ("gpt", {}, PP2, {"compile_backend": "aot_eager"}),
    # recomputed in backward: a stage's checkpointed first child replays the activation it received
    "gpt_checkpointed": ("gpt", {"checkpoint": "each"}, PP2),
    "cnn_checkpointed": ("cnn", {"checkpoint": "contiguous"}, PP2),  # on the trunk: child by child, with a warning
    # zero bubble: the last stage splits its backwards, its weight gradients run after the first stage's backward
    "gpt_zb": ("gpt", {}, {**PP2, **ZB}),
    "gpt_zb_fp16_clip": ("gpt", {}, {**PP2, **ZB, **FP16}, {"gradient_clip_val": CLIP}),
    "gpt_zb_fp32_clip": ("gpt", {}, {**PP2, **ZB}, {"gradient_clip_val": CLIP}),
    "gpt_zb_checkpointed": ("gpt", {"checkpoint": "each"}, {**PP2, **ZB}),  # W recomputes the blocks again
}


def _world_of_two(rank: int, dirpath: str) -> dict:
    return {
        "layouts": _fit_layouts(rank, LAYOUTS_2),
        "features": _fit_features(dirpath, SMPStrategy(**PP2)),
        "features_zb": _fit_features(os.path.join(dirpath, "zb"), SMPStrategy(**PP2, **ZB)),
        "errors": _errors(),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(_world_of_two, 2, str(tmp_path_factory.mktemp("pp2")), timeout=420)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["gpt_1f1b", "gpt_simple", "gpt_zb"])
def test_pp2_gpt_with_tied_head_matches_one_process(two_ranks, name):
    _check_against(_reference("gpt", {}), [r["layouts"] for r in two_ranks], name)


@pytest.mark.timeout(480)
def test_pp2_zero_bubble_holds_back_the_last_stages_weight_gradients(two_ranks):
    first, last = (r["layouts"]["gpt_zb"]["weight_actions"] for r in two_ranks)
    assert (first, last) == (0, STEPS * PP2["microbatches"])  # the first stage's backwards run whole
    assert all(r["layouts"]["gpt_1f1b"]["weight_actions"] == 0 for r in two_ranks)


@pytest.mark.timeout(300)
def test_pp2_gpt_with_untied_head_matches_one_process(two_ranks):
    _check_against(_reference("gpt", {"tied": False}), [r["layouts"] for r in two_ranks], "gpt_untied")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt_untied", "gpt_1f1b"])
def test_pp2_modules_before_the_trunk_live_on_the_first_stage_only_and_after_it_on_the_last(two_ranks, name):
    first, last = (set(r["layouts"][name]["held"]) for r in two_ranks)
    before, after = {"wte.weight", "wpe.weight"}, {"norm.weight", "norm.bias"}
    if name == "gpt_untied":
        after.add("head.weight")
        assert before <= first and not before & last and after <= last and not after & first
    else:  # the tied embedding and head weight: on both stages (under its first name), kept in sync
        assert before <= first and "wpe.weight" not in last and after <= last and "wte.weight" in last
    assert not {n for n in first if n.startswith("blocks.")} & {n for n in last if n.startswith("blocks.")}
    single = _reference("gpt", {} if name == "gpt_1f1b" else {"tied": False})["weights"]
    stage_bytes = [sum(r["layouts"][name]["held"].values()) for r in two_ranks]
    whole = sum(v.numel() * 4 for k, v in single.items() if k != "head.weight" or name == "gpt_untied")
    shared = VOCAB * WIDTH * 4 if name == "gpt_1f1b" else 0
    assert sum(stage_bytes) == whole + shared  # nothing held twice but the tied weight


@pytest.mark.timeout(300)
def test_pp2_with_two_virtual_stages_per_rank_matches_one_process(two_ranks):
    _check_against(_reference("gpt", {}), [r["layouts"] for r in two_ranks], "gpt_virtual")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "layout"), [("gpt", "gpt_checkpointed"), ("cnn", "cnn_checkpointed"), ("gpt", "gpt_zb_checkpointed")]
)
def test_pp2_activation_checkpointed_trunk_matches_one_process(two_ranks, name, layout):
    _check_against(_reference(name, {}), [r["layouts"] for r in two_ranks], layout)


@pytest.mark.timeout(300)
def test_pp2_compiled_model_matches_one_process(two_ranks):
    assert all(r["layouts"]["gpt_compiled"]["graphs"] > 0 for r in two_ranks)  # it really ran compiled
    _check_against(_reference("gpt", {}), [r["layouts"] for r in two_ranks], "gpt_compiled")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["cnn_1f1b", "cnn_simple"])
def test_pp2_sequential_cnn_matches_one_process(two_ranks, name):
    _check_against(_reference("cnn", {}), [r["layouts"] for r in two_ranks], name)


@pytest.mark.timeout(300)
def test_pp2_fp16_matches_one_process_with_the_same_skipped_steps(two_ranks):
    reference = _reference("gpt", {}, fp16=True, init_scale=2.0**16)
    assert reference["skipped"] > 0  # the check below means something
    for result in two_ranks:
        assert_fp16_matches(result["layouts"]["gpt_fp16"], reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt_fp16_clip", "gpt_zb_fp16_clip"])
def test_pp2_fp16_clips_by_the_global_norm_over_all_stages(two_ranks, name):
    reference = _reference("gpt", {}, fp16=True, init_scale=2.0**16, clip_norm=CLIP)
    unclipped = _reference("gpt", {}, fp16=True, init_scale=2.0**16)
    assert reference["losses"][-1] != pytest.approx(unclipped["losses"][-1], rel=FP16_REL)  # clipping mattered
    assert reference["skipped"] > 0  # the overflow vote after the last W skipped the same steps
    for result in two_ranks:
        assert_fp16_matches(result["layouts"][name], reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt_fp32_clip", "gpt_zb_fp32_clip"])
def test_pp2_fp32_clips_by_the_global_norm_over_all_stages(two_ranks, name):
    _check_against(_reference("gpt", {}, clip_norm=CLIP), [r["layouts"] for r in two_ranks], name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("features", ["features", "features_zb"])
def test_pp2_lightning_features_agree_on_every_rank_and_with_one_process(two_ranks, tmp_path, features):
    single = _fit_features(str(tmp_path), "auto")
    first, second = (r[features] for r in two_ranks)
    assert first.keys() == second.keys()
    for key in first:
        if key == "predictions":
            assert torch.equal(first[key], second[key]) and torch.equal(first[key], single[key])
        else:
            assert first[key] == second[key], key  # every rank saw the same values
    assert 2 * len(first["val"]) * 5 == len(first["losses"]) >= 10  # 5 batches per epoch... per 2 accumulated
    assert first["stopped_epoch"] == single["stopped_epoch"] > 0  # EarlyStopping fired, at the same epoch
    assert first["global_step"] == single["global_step"]
    assert first["best_path"] == single["best_path"]
    assert 0 < first["val_acc"][-1] < 1 and len(first["train_acc_epoch"]) == len(first["val"])
    for key in ("losses", "train_logged", "val", "lrs", "train_acc_step", "train_acc_epoch", "val_acc"):
        assert first[key] == pytest.approx(single[key], rel=1e-5), key
    for key in ("best", "test_loss"):
        assert first[key] == pytest.approx(single[key], rel=1e-5), key


@pytest.mark.timeout(300)
def test_pp2_user_errors_are_clear_and_raised_on_every_rank(two_ranks):
    first, second = (r["errors"] for r in two_ranks)
    skip, other_rank = first.pop("skip"), second.pop("skip")
    assert first == second  # at setup, or at the first step before any message: the same error everywhere
    assert "has no nn.Sequential or nn.ModuleList" in first["no_trunk"]
    assert "'blocks' has 1 children, fewer than the 2 pipeline stages" in first["too_many_stages"]
    assert "has 6 samples on dim 0, which microbatches=4 does not divide" in first["indivisible"]
    assert "'blocks.1' did not get the previous child's output" in first["skip_at_setup"]
    # A cut skip connection is found where it breaks the chain, on the first stage; the next stage, waiting for
    # that stage's activation, fails too (gloo reports the closed connection) instead of hanging.
    assert "did not get the previous child's output as its first argument" in skip
    assert other_rank.startswith("RuntimeError")


# -- world of 4: pp=4, pp=2 x dp=2 ---------------------------------------------------------------------------------

PP4 = {"pipeline_parallel_degree": 4, "microbatches": 4}
MLP_TP_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}  # each block's MLP split over 2 ranks
PP2_DP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}
PP2_TP2 = {**PP2, "tensor_parallel_degree": 2, "tensor_parallel_plan": MLP_TP_PLAN}
LAYOUTS_4 = {
    "gpt_pp4_1f1b": ("gpt", {}, PP4),
    "gpt_pp4_simple": ("gpt", {}, {**PP4, "pipeline": "simple"}),
    "cnn_pp4_1f1b": ("cnn", {}, PP4),
    "gpt_pp2_dp2": ("gpt", {}, PP2_DP2),
    # each tensor-parallel rank reads 4 samples (prescaled_batch=False): the two train on the reference's 8
    "gpt_pp2_tp2": ("gpt", {"batch_size": 4}, PP2_TP2),
    "gpt_pp4_zb": ("gpt", {}, {**PP4, **ZB}),
    "gpt_pp2_dp2_zb": ("gpt", {}, {**PP2_DP2, **ZB}),
    "gpt_pp2_dp2_zb_zero1": ("gpt", {}, {**PP2_DP2, **ZB, "shard_optimizer_state": True}),  # optimizer reduces
    # two batches of 8 per step: the reference's batches of 16 (64 samples: 2 steps per epoch in both)
    "gpt_pp2_dp2_accumulate": ("gpt", {"samples": 64}, PP2_DP2, {"accumulate_grad_batches": 2}),
    "gpt_pp2_dp2_fp16": ("gpt", {}, {**PP2_DP2, **FP16}),
    "gpt_pp2_dp2_checkpointed": ("gpt", {"checkpoint": "each"}, PP2_DP2),
    # each block checkpointed: W recomputes it again, replaying the tensor-parallel streams a second time
    "gpt_pp2_tp2_zb_checkpointed": ("gpt", {"checkpoint": "each", "batch_size": 4}, {**PP2_TP2, **ZB}),
}


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_fit_layouts, 4, LAYOUTS_4, timeout=480)


@pytest.mark.timeout(540)
@pytest.mark.parametrize("name", ["gpt_pp4_1f1b", "gpt_pp4_simple", "gpt_pp4_zb"])
def test_pp4_gpt_matches_one_process(four_ranks, name):
    _check_against(_reference("gpt", {}), four_ranks, name)


@pytest.mark.timeout(300)
def test_pp4_zero_bubble_splits_the_backwards_of_the_stages_that_hold_weight_gradients_back(four_ranks):
    # 4 microbatches and at most 4 live: stages 0 and 1 warm up with all of them and hold no W back (whole
    # backwards); stages 2 and 3 split every backward
    split = STEPS * PP4["microbatches"]
    assert [r["gpt_pp4_zb"]["weight_actions"] for r in four_ranks] == [0, 0, split, split]


@pytest.mark.timeout(300)
def test_pp4_sequential_cnn_matches_one_process(four_ranks):
    _check_against(_reference("cnn", {}), four_ranks, "cnn_pp4_1f1b")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt_pp2_dp2", "gpt_pp2_dp2_zb", "gpt_pp2_dp2_zb_zero1", "gpt_pp2_dp2_checkpointed"])
def test_pp2_dp2_matches_one_process_on_the_global_batch(four_ranks, name):
    assert [r[name]["dp"] for r in four_ranks] == [0, 0, 1, 1]
    _check_against(_reference("gpt", {}, replicas=2), four_ranks, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name",
    ["gpt_pp2_dp2", "gpt_pp2_dp2_zb", "gpt_pp2_dp2_accumulate", "gpt_pp2_dp2_fp16", "gpt_pp2_dp2_checkpointed"],
)
def test_pp2_dp2_all_reduces_start_during_the_last_backwards(four_ranks, name):
    # one overlapped reduction per optimizer step (none on the accumulation's first micro-steps), and every bucket
    # of it started by the gradient hooks of a chunk's last backward or weight pass, none left for after the schedule
    for rank in four_ranks:
        reductions = rank[name]["reductions"]
        assert len(reductions) == STEPS, name
        assert all(during == total >= 1 for during, total in reductions), (name, reductions)
    # with sharded optimizer state the optimizer reduces: the engine starts nothing
    assert all(rank["gpt_pp2_dp2_zb_zero1"]["reductions"] == [] for rank in four_ranks)


@pytest.mark.timeout(300)
def test_pp2_dp2_fp16_matches_one_process_with_the_same_skipped_steps(four_ranks):
    reference = _reference("gpt", {}, replicas=2, fp16=True, init_scale=2.0**16)
    assert reference["skipped"] > 0  # the check below means something
    runs = [rank["gpt_pp2_dp2_fp16"] for rank in four_ranks]
    for run in runs:
        assert_same_overflow(run, reference)  # every rank skipped the same steps: one vote over the replicas
    assert mean_losses(runs, replica="dp", steps=STEPS) == pytest.approx(reference["losses"], rel=FP16_REL)


@pytest.mark.timeout(300)
def test_pp2_dp2_accumulating_gradients_matches_one_process_on_the_accumulated_batch(four_ranks):
    # the step's gradients are all-reduced during its schedule, the earlier micro-step's after it: their sum is the
    # average over the replicas of two batches of 8, which is one step on the reference's batches of 16
    reference = _reference("gpt", {"batch_size": 16, "samples": 64}, replicas=2)
    held: dict = {}
    for rank in four_ranks:
        if rank["gpt_pp2_dp2_accumulate"]["dp"] == 0:
            held.update(rank["gpt_pp2_dp2_accumulate"]["weights"])
    assert_tensors_close(held, reference["weights"], rtol=1e-4, atol=1e-5, label="gpt_pp2_dp2_accumulate")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt_pp2_tp2", "gpt_pp2_tp2_zb_checkpointed"])
def test_pp2_tp2_matches_one_process(four_ranks, name):
    # ranks (placement "cluster"): 0, 1 = stage 0 (tp 0, 1); 2, 3 = stage 1. Sharded weights are the tensor-parallel
    # tests' business; the losses over ten steps check that the stages and shards train as one model.
    _check_against(_reference("gpt", {}), four_ranks, name, weights=False)


class _UnregisteredMetricGPT(_MetricGPT):
    """Keeps its metric in a plain dict, so it is not a submodule: other stages cannot find their copy."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = {"acc": MulticlassAccuracy(VOCAB, average="micro")}

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        self.plain["acc"](logits.argmax(-1), batch[:, 1:])
        self.log("acc", self.plain["acc"])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _log_an_unregistered_metric(rank: int) -> str:
    torch.set_num_threads(1)
    try:
        _trainer(SMPStrategy(**PP2), max_steps=1).fit(_UnregisteredMetricGPT())
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.timeout(120)
def test_pp2_a_logged_metric_outside_the_module_is_a_clear_error():
    first, last = run_distributed(_log_an_unregistered_metric, 2, timeout=100)
    assert "the metric must be an attribute of the LightningModule" in last
    assert first.startswith("RuntimeError")  # the first stage, waiting for the step's result, does not hang


# -- the transport between two stages -----------------------------------------------------------------------------

# Per step: the values stage 0 sends on one link, and whether stage 1 announces them (`expect`) at the step's start.
_LINK_STEPS = (
    ([torch.arange(6.0).view(2, 3), torch.ones(2, 3)], True),  # the link's first values: their layout travels
    ([torch.full((2, 3), 2.0), torch.full((2, 3), 3.0), torch.full((2, 3), 4.0)], True),  # all posted ahead
    ([torch.zeros(2, 3), torch.arange(8.0).view(2, 4), torch.ones(2, 3)], True),  # a new shape mid-step, and back
    ([torch.arange(8.0).view(2, 4), torch.ones(2, 3)], True),  # the step starts expecting the last step's last
    ([{"x": torch.ones(1, dtype=torch.float16), "n": 3}, "nothing", torch.ones(2, 3)], True),  # a tree, no value
    ([torch.full((2, 3), 5.0)], False),  # not announced: received when asked for
)


def _exchange_over_a_link(rank: int) -> tuple[list, list[str]]:
    import warnings

    from lightning_smp import topology
    from lightning_smp.pipeline.p2p import NOTHING, Transport
    from tests.distributed import init_gloo

    init_gloo()
    transport = Transport(topology.build(dp=1, pp=2, tp=1, order="cluster", device_type="cpu"), torch.device("cpu"))
    received = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for values, announced in _LINK_STEPS:
            transport.begin_step()
            if rank == 0:
                for value in values:
                    transport.send_activation(NOTHING if value == "nothing" else value, dst=1, tag=0)
            else:
                if announced:
                    transport.expect(src=0, tag=0, count=len(values))
                for _ in values:
                    value, _ = transport.recv_activation(src=0, requires_grad=False, tag=0)
                    received.append("nothing" if value is NOTHING else value)
            transport.wait_sends()
    return received, [f"{warning.category.__name__}: {warning.message}" for warning in caught]


@pytest.mark.timeout(60)
def test_the_transport_delivers_every_value_when_layouts_change_within_and_between_steps():
    (_, sender_warnings), (received, receiver_warnings) = run_distributed(_exchange_over_a_link, 2, timeout=50)
    assert sender_warnings == receiver_warnings == []  # e.g. no FutureWarning of torch's deprecated LeafSpec
    sent = [value for values, _ in _LINK_STEPS for value in values]
    assert len(received) == len(sent)
    for got, expected in zip(received, sent, strict=True):
        if isinstance(expected, dict):
            assert got["n"] == expected["n"] and torch.equal(got["x"], expected["x"])
            assert got["x"].dtype == torch.float16
        elif isinstance(expected, Tensor):
            assert torch.equal(got, expected)
        else:
            assert got == expected
