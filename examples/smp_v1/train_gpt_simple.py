"""An smp v1 training script, shaped like AWS's ``train_gpt_simple.py``, run unchanged but for the import.

The SageMaker example's loop, line for line: ``smp.init(smp_config)``, the model built under
``smp.model_creation(tensor_parallelism=...)``, ``smp.DistributedModel``, AdamW over the wrapped model's parameter
groups (no weight decay for biases and norms), ``smp.DistributedOptimizer`` with smp's fp16 example settings, a
warm-up schedule that does not step after a skipped (overflowed) fp16 step, an ``@smp.step`` train step calling
``model.backward(loss)`` and an ``@smp.step`` evaluation step, ``loss.reduce_mean()``, fp16's gradient clipping on
the fp32 masters, and ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` with the scheduler in ``user_content``.
The only change is the first import: ``import smdistributed.modelparallel.torch as smp`` became
``from lightning_smp import smp``. The model and the data are examples/gpt_char.py's (a character GPT on the Python
standard library's own sources, which every machine has).

    torchrun --nproc-per-node=2 examples/smp_v1/train_gpt_simple.py                       # dp=2
    torchrun --nproc-per-node=2 examples/smp_v1/train_gpt_simple.py --tensor_parallel_degree 2
    torchrun --nproc-per-node=2 examples/smp_v1/train_gpt_simple.py --pipeline_parallel_degree 2 --microbatches 4
    torchrun --nproc-per-node=4 examples/smp_v1/train_gpt_simple.py --pipeline_parallel_degree 2 \\
        --tensor_parallel_degree 2 --fp16 1                                              # pp2 x tp2, fp16
    python examples/smp_v1/train_gpt_simple.py                                            # one process

A run that finds a checkpoint in ``--checkpoint-dir`` resumes from it (under any layout). Rank 0 prints the loss
every ``--logging_freq`` steps, the throughput, and the final validation loss.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_smp import smp  # was: import smdistributed.modelparallel.torch as smp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the model and data of gpt_char.py
from gpt_char import GPT, VOCAB_SIZE, CharWindows, encode, stdlib_sources


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train_batch_size", type=int, default=8, help="per rank (smp's per-GPU batch)")
    parser.add_argument("--val_batch_size", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--seq_length", type=int, default=64)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--num_files", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--logging_freq", type=int, default=10)
    parser.add_argument("--save_freq", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--checkpoint-dir", type=str, default="")
    # smp's parameters, as AWS's script names them
    parser.add_argument("--pipeline_parallel_degree", type=int, default=1)
    parser.add_argument("--tensor_parallel_degree", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--active_microbatches", type=int, default=None)
    parser.add_argument("--optimize", type=str, default="speed")
    parser.add_argument("--fp16", type=int, default=0)
    parser.add_argument("--shard_optimizer_state", type=int, default=0)
    parser.add_argument("--prescaled_batch", type=int, default=0)
    parser.add_argument("--delayed_param", type=int, default=0)
    return parser.parse_args(argv)


@smp.step
def train_step(model, input_ids, labels):
    logits = model(input_ids)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1))
    model.backward(loss)
    return loss


@smp.step
def test_step(model, input_ids, labels):
    logits = model(input_ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1))


def param_groups(module, weight_decay):
    """AWS's grouping: no weight decay for biases and norm weights."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def data_loaders(args):
    sources = stdlib_sources(args.num_files, seed=0)
    cuts = [int(len(text) * 0.9) for text in sources]
    train = CharWindows(encode("\n".join(t[:c] for t, c in zip(sources, cuts, strict=True))), args.seq_length)
    val = CharWindows(encode("\n".join(t[c:] for t, c in zip(sources, cuts, strict=True))), args.seq_length)
    # smp's data parallelism: with prescaled_batch each tensor-parallel group reads one batch (rdp), else every rank
    replicas, rank = (smp.rdp_size(), smp.rdp_rank()) if args.prescaled_batch else (smp.dp_size(), smp.dp_rank())
    sampler = DistributedSampler(train, num_replicas=replicas, rank=rank, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val, num_replicas=replicas, rank=rank, shuffle=False, drop_last=True)
    return (
        DataLoader(train, batch_size=args.train_batch_size, sampler=sampler, drop_last=True),
        DataLoader(val, batch_size=args.val_batch_size, sampler=val_sampler, drop_last=True),
    )


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    smp_config = {
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "microbatches": args.microbatches,
        "optimize": args.optimize,
        "fp16": args.fp16 > 0,
        "shard_optimizer_state": args.shard_optimizer_state > 0,
        "prescaled_batch": args.prescaled_batch > 0,
        "delayed_parameter_initialization": args.delayed_param > 0,
        "ddp": True,
    }
    if args.active_microbatches is not None:
        smp_config["active_microbatches"] = args.active_microbatches
    smp.init(smp_config)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # several ranks share the CPU's cores
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial model on every rank, as AWS's set_seed

    dtype = torch.float16 if args.fp16 else torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=dtype):
        model = GPT(args.n_layer, args.n_head, args.n_embd, args.seq_length, dropout=0.0)
    model = smp.DistributedModel(model)

    optimizer = torch.optim.AdamW(param_groups(model.get_module(), args.weight_decay), lr=args.lr)
    optimizer = smp.DistributedOptimizer(
        optimizer,
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )

    def warmup_then_cosine(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)))

    # AWS's tip: under fp16 the scheduler takes the inner optimizer
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer if args.fp16 else optimizer, warmup_then_cosine
    )

    total_steps = 0
    if args.checkpoint_dir and (Path(args.checkpoint_dir) / "newest").is_file():
        user_content = smp.resume_from_checkpoint(args.checkpoint_dir, tag=None, partial=True)
        total_steps = user_content["total_steps"]
        lr_scheduler.load_state_dict(user_content["lr_scheduler"])
        if smp.rank() == 0:
            print(f"resumed from {args.checkpoint_dir} at step {total_steps}", flush=True)

    train_loader, val_loader = data_loaders(args)
    model.train()
    start, tokens = time.perf_counter(), 0
    epoch = 0
    while total_steps < args.max_steps:
        train_loader.sampler.set_epoch(epoch)
        for input_ids, labels in train_loader:
            if total_steps >= args.max_steps:
                break
            input_ids, labels = input_ids.to(device), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss_mb = train_step(model, input_ids, labels)
            loss = loss_mb.reduce_mean()
            if args.fp16 and args.grad_clip > 0:
                optimizer.clip_master_grads(args.grad_clip)  # the norm of the fp32 masters over every rank
            optimizer.step()
            if not (args.fp16 and optimizer.overflow):
                lr_scheduler.step()
            total_steps += 1
            tokens += input_ids.numel()
            if smp.rank() == 0 and (total_steps % args.logging_freq == 0 or total_steps == 1):
                rate = tokens * smp.dp_size() / (time.perf_counter() - start)
                print(f"step {total_steps} loss {loss.item():.4f} ({rate:,.0f} tokens/s)", flush=True)
            if args.save_freq and total_steps % args.save_freq == 0:
                smp.save_checkpoint(
                    args.checkpoint_dir,
                    tag=f"total_steps{total_steps}",
                    partial=True,
                    model=model,
                    optimizer=optimizer,
                    user_content={"total_steps": total_steps, "lr_scheduler": lr_scheduler.state_dict()},
                    num_kept_partial_checkpoints=2,
                )
        epoch += 1

    model.eval()
    with torch.no_grad():
        losses = [test_step(model, ids.to(device), labels.to(device)).reduce_mean() for ids, labels in val_loader]
    val_loss = torch.stack(losses).mean().item() if losses else float("nan")
    if smp.rank() == 0:
        print(f"validation loss {val_loss:.4f} after {total_steps} steps", flush=True)
    return val_loss


if __name__ == "__main__":
    main()
