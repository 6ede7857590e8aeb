"""The examples run end to end on the CPU and reach the accuracy their docstrings promise."""

import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.distributed import run_distributed, run_process

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def digits_cnn() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("digits_cnn", _EXAMPLES / "digits_cnn.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so that pickling and Lightning can find the classes by module name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # seed_everything sets it; restored after the test


def test_digits_cnn_fp16_reaches_target_with_skipped_warmup_steps(digits_cnn: ModuleType) -> None:
    metrics = digits_cnn.main(["--accelerator", "cpu"])
    assert metrics["val_acc"] >= digits_cnn.TARGET_VAL_ACC
    # dynamic scaling starts at 2**32: the first steps overflow, are skipped, and the scale comes down
    assert metrics["skipped_steps"] > 0
    assert metrics["loss_scale"] < 2.0**32


def test_hf_llama_trains_a_transformers_model_at_its_smallest_setting() -> None:
    pytest.importorskip("transformers")
    from examples import hf_llama

    brief = ["--accelerator", "cpu", "--max-steps", "40", "--val-every", "40", "--batch-size", "8", "--num-files", "3"]
    metrics = hf_llama.main(brief)
    assert metrics["val_loss"] < 3.30  # better than the character frequencies after 40 steps
    checkpointed = hf_llama.main([*brief, "--max-steps", "6", "--val-every", "6", "--activation-checkpointing"])
    plain = hf_llama.main([*brief, "--max-steps", "6", "--val-every", "6"])
    assert checkpointed["val_loss"] == plain["val_loss"] and checkpointed["train_loss"] == plain["train_loss"]


def _hf_finetune(rank: int, argv: list[str]) -> dict[str, float]:
    from examples import hf_finetune

    return hf_finetune.main(argv)


def test_hf_finetune_fine_tunes_a_pretrained_llama_and_exports_it(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from examples import hf_finetune

    small = ["--accelerator", "cpu", "--num-files", "2", "--batch-size", "8", "--val-batches", "4"]
    hf_finetune.main(["--make-tiny-pretrained", str(tmp_path / "tiny"), "--pretrain-steps", "2", *small])
    tuned = [*small, "--model-dir", str(tmp_path / "tiny"), "--max-steps", "4"]
    metrics = hf_finetune.main([*tuned, "--output-dir", str(tmp_path / "full")])
    assert metrics["val_loss"] < metrics["val_loss_before"]
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "full" / "model").iterdir()}
    lora = [*tuned, "--output-dir", str(tmp_path / "lora"), "--lora", "--pp", "2", "--lr", "1e-2"]
    first, _ = run_distributed(_hf_finetune, 2, lora, timeout=300)
    assert first["val_loss"] < first["val_loss_before"]
    assert (tmp_path / "lora" / "adapters" / "adapter_model.safetensors").is_file()


def test_digits_cnn_fp32_reaches_target_without_loss_scaling(digits_cnn: ModuleType) -> None:
    metrics = digits_cnn.main(["--accelerator", "cpu", "--no-fp16"])
    assert metrics["val_acc"] >= digits_cnn.TARGET_VAL_ACC
    assert "loss_scale" not in metrics


def _torchrun(processes: int, script: Path, *argv: str, timeout: float = 240) -> str:
    """``script`` launched by torchrun over ``processes`` CPU processes; its output (rank 0 prints)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}", str(script), *argv]
    result = run_process(command, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-3000:]}"
    return result.stdout


def _validation_loss(output: str) -> float:
    return float(re.search(r"validation loss (\S+) after", output).group(1))


def test_the_smp_v1_script_runs_unchanged_and_resumes_under_another_layout(tmp_path: Path) -> None:
    script = _EXAMPLES / "smp_v1" / "train_gpt_simple.py"
    brief = ["--num_files", "3", "--n_embd", "32", "--checkpoint-dir", str(tmp_path)]
    first = _torchrun(2, script, *brief, "--max_steps", "12", "--save_freq", "12", "--pipeline_parallel_degree", "2")
    assert _validation_loss(first) < 4.2  # uniform guessing over 128 characters scores 4.85
    resumed = _torchrun(2, script, *brief, "--max_steps", "16", "--tensor_parallel_degree", "2", "--fp16", "1")
    assert "resumed from" not in first and "at step 12" in resumed
    assert _validation_loss(resumed) < 4.2
