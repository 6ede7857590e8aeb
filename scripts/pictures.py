"""The docs' pictures, each drawn by this command from a real run or from the package's real plans.

    python scripts/pictures.py                        # every picture, into docs/images/
    python scripts/pictures.py tp-split loss-scale    # some of them
    python scripts/pictures.py --out /tmp/pics tp-split

- ``pipeline``: ``pipeline_<value>.png``, one per ``pipeline`` value: a measured two-stage run of each schedule
  (``benchmarks/pipeline_timeline.py --plot``; a few minutes on 2 busy cores);
- ``tp-split``: ``tp_split.png``: the tensor-parallel plan of ``examples/gpt_char.py``'s GPT at tp=4
  (`plan_tensor_parallel`; seconds);
- ``loss-scale``: ``fp16_loss_scale.png``: an fp16 run of ``examples/digits_cnn.py``'s CNN, 5 epochs (under two
  minutes of CPU);
- ``memory``: ``llama3_8b.png``: the memory planner's chart of ``examples/planning/llama3_8b.yaml`` (Llama-3-8B's
  shape on 8 x 40 GB at 8192 tokens; ``lightning-smp estimate --plot``, its activations traced on the meta device).

tests/test_docs_site.py checks that every file here exists and that a docs page shows it (and that every picture a
page shows is one of these), and draws the cheap ones again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
IMAGES = _ROOT / "docs" / "images"
# the `pipeline` values (config.py's choices); a new schedule gets its picture by being added here
PIPELINES = ("interleaved", "simple", "zero_bubble")


@dataclass(frozen=True)
class Picture:
    files: tuple[str, ...]
    draw: Callable[[Path], None]
    """Draws every file into the folder it is given."""
    cheap: bool
    """Seconds to draw: the docs test draws it again."""


def draw_pipelines(out: Path) -> None:
    """One measured step per `pipeline` value: 2 stages, 4 microbatches (GPipe with all 4 in flight)."""
    for pipeline in PIPELINES:
        subprocess.run(
            [
                *(sys.executable, str(_ROOT / "benchmarks" / "pipeline_timeline.py"), "--pipeline", pipeline),
                *("--microbatches", "4", "--active-microbatches", "4", "--steps", "16", "--warmup", "5"),
                *("--show", "10", "--plot", str(out / f"pipeline_{pipeline}.png")),
            ],
            check=True,
            cwd=_ROOT,
        )


# Four weights of one layer of the GPT, and what splitting each means for the layer's inputs and outputs.
_TP_WEIGHTS = {
    "blocks.0.layer.self_attn.in_proj_weight": "attention q, k, v (auto):\nits heads' rows of each; the whole\n"
    "input in, its heads out, no message",
    "blocks.0.layer.linear1.weight": "feed-forward in (colwise):\nrows = output features; the whole\n"
    "input in, its hidden units out",
    "blocks.0.layer.linear2.weight": "feed-forward out (rowwise):\ncolumns = input features; its hidden\n"
    "units in, partial outputs all-reduced",
    "token_embedding.weight": "token embedding (vocab):\nrows = the vocabulary; each rank looks\n"
    "up its tokens, the vectors all-reduced",
}


def draw_tp_split(out: Path) -> None:
    """How tensor parallelism splits four weights of examples/gpt_char.py's GPT at tp=4: read from the plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.patches import Patch, Rectangle

    sys.path.insert(0, str(_ROOT))
    from examples.gpt_char import GPT
    from lightning_smp import smp
    from lightning_smp.tensor_parallel.plan import plan_tensor_parallel

    tp = 4
    with torch.device("meta"), smp.model_creation(tensor_parallelism=True):
        model = GPT(n_layer=2, n_head=4, d_model=64, block_size=64, dropout=0.0)
    specs = plan_tensor_parallel(model, tp_size=tp).sharded_specs
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    side = max(max(shapes[name]) for name in _TP_WEIGHTS)
    colours = plt.get_cmap("tab10").colors
    figure, axes = plt.subplots(1, len(_TP_WEIGHTS), figsize=(12, 5))
    for ax, (name, caption) in zip(axes, _TP_WEIGHTS.items(), strict=True):
        rows, cols = shapes[name]
        spec = specs[name]  # KeyError: the plan no longer splits this weight, and the picture would lie
        pieces = spec.blocks * tp
        length = (rows, cols)[spec.dim] / pieces
        for piece in range(pieces):
            block, rank = divmod(piece, tp)
            if spec.dim == 0:  # rows, from the top
                xy, width, height = (0, rows - (piece + 1) * length), cols, length
            else:  # columns, from the left
                xy, width, height = (piece * length, 0), length, rows
            ax.add_patch(Rectangle(xy, width, height, facecolor=colours[rank], edgecolor="white", lw=0.8))
            ax.text(xy[0] + width / 2, xy[1] + height / 2, f"r{rank}", ha="center", va="center", fontsize=7)
            if spec.blocks > 1 and spec.dim == 0 and rank == 0:  # a packed weight: name its blocks
                centre = rows - (block + 0.5) * rows / spec.blocks
                ax.text(-3, centre, "qkv"[block] if spec.blocks == 3 else str(block), ha="right", va="center")
        ax.set(xlim=(-8, side), ylim=(0, side), aspect="equal", xticks=[], yticks=[])
        ax.set_frame_on(False)
        ax.set_title(f"{name.removeprefix('blocks.0.layer.')}\n{rows} x {cols}, split along dim {spec.dim}", fontsize=9)
        ax.text(0, -8, caption, ha="left", va="top", fontsize=8)
    figure.legend(
        handles=[Patch(color=colours[r], label=f"rank {r}") for r in range(tp)],
        loc="upper center",
        ncol=tp,
        frameon=False,
    )
    figure.suptitle(
        f"What each of {tp} tensor-parallel ranks keeps: four weights of examples/gpt_char.py's GPT, as planned",
        y=0.9,
        fontsize=10,
    )
    figure.subplots_adjust(left=0.03, right=0.99, top=0.78, bottom=0.15, wspace=0.25)
    figure.savefig(out / "tp_split.png", dpi=100)
    plt.close(figure)


def draw_loss_scale(out: Path, max_steps: int = -1) -> None:
    """The loss and the loss scale of an fp16 run of the digits CNN, each skipped step marked: the scale starts at
    2**32 and halves on overflows, then doubles after every ``scale_window`` (50 here) clean steps. 5 epochs, or
    ``max_steps``."""
    import lightning as L
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(_ROOT))
    from examples.digits_cnn import DigitsCNN, digits_datasets
    from lightning_smp import MasterWeightOptimizer, SMPStrategy

    class PlainOptimizer(DigitsCNN):
        """The digits CNN with a plain optimizer: the strategy's own loss-scale settings apply."""

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adadelta(self.parameters(), lr=1.0)

    class Record(L.Callback):
        def __init__(self) -> None:
            self.steps: list[tuple[float, float, bool]] = []  # loss, the scale the step used, skipped
            self._scale, self._skipped = 0.0, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            optimizer = trainer.strategy.optimizers[0]
            assert isinstance(optimizer, MasterWeightOptimizer)
            self._scale, self._skipped = optimizer.loss_scale, optimizer.skipped_steps.item()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            skipped = trainer.strategy.optimizers[0].skipped_steps.item() > self._skipped
            self.steps.append((outputs["loss"].item(), self._scale, skipped))

    L.seed_everything(1, verbose=False)
    record = Record()
    train, _ = digits_datasets()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SMPStrategy(fp16=True, dynamic_loss_args={"scale_window": 50, "delayed_shift": 2}),
        max_epochs=5,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[record],
    )
    trainer.fit(PlainOptimizer(), train_dataloaders=DataLoader(train, batch_size=32, shuffle=True))

    losses, scales, skipped = zip(*record.steps, strict=True)
    marked = [step for step, skip in enumerate(skipped) if skip]
    figure, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    ax_loss.plot(losses, lw=1)
    ax_loss.plot(marked, [losses[s] for s in marked], "x", color="#C44E52", label="skipped step (fp16 overflow)")
    ax_loss.set(ylabel="training loss", yscale="log")
    ax_loss.legend(frameon=False, fontsize=8)
    ax_scale.step(range(len(scales)), scales, where="post", lw=1)
    ax_scale.plot(marked, [scales[s] for s in marked], "x", color="#C44E52")
    ax_scale.set(ylabel="loss scale", yscale="log", xlabel="training step")
    figure.suptitle(
        f"smp_fp16 on the digits CNN: {len(marked)} of {len(losses)} steps skipped "
        "(init_scale 2**32, scale_window 50, delayed_shift 2)",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(out / "fp16_loss_scale.png", dpi=100)
    plt.close(figure)


def draw_memory(out: Path) -> None:
    """The planner's per-stage chart of Llama-3-8B's shape on pp=2 x tp=4 with sequence parallelism, 8 x 40 GB."""
    sys.path.insert(0, str(_ROOT))
    from lightning_smp import cli

    command = ["estimate", "--config", str(_ROOT / "examples" / "planning" / "llama3_8b.yaml")]
    command += ["--device-memory", "40GB", "--micro-batch-size", "1", "--sequence-length", "8192"]
    cli.main([*command, "--plot", str(out / "llama3_8b.png")])


PICTURES = {
    "pipeline": Picture(tuple(f"pipeline_{p}.png" for p in PIPELINES), draw_pipelines, cheap=False),
    "tp-split": Picture(("tp_split.png",), draw_tp_split, cheap=True),
    "loss-scale": Picture(("fp16_loss_scale.png",), draw_loss_scale, cheap=False),
    "memory": Picture(("llama3_8b.png",), draw_memory, cheap=False),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"pictures to draw, of {', '.join(PICTURES)} (default: all)")
    parser.add_argument("--out", type=Path, default=IMAGES, help=f"folder to draw into (default: {IMAGES})")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.names) - PICTURES.keys()):
        parser.error(f"no picture is named {', '.join(unknown)}; pick from {', '.join(PICTURES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or PICTURES:
        PICTURES[name].draw(args.out)
        print(f"drew {', '.join(PICTURES[name].files)} into {args.out}")


if __name__ == "__main__":
    main()
