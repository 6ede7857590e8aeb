import os
import re
import sys
import textwrap
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_smp import SMPStrategy, smp
from lightning_smp.config import SMPConfig
from tests.distributed import run_distributed, run_process
from tests.models import TinyRegressor, mlp, quiet_trainer, random_dataset

_AXIS_HELPERS = tuple(f"{axis}_{what}" for axis in ("dp", "rdp", "pp", "tp", "mp") for what in ("rank", "size"))
_RANK_HELPERS = ("rank", "size", "local_rank", "local_size", *_AXIS_HELPERS)
_GROUP_GETTERS = tuple(f"get_{axis}_process_group" for axis in ("dp", "rdp", "pp", "tp", "mp", "world"))
_BARRIERS = ("barrier", "dp_barrier", "rdp_barrier", "pp_barrier", "tp_barrier", "mp_barrier")


def _trainer(strategy: str | SMPStrategy = "smp", devices: int = 1, **kwargs) -> pl.Trainer:
    return quiet_trainer(strategy, devices=devices, **kwargs)


def _facade_answers() -> dict:
    """Everything the facade says about this rank, as plain values."""
    answers = {name: getattr(smp, name)() for name in _RANK_HELPERS}
    answers["group_sizes"] = {name: dist.get_world_size(getattr(smp, name)()) for name in _GROUP_GETTERS}
    for name in _BARRIERS:
        getattr(smp, name)()
    answers["fp16"] = smp.state.cfg.fp16
    answers["bf16"] = smp.state.cfg.bf16
    answers["initialized"] = smp.state.initialized
    return answers


class _FacadeProbe(TinyRegressor):
    """Asks the facade from inside the hooks the smp docs name: configure_model and training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.in_configure_model: dict | None = None
        self.in_training_step: dict | None = None

    def configure_model(self) -> None:
        self.in_configure_model = _facade_answers()

    def training_step(self, batch, batch_idx):
        self.in_training_step = _facade_answers()
        return super().training_step(batch, batch_idx)


# ---------------------------------------------------------------- outside a run


def _facts() -> dict:
    """What the facade answers outside a run: ranks, sizes and the config."""
    return {
        **{name: getattr(smp, name)() for name in _RANK_HELPERS},
        "cfg": smp.state.cfg,
        "initialized": smp.state.initialized,
    }


def _before_any_run(rank: int) -> dict:
    return _facts()  # a fresh process: no run has started in it


def test_facade_before_any_run_answers_as_one_process():
    (facts,) = run_distributed(_before_any_run, 1, timeout=60)
    assert facts.pop("cfg") == SMPConfig()
    assert facts.pop("initialized") is False
    assert facts == {name: (1 if name.endswith("size") else 0) for name in _RANK_HELPERS}


@pytest.mark.parametrize(
    ("call", "hint"),
    [
        (smp.barrier, r"trainer\.strategy\.barrier\(\)"),
        (smp.tp_barrier, r"trainer\.strategy\.barrier\(\)"),
        (smp.get_dp_process_group, r"trainer\.strategy\.barrier\(\)"),
        (lambda: smp.allgather(1, smp.WORLD), r"trainer\.strategy\.broadcast\(obj\)"),
        (lambda: smp.broadcast(1, smp.PP_GROUP), r"trainer\.strategy\.broadcast\(obj\)"),
        (lambda: smp.send(1, 0, smp.RankType.PP_RANK), r"trainer\.strategy"),
        (lambda: smp.recv_from(0, smp.RankType.PP_RANK), r"trainer\.strategy"),
        (lambda: smp.save_checkpoint("checkpoints", tag="a"), r"trainer\.save_checkpoint\(path\)"),
        (lambda: smp.save({}, "model.pt"), r"trainer\.save_checkpoint\(path\)"),
    ],
    ids=[
        "barrier",
        "tp_barrier",
        "get_dp_process_group",
        "allgather",
        "broadcast",
        "send",
        "recv_from",
        "save_checkpoint",
        "save",
    ],
)
def test_collectives_and_checkpoint_helpers_outside_a_run_say_where_to_call_them(call, hint):
    assert not smp.state.initialized
    with pytest.raises(RuntimeError, match=r"needs a running SMPStrategy.*inside the LightningModule's hooks") as error:
        call()
    assert re.search(hint, str(error.value))
    assert "in an smp script, call smp.init() first" in str(error.value)


def test_distributed_optimizer_outside_a_run_raises():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"smp\.DistributedOptimizer\(\) needs a running SMPStrategy.*configure_"):
        smp.DistributedOptimizer(optimizer)


def test_the_script_calls_before_smp_init_name_it():
    # the scripts' own runs are in tests/test_smp_script.py; here only what fails before any run starts
    with pytest.raises(RuntimeError, match=r"needs smp\.init\(\) first"):
        smp.DistributedModel(mlp())

    @smp.step
    def train_step(model, data):
        return model(data)

    with pytest.raises(RuntimeError, match=r"smp\.step\(\.\.\.\) needs smp\.init\(\) first"):
        train_step(mlp(), torch.zeros(2, 8))


def test_state_helpers_answer_as_smp_did():
    assert smp.is_initialized() is smp.state.initialized is False
    assert smp.is_tracing() is False
    assert smp.num_microbatches() == smp.state.cfg.microbatches


@pytest.mark.parametrize(
    ("call", "hint"),
    [
        (lambda: smp.tp_register(smp.nn.DistributedTransformer), r"tensor_parallel_plan="),
        (lambda: smp.tp_register_with_module(torch.nn.Linear, smp.nn.DistributedLinear), r"tensor_parallel_plan="),
    ],
    ids=["tp_register", "tp_register_with_module"],
)
def test_smp_calls_lightning_smp_does_not_need_say_what_to_use(call, hint):
    with pytest.raises(RuntimeError, match=hint):
        call()


def test_delay_param_initialization_creates_no_memory_until_the_strategy_materialises():
    with smp.delay_param_initialization():
        delayed = torch.nn.Linear(4, 4)
    with smp.delay_param_initialization(enabled=False):
        eager = torch.nn.Linear(4, 4)
    assert all(p.is_meta for p in delayed.parameters()) and not any(p.is_meta for p in eager.parameters())


class _DelayedRegressor(TinyRegressor):
    """Its network built under smp.delay_param_initialization, as AWS's scripts build their models."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        with smp.delay_param_initialization(enabled=True):
            self.net = mlp()
        self.initial: dict[str, torch.Tensor] = {}

    def on_fit_start(self) -> None:
        self.initial = {name: p.detach().clone() for name, p in self.net.named_parameters()}


def test_delay_param_initialization_trains_from_the_eager_builds_values():
    model = _DelayedRegressor()
    assert all(p.is_meta for p in model.parameters())
    _trainer("smp", max_steps=2).fit(model)
    torch.manual_seed(0)
    eager = mlp()
    assert model.initial.keys() == dict(eager.named_parameters()).keys()
    for name, value in eager.named_parameters():
        assert torch.equal(model.initial[name], value), name
    assert not any(p.is_meta for p in model.parameters())


def test_smp_nn_names_exist_as_aliases_or_raise_naming_what_to_use():
    assert smp.nn.DistributedLayerNorm is torch.nn.LayerNorm and smp.nn.FusedLayerNorm is torch.nn.LayerNorm
    assert issubclass(smp.nn.DistributedLinear, torch.nn.Linear)
    assert issubclass(smp.nn.DistributedEmbedding, torch.nn.Embedding)
    assert issubclass(smp.nn.DistributedTransformerLayer, torch.nn.TransformerEncoderLayer)
    for name, hint in [
        ("DistributedTransformer", "nn.TransformerEncoderLayer"),
        ("DistributedTransformerLMHead", "smp.nn.DistributedLMHead tied to the embedding"),
        ("DistributedAttentionLayer", "nn.MultiheadAttention"),
        ("DistributedTransformerOutputLayer", "colwise then rowwise"),
        ("DistributedModule", "tensor_parallel_plan"),
    ]:
        with pytest.raises(RuntimeError, match=rf"smp\.nn\.{name} is smp's own module, not reproduced.*{hint}"):
            getattr(smp.nn, name)(num_layers=2, hidden_size=16)
    with pytest.raises(RuntimeError, match=r"class MyLayer\(smp\.nn\.DistributedModule\) defines a distributed"):

        class MyLayer(smp.nn.DistributedModule):
            pass

    with pytest.raises(
        TypeError, match=r"got smp's keyword arguments \['hidden_size', 'num_attention_heads'\].*d_model="
    ):
        smp.nn.DistributedTransformerLayer(num_attention_heads=4, hidden_size=16)


class _BareDistributedOptimizer(TinyRegressor):
    """Wraps its optimizer with smp.DistributedOptimizer, given ``scaling`` (nothing: smp's defaults)."""

    def __init__(self, **scaling) -> None:
        super().__init__()
        self.scaling = scaling

    def configure_optimizers(self):
        return smp.DistributedOptimizer(torch.optim.SGD(self.parameters(), lr=0.05), **self.scaling)


def test_distributed_optimizer_defaults_warn_when_they_replace_the_strategys_scaling():
    model = _BareDistributedOptimizer()
    with pytest.warns(UserWarning, match=r"takes smp's defaults .*static_loss_scale=1\.0, dynamic_loss_scale=False"):
        _trainer("smp_fp16", max_steps=1).fit(model)
    assert model.trainer.optimizers[0].loss_scale == 1.0  # smp's defaults, as on SageMaker
    dynamic = _BareDistributedOptimizer(dynamic_loss_scale=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"smp\.DistributedOptimizer")
        _trainer("smp_fp16", max_steps=1).fit(dynamic)  # what it was given makes the strategy's scaler: silent
        _trainer(SMPStrategy(fp16=True, dynamic_loss_scale=False), max_steps=1).fit(_BareDistributedOptimizer())


@pytest.mark.timeout(600)
def test_lightning_smps_own_log_lines_show_on_rank_zero_by_default():
    script = textwrap.dedent(
        """
        import logging
        import lightning_smp
        from tests.models import TinyRegressor, quiet_trainer
        logging.getLogger("lightning_smp.example").info("an info line")
        quiet_trainer(lightning_smp.SMPStrategy(), max_steps=1).fit(TinyRegressor())
        """
    )
    shown = run_process([sys.executable, "-c", script], timeout=280)
    assert shown.returncode == 0, shown.stderr
    assert "an info line" in shown.stderr and "lightning_smp topology: dp=1 pp=1 tp=1" in shown.stderr
    other_rank = (
        "import logging, lightning_smp; log = logging.getLogger('lightning_smp.x'); log.info('i'); log.warning('w')"
    )
    hidden = run_process([sys.executable, "-c", other_rank], timeout=200, env={**os.environ, "RANK": "1"})
    assert hidden.stderr.splitlines() == ["w"]  # rank 1: warnings only


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize(
    ("strategy", "fp16", "bf16"), [("smp", False, False), ("smp_fp16", True, False), ("smp_bf16", False, True)]
)
def test_facade_inside_a_one_process_run(strategy, fp16, bf16):
    model = _FacadeProbe()
    trainer = _trainer(strategy, max_steps=1)
    trainer.fit(model)

    expected_ranks = {name: (1 if name.endswith("size") else 0) for name in _RANK_HELPERS}
    for answers in (model.in_configure_model, model.in_training_step):
        assert answers is not None
        assert {name: answers[name] for name in _RANK_HELPERS} == expected_ranks
        assert answers["group_sizes"] == dict.fromkeys(_GROUP_GETTERS, 1)
        assert (answers["fp16"], answers["bf16"]) == (fp16, bf16)
        assert answers["initialized"]

    # after fit: the last run's facts, no collectives
    assert not smp.state.initialized
    assert smp.state.cfg is trainer.strategy.config
    assert {name: getattr(smp, name)() for name in _RANK_HELPERS} == expected_ranks
    with pytest.raises(RuntimeError, match="needs a running SMPStrategy"):
        smp.barrier()


class _ObjectsProbe(TinyRegressor):
    """Runs ``exchange`` in configure_model (the facade is live, the groups exist) and keeps what it returned."""

    def __init__(self, exchange) -> None:
        super().__init__()
        self._exchange = exchange
        self.exchanged: dict | None = None

    def configure_model(self) -> None:
        self.exchanged = self._exchange()


def _misuses() -> dict:
    """Each wrong call of the object primitives in a one-process run, and what it raised."""
    calls = {
        "to_itself": lambda: smp.send("x", 0, smp.RankType.WORLD_RANK),
        "outside_group": lambda: smp.recv_from(3, smp.RankType.PP_RANK),
        "group_as_string": lambda: smp.allgather(1, "world"),
        "rank_type_for_group": lambda: smp.broadcast(1, smp.RankType.WORLD_RANK),
    }
    raised = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as error:
            raised[name] = str(error)
    raised["alone"] = smp.allgather({"a": 1}, smp.WORLD)
    return raised


def test_object_primitives_refuse_wrong_ranks_and_groups_with_the_fix():
    model = _ObjectsProbe(_misuses)
    _trainer(max_steps=1).fit(model)
    raised = model.exchanged
    assert "rank 0 of the WORLD_RANK group is this rank itself; pass another rank" in raised["to_itself"]
    assert "rank 3 is not in this rank's PP_RANK group, which has ranks 0..0" in raised["outside_group"]
    assert "smp.allgather takes an smp.CommGroup, e.g. smp.CommGroup.PP_GROUP" in raised["group_as_string"]
    assert "smp.broadcast takes an smp.CommGroup" in raised["rank_type_for_group"]
    assert raised["alone"] == [{"a": 1}]


class _Failing(TinyRegressor):
    def training_step(self, batch, batch_idx):
        raise ValueError("boom")


def test_facade_ends_the_run_when_fit_raises():
    trainer = _trainer(max_steps=1)
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(_Failing())
    assert not smp.state.initialized
    assert smp.state.cfg is trainer.strategy.config
    with pytest.raises(RuntimeError, match="needs a running SMPStrategy"):
        smp.get_world_process_group()


# ---------------------------------------------------------------- the seed's code, one import changed


class _SeedModule(pl.LightningModule):
    """The seed's LightningModule: layers built by smp.model_creation, optimizer by smp.DistributedOptimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = None
        self.dataset = random_dataset(num_samples=128)
        self.returned_optimizer = None
        self.dataset_loss: list[float] = []  # whole-dataset loss at the start and the end of fit
        self.epoch_lrs: list[float] = []

    # -- the seed's snippet, verbatim but for the import
    def configure_model(self):
        if self.net is not None:
            return
        with smp.model_creation(
            dtype=torch.float16 if smp.state.cfg.fp16 else torch.get_default_dtype(),
            tensor_parallelism=smp.tp_size() > 1,
        ):
            self.net = mlp(8, 32, 1)

    def configure_optimizers(self):
        optimizer = torch.optim.Adadelta(self.parameters(), lr=1.0)
        optimizer = smp.DistributedOptimizer(
            optimizer,
            static_loss_scale=None,
            dynamic_loss_scale=True,
            dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
        )
        scheduler = torch.optim.lr_scheduler.StepLR(
            optimizer.optimizer if smp.state.cfg.fp16 else optimizer, step_size=1, gamma=0.7
        )
        self.returned_optimizer = optimizer
        return [optimizer], [scheduler]

    # -- the rest is an ordinary LightningModule
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=8)

    def on_train_start(self):
        self.dataset_loss.append(self._whole_dataset_loss())

    def on_train_epoch_start(self):
        self.epoch_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self):
        self.dataset_loss.append(self._whole_dataset_loss())

    @torch.no_grad()
    def _whole_dataset_loss(self) -> float:
        x, y = self.dataset.tensors
        dtype = next(self.net.parameters()).dtype
        return F.mse_loss(self.net(x.to(dtype)).float(), y).item()


@pytest.mark.parametrize(
    ("strategy", "param_dtype"), [("smp_fp16", torch.float16), ("smp", torch.float32), ("smp_bf16", torch.bfloat16)]
)
def test_seed_snippet_trains(strategy, param_dtype):
    torch.manual_seed(0)
    model = _SeedModule()
    trainer = _trainer(strategy, max_epochs=3)
    trainer.fit(model)

    assert trainer.global_step == 3 * 16
    # Lightning kept the optimizer smp.DistributedOptimizer returned: not wrapped a second time
    assert trainer.strategy.optimizers[0] is model.returned_optimizer
    assert all(param.dtype == param_dtype for param in model.net.parameters())
    # the epoch-level StepLR decays the LR by 0.7 each epoch
    assert model.epoch_lrs == pytest.approx([1.0, 0.7, 0.49])
    assert model.dataset_loss[1] < 0.8 * model.dataset_loss[0]

    if param_dtype == torch.float16:
        scaler_state = model.returned_optimizer.state_dict()["loss_scaler"]
        assert scaler_state["delayed_shift"] == 2
        assert scaler_state["scale_window"] == 1000
        assert scaler_state["min_scale"] == 1
        # The initial 2**32 overflows the fp16 grads, so steps 0..k overflow in a row (and are skipped) until the
        # scale fits. With delayed_shift=2 the first overflow only uses up the hysteresis; each later one halves.
        overflows = scaler_state["last_overflow_iter"] + 1
        assert 1 < overflows < 3 * 16
        assert model.returned_optimizer.state_dict()["skipped_steps"] == overflows
        assert scaler_state["cur_scale"] == 2.0 ** (32 - (overflows - 1))
        assert scaler_state["cur_hysteresis"] == 1
    elif param_dtype == torch.bfloat16:
        assert model.returned_optimizer.state_dict()["loss_scaler"] is None  # bf16: master weights, no scaling


# ---------------------------------------------------------------- two processes


def _two_rank_facade(rank: int) -> dict:
    model = _FacadeProbe()
    trainer = _trainer(SMPStrategy(microbatches=2), devices=2, max_steps=2)
    trainer.fit(model)
    answers = model.in_training_step
    answers["after_fit"] = _facts()
    trainer.validate(model, verbose=False)
    answers["after_validate"] = _facts()
    with warnings.catch_warnings(record=True) as caught:  # a model with nothing tensor parallelism can split
        warnings.simplefilter("always")
        _trainer(SMPStrategy(tensor_parallel_degree=2), devices=2, max_steps=1).fit(TinyRegressor())
    answers["tp_warnings"] = [str(w.message) for w in caught if "tensor_parallel_degree=2" in str(w.message)]
    return answers


def _exchange_between_stages() -> dict:
    """smp's object primitives as its GPT example uses them (stage 0 tells stage 1 its loader's length)."""
    out = {
        "world": smp.allgather(smp.rank(), smp.WORLD),
        "pp": smp.allgather({"pp_rank": smp.pp_rank()}, smp.CommGroup.PP_GROUP),
        "dp": smp.allgather(smp.rank(), smp.DP_GROUP),  # one rank per group with pp=2 on 2 ranks
    }
    if smp.pp_rank() == 0:
        smp.broadcast(("batches", 7), smp.PP_GROUP)
        smp.send(torch.arange(3), 1, smp.RankType.PP_RANK)
        out["received"] = smp.recv_from(1, smp.RankType.WORLD_RANK)
    else:
        out["received"] = (smp.recv_from(0, smp.RankType.PP_RANK), smp.recv_from(0, smp.RankType.MP_RANK))
        smp.send("thanks", 0, smp.RankType.WORLD_RANK)
    smp.barrier(smp.MP_GROUP)
    return out


def _two_stage_objects(rank: int) -> dict:
    model = _ObjectsProbe(_exchange_between_stages)
    _trainer(SMPStrategy(pipeline_parallel_degree=2), devices=2, max_steps=1).fit(model)
    return model.exchanged


@pytest.mark.timeout(120)
def test_object_primitives_between_two_pipeline_stages():
    first, second = run_distributed(_two_stage_objects, 2, timeout=100)
    for out in (first, second):
        assert out["world"] == [0, 1]
        assert out["pp"] == [{"pp_rank": 0}, {"pp_rank": 1}]
    assert (first["dp"], second["dp"]) == ([0], [1])
    assert first["received"] == "thanks"
    assert second["received"][0] == ("batches", 7)
    assert torch.equal(second["received"][1], torch.arange(3))


@pytest.mark.timeout(120)
def test_facade_in_a_two_process_run():
    results = run_distributed(_two_rank_facade, 2, timeout=100)

    for rank, answers in enumerate(results):
        assert answers["rank"] == rank
        assert answers["size"] == 2
        assert (answers["local_rank"], answers["local_size"]) == (rank, 2)
        assert (answers["dp_rank"], answers["dp_size"]) == (rank, 2)
        assert (answers["rdp_rank"], answers["rdp_size"]) == (rank, 2)
        assert (answers["pp_rank"], answers["pp_size"]) == (0, 1)
        assert (answers["tp_rank"], answers["tp_size"]) == (0, 1)
        assert (answers["mp_rank"], answers["mp_size"]) == (0, 1)
        assert answers["group_sizes"] == {
            "get_dp_process_group": 2,
            "get_rdp_process_group": 2,
            "get_pp_process_group": 1,
            "get_tp_process_group": 1,
            "get_mp_process_group": 1,
            "get_world_process_group": 2,
        }
        assert not answers["fp16"]
        # after fit and validate return: the last run's ranks, sizes and config
        for when in ("after_fit", "after_validate"):
            facts = answers[when]
            assert {name: facts[name] for name in _RANK_HELPERS} == {name: answers[name] for name in _RANK_HELPERS}
            assert facts["cfg"].microbatches == 2
            assert facts["initialized"] is False
    # tensor_parallel_degree=2 over a model nothing of which is split: said once, on rank 0
    (warning,) = results[0]["tp_warnings"]
    assert (
        warning.startswith("tensor_parallel_degree=2 splits nothing in this model")
        and "tensor_parallel_plan" in warning
    )
    assert results[1]["tp_warnings"] == []


# ---------------------------------------------------------------- a planned layout (the memory planner)


def test_preview_answers_a_planned_layout_and_refuses_process_groups():
    config = SMPConfig(pipeline_parallel_degree=2, tensor_parallel_degree=2, fp16=True)
    before = (smp.tp_size(), smp.pp_size(), smp.state.cfg)
    with smp.preview(config, world_size=8):
        assert (smp.tp_size(), smp.pp_size(), smp.rdp_size(), smp.dp_size(), smp.size()) == (2, 2, 2, 4, 8)
        assert (smp.rank(), smp.tp_rank(), smp.pp_rank()) == (0, 0, 0)
        assert smp.state.cfg.fp16
        assert not smp.state.initialized
        with pytest.raises(RuntimeError, match=r"smp.get_tp_process_group\(\) needs a running SMPStrategy"):
            smp.get_tp_process_group()
    assert (smp.tp_size(), smp.pp_size(), smp.state.cfg) == before  # the facade answers as before the preview
    with pytest.raises(ValueError, match="does not divide the world size 6"), smp.preview(config, world_size=6):
        pass


def test_preview_takes_the_strategys_keyword_arguments_as_a_dict():
    """The form docs/choosing-a-layout.md shows: the same dict SMPStrategy(**kwargs) and estimate_memory take."""
    options = {"enabled": True, "parameters": {"pipeline_parallel_degree": 2}}
    with smp.preview({"tensor_parallel_degree": 2, "smp_options": options, "fp16": True}, world_size=8):
        assert (smp.tp_size(), smp.pp_size(), smp.rdp_size()) == (2, 2, 2) and smp.state.cfg.fp16
    with (
        pytest.raises(ValueError, match="did you mean 'tensor_parallel_degree'"),
        smp.preview({"tensor_parallel_degre": 2}, world_size=2),
    ):
        pass
