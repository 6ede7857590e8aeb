"""The CPU benchmarks still run, with the smallest settings, and report every kind they promise (no timings are
judged here: docs/benchmarks.md holds the measured figures and the commands that produce them)."""

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from benchmarks import doors_bench, pipeline_bench, tp_memory
from benchmarks.pipeline_bench import PIPELINES
from tests.distributed import run_benchmark, run_distributed


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _assert_records_the_cores(result: dict) -> None:
    """A CPU pipeline figure is a ratio of what the ranks' cores do: its JSON says how many the machine had."""
    machine = result["machine"]
    assert machine["cpu_count"] == os.cpu_count()
    assert machine["cpu_affinity_count"] == len(os.sched_getaffinity(0))


def test_pipeline_bench_reports_every_pipeline_against_the_ideal(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    small = ("--width", "16", "--batch", "32", "--microbatches", "2", "--rounds", "1", "--steps", "2", "--warmup", "1")
    run_benchmark("pipeline_bench.py", *small, "--out", str(out))
    result = json.loads(out.read_text())
    _assert_records_the_cores(result)
    (row,) = result["rows"]
    assert row["microbatches"] == 2
    assert _positive(row["B"]) and _positive(row["ideal_speedup"])
    for kind in PIPELINES:
        assert _positive(row[f"{kind}_s"]) and _positive(row[f"{kind}_of_ideal"]), kind


def test_pipeline_bench_reports_only_the_pipelines_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    chosen = pipeline_bench.parse_pipelines("torch_zb,smp_zb")
    assert chosen == ["smp_zb", "torch_zb"]  # PIPELINES' order
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown pipeline.*smp_zbv"):
        pipeline_bench.parse_pipelines("smp_zbv")
    best = {("single", 8): 1.0, ("half", 8): 0.6, ("smp_zb", 8): 0.9, ("torch_zb", 8): 1.2}
    args = argparse.Namespace(microbatches=[8], pipelines=chosen)
    (row,) = pipeline_bench.report(best, args)["rows"]
    assert row["smp_zb_over_torch_zb"] == pytest.approx(0.75)
    assert "smp_zb_over_smp_1f1b" not in row and "smp_1f1b_s" not in row
    assert "smp_zb step / torch_zb step = 0.750" in capsys.readouterr().out


def test_pipeline_messages_reports_ours_and_torch_per_compute_time(tmp_path: Path) -> None:
    out = tmp_path / "messages.json"
    small = ("--width", "16", "--rows", "4", "--compute-us", "0,50", "--rounds", "1", "--steps", "2", "--warmup", "1")
    run_benchmark("pipeline_messages.py", *small, "--out", str(out))
    result = json.loads(out.read_text())
    _assert_records_the_cores(result)
    rows = result["rows"]
    assert [row["compute_us"] for row in rows] == [0, 50]
    assert all(_positive(row["ours_s"]) and _positive(row["torch_s"]) for row in rows)


def test_pipeline_timeline_prints_both_ranks_actions_and_writes_a_trace_and_a_picture(tmp_path: Path) -> None:
    small = ("--width", "16", "--batch", "32", "--steps", "8", "--warmup", "2", "--show", "4")
    stdout = run_benchmark(
        "pipeline_timeline.py", *small, "--trace", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")
    )
    for rank in (0, 1):
        assert f"rank {rank}: step=" in stdout
    assert "F0[" in stdout and "B0[" in stdout
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {(e["tid"], e["name"]) for e in events if e["ph"] == "X"} >= {(r, f"{k}0") for r in (0, 1) for k in "FB"}
    assert (tmp_path / "t.png").stat().st_size > 0


def test_pipeline_timeline_draws_the_weight_gradients_of_zero_bubble() -> None:
    stdout = run_benchmark(
        "pipeline_timeline.py",
        *("--width", "16", "--batch", "32", "--steps", "8", "--warmup", "2", "--show", "4"),
        *("--pipeline", "zero_bubble", "--lane-width", "40"),
    )
    assert "W0[" in stdout  # the last stage holds its weight gradients back
    last_lane = next(line for line in stdout.splitlines() if line.startswith("rank 1 |"))
    assert len(last_lane) == len("rank 1 |") + 40 + 1 and set(last_lane[8:-1]) <= set("FBW.")


def test_precision_bench_tiny_times_each_requested_mode(tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    run_benchmark(
        "precision_bench.py",
        "--size",
        "tiny",
        "--modes",
        "smp_fp16,16-mixed",
        "--steps",
        "2",
        "--warmup",
        "2",
        "--out",
        str(out),
    )
    modes = json.loads(out.read_text())["results"]["tiny"]["modes"]
    assert set(modes) == {"smp_fp16", "16-mixed"}
    assert all(_positive(mode["tokens_per_s"]) for mode in modes.values())
    # every timed step split into the same phases, so a GPU run can say where one mode loses time to another
    phases = ("forward", "backward", "unscale", "optimizer", "loop")
    assert all(set(mode["phases_ms"]) == set(phases) for mode in modes.values())
    assert all(_positive(mode["phases_ms"]["backward"]) for mode in modes.values())


def test_activation_memory_reports_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    small = ("--layers", "2", "--width", "32", "--block", "16", "--batch", "2", "--vocab", "64", "--steps", "2")
    run_benchmark("activation_memory.py", *small, "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["plain", "checkpointed", "offloaded"]
    assert all(_positive(row["peak_mib"]) and _positive(row["ms_per_step"]) for row in rows)


def _tp_memory_in_rank(rank: int, tp: int, path: str) -> None:
    tp_memory.run_one(tp, path)


def test_tp_memory_reports_every_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The script's measurement and table, its ranks forked from the preloaded fork server (the script starts a
    fresh interpreter per degree and per rank: ~12 s of imports each, eight in all)."""
    results = {}
    for tp in tp_memory.TP_DEGREES:
        path = tmp_path / f"tp{tp}.json"
        run_distributed(_tp_memory_in_rank, tp, tp, str(path), timeout=200)
        results[tp] = json.loads(path.read_text())
    tp_memory.report(results)
    stdout = capsys.readouterr().out
    for tp in (1, 2, 4):
        assert f"tp={tp}: largest per-rank block state" in stdout


@pytest.mark.timeout(650)  # one launch of two ranks
def test_sequence_parallel_times_ours_and_torchs_plan_on_the_same_llama(tmp_path: Path) -> None:
    out = tmp_path / "time.json"
    smoke = ("--size", "smoke", "--steps", "1", "--repeats", "1")  # one launch of two ranks fits all four in turn
    run_benchmark("sequence_parallel.py", "time", *smoke, "--out", str(out), timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [row["layout"] for row in rows] == ["tp2", "tp2+sp", "torch-tp2", "torch-tp2+sp"]
    keys = ("step_seconds", "cpu_seconds", "of_ours_tp2", "cpu_of_ours_tp2")
    assert all(_positive(row[key]) for row in rows for key in keys)
    assert all(len(row["cpu_seconds_per_repeat"]) == row["repeats"] == 1 for row in rows)


@pytest.mark.timeout(400)  # two launches (one and two ranks) of a tiny GPT; cp4 only adds a launch
def test_context_parallel_counts_each_layouts_bytes_and_cpu_against_one_device(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    layouts = ("--layouts", "1,cp2,tp2+sp-shared")
    run_benchmark(
        "context_parallel.py", "--size", "long_smoke", "--steps", "1", *layouts, "--out", str(out), timeout=360
    )
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["1", "cp2", "tp2+sp-shared"] and rows["1"]["bytes_of_one"] == 1.0
    assert rows["cp2"]["saved_bytes_largest_rank"] < rows["1"]["saved_bytes_largest_rank"]
    assert all(_positive(row["cpu_of_one"]) for row in rows.values())


def test_load_pretrained_reports_each_rank_s_growth_while_loading(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    run_benchmark("load_pretrained.py", "--size", "smoke", "--layouts", "tp2", "--out", str(out))
    [row] = json.loads(out.read_text())["rows"]
    assert row["layout"] == "tp2" and len(row["ranks"]) == 2
    for rank in row["ranks"]:
        assert _positive(rank["kept"]) and rank["peak"] >= rank["peak_after_loading"] >= rank["rss_before_fit"]


def test_split_backward_cost_reports_both_passes_against_the_whole_backward(tmp_path: Path) -> None:
    out = tmp_path / "split.json"
    run_benchmark("split_backward_cost.py", "--widths", "8,16", "--repeats", "3", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["width"] for row in rows] == [8, 16]
    for row in rows:
        assert all(_positive(row[key]) for key in ("whole_ms", "input_pass_ms", "weight_pass_ms", "split_over_whole"))


def test_planner_cost_reports_the_estimates_cpu_seconds_and_the_layouts_listed(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    estimate = "--config examples/configs/pp_tp_dp.yaml --device-memory 1GiB --devices 2 --sequence-length 8"
    run_benchmark("planner_cost.py", "--estimate", estimate, "--repeats", "1", "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["command"] == f"lightning-smp estimate {estimate}"
    assert _positive(row["cpu_s"]) and _positive(row["import_cpu_s"]) and row["layouts_listed"] > 0


@pytest.mark.timeout(400)
def test_checkpoint_stall_times_saving_and_normal_steps_of_both_kinds(tmp_path: Path) -> None:
    out = tmp_path / "stall.json"
    run_benchmark("checkpoint_stall.py", "--size", "smoke", "--steps", "5", "--warmup", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert [row["kind"] for row in result["rows"]] == ["sync", "async"]
    for row in result["rows"]:
        assert all(_positive(row[key]) for key in ("normal", "saving"))
    assert "stall_ratio" in result and result["settings"]["size"] == "smoke"


def test_doors_bench_reports_each_door_against_the_trainers_step(capsys: pytest.CaptureFixture[str]) -> None:
    # a two-rank launch costs about a minute of CPU (five two-rank runs), so only the report is exercised here
    args = doors_bench.parse_args(["--layouts", "pp2,tp2", "--doors", "trainer,script,fabric"])
    best = {
        (door, layout): {"seconds": seconds, "loss": 1.5, "skipped": 0.0}
        for door, layout, seconds in (
            ("trainer", "pp2", 0.05),
            ("script", "pp2", 0.055),
            ("trainer", "tp2", 0.1),
            ("fabric", "tp2", 0.098),
        )
    }
    pp2, tp2 = doors_bench.report(best, args)["rows"]
    assert pp2["script_over_trainer"] == pytest.approx(1.1) and "fabric_s" not in pp2
    assert pp2["microbatches"] == 8 and tp2["microbatches"] == 1
    assert tp2["fabric_over_trainer"] == pytest.approx(0.98) and "script_s" not in tp2
    assert "pp2: script 55.00 ms/step (1.100x); last loss 1.500000, 0 skipped" in capsys.readouterr().out


def test_doors_bench_one_process_fp16_trains_the_same_in_every_door(tmp_path: Path) -> None:
    # the layout the lent GPU runs (`benchmarks/gpu_checks.sh`), here on the CPU with the tiny GPT
    out = tmp_path / "doors.json"
    common = ["--model", "gpt", "--size", "tiny", "--batch", "4", "--fp16", "--rounds", "1"]
    run_benchmark("doors_bench.py", "--layouts", "one", *common, "--steps", "2", "--warmup", "1", "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["layout"] == "one" and row["fp16"]
    assert all(_positive(row[f"{door}_s"]) for door in doors_bench.DOORS)
    # one model, one batch, one engine: every door ends on the same loss after skipping the same steps
    assert {row[f"{door}_loss"] for door in doors_bench.DOORS} == {row["trainer_loss"]}
    assert {row[f"{door}_skipped"] for door in doors_bench.DOORS} == {3.0}  # smp's first scale, 2**32, overflows
    with pytest.raises(SystemExit):
        doors_bench.parse_args(["--accelerator", "cuda", *common])  # two ranks on one GPU: NCCL refuses
