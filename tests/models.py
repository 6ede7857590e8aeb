"""Tiny shared models and data for the tests: a fixed random regression set, an MLP, a LightningModule, and a
transformer block.

Small enough that a fit of a few dozen steps takes well under a second on two CPU cores, and generic: nothing
here knows about smp, so any test (strategy, precision, checkpointing, ...) can build on it; `quiet_trainer` is
the Trainer most of them use.
"""

import math
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["TinyRegressor", "TransformerBlock", "mlp", "quiet_trainer", "random_dataset", "small_cnn"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


def quiet_trainer(strategy: Any = "auto", **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer that writes and prints nothing (no logger, checkpoints, progress bar or model summary) unless
    ``kwargs`` say otherwise; one device unless ``devices`` is given."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def random_dataset(num_samples: int = 64, in_features: int = 8, out_features: int = 1, seed: int = 0) -> TensorDataset:
    """``(x, y)`` with ``y`` a fixed random linear function of ``x`` plus a little noise: learnable, reproducible."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, in_features, generator=generator)
    weight = torch.randn(in_features, out_features, generator=generator) / in_features**0.5
    y = x @ weight + 0.01 * torch.randn(num_samples, out_features, generator=generator)
    return TensorDataset(x, y)


def mlp(in_features: int = 8, hidden: int = 16, out_features: int = 1) -> nn.Sequential:
    """A two-layer MLP, created in the current default dtype."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, out_features))


def small_cnn() -> nn.Sequential:
    """A small classifier of 1 x 8 x 8 images into 10 classes, as one nn.Sequential (a pipeline trunk with nothing
    before or after it), created in the current default dtype."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


class TransformerBlock(nn.Module):
    """A pre-norm transformer block (attention, then an MLP, each with a residual), with ``dropout`` after the MLP
    when it is > 0; the causal mask comes in as a second argument (a pipeline does not send it between stages)."""

    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        dropped = [nn.Dropout(dropout)] if dropout else []
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), *dropped)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        width = x.shape[-1]
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)  # (B, T, W) each
        attention = (q @ k.transpose(-1, -2) / math.sqrt(width)).masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj(attention @ v)  # (B, T, W)
        return x + self.mlp(self.norm2(x))


class TinyRegressor(pl.LightningModule):
    """An MLP regressor on `random_dataset` with MSE loss; ``losses`` records every training-step loss.

    Args:
        optimizer: builds the optimizer from the parameters; default ``SGD(lr=0.05)``.
        num_samples, batch_size: the size of the training (and validation) set and of its batches.
    """

    def __init__(
        self,
        in_features: int = 8,
        hidden: int = 16,
        out_features: int = 1,
        *,
        optimizer: OptimizerFactory | None = None,
        num_samples: int = 64,
        batch_size: int = 8,
    ) -> None:
        super().__init__()
        self.net = mlp(in_features, hidden, out_features)
        self._optimizer_factory = optimizer or (lambda params: torch.optim.SGD(params, lr=0.05))
        self._dataset = random_dataset(num_samples, in_features, out_features)
        self._batch_size = batch_size
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.item())  # sync: fine for tests
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Optimizer:
        return self._optimizer_factory(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset, batch_size=self._batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset, batch_size=self._batch_size)
