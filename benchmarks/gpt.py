"""A nanoGPT-style GPT-2 and the LightningModule that trains it, for the precision benchmarks.

The model follows nanoGPT's `model.py` (karpathy/nanoGPT@3adf61e): pre-LayerNorm blocks, causal self-attention
through `scaled_dot_product_attention` (flash kernels on the GPU), GELU MLP, weights tied between the token
embedding and the head, and nanoGPT's initialisation. There is no dropout: the benchmark measures the step.

`GPTModule.configure_model` is where `torch.compile` is applied, to the inner `GPT` only: the LightningModule
itself stays eager so the strategy and precision plugin see ordinary parameters and hooks. This is how to compile
a model trained with `SMPStrategy` (see docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "PRESETS", "GPTConfig", "GPTModule"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """GPT-2 shapes. ``vocab_size`` 50304 is GPT-2's 50257 rounded up to a multiple of 64 (nanoGPT)."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        if name not in PRESETS:
            raise ValueError(f"Unknown GPT size {name!r}; choose one of {', '.join(PRESETS)}.")
        return PRESETS[name]


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256),  # CPU smoke size
    "124m": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # GPT-2 small
    "350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 medium
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}.")
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # scaled at init (GPT-2 paper)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding width
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.c_proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, C) → (B, T, 4C) → (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one (V, C) matrix embeds and un-embeds
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)  # each block adds two residual branches
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)  # idx: (B, T)
        if self.config.block_size < T:
            raise ValueError(f"Sequence length {T} exceeds block_size={self.config.block_size}.")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C) + (T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V) in the parameters' (or autocast's) dtype

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, each tied one counted once; ``non_embedding`` leaves out the position embeddings
        (the token embedding stays: it is also the head's weight)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, nanoGPT's estimate (PaLM appendix B): 6N for the matmuls of forward and
        backward, plus 12·L·H·Q·T for attention scores and values (not halved for causality)."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        return 6 * self.num_params() + 12 * L * H * Q * T


class GPTModule(L.LightningModule):
    """Trains a `GPT` on ``(x, y)`` token batches with next-token cross-entropy and AdamW.

    Args:
        config: the model's shapes.
        compile_model: apply ``torch.compile`` to the inner `GPT` in ``configure_model``.
        lr, weight_decay, betas: AdamW's settings (nanoGPT's for GPT-2 small).
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        compile_model: bool = False,
        lr: float = 6e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        self.config = config
        self.compile_model = compile_model
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = betas
        self.model: nn.Module = GPT(config)

    def configure_model(self) -> None:
        # Runs before the precision plugin casts the module and before the optimizer exists; compiling is lazy,
        # so the graph is traced at the first forward, with the parameters already in their training dtype.
        if self.compile_model and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch  # (B, T) token ids each; y is x shifted left by one
        logits = self(x)  # (B, T, V)
        # fp32 logits for the softmax: fp16 log-softmax over 50k classes loses the small probabilities.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # nanoGPT: decay the matrices (and embeddings), not biases or LayerNorm gains.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        on_cuda = self.device.type == "cuda"
        # fused: one kernel for the whole update, and it takes the fp16 overflow flag on the device.
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, fused=on_cuda, foreach=not on_cuda)
