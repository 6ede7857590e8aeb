"""A tiny GPT trained in a plain Lightning Fabric loop with `SMPFabricStrategy` (``strategy="smp_fp16"`` by default).

The loop is Fabric's own (``fabric.setup``, ``model(x)``, ``fabric.backward``, ``fabric.clip_gradients``,
``optimizer.step``, ``fabric.save``); the strategy adds smp's layouts and fp16 with fp32 master weights and dynamic
loss scaling. The data is a learnable toy language: each token is followed by ``(3 * token + 1) % VOCAB`` nine
times in ten, a random token otherwise, so the loss falls from ln(64) = 4.16 to ~0.9 nats in the default 100
steps. The layers are created under ``smp.model_creation(tensor_parallelism=...)``, so ``--tp 2`` splits them.

    python examples/fabric/train.py                      # one process, fp16 masters (CPU: fp16 matmuls work)
    python examples/fabric/train.py --devices 2          # two data-parallel replicas (DDP)
    python examples/fabric/train.py --devices 2 --tp 2   # tensor_parallel_degree=2
    python examples/fabric/train.py --devices 2 --zero1  # shard_optimizer_state=True (ZeRO-1)
    python examples/fabric/train.py --precision 32       # strategy="smp": fp32

Runs in well under 30 s on two CPU cores at its defaults. Exits with status 1 when the last loss misses ``TARGET``.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_smp
from lightning_smp import smp

VOCAB, WIDTH, HEADS, SEQ, LAYERS = 64, 32, 4, 16, 2
TARGET = 2.0  # nats per token after the default steps (uniform guessing scores 4.16)


class GPT(nn.Module):
    """Token and position embeddings, pre-norm ``nn.TransformerEncoderLayer`` blocks, a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, 0.0, batch_first=True, norm_first=True)
                for _ in range(LAYERS)
            )
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        for embedding in (self.tok, self.pos):  # small logits at the start: the loss starts near ln(VOCAB)
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))  # (B, T, W)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype, device=h.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))  # (B, T, V)


def toy_language(samples: int, seed: int = 0) -> TensorDataset:
    """``samples`` sequences of SEQ + 1 tokens as (inputs, next-token targets)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(samples, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (samples,), generator=generator)
    for t in range(1, SEQ + 1):
        noise = torch.randint(0, VOCAB, (samples,), generator=generator)
        keep = torch.rand(samples, generator=generator) < 0.9
        tokens[:, t] = torch.where(keep, (3 * tokens[:, t - 1] + 1) % VOCAB, noise)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree")
    parser.add_argument("--zero1", action="store_true", help="shard_optimizer_state=True")
    parser.add_argument("--precision", choices=["16", "bf16", "32"], default="16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--save", default=None, help="write a sharded checkpoint here at the end")
    args = parser.parse_args(argv)

    strategy = lightning_smp.SMPFabricStrategy(
        tensor_parallel_degree=args.tp,
        shard_optimizer_state=args.zero1,
        fp16=args.precision == "16",
        bf16=args.precision == "bf16",
    )
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)  # the same initial weights on every rank

    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)  # split, cast, wrapped: fp32 masters in fp16/bf16
    loader = fabric.setup_dataloaders(DataLoader(toy_language(2048), batch_size=args.batch_size, shuffle=True))

    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for step, (ids, target) in zip(range(args.steps), batches, strict=False):
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), target.flatten())
        fabric.backward(loss)  # times the fp16 loss scale
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # on the fp32 masters, global over every rank
        optimizer.step()  # skipped on every rank alike when the scaled gradients overflowed
        optimizer.zero_grad()
        if step % 25 == 0 or step == args.steps - 1:
            scale = optimizer.loss_scale if args.precision == "16" else 1.0
            fabric.print(f"step {step:4d}  loss {fabric.all_reduce(loss.detach()).item():.3f}  loss_scale {scale:g}")
    final = float(fabric.all_reduce(loss.detach()).item())
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": args.steps})
    return final


if __name__ == "__main__":
    last = main()
    sys.exit(0 if last <= TARGET else 1)
