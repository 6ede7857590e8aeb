"""A small Llama-style model from Hugging Face transformers (random init, from a ``LlamaConfig``), trained with
`SMPStrategy` on the characters of the Python standard library's sources.

Target: validation loss <= 2.4 nats per character after the default 300 steps (2.21 measured in fp32 on CPU;
always predicting the character frequencies scores 3.30).

The model is transformers' own ``LlamaForCausalLM`` with grouped-query attention, built under
``smp.model_creation(tensor_parallelism=...)`` and nothing else: tensor parallelism splits it by the model's own
plan (``model.tp_plan``: q/k/v/gate/up column-parallel, o/down row-parallel, the embedding and the head along the
vocabulary), and pipeline parallelism splits its decoder layers (``model.model.layers``) between stages. The data
and the flags are examples/gpt_char.py's (its `StdlibCharData`, ASCII characters, 128 tokens):

    pip install "lightning-smp[hf]"
    python examples/hf_llama.py                               # one process (GPU when present, fp16)
    python examples/hf_llama.py --tp 2                        # tensor_parallel_degree=2, by the model's own plan
    python examples/hf_llama.py --pp 2 --microbatches 2       # two pipeline stages
    python examples/hf_llama.py --pp 2 --tp 2 --fp16          # pp x tp = 2 x 2, fp16 with fp32 master weights
    python examples/hf_llama.py --activation-checkpointing    # recompute each decoder layer in backward

``lightning-smp fit --config examples/configs/hf_llama.yaml`` runs the same LightningModule from the command line.
Exits with status 1 when the final validation loss misses the target.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_smp import smp

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.gpt_char import VOCAB_SIZE, GPTCharLM, parse_args, train

__all__ = ["TARGET_VAL_LOSS", "LlamaCharLM", "main"]

TARGET_VAL_LOSS = 2.4


class LlamaCharLM(GPTCharLM):
    """``LlamaForCausalLM`` over ASCII characters, written the smp way (built under ``smp.model_creation``); the loss,
    the logging and the optimizer are `GPTCharLM`'s.

    Args:
        n_layer: decoder layers (at least the pipeline degree).
        n_head: attention heads (divisible by the tensor-parallel degree).
        n_kv_head: key/value heads (grouped-query attention; divisible by the tensor-parallel degree, or the
            attention layers stay whole with a warning).
        d_model: width (divisible by ``n_head``).
        intermediate_size: width of the gated feed-forward layer.
        block_size: longest context.
        lr: AdamW learning rate.
        activation_checkpointing: recompute each decoder layer's activations in backward instead of keeping them
            (``smp.set_activation_checkpointing`` on ``model.model.layers``).
        vocab_size: rows of the embedding and the head (the characters need 128; a bigger one plans a real model's
            logits, as examples/planning/llama3_8b.yaml does).
    """

    def __init__(
        self,
        n_layer: int = 2,
        n_head: int = 4,
        n_kv_head: int = 2,
        d_model: int = 64,
        intermediate_size: int = 128,
        block_size: int = 64,
        lr: float = 1e-2,
        weight_decay: float = 0.01,
        activation_checkpointing: bool = False,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        super().__init__(
            n_layer, n_head, d_model, block_size, lr=lr, weight_decay=weight_decay,
            activation_checkpointing=activation_checkpointing,
        )  # fmt: skip
        self.save_hyperparameters()
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is not None:  # fit, then validate: build once
            return
        hp = self.hparams
        config = LlamaConfig(
            vocab_size=hp.vocab_size,
            hidden_size=hp.d_model,
            intermediate_size=hp.intermediate_size,
            num_hidden_layers=hp.n_layer,
            num_attention_heads=hp.n_head,
            num_key_value_heads=hp.n_kv_head,
            max_position_embeddings=hp.block_size,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        )
        dtype = torch.float16 if smp.state.cfg.fp16 else torch.get_default_dtype()
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=dtype):
            self.model = LlamaForCausalLM(config)
        if hp.activation_checkpointing:
            smp.set_activation_checkpointing(self.model.model.layers)  # each decoder layer its own checkpoint

    def forward(self, idx: Tensor) -> Tensor:  # (B, T) int64 -> (B, T, V) logits, whole on every tp rank
        assert self.model is not None
        return self.model(input_ids=idx).logits


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train and validate with examples/gpt_char.py's flags; return the final metrics as floats."""
    args = parse_args(argv, description=__doc__.splitlines()[0])
    model = LlamaCharLM(n_layer=args.layers, activation_checkpointing=args.activation_checkpointing)
    return train(args, model, TARGET_VAL_LOSS)


if __name__ == "__main__":
    sys.exit(0 if main()["val_loss"] <= TARGET_VAL_LOSS else 1)
