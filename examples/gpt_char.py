"""A GPT character language model on the Python standard library's own sources, trained with `SMPStrategy`.

Target: validation loss <= 2.2 nats per character after the default 300 steps (2.03 measured in fp32 on CPU,
where a step takes ~35 ms on an idle core; always predicting the character frequencies scores 3.30).

The corpus exists on every machine: the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (not
``site-packages``), shuffled with a fixed seed, of which the first ``--num-files`` are read; the last 10% of
each file is held out for validation. Characters are ASCII codes (anything else becomes ``?``), so the vocabulary has
128 entries, divisible by every tensor-parallel degree up to 128.

The model is nanoGPT's shape built from torch's own ``nn.TransformerEncoderLayer`` (pre-norm, causal mask):
its trunk, ``model.blocks``, is an ``nn.Sequential`` that pipeline parallelism splits between stages, and its
layers and embeddings are created under ``smp.model_creation(tensor_parallelism=...)`` so that tensor
parallelism splits them. The flags map one-to-one onto `SMPStrategy`:

    python examples/gpt_char.py                              # GPU when present (fp16), else CPU (fp32)
    python examples/gpt_char.py --fp16                       # fp16 params + fp32 master weights + loss scaling
    python examples/gpt_char.py --devices 2                  # two data-parallel replicas
    python examples/gpt_char.py --tp 2                       # tensor_parallel_degree=2 (devices = pp * tp * dp)
    python examples/gpt_char.py --pp 2 --microbatches 4      # pipeline_parallel_degree=2, 4 microbatches
    python examples/gpt_char.py --pp 2 --tp 2 --devices 8    # pp x tp x dp = 2 x 2 x 2
    python examples/gpt_char.py --activation-checkpointing   # recompute activations in backward: less memory

The progress bar shows ``train_loss`` and, in fp16, ``loss_scale``. The same LightningModule and DataModule run
from the command line through ``lightning-smp fit --config examples/configs/dp.yaml`` (see examples/configs/).
Exits with status 1 when the final validation loss misses the target.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import sysconfig
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import lightning_smp
from lightning_smp import smp

__all__ = [
    "TARGET_VAL_LOSS",
    "VOCAB_SIZE",
    "GPTCharLM",
    "StdlibCharData",
    "add_layout_flags",
    "main",
    "make_strategy",
    "parse_args",
    "stdlib_sources",
    "train",
]

TARGET_VAL_LOSS = 2.2
VOCAB_SIZE = 128  # ASCII
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_VAL_FRACTION = 0.1


def stdlib_sources(num_files: int = 60, seed: int = 0) -> list[str]:
    """The text of ``num_files`` of the standard library's ``*.py`` sources, picked by a seeded shuffle."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(name for name in subdirs if name not in _SKIPPED_DIRS)
        paths.extend(Path(directory, name) for name in sorted(files) if name.endswith(".py"))
    if not paths:
        raise FileNotFoundError(f"no *.py files under the standard library directory {root}")
    paths.sort(key=lambda path: path.relative_to(root).as_posix())
    random.Random(seed).shuffle(paths)
    return [path.read_text(encoding="utf-8", errors="replace") for path in paths[:num_files]]


def encode(text: str) -> Tensor:
    """Characters as int64 ASCII codes; anything outside ASCII becomes ``?``."""
    return torch.frombuffer(bytearray(text.encode("ascii", errors="replace")), dtype=torch.uint8).long()


def decode(codes: Tensor) -> str:
    return bytes(codes.tolist()).decode("ascii")


class CharWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` characters: ``(input, target)`` shifted by one."""

    def __init__(self, codes: Tensor, block_size: int) -> None:
        self.codes, self.block_size = codes, block_size

    def __len__(self) -> int:
        return (len(self.codes) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        window = self.codes[start : start + self.block_size + 1]
        return window[:-1], window[1:]  # (T,), (T,)


class StdlibCharData(L.LightningDataModule):
    """The standard library's sources as character windows: 90% of each file to train on, its tail to validate.

    Args:
        block_size: characters per sample (the model's context length).
        batch_size: samples per batch on each rank (smp's per-GPU batch: the ranks of a tensor-parallel group each
            read one and train on their union, prescaled_batch=False); their union divisible by the microbatches.
        num_files: how many source files to read (after a shuffle seeded by ``seed``).
    """

    def __init__(self, block_size: int = 64, batch_size: int = 32, num_files: int = 60, seed: int = 0) -> None:
        super().__init__()
        self.block_size, self.batch_size, self.num_files, self.seed = block_size, batch_size, num_files, seed
        self.train_set: CharWindows | None = None
        self.val_set: CharWindows | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        # the tail of every file is held out, so that train and validation text come from the same files
        sources = stdlib_sources(self.num_files, self.seed)
        cuts = [int(len(text) * (1 - _VAL_FRACTION)) for text in sources]
        train = "\n".join(text[:cut] for text, cut in zip(sources, cuts, strict=True))
        val = "\n".join(text[cut:] for text, cut in zip(sources, cuts, strict=True))
        self.train_set = CharWindows(self.encode(train), self.block_size)
        self.val_set = CharWindows(self.encode(val), self.block_size)

    def encode(self, text: str) -> Tensor:
        """The text as token ids: its ASCII codes (examples/hf_finetune.py uses a model's tokenizer instead)."""
        return encode(text)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)


class Block(nn.Module):
    """One pre-norm transformer layer with a causal mask: torch's own layer, so tensor parallelism can split it."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model, n_head, 4 * d_model, dropout, activation="gelu", batch_first=True, norm_first=True
        )

    def forward(self, x: Tensor) -> Tensor:  # (B, T, C) -> (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device, dtype=x.dtype)  # (T, T)
        return self.layer(x, src_mask=mask, is_causal=True)


class GPT(nn.Module):
    """Token + position embeddings, a sequential trunk of `Block`, a final norm and a linear head."""

    def __init__(
        self, n_layer: int, n_head: int, d_model: int, block_size: int, dropout: float, vocab_size: int = VOCAB_SIZE
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_head, dropout) for _ in range(n_layer)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:  # (B, T) int64 -> (B, T, V) logits
        positions = torch.arange(idx.size(1), device=idx.device)  # (T,)
        x = self.token_embedding(idx) + self.position_embedding(positions)  # (B, T, C)
        x = self.blocks(x)  # (B, T, C)
        return self.head(self.norm(x))  # (B, T, V)


class GPTCharLM(L.LightningModule):
    """A small GPT over ASCII characters, written the smp way (layers built under ``smp.model_creation``).

    Args:
        n_layer: transformer layers in the trunk (at least the pipeline degree).
        n_head: attention heads (divisible by the tensor-parallel degree).
        d_model: width (divisible by ``n_head``).
        block_size: longest context; the data's ``block_size`` must not exceed it.
        lr: AdamW learning rate.
        activation_checkpointing: recompute each layer's activations in backward instead of keeping them
            (``smp.set_activation_checkpointing`` on the trunk).
        vocab_size: rows of the embedding and outputs of the head: the 128 ASCII codes this data has; larger only to
            plan the memory of a model with a real tokenizer's vocabulary (examples/planning/).
    """

    def __init__(
        self,
        n_layer: int = 2,
        n_head: int = 4,
        d_model: int = 64,
        block_size: int = 64,
        dropout: float = 0.0,
        lr: float = 1e-2,
        weight_decay: float = 0.01,
        activation_checkpointing: bool = False,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is not None:  # fit, then validate: build once
            return
        hp = self.hparams
        dtype = torch.float16 if smp.state.cfg.fp16 else torch.get_default_dtype()
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=dtype):
            self.model = GPT(hp.n_layer, hp.n_head, hp.d_model, hp.block_size, hp.dropout, hp.vocab_size)
        if hp.activation_checkpointing:
            smp.set_activation_checkpointing(self.model.blocks)  # each layer its own checkpoint

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        idx, targets = batch  # (B, T), (B, T)
        logits = self(idx)  # (B, T, V)
        # in fp32: a log-softmax over fp16 logits loses precision for confident predictions
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # a plain optimizer: with fp16 the strategy wraps it in fp32 master weights and a loss scaler itself
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.99), weight_decay=self.hparams.weight_decay
        )


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    add_layout_flags(parser)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--val-every", type=int, default=100, help="validate every this many steps")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="per rank (a tensor-parallel group trains on its ranks' batches together)",
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute layer activations in backward (less memory)"
    )
    parser.add_argument("--num-files", type=int, default=60, help="standard-library files to read")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `make_strategy` and the Trainer's ``devices`` read (examples/hf_finetune.py takes them too)."""
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel_degree")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree")
    parser.add_argument("--microbatches", type=int, default=1, help="microbatches per batch (pipelining)")
    parser.add_argument(
        "--fp16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fp16 params + fp32 master weights + loss scaling; default: on with a GPU, off on CPU",
    )
    parser.add_argument("--devices", type=int, default=None, help="processes; default pp * tp (one replica)")
    parser.add_argument("--accelerator", default="auto", help="auto (GPU when present, else CPU), cpu, gpu")


def make_strategy(args: argparse.Namespace, **settings) -> lightning_smp.SMPStrategy:
    """The flags as `SMPStrategy` arguments, one to one, and any other ``settings``."""
    fp16 = args.fp16
    if fp16 is None:  # CPUs have no fast fp16 matmul: there it runs ~15x slower than fp32
        fp16 = torch.cuda.is_available() and args.accelerator not in ("cpu",)
    return lightning_smp.SMPStrategy(
        pipeline_parallel_degree=args.pp,
        tensor_parallel_degree=args.tp,
        microbatches=args.microbatches,
        fp16=fp16,
        **settings,
    )


def train(args: argparse.Namespace, model: L.LightningModule, target: float) -> dict[str, float]:
    """Fit ``model`` on `StdlibCharData` as the flags say; return the final metrics (``val_loss``, ...) as floats."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # the corpus is one in-memory tensor
    warnings.filterwarnings("ignore", ".*enable_nested_tensor is True.*")  # torch's hint for post-norm layers
    L.seed_everything(args.seed, verbose=False)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices or args.pp * args.tp,
        strategy=make_strategy(args),
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=20,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=StdlibCharData(batch_size=args.batch_size, num_files=args.num_files))
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print(f"final val_loss={metrics['val_loss']:.4f} nats/char (target <= {target})")
    return metrics


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train and validate; return the final metrics (``val_loss``, ``train_loss``, ...) as floats."""
    args = parse_args(argv)
    model = GPTCharLM(n_layer=args.layers, activation_checkpointing=args.activation_checkpointing)
    return train(args, model, TARGET_VAL_LOSS)


if __name__ == "__main__":
    sys.exit(0 if main()["val_loss"] <= TARGET_VAL_LOSS else 1)
