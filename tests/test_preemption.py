"""Preemption without lost work: a signal at any point of a fit stops every rank at one step, saves it, and a fit
with ``ckpt_path="last"`` continues with the losses of an uninterrupted run, the data position included.

Two launches (two ranks, four ranks) run every signal time: each layout's fit is interrupted again and again, each
fit resuming the previous one's preemption save, until the last one reaches ``STEPS``; the losses of the pieces,
put together, are compared with one uninterrupted single-device run in plain PyTorch (`tests/parity.py`). Steps
sleep ``STEP_S`` (no CPU) so that the ranks vote every step, as they do once steps take 0.25 s or more.
"""

import os
import signal
import stat
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from lightning_smp import SMPStrategy, consolidate_checkpoint, smp
from lightning_smp.data_position import SkipFirst, position_train_dataloader
from lightning_smp.fault_tolerance import VOTE_INTERVAL_S
from lightning_smp.preemption import PREEMPTED_EXIT_CODE, check_torchelastic_restarts, newest_complete_checkpoint
from tests.distributed import launch_once
from tests.gpt import AdamWGPT, token_batches
from tests.models import quiet_trainer
from tests.parity import FP16_REL, FP32_REL, assert_same_overflow, assert_tensors_close, single_device_run

STEPS = 14  # every layout's whole run
STEP_S = VOTE_INTERVAL_S + 0.05  # each training step sleeps this long: the ranks vote every step
SAVE_EVERY = 3  # ModelCheckpoint's every_n_train_steps
VAL_EVERY = 2  # val_check_interval, in steps
FP16 = {"fp16": True, "dynamic_loss_args": {"init_scale": 2.0**16}}

# Each layout: its strategy settings, the batch size each rank's loader reads, the reference's replicas, and the
# signals: (global step when sent, where, the ranks that get it). Where: at a batch's start, inside the step (a
# pipeline's schedule), during validation, during a ModelCheckpoint save, or SLURM's requeue signal (SIGUSR1).
ALL = (0, 1, 2, 3)
LAYOUTS_2 = {
    "pp2": (
        {"pipeline_parallel_degree": 2, "microbatches": 2},
        8,
        1,
        [
            (1, "batch", (0, 1)),
            (3, "schedule", (0, 1)),
            (6, "validation", (0,)),
            (9, "save", (0, 1)),
            (11, "schedule", (1,)),
        ],
    ),
    "sdp2": (
        # asynchronous saves of FSDP2's DTensor shards
        {
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": 0,
            "sdp_gradient_clipping": 1e9,
            "async_checkpoint": True,
        },
        8,
        2,
        [
            (0, "batch", (0,)),
            (4, "validation", (1,)),
            (6, "schedule", (0, 1)),
            (9, "save", (0,)),
            (11, "batch", (1,)),
        ],
    ),
    # two batches of 8 per optimizer step (the reference's 16): a stop agreed on inside an accumulation (after the
    # step-3 save) waits for the next step's first batch
    "dp2_accumulate": ({}, 8, 2, [(1, "batch", (0,)), (3, "save", (0, 1)), (6, "schedule", (1,))], {"accumulate": 2}),
    # saves written by a background thread; a signal while one is written; the preemption save waits for it
    "dp2_zero1_async": (
        {"shard_optimizer_state": True, "async_checkpoint": True},
        8,
        2,
        [(3, "save", (1,)), (5, "batch", (0,))],
    ),
    # last: its requeue sets SLURM's variables in the ranks (torchelastic's, which Lightning prefers, stay)
    "dp2_zero1": (
        {"shard_optimizer_state": True},
        8,
        2,
        [
            (0, "schedule", (1,)),
            (3, "save", (1,)),
            (5, "batch", (0,)),
            (8, "validation", (0, 1)),
            (11, "requeue", (0, 1)),
        ],
    ),
}
LAYOUTS_4 = {
    # each tensor-parallel rank reads 4 samples (prescaled_batch=False): the reference's two replicas of 4
    "pp2_tp2_fp16": (
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2, **FP16},
        4,
        2,
        [(0, "batch", ALL), (3, "save", (3,)), (6, "validation", (2,)), (8, "schedule", ALL), (12, "save", ALL)],
    ),
}
# one device: no vote, Lightning's loop stops after the batch the signal came in
LAYOUTS_1 = {"one_device": ({}, 8, 1, [(2, "batch", (0,)), (5, "schedule", (0,))])}
SLURM_JOB_ID = "4242"


class _GPT(AdamWGPT):
    """`AdamWGPT` with a validation loop, ``batch`` samples per loader batch, steps of at least ``STEP_S``, and no LR
    schedule (the reference has none)."""

    def __init__(self, batch: int = 8, signals: "_Signals | None" = None) -> None:
        super().__init__()
        self.batch, self.signals = batch, signals

    def training_step(self, batch, batch_idx):
        if self.signals is not None:
            self.signals.send(self.trainer, "schedule")
        time.sleep(STEP_S / max(1, smp.state.cfg.microbatches))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.signals is not None:
            self.signals.send(self.trainer, "validation")
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*token_batches(seed=1, samples=32)), batch_size=self.batch)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*token_batches(seed=2, samples=8)), batch_size=4)


class _Signals(Callback):
    """Sends this rank's signal of the fit once (``where`` and global step as planned), records each step's loss."""

    def __init__(self, rank: int, event: tuple | None) -> None:
        self.rank, self.event, self.sent_at = rank, event, None
        self.losses: dict[int, float] = {}

    def send(self, trainer, where: str) -> None:
        if self.event is None or self.sent_at is not None:
            return
        step, planned, ranks = self.event
        if trainer.global_step != step or self.rank not in ranks:
            return
        if planned == where or (planned == "requeue" and where == "batch"):
            self.sent_at = trainer.global_step
            os.kill(os.getpid(), signal.SIGUSR1 if planned == "requeue" else signal.SIGTERM)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.event is not None and self.event[1] == "save" and trainer.global_step + 1 == self.event[0]:
            self._signal_in_the_next_write(trainer)
        self.send(trainer, "batch")

    def _signal_in_the_next_write(self, trainer):
        original, signals = FileSystemWriter.write_data, self

        def write_data(writer, plan, planner):
            FileSystemWriter.write_data = original
            if signals.rank in signals.event[2]:
                signals.sent_at = signals.event[0]  # the saving step (an asynchronous save writes later)
                os.kill(os.getpid(), signal.SIGTERM)  # held until the save is whole
            return original(writer, plan, planner)

        FileSystemWriter.write_data = write_data

    def on_train_start(self, trainer, pl_module):
        self.dp, self.step, self.batch_losses = smp.dp_rank(), trainer.global_step, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batch_losses.append(outputs["loss"].item())  # this replica's
        if trainer.global_step != self.step:  # an optimizer step: Lightning divided each batch's by their number
            self.losses[trainer.global_step] = sum(self.batch_losses)
            self.step, self.batch_losses = trainer.global_step, []


def _fit(rank, layout, root, event):
    settings, batch, _, _, *options = layout
    accumulate = options[0]["accumulate"] if options else 1
    torch.manual_seed(0)
    signals = _Signals(rank, event)
    trainer = quiet_trainer(
        SMPStrategy(**settings),
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=STEPS,
        val_check_interval=VAL_EVERY,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        enable_checkpointing=True,
        callbacks=[signals, ModelCheckpoint(dirpath=root, every_n_train_steps=SAVE_EVERY, save_top_k=-1)],
        default_root_dir=root,
        accumulate_grad_batches=accumulate,
    )
    model = _GPT(batch, signals)
    record = {"code": None}
    try:
        trainer.fit(model, ckpt_path="last")
    except SIGTERMException as stop:
        record["code"] = stop.code
    optimizer = trainer.strategy.optimizers[0]
    scontrol = Path(root) / f"scontrol-{rank}.txt"  # what the fake scontrol was asked
    record.update(
        sent_at=signals.sent_at,
        directory=str(root),
        dp=signals.dp,
        stopped_at=trainer.global_step,
        losses=signals.losses,
        resumed_from=str(trainer.ckpt_path) if trainer.ckpt_path else None,
        files=sorted(p.name for p in Path(root).iterdir()),
        skipped=float(getattr(optimizer, "skipped_steps", torch.zeros(())).item()),
        scale=getattr(optimizer, "loss_scale", None),
        requeued=scontrol.read_text() if scontrol.exists() else None,
    )
    return record


def _with_slurm(rank, world_size, root):
    """The variables srun gives a task of a two-task job, and a fake ``scontrol`` that records its arguments."""
    bin_dir = Path(root) / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {root}/scontrol-$SLURM_PROCID.txt\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    os.environ.update(
        SLURM_NTASKS=str(world_size),
        SLURM_NTASKS_PER_NODE=str(world_size),
        SLURM_NNODES="1",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        SLURM_JOB_ID=SLURM_JOB_ID,
        SLURM_JOB_NAME="train",
        SLURM_NODELIST="127.0.0.1",
        PATH=f"{bin_dir}:{os.environ['PATH']}",
    )
    return SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1)


def _preempted_runs(rank, root, layouts):
    """Each layout: one fit per signal (each resuming the last), then one to the end; every fit's record."""
    torch.set_num_threads(1)
    results = {}
    for name, layout in layouts.items():
        directory = Path(root) / name
        records = []
        for event in [*layout[3], None]:
            if event is not None and event[1] == "requeue":
                environment = _with_slurm(rank, int(os.environ["WORLD_SIZE"]), directory)
                layout = ({**layout[0], "cluster_environment": environment}, *layout[1:])
            records.append(_fit(rank, layout, directory, event))
        results[name] = records
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_once(_preempted_runs, 2, str(tmp_path_factory.mktemp("two")), LAYOUTS_2, timeout=600)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return launch_once(_preempted_runs, 1, str(tmp_path_factory.mktemp("one")), LAYOUTS_1, timeout=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return launch_once(_preempted_runs, 4, str(tmp_path_factory.mktemp("four")), LAYOUTS_4, timeout=600)


_REFERENCES = {}


def _reference(batch: int, replicas: int, fp16: bool) -> dict:
    key = (batch, replicas, fp16)
    if key not in _REFERENCES:

        def build():
            model = _GPT(batch)
            model.configure_model()
            return model

        options = {"fp16": True, "init_scale": FP16["dynamic_loss_args"]["init_scale"]} if fp16 else {}
        _REFERENCES[key] = single_device_run(
            build, lambda model, batch, step: model.loss(batch), steps=STEPS, replicas=replicas, **options
        )
    return _REFERENCES[key]


def _check_layout(ranks: list[dict], name: str, layout: tuple) -> None:
    settings, batch, replicas, events, *options = layout
    batch *= options[0]["accumulate"] if options else 1  # the reference steps on the accumulated batches
    for rank, records in enumerate(ranks):
        fits = records[name]
        assert len(fits) == len(events) + 1, rank
        previous_stop = 0
        for index, (record, event) in enumerate(zip(fits, [*events, None], strict=True)):
            label = f"{name} rank {rank} signal {event}"
            stopped = record["stopped_at"]
            if event is None:  # the last fit trains to the end, from the last preemption save
                assert record["code"] is None and stopped == STEPS, label
            else:
                # every rank stopped at the same step, within two steps of the signal, saved it and said so
                assert record["code"] == PREEMPTED_EXIT_CODE, label
                assert {r[name][index]["stopped_at"] for r in ranks} == {stopped}, label
                sent = max(-1 if r[name][index]["sent_at"] is None else r[name][index]["sent_at"] for r in ranks)
                assert sent == event[0] and sent < stopped <= sent + 2, (label, sent, stopped)
                assert f"preempted-step={stopped}.ckpt" in record["files"], (label, record["files"])
                assert sum(file.startswith("preempted-") for file in record["files"]) == 1, label
            if previous_stop:
                assert record["resumed_from"].endswith(f"preempted-step={previous_stop}.ckpt"), label
            else:
                assert record["resumed_from"] is None, label  # a first run: "last" finds nothing, starts fresh
            assert sorted(record["losses"]) == list(range(previous_stop + 1, stopped + 1)), label
            assert not any(".partial-" in file or file.endswith(".previous") for file in record["files"]), label
            previous_stop = stopped
        if settings.get("fp16"):
            assert_same_overflow(fits[-1], _reference(batch, replicas, True))
    # the pieces' losses, averaged over the data-parallel replicas, are the uninterrupted reference's
    by_replica = {}
    for records in ranks:
        losses = {step: loss for record in records[name] for step, loss in record["losses"].items()}
        assert by_replica.setdefault(records[name][0]["dp"], losses) == losses  # a replica's ranks agree
    count = len(by_replica)  # the run's replicas (a tensor-parallel group's loss is its samples' already)
    losses = {step: sum(replica[step] for replica in by_replica.values()) / count for step in range(1, STEPS + 1)}
    reference = _reference(batch, replicas, settings.get("fp16", False))
    expected = dict(enumerate(reference["losses"], start=1))
    assert losses == pytest.approx(expected, rel=FP16_REL if settings.get("fp16") else FP32_REL), name


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_rank_layouts_stop_together_save_and_resume_with_the_uninterrupted_losses(two_ranks, name):
    _check_layout(two_ranks, name, LAYOUTS_2[name])


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_rank_fp16_layout_stops_together_saves_and_resumes_with_the_same_skips(four_ranks, name):
    _check_layout(four_ranks, name, LAYOUTS_4[name])


@pytest.mark.timeout(360)
def test_one_device_stops_after_the_batch_saves_and_resumes_with_the_uninterrupted_losses(one_rank):
    _check_layout(one_rank, "one_device", LAYOUTS_1["one_device"])


@pytest.mark.timeout(660)
def test_an_asynchronous_save_is_the_synchronous_one(two_ranks, tmp_path):
    directory = Path(two_ranks[0]["dp2_zero1"][0]["directory"]).parent
    saved = {}
    for name in ("dp2_zero1", "dp2_zero1_async"):
        path = consolidate_checkpoint(directory / name / "epoch=5-step=12.ckpt", tmp_path / f"{name}.pt")
        saved[name] = torch.load(path, weights_only=False)
        assert saved[name]["global_step"] == 12
    assert_tensors_close(saved["dp2_zero1_async"]["state_dict"], saved["dp2_zero1"]["state_dict"], rtol=0, atol=0)


@pytest.mark.timeout(660)
def test_slurm_requeue_signal_saves_then_rank_0_requeues_the_job(two_ranks):
    fits = [records["dp2_zero1"] for records in two_ranks]
    index = [event[1] for event in LAYOUTS_2["dp2_zero1"][3]].index("requeue")
    assert [f[index]["code"] for f in fits] == [PREEMPTED_EXIT_CODE] * 2
    assert [f[index]["requeued"] for f in fits] == [f"requeue {SLURM_JOB_ID}\n", None]  # once, by rank 0
    assert all(f[index - 1]["requeued"] is None for f in fits)  # SIGTERM: no requeue
    assert not any(file.startswith("hpc_ckpt") for f in fits for file in f[index]["files"])  # Lightning's did not run


def test_signal_times_cover_every_place_and_layout():
    layouts = {**LAYOUTS_1, **LAYOUTS_2, **LAYOUTS_4}
    events = [event for layout in layouts.values() for event in layout[3]]
    assert len(events) >= 20
    assert {where for _, where, _ in events} == {"batch", "schedule", "validation", "save", "requeue"}


# -- single process: the data position and "last" ---------------------------------------------------------------


def test_a_distributed_sampler_skips_the_consumed_batches_once_and_no_sample_repeats():
    dataset = TensorDataset(torch.arange(40))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    sampler.set_epoch(3)
    whole = [batch[0].tolist() for batch in DataLoader(dataset, batch_size=4, sampler=sampler)]
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    assert position_train_dataloader(loader, 2, epoch=3) is loader
    assert isinstance(loader.batch_sampler.sampler, SkipFirst)
    resumed = [batch[0].tolist() for batch in loader]
    assert resumed == whole[2:]  # the epoch goes on at its third batch: nothing seen twice, nothing skipped
    assert [batch[0].tolist() for batch in loader] == whole  # the next pass is whole
    assert len(loader) == len(whole)  # Lightning counts the epoch's batches from the saved index on


def test_a_loader_that_cannot_be_positioned_warns_what_repeats():
    dataset = TensorDataset(torch.arange(16))
    loader = DataLoader(dataset, batch_size=4, sampler=RandomSampler(dataset))
    with pytest.warns(UserWarning, match="those 3 batches are trained on twice"):
        assert position_train_dataloader(loader, 3, epoch=0) is loader
    assert isinstance(loader.batch_sampler.sampler, RandomSampler)
    position_train_dataloader(loader, 0, epoch=0)  # at an epoch's start: nothing to say


def test_torchrun_restarts_with_a_shared_rendezvous_store_get_a_warning_naming_the_fix(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_torchelastic_restarts()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what the variable makes torchrun set
    check_torchelastic_restarts()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # the default: nothing restarts
    check_torchelastic_restarts()


def test_last_is_the_newest_complete_checkpoint_and_none_on_a_first_run(tmp_path):
    trainer = quiet_trainer(
        default_root_dir=tmp_path, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "mc")]
    )
    assert newest_complete_checkpoint(trainer) is None
    older, newer = tmp_path / "mc" / "epoch=0-step=3.ckpt", tmp_path / "checkpoints" / "preempted-step=5.ckpt"
    for path, when in ((older, 100), (newer, 200)):
        path.mkdir(parents=True)
        (path / "meta.pt").write_bytes(b"")
        os.utime(path / "meta.pt", (when, when))
    (tmp_path / "mc" / ".epoch=0-step=6.ckpt.partial-0123456789ab").mkdir()  # a save that never finished
    (tmp_path / "mc" / "epoch=0-step=6.ckpt").mkdir()  # no meta file: not complete
    assert newest_complete_checkpoint(trainer) == str(newer)
    os.utime(older / "meta.pt", (300, 300))
    assert newest_complete_checkpoint(trainer) == str(older)
