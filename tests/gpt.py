"""The tiny GPTs the tests train, in the two forms the package meets, and a tiny Hugging Face Llama; each test adds
its own steps, optimizer and data to the GPTs (`AdamWGPT` is the one recipe two test files share).

`TinyGPT` is written as the smp docs tell users to write one: torch's ``nn.TransformerEncoderLayer`` blocks built
in ``configure_model`` under ``smp.model_creation(tensor_parallelism=smp.tp_size() > 1)``, a ModuleList trunk for
the pipeline, and a head tied to the token embedding. `BlockGPT` is built at construction from
`tests.models.TransformerBlock`, whose causal mask is a second positional argument (a pipeline does not send it
between stages), with the head tied or not. `TinyLlama` wraps a transformers ``LlamaForCausalLM`` (grouped-query
attention, an untied head: `llama_config`), random or ``from_pretrained``, optionally under peft's LoRA, with its
own steps, optimizer and data (transformers and peft are imported only when it is built).

`ScriptGPT` and `ScriptLlama` are plain ``nn.Module``s as smp v1 scripts build them (no Lightning hooks): a torch GPT
with a ModuleList trunk and a tied head, and a transformers Llama created under ``smp.model_creation``. `lit_gpt`
builds LitGPT's ``litgpt.GPT`` (a third-party model with its own module layout: `litgpt_config`), imported only when
it is built: litgpt is a test-only dependency that `scripts/setup.sh` installs without its own requirements.
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from lightning_smp import smp
from tests.models import TransformerBlock

__all__ = [
    "BLOCKS",
    "HEADS",
    "SEQ",
    "VOCAB",
    "WIDTH",
    "AdamWGPT",
    "BlockGPT",
    "ScriptGPT",
    "ScriptLlama",
    "TinyGPT",
    "TinyLlama",
    "lit_gpt",
    "litgpt_config",
    "llama_config",
    "token_batches",
]

VOCAB, WIDTH, HEADS, SEQ = 32, 16, 4, 8
BLOCKS = 4  # BlockGPT's trunk: enough for four pipeline stages, or two of two virtual stages each


def token_batches(seed: int, samples: int, vocab: int = VOCAB) -> tuple[Tensor, Tensor]:
    """``samples`` random sequences as (inputs, next-token targets), each (samples, SEQ)."""
    tokens = torch.randint(0, vocab, (samples, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


class TinyGPT(pl.LightningModule):
    """Embeddings, two torch transformer layers (packed q/k/v: split in three blocks under tensor parallelism), a
    head tied to the token embedding; ``vocab_parallel`` uses smp.nn's vocabulary-parallel embedding and LM head.
    The same weights on every rank and in every layout (seeded in `configure_model`).

    Args:
        vocab: the vocabulary size.
        ff: the width of each layer's feed-forward network.
        activation: the feed-forward network's activation, as ``nn.TransformerEncoderLayer`` takes it.
        dropout: of the residual stream only (none in the attention or the feed-forward network), where one device
            draws the same masks as a tensor-parallel layout.
        checkpointing: checkpoint every layer (``smp.set_activation_checkpointing``).
    """

    def __init__(
        self,
        *,
        vocab_parallel: bool = False,
        vocab: int = VOCAB,
        ff: int = 2 * WIDTH,
        activation: str = "relu",
        dropout: float = 0.0,
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_parallel = vocab_parallel
        self.vocab, self.ff, self.activation = vocab, ff, activation
        self.dropout, self.checkpointing = dropout, checkpointing
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        torch.manual_seed(0)
        embedding = smp.nn.DistributedEmbedding if self.vocab_parallel else nn.Embedding
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.tok = embedding(self.vocab, WIDTH)
            self.pos = nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    WIDTH, HEADS, self.ff, self.dropout, activation=self.activation, batch_first=True, norm_first=True
                )
                for _ in range(2)
            )
            for block in self.blocks:
                block.dropout.p, block.self_attn.dropout = 0.0, 0.0
            self.norm = nn.LayerNorm(WIDTH)
            self.head = (
                smp.nn.DistributedLMHead(WIDTH, self.vocab)
                if self.vocab_parallel
                else nn.Linear(WIDTH, self.vocab, bias=False)
            )
        self.head.weight = self.tok.weight
        if self.checkpointing:
            smp.set_activation_checkpointing(self.blocks)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))  # (B, T, W)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))  # (B, T, V), or (B, T, V/tp) vocab-parallel

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """The mean next-token cross entropy of ``(ids, target)``, in fp32."""
        ids, target = batch
        if self.vocab_parallel:
            return self.head.loss(self(ids), target)
        return F.cross_entropy(self(ids).float().flatten(0, 1), target.flatten())


class AdamWGPT(TinyGPT):
    """`TinyGPT` trained on 32 random sequences in steps of 8 per model replica with AdamW and a per-step StepLR, so
    that optimizer state and the LR schedule cross a checkpoint. Each tensor-parallel rank reads its share of the 8
    (``prescaled_batch=False``), so every layout steps on the same samples."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": StepLR(optimizer, 3, 0.5), "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*token_batches(seed=1, samples=32)), batch_size=8 // smp.tp_size())


class BlockGPT(pl.LightningModule):
    """Token and position embeddings, a ModuleList trunk of `BLOCKS` `TransformerBlock`s (with ``dropout`` after
    each MLP when it is > 0), a final norm and a head, tied to the token embedding unless ``tied=False``; built at
    construction, from the global RNG."""

    def __init__(self, *, tied: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(TransformerBlock(WIDTH, dropout=dropout) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).triu(1)  # (T, T): True above the diagonal
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))  # (B, T, W)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))  # (B, T, VOCAB)

    def loss(self, batch: Tensor) -> Tensor:
        """The mean next-token cross entropy of a (B, SEQ + 1) token batch, in fp32."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def llama_config(**overrides):
    """A tiny ``LlamaConfig``: 2 layers of width 16, 4 query heads over 2 key/value heads, an untied head, VOCAB
    tokens; ``overrides`` replace any of it."""
    import transformers

    tiny = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2 * SEQ}
    return transformers.LlamaConfig(**{**tiny, **heads, "pad_token_id": 0, **overrides})


class TinyLlama(pl.LightningModule):
    """A ``LlamaForCausalLM`` built in ``configure_model`` under ``smp.model_creation`` and kept as ``self.model``:
    random (`llama_config` with ``config`` overrides, seeded) or ``from_pretrained(pretrained)``; with ``lora``,
    wrapped by ``peft.get_peft_model`` with ``LoraConfig(**lora)`` (its adapters seeded). Trained with AdamW over
    ``self.parameters()`` (peft froze the base) on 64 random sequences in batches of 4.
    """

    def __init__(self, pretrained: str | None = None, *, lora: dict | None = None, **config) -> None:
        super().__init__()
        self.pretrained, self.lora, self.config_overrides = pretrained, lora, config
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        import transformers

        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            if self.pretrained is None:
                model = transformers.LlamaForCausalLM(llama_config(**self.config_overrides))
            else:
                model = transformers.LlamaForCausalLM.from_pretrained(self.pretrained)
            if self.lora is not None:
                import peft

                torch.manual_seed(0)
                model = peft.get_peft_model(model, peft.LoraConfig(**self.lora))
        self.model = model

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        ids, target = batch
        return F.cross_entropy(self.model(input_ids=ids).logits.float().flatten(0, 1), target.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        ids, target = token_batches(seed=1, samples=64)
        return DataLoader(TensorDataset(ids % self.model.config.vocab_size, target), batch_size=4)


class ScriptGPT(nn.Module):
    """A plain torch GPT as smp scripts build one: embeddings, a ModuleList of torch transformer layers (the trunk
    a pipeline splits, the layers tensor parallelism splits), a head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True) for _ in range(4)
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids: Tensor) -> Tensor:
        hidden = self.embedding(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


class ScriptLlama(nn.Module):
    """A Hugging Face transformers Llama (`llama_config`), a third-party model as a script builds it: under
    ``smp.model_creation``, so that tensor parallelism splits it by its own ``tp_plan``; its logits out."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
            self.llama = transformers.LlamaForCausalLM(llama_config())

    def forward(self, ids: Tensor) -> Tensor:
        return self.llama(ids).logits


def litgpt_config(**overrides):
    """A tiny Llama-shaped ``litgpt.Config``: 2 blocks of width 16, 4 query heads over 2 key/value groups (grouped-
    query attention), RMSNorm, LLaMAMLP (SiLU-gated), rotary embeddings over whole heads, no biases, an untied
    head, VOCAB tokens, sequences up to SEQ; ``overrides`` replace any of it."""
    import litgpt

    tiny = {"block_size": SEQ, "vocab_size": VOCAB, "padded_vocab_size": VOCAB, "n_layer": 2, "n_embd": WIDTH}
    llama = {"n_head": HEADS, "n_query_groups": 2, "intermediate_size": 2 * WIDTH, "rotary_percentage": 1.0}
    shape = {"bias": False, "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "parallel_residual": False}
    return litgpt.Config(**{**tiny, **llama, **shape, **overrides})


def lit_gpt(*recipe: type, **overrides) -> nn.Module:
    """LitGPT's ``litgpt.GPT`` over `litgpt_config` (``overrides``), built from the global RNG; its forward returns
    the logits (B, T, VOCAB). ``recipe``: mixins put in front of ``litgpt.GPT`` in a subclass (a test's
    ``configure_optimizers`` / ``train_dataloader``), which changes neither the modules nor their names."""
    import litgpt

    cls = type("LitGPT", (*recipe, litgpt.GPT), {}) if recipe else litgpt.GPT
    return cls(litgpt_config(**overrides))
