"""Pipeline parallelism through Lightning's loops, checked against the single-process fp32 run (gloo, CPU).

Each `run_distributed` call starts its ranks once and trains several layouts one after another (process start-up
dominates on two shared cores); the module-scoped fixtures hold their results and the tests compare them.
"""

import math
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_smp import SMPStrategy
from lightning_smp.loss_scaler import DynamicLossScaler
from lightning_smp.optimizer import MasterWeightOptimizer
from tests.distributed import run_distributed

STEPS = 10
VOCAB, WIDTH, SEQ, BLOCKS = 32, 16, 8, 4

# -- models ----------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block; the causal mask comes in as an extra argument (not sent between stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)  # (B, T, W) each
        attention = (q @ k.transpose(-1, -2) / math.sqrt(WIDTH)).masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj(attention @ v)
        return x + self.mlp(self.norm2(x))


class TinyGPT(pl.LightningModule):
    """Token + position embeddings before a ModuleList trunk, a final norm and a head tied to the embedding."""

    def __init__(self, *, lr: float = 0.05, optimizer: str = "sgd", batch_size: int = 8, samples: int = 80) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        self.lr, self.optimizer_name, self.batch_size = lr, optimizer, batch_size
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)

    def forward(self, idx: Tensor) -> Tensor:
        mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).triu(1)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))

    def loss(self, batch: Tensor) -> Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch[:, :-1]).argmax(-1)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)}
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.tokens, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.tokens[:32], batch_size=self.batch_size)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class TinyCNN(pl.LightningModule):
    """The whole model is one nn.Sequential: the trunk, with nothing before or after it."""

    def __init__(self, *, batch_size: int = 8, samples: int = 80) -> None:
        super().__init__()
        self.net = nn.Sequential(
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
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(2)
        self.data = TensorDataset(
            torch.randn(samples, 1, 8, 8, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


MODELS = {"gpt": TinyGPT, "cnn": TinyCNN}


class _Losses(Callback):
    """Every step's loss as Lightning saw it (the step output), and the LR after each step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _trainer(strategy, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return pl.Trainer(**{**defaults, **kwargs})


# -- the distributed runs ---------------------------------------------------------------------------------------


def _fit_layouts(rank: int, layouts: dict[str, tuple[str, dict, dict]]) -> dict:
    """Train each layout (model name, model kwargs, strategy kwargs); return losses and local weights."""
    results = {}
    for name, (model_name, model_kwargs, strategy_kwargs) in layouts.items():
        torch.manual_seed(0)
        model = MODELS[model_name](**model_kwargs)
        recorder = _Losses()
        trainer = _trainer(SMPStrategy(**strategy_kwargs), callbacks=[recorder])
        trainer.fit(model)
        optimizer = trainer.strategy.optimizers[0]
        owned = trainer.strategy.pipeline.owned_parameter_names()
        results[name] = {
            "losses": recorder.losses,
            "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items() if k in owned},
            "skipped": getattr(optimizer, "skipped_steps", torch.zeros(())).item(),
            "scale": getattr(optimizer, "loss_scale", None),
        }
    return results


def _reference(
    model_name: str, model_kwargs: dict, *, replicas: int = 1, fp16: bool = False, init_scale: float = 2.0**16
) -> dict:
    """The single-process run in plain PyTorch on the global batch (the data-parallel replicas' batches together,
    in Lightning's shuffled order): fp32, or fp16 with fp32 master weights (the package's optimizer)."""
    torch.manual_seed(0)
    model = MODELS[model_name](**model_kwargs)
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    if fp16:
        model.half()
        optimizer = MasterWeightOptimizer(
            type(optimizer)(model.parameters(), **optimizer.defaults),
            loss_scaler=DynamicLossScaler.from_args({"init_scale": init_scale}),
        )
    dataset = model.train_dataloader().dataset
    batch_size = model.train_dataloader().batch_size
    shards = [list(DistributedSampler(dataset, num_replicas=replicas, rank=r, seed=0)) for r in range(replicas)]
    losses = []
    for step in range(STEPS):
        indices = torch.tensor([i for shard in shards for i in shard[step * batch_size : (step + 1) * batch_size]])
        batch = dataset[indices]
        if fp16:
            batch = [t.half() if t.is_floating_point() else t for t in batch] if isinstance(batch, tuple) else batch
        loss = model.loss(batch) if model_name == "gpt" else model.training_step(batch, step)
        losses.append(loss.item())
        optimizer.zero_grad()
        (loss.float() * (optimizer.loss_scale if fp16 else 1.0)).backward()
        if fp16:
            optimizer.note_backward()
        optimizer.step()
    return {
        "losses": losses,
        "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
        "skipped": optimizer.skipped_steps.item() if fp16 else 0.0,
        "scale": optimizer.loss_scale if fp16 else None,
    }


def _check_against(reference: dict, ranks: list[dict], name: str, *, rel: float = 1e-5) -> None:
    for rank, result in enumerate(ranks):
        run = result[name]
        assert len(run["losses"]) == STEPS, (name, rank)
        assert run["losses"] == pytest.approx(reference["losses"], rel=rel), (name, rank)
    held = {}
    for result in ranks:
        held.update(result[name]["weights"])
    assert set(held) == set(reference["weights"]), name  # every parameter lives on some stage
    for key, value in held.items():
        torch.testing.assert_close(value, reference["weights"][key], rtol=max(rel, 1e-4), atol=1e-5, msg=key)


# -- world of 2: pp=2 ----------------------------------------------------------------------------------------------

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 4}
LAYOUTS_2 = {
    "gpt_1f1b": ("gpt", {}, PP2),
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_fit_layouts, 2, LAYOUTS_2, timeout=150)


@pytest.mark.timeout(200)
def test_pp2_1f1b_gpt_matches_one_process(two_ranks):
    _check_against(_reference("gpt", {}), two_ranks, "gpt_1f1b")
