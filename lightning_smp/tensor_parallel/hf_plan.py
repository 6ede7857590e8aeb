"""The tensor-parallel plan a Hugging Face transformers model carries, in lightning_smp's terms; pure.

A transformers model (``PreTrainedModel``) names what to split in ``model.tp_plan``: module-path patterns relative to
the model (``*`` for the layer number), merged by transformers from the class's ``_tp_plan``, the config's
``base_model_tp_plan`` and its children's plans. GPT-2, BERT and RoBERTa ship none; smp split them out of the box,
so a built-in plan stands in. `plan.py` matches the patterns and builds the units; this module only says which plan
a model has, which of its styles lightning_smp honours, which entries must split together (`link_key`), and which
layers peft's adapters wrap (`is_adapter_layer`: LoRA's low-rank product would need a split of its own). Nothing
here imports transformers or peft: a module that is a transformers model or a peft layer has imported it already.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from lightning_smp.config import TENSOR_PARALLEL_STYLES

__all__ = [
    "HONOURED_STYLES",
    "SELF_CONTAINED_STYLES",
    "ModelPlan",
    "heads_reason",
    "is_adapter_layer",
    "is_transformers_model",
    "layers_by_style",
    "link_key",
    "model_plan",
]

# transformers' style names that lightning_smp honours: those a user's plan may use (the same names mean the same)
HONOURED_STYLES = frozenset(TENSOR_PARALLEL_STYLES)
# styles whose input and output are whole: such a module splits (or not) on its own, not with its neighbours
SELF_CONTAINED_STYLES = frozenset(
    {
        "colwise_gather_output",
        "colwise_rep",
        "rowwise_split_input",
        "rowwise_rep",
        "embedding_rowwise",
        "vocab",
        "replicate",
        "sequence_parallel",
        "auto",
    }
)

_BERT = {
    "embeddings.word_embeddings": "embedding_rowwise",
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}
# config.model_type -> (base-model plan, how many path components up the entries that split together meet)
_BUILT_IN: dict[str, tuple[dict[str, str], int]] = {
    "gpt2": (
        {"wte": "embedding_rowwise", "h.*.attn": "auto", "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
        1,
    ),
    # BERT's attention.self.query and attention.output.dense meet two levels up (at attention), as the feed-forward
    # layer's intermediate.dense and output.dense do (at the layer)
    "bert": (_BERT, 2),
    "roberta": (_BERT, 2),
}


# attributes in which transformers' attention layers keep the width of one head
_HEAD_SIZES = ("head_dim", "attention_head_size", "head_size")


@dataclass(frozen=True)
class ModelPlan:
    """A transformers model's plan: ``entries`` (pattern relative to the model -> style) and ``link_up``: entries
    that pass a split activation to each other (a "colwise" layer feeding a "rowwise" one) meet this many path
    components above their modules; they split together or stay whole together."""

    entries: dict[str, str]
    link_up: int = 1


def is_transformers_model(module: nn.Module) -> bool:
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return modeling_utils is not None and isinstance(module, modeling_utils.PreTrainedModel)


def model_plan(model: nn.Module) -> ModelPlan | None:
    """The plan of transformers model ``model``: its own ``tp_plan``, else the built-in one for its type, else None."""
    own = dict(getattr(model, "tp_plan", None) or {})
    if own:
        return ModelPlan(own)
    built_in = _BUILT_IN.get(getattr(model.config, "model_type", ""))
    if built_in is None:
        return None
    base_plan, link_up = built_in
    base = model.base_model
    prefix = "" if base is model else f"{model.base_model_prefix}."
    entries = {f"{prefix}{pattern}": style for pattern, style in base_plan.items()}
    head = model.get_output_embeddings() if base is not model else None
    if isinstance(head, nn.Linear):
        entries.update({name: "colwise_gather_output" for name, module in model.named_modules() if module is head})
    return ModelPlan(entries, link_up)


def link_key(name: str, style: str, link_up: int) -> str:
    """The group a plan entry for module ``name`` splits with: itself when its style is self-contained."""
    if style in SELF_CONTAINED_STYLES:
        return name
    return ".".join(name.split(".")[:-link_up])


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer peft's adapters (LoRA) wrap: ``peft.tuners.tuners_utils.BaseTunerLayer``."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer)


def heads_reason(parent: nn.Module, features: int, tp_size: int, what: str) -> str | None:
    """Why ``features`` (of a projection inside attention ``parent``) do not split into whole heads, or None."""
    head = next((getattr(parent, name) for name in _HEAD_SIZES if isinstance(getattr(parent, name, None), int)), 0)
    if head <= 0 or features % head:
        return None  # not an attention layer we know the heads of: the layer's own size check decides
    if (features // head) % tp_size:
        return (
            f"its {what}={features} hold {features // head} heads of {head}, not divisible by "
            f"tensor_parallel_degree={tp_size}"
        )
    heads = getattr(getattr(parent, "config", None), "num_attention_heads", None)
    if isinstance(heads, int) and heads % tp_size:  # q, k and v packed per head (GPT-NeoX's query_key_value)
        return f"its attention has num_attention_heads={heads}, not divisible by tensor_parallel_degree={tp_size}"
    return None


def layers_by_style() -> dict[str, dict[type[nn.Module], type[nn.Module]]]:
    """transformers classes (GPT-2's Conv1D and attention) -> their tensor-parallel class, per style; empty when
    transformers is not imported."""
    if "transformers" not in sys.modules:
        return {}
    from lightning_smp.tensor_parallel.hf_layers import LAYERS_BY_STYLE

    return LAYERS_BY_STYLE
