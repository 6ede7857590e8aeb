"""Fine-tune a pretrained Hugging Face Llama from a local directory with `SMPStrategy`, then export it.

Every rank reads only its own slices of the checkpoint (delayed parameter initialisation: nothing whole on any
rank), trains the whole model or, with ``--lora``, peft's low-rank adapters only, on the Python standard library's
sources (examples/gpt_char.py's data, encoded by the directory's tokenizer when it has one, else as ASCII codes),
saves a sharded checkpoint and exports it with `lightning_smp.export_hf`: a directory ``from_pretrained`` loads, or
under ``--lora`` the adapters in peft's own layout, which ``PeftModel.from_pretrained(base, dir)`` loads. Last, rank
0 loads the export as a user would and generates a few tokens from it.

No internet needed: ``--make-tiny-pretrained DIR`` writes a small Llama (examples/hf_llama.py's model, trained a
few steps on the characters) standing in for a downloaded one:

    pip install "lightning-smp[hf]"
    python examples/hf_finetune.py --make-tiny-pretrained llama-tiny      # once: a small pretrained Llama, offline
    python examples/hf_finetune.py --model-dir llama-tiny                 # full fine-tune, one process
    python examples/hf_finetune.py --model-dir llama-tiny --pp 2 --tp 2   # split 2 x 2 over four processes
    python examples/hf_finetune.py --model-dir llama-tiny --lora --pp 2   # LoRA: only the adapters train
    python examples/hf_finetune.py --model-dir llama-tiny --fp16          # fp16 with fp32 master weights

A downloaded model works the same (``hf download meta-llama/Llama-3.2-1B --local-dir llama-1b``, then
``--model-dir llama-1b``); see docs/fine-tuning.md for the memory to expect. Exits with status 1 when fine-tuning
did not lower the validation loss.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from transformers import AutoTokenizer, LlamaForCausalLM

from lightning_smp import export_hf, smp

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.gpt_char import GPTCharLM, StdlibCharData, add_layout_flags, decode, make_strategy, train
from examples.gpt_char import parse_args as gpt_char_args
from examples.hf_llama import TARGET_VAL_LOSS, LlamaCharLM

__all__ = ["FineTunedLlama", "StdlibTokens", "main", "make_tiny_pretrained"]


class FineTunedLlama(GPTCharLM):
    """A pretrained ``LlamaForCausalLM`` loaded in ``configure_model``, the smp way; the loss, the logging and the
    optimizer (AdamW over ``self.parameters()``: parameters that do not require grad are left out) are `GPTCharLM`'s.

    Args:
        model_dir: the directory ``save_pretrained`` (or a download) wrote.
        lora_rank: 0 trains every weight; else peft's LoRA of this rank on every linear layer but the head, and only
            the adapters train.
        lr: AdamW learning rate.
    """

    def __init__(self, model_dir: str, lora_rank: int = 0, lr: float = 1e-3) -> None:
        super().__init__(lr=lr, weight_decay=0.0)
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:  # validate, then fit: build once
            return
        hp = self.hparams
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            # under delayed initialisation this reads only the files' headers; each rank reads its slices at setup
            model = LlamaForCausalLM.from_pretrained(hp.model_dir, dtype=torch.float32)
            if hp.lora_rank:
                from peft import LoraConfig, get_peft_model

                lora = LoraConfig(r=hp.lora_rank, lora_alpha=2 * hp.lora_rank, target_modules="all-linear")
                model = get_peft_model(model, lora)  # freezes the base model's weights
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:  # (B, T) token ids -> (B, T, V) logits
        assert self.model is not None
        return self.model(input_ids=idx).logits


class StdlibTokens(StdlibCharData):
    """examples/gpt_char.py's standard-library sources, encoded by the tokenizer in ``model_dir`` when there is
    one, else as ASCII codes (the tiny pretrained model's vocabulary)."""

    def __init__(self, model_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        has_tokenizer = any(Path(model_dir, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir) if has_tokenizer else None

    def encode(self, text: str) -> Tensor:
        if self.tokenizer is None:
            return super().encode(text)
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Tensor) -> str:
        return decode(ids) if self.tokenizer is None else self.tokenizer.decode(ids)


def make_tiny_pretrained(directory: str, *, steps: int, accelerator: str, num_files: int) -> None:
    """examples/hf_llama.py's Llama trained ``steps`` steps on the characters, saved with ``save_pretrained``."""
    flags = ["--accelerator", accelerator, "--max-steps", str(steps), "--val-every", str(steps)]
    model = LlamaCharLM()
    train(gpt_char_args([*flags, "--num-files", str(num_files)]), model, TARGET_VAL_LOSS)
    if model.trainer.is_global_zero:
        model.model.save_pretrained(directory)
        print(f"wrote a pretrained Llama to {directory}; fine-tune it with --model-dir {directory}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a Hugging Face model directory (config.json and safetensors files)")
    parser.add_argument("--make-tiny-pretrained", metavar="DIR", help="write a small pretrained Llama to DIR, exit")
    parser.add_argument("--pretrain-steps", type=int, default=200, help="steps --make-tiny-pretrained trains")
    parser.add_argument("--output-dir", default="finetuned", help="the checkpoint and the export go here")
    parser.add_argument("--lora", action="store_true", help="train peft LoRA adapters only (not under --tp)")
    parser.add_argument("--lora-rank", type=int, default=8)
    add_layout_flags(parser)  # --pp, --tp, --microbatches, --fp16, --devices, --accelerator
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per sample")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-batches", type=int, default=20, help="batches each validation reads")
    parser.add_argument("--num-files", type=int, default=60, help="standard-library files to read")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.make_tiny_pretrained is None and (args.model_dir is None or not Path(args.model_dir).is_dir()):
        parser.error(
            f"no model directory at --model-dir {args.model_dir}: download one (hf download <repo> --local-dir DIR) "
            "or write a small pretrained Llama offline with --make-tiny-pretrained DIR, then pass --model-dir DIR"
        )
    if args.lora and args.tp > 1:
        parser.error("LoRA under tensor parallelism is not supported: use --pp or --devices (data parallel) instead")
    exported = Path(args.output_dir, "adapters" if args.lora else "model")
    if exported.exists():
        parser.error(f"{exported} exists: pass another --output-dir, or delete it")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Fine-tune, save, export and load the export back; return the metrics (``val_loss_before``, ``val_loss``)."""
    args = parse_args(argv)
    if args.make_tiny_pretrained is not None:
        make_tiny_pretrained(
            args.make_tiny_pretrained, steps=args.pretrain_steps, accelerator=args.accelerator, num_files=args.num_files
        )
        return {}
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # the corpus is one in-memory tensor
    L.seed_everything(args.seed, verbose=False)
    # nothing whole on any rank: each reads its slices of the files at setup
    strategy = make_strategy(args, delayed_parameter_initialization=True)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices or args.pp * args.tp,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,  # validate once, at the end
        check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = FineTunedLlama(args.model_dir, lora_rank=args.lora_rank if args.lora else 0, lr=args.lr)
    data = StdlibTokens(
        args.model_dir, block_size=args.block_size, batch_size=args.batch_size, num_files=args.num_files
    )
    before = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    trainer.fit(model, datamodule=data)
    metrics = {"val_loss_before": float(before), **{k: float(v) for k, v in trainer.callback_metrics.items()}}

    # The sharded checkpoint (every rank writes its own part), then one process turns it into the export.
    checkpoint = Path(args.output_dir, "last.ckpt")
    trainer.save_checkpoint(checkpoint)
    if trainer.is_global_zero:
        exported = export_hf(checkpoint, Path(args.output_dir, "adapters" if args.lora else "model"))
        print(f"val_loss {metrics['val_loss_before']:.4f} -> {metrics['val_loss']:.4f}; exported to {exported}")
        print(f"sample: {sample(args.model_dir, exported, lora=args.lora, data=data)!r}")
    return metrics


def sample(model_dir: str, exported: Path, *, lora: bool, data: StdlibTokens, prompt: str = "def ") -> str:
    """The export loaded as a user loads it (LoRA: onto the pretrained base), continuing ``prompt`` greedily."""
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(model_dir), exported)
    else:
        model = LlamaForCausalLM.from_pretrained(exported)
    ids = data.encode(prompt)[None]  # (1, T)
    generated = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
    return data.decode(generated[0])


if __name__ == "__main__":
    result = main()
    sys.exit(0 if not result or result["val_loss"] < result["val_loss_before"] else 1)
