"""The ``lightning-smp`` command (LightningCLI): strategy by name or class path, every smp parameter and the
SageMaker dict from YAML, the precision trap, both entry points, and the example configs run briefly on CPU."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_smp import SMPConfig, SMPPrecision, SMPStrategy, cli
from lightning_smp.memory import parse_bytes
from tests.distributed import run_distributed, run_process

_ROOT = Path(__file__).resolve().parents[1]
_CONFIGS = _ROOT / "examples" / "configs"
_BORING = "lightning.pytorch.demos.boring_classes"


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # LightningCLI writes lightning_logs/ into the working directory
    monkeypatch.setattr(sys, "argv", ["lightning-smp"])
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


def _parse(tmp_path: Path, trainer: dict[str, Any]) -> SMPStrategy:
    """Build (not run) the CLI from a YAML config with this ``trainer`` section; return the trainer's strategy."""
    config = {
        "model": {"class_path": f"{_BORING}.BoringModel"},
        "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, **trainer},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    trainer_obj = cli.make_cli(["--config", str(path)], run=False).trainer
    strategy = trainer_obj.strategy
    assert isinstance(strategy, SMPStrategy)
    # the precision trap: the strategy's own plugin survives the CLI path and is the trainer's
    assert isinstance(trainer_obj.precision_plugin, SMPPrecision)
    assert trainer_obj.precision_plugin is strategy.precision_plugin
    return strategy


def test_strategy_by_registered_name(tmp_path: Path) -> None:
    strategy = _parse(tmp_path, {"strategy": "smp_fp16"})
    assert strategy.config.fp16
    assert strategy.precision_plugin.dtype is not None


def test_strategy_defaults_to_smp_in_fp32(tmp_path: Path) -> None:
    strategy = _parse(tmp_path, {})
    assert strategy.config == SMPConfig()
    assert strategy.precision_plugin.dtype is None


def _non_default_values() -> dict[str, Any]:
    """A valid value for every SMPConfig field, changed from the default wherever that is possible today."""
    values = {field.name: field.default for field in dataclasses.fields(SMPConfig)}
    values.update(
        microbatches=4,
        pipeline="simple",
        optimize="memory",
        placement_strategy="spread",
        auto_partition=False,
        default_partition=0,
        memory_weight=0.5,
        active_microbatches=2,
        fp16=True,
        prescaled_batch=True,
        tensor_parallel_seed=7,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
        pipeline_module="layer",
        partition=[1],
    )
    return values


def test_class_path_takes_every_smp_parameter(tmp_path: Path) -> None:
    values = _non_default_values()
    strategy = _parse(tmp_path, {"strategy": {"class_path": "lightning_smp.SMPStrategy", "init_args": values}})
    assert strategy.config == SMPConfig(**values)


def test_class_path_takes_the_sagemaker_smp_options_dict(tmp_path: Path) -> None:
    smp_options = {"enabled": True, "parameters": {"partitions": 1, "microbatches": 4, "fp16": True, "ddp": True}}
    strategy = _parse(
        tmp_path,
        {"strategy": {"class_path": "lightning_smp.SMPStrategy", "init_args": {"smp_options": smp_options}}},
    )
    assert strategy.config == SMPConfig(microbatches=4, fp16=True, ddp=True)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "bf16-mixed"])
def test_precision_next_to_the_strategy_gives_the_clear_error(tmp_path: Path, precision: str) -> None:
    with pytest.raises(MisconfigurationException, match="SMPStrategy chooses the precision itself"):
        _parse(tmp_path, {"strategy": "smp_fp16", "precision": precision})


def test_unknown_smp_key_in_yaml_names_the_near_key(tmp_path: Path) -> None:
    init_args = {"smp_options": {"parameters": {"microbatch": 4}}}
    with pytest.raises(ValueError, match="did you mean 'microbatches'"):
        _parse(tmp_path, {"strategy": {"class_path": "lightning_smp.SMPStrategy", "init_args": init_args}})


# -- end to end: both entry points, the example configs ------------------------------------------------------

_BRIEF = [  # a brief CPU run of any config
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_progress_bar=false",
]


def _run(command: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = run_process(command, cwd=cwd, env=env, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _fit_from_the_root(rank: int, argv: list[str]) -> None:
    os.chdir(_ROOT)  # the configs name examples.gpt_char.GPTCharLM
    cli.main(argv)


@pytest.mark.parametrize("name", sorted(path.stem for path in _CONFIGS.glob("*.yaml")))
def test_example_config_runs_briefly_on_cpu(name: str, tmp_path: Path) -> None:
    """Each config, 2 steps on CPU from the repository root: dp.yaml through the console script (whose ``sys.path``
    starts at the venv's bin/, so this also checks that the working directory is importable) and tp.yaml through
    ``python -m lightning_smp``, their ranks launched by Lightning; the others in ranks `run_distributed` starts
    (as torchrun would), which spares the imports of a fresh interpreter per rank."""
    config = _CONFIGS / f"{name}.yaml"
    if name.startswith("hf_"):
        pytest.importorskip("transformers")  # the extra "hf"; the "test" extra installs it
    extra = [f"--trainer.default_root_dir={tmp_path}", "--data.num_files=3", "--data.batch_size=8"]
    argv = ["fit", "--config", str(config), *_BRIEF, *extra]
    if name == "dp":
        script = Path(sys.executable).with_name("lightning-smp")
        assert script.exists(), "the console script is missing: run `pip install -e .` (scripts/setup.sh does)"
        _run([str(script), *argv], cwd=_ROOT)
    elif name == "tp":
        _run([sys.executable, "-m", "lightning_smp", *argv], cwd=_ROOT)
    else:
        devices = yaml.safe_load(config.read_text())["trainer"]["devices"]
        run_distributed(_fit_from_the_root, devices, argv, timeout=240)
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "train_loss" in metrics and "val_loss" in metrics
    if "fp16" in config.read_text():
        assert "loss_scale" in metrics
    assert (tmp_path / "lightning_logs" / "version_0" / "config.yaml").exists(), "LightningCLI saved no config"


def test_example_configs_cover_dp_tp_pp_and_all_three() -> None:
    assert {path.stem for path in _CONFIGS.glob("*.yaml")} >= {"dp", "tp", "pp", "pp_tp_dp"}


# -- lightning-smp estimate ----------------------------------------------------------------------------------------

_LAYOUT_LINES = {
    "dp": "pp=1 x tp=1 x dp=2 on 2 device(s)",
    "tp": "pp=1 x tp=2 x dp=1 on 2 device(s)",
    "pp": "pp=2 x tp=1 x dp=1 on 2 device(s)",
    "pp_tp_dp": "pp=2 x tp=2 x dp=2 on 8 device(s)",
}


@pytest.mark.parametrize("name", sorted(_LAYOUT_LINES))
def test_estimate_prints_the_configured_layout_and_the_layouts_that_fit(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(_ROOT)  # the configs name examples.gpt_char.GPTCharLM
    sizes = ["--micro-batch-size", "8", "--sequence-length", "64", "--context-parallel"]
    cli.main(
        ["estimate", "--config", str(_CONFIGS / f"{name}.yaml"), "--device-memory", "1GiB", "--devices", "8", *sizes]
    )
    out = capsys.readouterr().out
    assert f"Memory per rank, {_LAYOUT_LINES[name]}, fp16 with fp32 masters:" in out
    assert "Largest rank: stage 0" in out and "fits in 1.0 GiB" in out
    assert "measured: one microbatch ((8, 64), (8, 64)) traced forward and backward on the meta device" in out
    assert "Layouts of 8 device(s) that fit 1.0 GiB per device" in out
    # the tp layouts are built tensor-parallel (smp.tp_size() > 1 in configure_model, under smp.preview): tp=2 holds
    # about half of one device's model states per rank
    states = {}
    for line in out.split("smallest model-parallel degree first:")[1].split("\n\n")[0].splitlines()[2:]:
        pp, tp, _dp, _optimizer_state, _, _, value, unit = line.split()[:8]
        states[(int(pp), int(tp))] = parse_bytes(value + unit)
    assert 0.45 < states[(1, 2)] / states[(1, 1)] < 0.6
    # then the context-parallel layouts: the whole model per rank, 1/cp of every sequence's activations
    listed = out.split("Context-parallel layouts of 8 device(s)")[1].splitlines()[3:]
    activations = {int(row.split("|")[1]): parse_bytes(row.split("|")[3].replace(" ", "")) for row in listed}
    assert sorted(activations) == [2, 4, 8] and 0.45 < activations[4] / activations[2] < 0.55


def test_estimate_explains_what_it_needs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(_ROOT)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--config", str(_CONFIGS / "tp.yaml"), "--devices", "4"])
    assert "--devices lists the layouts that fit a device: give --device-memory too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--config", str(_CONFIGS / "tp.yaml"), "--device-memory", "40 gigs"])
    assert "'40 gigs' is not a size" in capsys.readouterr().err
    cli.main(["estimate", "--config", str(_CONFIGS / "tp.yaml")])
    out = capsys.readouterr().out  # a replica's batch: each tp rank's 16 x 64 of the config's data, together
    assert "pp=1 x tp=2 x dp=1" in out and "measured: one microbatch ((32, 64), (32, 64))" in out
    assert "PL_GLOBAL_SEED" not in os.environ  # a plan seeds nothing: processes started later build their own


def test_estimate_draws_the_memory_of_each_stage_against_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(_ROOT)
    chart = tmp_path / "memory.png"
    cli.main(["estimate", "--config", str(_CONFIGS / "pp.yaml"), "--device-memory", "64MiB", "--plot", str(chart)])
    assert f"Wrote the chart to {chart}." in capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


def test_a_setting_left_out_of_the_yaml_does_not_override_smp_options(tmp_path: Path) -> None:
    # LightningCLI passes every default; only the settings the YAML writes count as given (a written default too).
    init_args = {"smp_options": {"parameters": {"microbatches": 4, "fp16": True}}, "tensor_parallel_seed": 3}
    strategy = _parse(tmp_path, {"strategy": {"class_path": "lightning_smp.SMPStrategy", "init_args": init_args}})
    assert strategy.config == SMPConfig(microbatches=4, fp16=True, tensor_parallel_seed=3)
