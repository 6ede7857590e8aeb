"""examples/gpt_char.py: reaches its stated validation loss on CPU, shows the loss scale in fp16, and maps its
``--pp/--tp/--microbatches/--fp16`` flags onto SMPStrategy one to one."""

from pathlib import Path

import pytest

from examples import gpt_char


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # seed_everything sets it


def test_default_run_reaches_the_stated_validation_loss() -> None:
    metrics = gpt_char.main(["--accelerator", "cpu"])  # fp32 on CPU, 300 steps
    assert metrics["val_loss"] <= gpt_char.TARGET_VAL_LOSS
    assert "loss_scale" not in metrics


def test_fp16_shows_the_loss_scale_and_skips_the_first_overflowing_steps() -> None:
    brief = ["--max-steps", "6", "--val-every", "6", "--batch-size", "4", "--num-files", "3"]
    metrics = gpt_char.main(["--accelerator", "cpu", "--fp16", *brief])
    assert metrics["skipped_steps"] > 0  # the scale starts at 2**32
    assert metrics["loss_scale"] < 2.0**32


def test_activation_checkpointing_trains_the_same_model() -> None:
    brief = ["--accelerator", "cpu", "--max-steps", "6", "--val-every", "6", "--batch-size", "4", "--num-files", "3"]
    plain = gpt_char.main(brief)
    checkpointed = gpt_char.main([*brief, "--activation-checkpointing"])
    assert checkpointed["val_loss"] == plain["val_loss"] and checkpointed["train_loss"] == plain["train_loss"]


def test_flags_map_onto_the_strategy() -> None:
    args = gpt_char.parse_args(["--pp", "2", "--tp", "2", "--microbatches", "4", "--fp16"])
    config = gpt_char.make_strategy(args).config
    assert (config.pipeline_parallel_degree, config.tensor_parallel_degree) == (2, 2)
    assert (config.microbatches, config.fp16) == (4, True)
    cpu = gpt_char.make_strategy(gpt_char.parse_args(["--accelerator", "cpu"])).config
    assert not cpu.fp16


def test_corpus_is_a_fixed_slice_of_the_standard_library() -> None:
    first, again = gpt_char.stdlib_sources(5, seed=0), gpt_char.stdlib_sources(5, seed=0)
    assert first == again and len(first) == 5
    assert gpt_char.encode("".join(first)).max() < gpt_char.VOCAB_SIZE
