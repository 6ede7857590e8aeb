"""A small CNN on scikit-learn's digits, written the smp v1 way and trained with `SMPStrategy`.

Target: validation accuracy >= 0.95 after the default 5 epochs, in fp16 and in fp32 (both reach about 0.98,
in about 10 s on 2 idle CPU cores).

The data is ``sklearn.datasets.load_digits`` (1,797 8×8 images, bundled with scikit-learn, so no download),
split 80/20 into train/val with a fixed seed. The LightningModule is what a SageMaker smp script would contain:
layers built under ``smp.model_creation``, the optimizer wrapped in ``smp.DistributedOptimizer`` with dynamic loss
scaling, and ``StepLR`` on ``optimizer.optimizer`` in fp16. The strategy logs ``loss_scale`` to the progress bar.
Dynamic scaling starts at 2**32, so the first 18 steps overflow and are skipped while the scale comes down to
2**15 (``delayed_shift=2`` lets one overflow pass before the first halving); the final line reports the count.

    python examples/digits_cnn.py                   # fp16 params + fp32 master weights + loss scaling
    python examples/digits_cnn.py --no-fp16         # plain fp32
    python examples/digits_cnn.py --devices 2       # two data-parallel processes (gloo on CPU)

Exits with status 1 when the final validation accuracy misses the target.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy

import lightning_smp
from lightning_smp import smp

__all__ = ["TARGET_VAL_ACC", "DigitsCNN", "main"]

TARGET_VAL_ACC = 0.95
_SPLIT_SEED = 0  # the train/val split never changes with --seed: the target is measured on the same images
_VAL_FRACTION = 0.2
_MEAN, _STD = 0.3053, 0.3760  # of all digits pixels scaled to [0, 1], as MNIST's (0.1307, 0.3081)


class Net(nn.Module):
    """The classic PyTorch MNIST example's network, sized for 8×8 inputs (padded convolutions)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))  # (B, 16, 8, 8)
        x = F.relu(self.conv2(x))  # (B, 32, 8, 8)
        x = F.max_pool2d(x, 2)  # (B, 32, 4, 4)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)  # (B, 512)
        x = self.dropout2(F.relu(self.fc1(x)))  # (B, 64)
        return self.fc2(x)  # (B, 10) logits


class DigitsCNN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Net | None = None
        self.val_acc = MulticlassAccuracy(num_classes=10)

    def configure_model(self) -> None:
        if self.model is not None:  # fit, then validate: build once
            return
        # smp's seed shape: parameters are created in fp16 when the job runs fp16, and tensor-parallel when tp > 1
        dtype = torch.float16 if smp.state.cfg.fp16 else torch.get_default_dtype()
        with smp.model_creation(dtype=dtype, tensor_parallelism=smp.tp_size() > 1):
            self.model = Net()

    def forward(self, x: Tensor) -> Tensor:
        assert self.model is not None
        return self.model(x)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        # The loss is taken in fp32: a log-softmax over fp16 logits loses precision for confident predictions.
        return F.cross_entropy(logits.float(), y), logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.val_acc(logits.argmax(dim=1), batch[1])
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)  # a Metric syncs its own state over the dp replicas

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adadelta(self.parameters(), lr=1.0)
        optimizer = smp.DistributedOptimizer(
            optimizer,
            static_loss_scale=None,
            dynamic_loss_scale=True,
            dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
        )
        scheduler = StepLR(optimizer.optimizer if smp.state.cfg.fp16 else optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def digits_datasets() -> tuple[TensorDataset, TensorDataset]:
    """The bundled digits as (N, 1, 8, 8) standardized float images and int64 labels, split train/val."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    images = (images - _MEAN) / _STD
    labels = torch.tensor(digits.target, dtype=torch.int64)
    dataset = TensorDataset(images, labels)
    generator = torch.Generator().manual_seed(_SPLIT_SEED)
    train, val = random_split(dataset, [1 - _VAL_FRACTION, _VAL_FRACTION], generator=generator)
    return train, val  # type: ignore[return-value]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True, help="fp16 (default) or fp32")
    parser.add_argument("--devices", type=int, default=1, help="data-parallel processes")
    parser.add_argument("--accelerator", default="auto", help="auto (GPU when present, else CPU), cpu, gpu")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train and validate; return the final metrics (``val_acc``, ``val_loss``, ...) as floats."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # the whole dataset is one small tensor
    L.seed_everything(args.seed, verbose=False)
    train, val = digits_datasets()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=lightning_smp.SMPStrategy(fp16=args.fp16),
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(
        DigitsCNN(),
        train_dataloaders=DataLoader(train, batch_size=args.batch_size, shuffle=True),
        val_dataloaders=DataLoader(val, batch_size=256),
    )
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        skipped = f", skipped_steps={metrics['skipped_steps']:.0f}" if "skipped_steps" in metrics else ""
        print(f"final val_acc={metrics['val_acc']:.4f} (target >= {TARGET_VAL_ACC}){skipped}")
    return metrics


if __name__ == "__main__":
    sys.exit(0 if main()["val_acc"] >= TARGET_VAL_ACC else 1)
