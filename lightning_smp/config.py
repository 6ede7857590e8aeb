"""SMPConfig: every smp v1 ``parameters`` key plus lightning_smp's own settings, checked at construction.

Owns the defaults, the validation (every bad value is a ``ValueError`` that repeats it and names the fix) and the
table of settings accepted but not acted on yet; reading the SageMaker sources (the ``smp_options`` dict, the
``SM_HP_MP_PARAMETERS`` variable) is `smp_options`'s. It does not know the world size (``data_parallel_degree``
checks it once the strategy does) and builds no rank layout or process group (``topology.py`` does). Frozen, so
derived values are properties and never drift from the fields they come from. Longer than our ~600-line mark
because `SMPConfig` is the one list of settings: each of its ~50 fields carries the docstring the configuration
reference (docs/configuration.md) is generated from, and the checks below it are that class's alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_smp import smp_options as _sources

__all__ = ["TENSOR_PARALLEL_STYLES", "SMPConfig"]

_PIPELINES = ("interleaved", "simple", "zero_bubble")
_OPTIMIZE = ("speed", "memory")
_DDP_BACKENDS = ("auto", "nccl")
_NAMED_PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}
_OWN_FIELDS = frozenset(
    {
        "static_loss_scale",
        "dynamic_loss_scale",
        "dynamic_loss_args",
        "pipeline_module",
        "partition",
        "virtual_stages",
        "tensor_parallel_plan",
        "sequence_parallel",
        "async_checkpoint",
        "context_parallel_degree",
        "cp_comm_type",
    }
)
_CP_COMM_TYPES = ("p2p", "all_gather")
# lightning_smp settings named as smp v2 names them: accepted in an smp_options ``parameters`` dict too (an smp v2
# job's), though smp v1 had none, so `SMPConfig.as_smp_parameters` (smp v1's ``smp.state.cfg``) leaves them out
_SMP_V2_NAMES = frozenset({"context_parallel_degree"})
TENSOR_PARALLEL_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_split_input",
    "rowwise_rep",
    "packed_colwise",
    "embedding_rowwise",
    "vocab",
    "replicated_with_grad_allreduce",
    "sequence_parallel",
    "auto",
    "replicate",
)
"""Styles of a ``tensor_parallel_plan`` entry, named as Hugging Face transformers names them where they mean the
same: "colwise" (an nn.Linear split by output features; its output stays split), "rowwise" (an nn.Linear split by
input features; takes a split input, e.g. a "colwise" output, and returns the whole output), "colwise_gather_output"
(= "colwise_rep": "colwise" with the output all-gathered, e.g. a language-model head), "rowwise_split_input"
(= "rowwise_rep": "rowwise" that splits a whole input itself), "packed_colwise" (an nn.Linear holding two weights
packed along its output, such as a fused [gate; up] projection: each rank keeps its part of each), "embedding_rowwise"
(= "vocab": an nn.Embedding split along the vocabulary), "replicated_with_grad_allreduce" (any module kept whole
whose parameter gradients are summed over the tensor-parallel ranks, e.g. a per-head norm between a "colwise" and a
"rowwise" layer), "sequence_parallel" (any module kept whole that runs on this rank's slice of the sequence, dim 1,
its parameter gradients summed over the ranks, e.g. a norm), "auto" (a layer lightning_smp splits by itself:
nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.MultiheadAttention, nn.Embedding, GPT-2's attention),
"replicate" (keep the module and everything in it whole)."""

# smp settings that lightning_smp accepts but that change nothing yet: field -> why. When a feature lands,
# delete its line here; `SMPConfig.inactive_settings` reads only this table.
_INACTIVE_SETTINGS: dict[str, str] = {
    "ddp": "data parallelism is always on (data parallel degree = world size / (pp * tp))",
    "ddp_port": "Lightning's cluster environment provides MASTER_ADDR and MASTER_PORT",
    "ddp_dist_backend": "Lightning picks the backend: NCCL on GPU, gloo on CPU",
    "horovod": "data parallelism runs on torch.distributed, never Horovod",
    "contiguous": "it is a TensorFlow-only smp setting",
    "deterministic_server": "there is no execution server; every rank runs the same fixed pipeline schedule",
    "skip_tracing": "lightning_smp never traces the model",
    "sdp_reduce_bucket_size": "FSDP2, which runs sharded data parallelism, reduce-scatters one module's "
    "gradients at a time and has no bucket size",
    "sdp_max_live_parameters": "FSDP2, which runs sharded data parallelism, gathers one module's parameters at a "
    "time (and prefetches the next) and has no limit on live parameters",
    "sdp_hierarchical_allgather": "FSDP2, which runs sharded data parallelism, all-gathers over one shard group; "
    "keep a shard group inside a node (sharded_data_parallel_degree <= devices per node) for the same effect",
    "optimize": "tensor-parallel layers have a single implementation",
}

# smp's deprecated parameters (config.yaml ``deprecated: True``) -> the one that replaces it, which they set.
_DEPRECATED: dict[str, str] = {"fp16_params": "fp16"}

# smp's schema requirements (``requires`` / ``requires_not``) that lightning_smp does not enforce, and why; every
# other one is checked (the degrees' bounds, bf16 against fp16 and fp16_params, sharded data parallelism against
# pipelining and shard_optimizer_state, auto_partition=False against default_partition, ddp against horovod, and
# the internal settings' in `smp_options`).
SMP_REQUIREMENTS_NOT_ENFORCED: dict[str, str] = {
    "tensor_parallel_degree > 1 requires ddp=True": "data parallelism is always on, so there is nothing to turn on",
    "ddp_port requires ddp=True": "ddp_port has no effect (the cluster environment gives the port)",
    "ddp_dist_backend requires ddp=True": "ddp_dist_backend has no effect (Lightning picks the backend)",
    "prescaled_batch=True requires optimize='speed'": "optimize chose between two implementations of smp's "
    "DistributedTransformer, which lightning_smp does not reproduce",
    "sharded_data_parallel_degree > 1 requires tensor_parallel_degree=1": "smp 1.15 lifted it (sharded data "
    "parallelism with tensor parallelism), and lightning_smp combines the two",
}
"""smp v1 requirement -> why lightning_smp accepts a config that breaks it."""

# Lowest allowed value of each plain int field (upper bounds that depend on other fields are checked apart).
_INT_MINIMUMS: dict[str, tuple[int, str]] = {
    "virtual_stages": (1, "the trunk chunks each pipeline rank runs; 1 means one chunk per stage"),
    "pipeline_parallel_degree": (1, "the number of pipeline stages; 1 means no pipelining"),
    "tensor_parallel_degree": (1, "the number of ranks each tensor-parallel layer is split over"),
    "context_parallel_degree": (1, "the number of ranks each sequence is split over; 1 means no context parallelism"),
    "microbatches": (1, "the number of pieces each batch is split into; 1 means no pipelining"),
    "activation_loading_horizon": (0, "how many checkpointed modules' offloaded inputs are loaded back ahead"),
    "sharded_data_parallel_degree": (1, "1 means no sharded data parallelism"),
    "tensor_parallel_seed": (0, "the seed of random ops inside tensor-parallel layers"),
    "sdp_reduce_bucket_size": (1, "elements per gradient bucket"),
    "sdp_param_persistence_threshold": (0, "elements below which a parameter is not sharded"),
    "sdp_max_live_parameters": (1, "parameters gathered at once"),
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# dynamic_loss_args key -> (check, what it must be). Defaults live with the loss scaler, not here.
_LOSS_ARG_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "init_scale": (lambda v: _is_number(v) and v > 0, "a number > 0, for example 2**32"),
    "scale_factor": (lambda v: _is_number(v) and v > 1, "a number > 1, for example 2.0"),
    "scale_window": (lambda v: _is_int(v) and v >= 1, "an int >= 1, for example 1000"),
    "min_scale": (lambda v: _is_number(v) and v > 0, "a number > 0, for example 1"),
    "delayed_shift": (lambda v: _is_int(v) and v >= 1, "an int >= 1, for example 2"),
    "consecutive_hysteresis": (lambda v: isinstance(v, bool), "True or False"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SMPConfig:
    """Every smp v1 parameter with smp's default, plus lightning_smp's own settings.

    Build it from keyword arguments, from a pasted SageMaker dict (`from_smp_options`), or from every source
    with SageMaker's precedence (`from_sources`). Defaults and checks follow smdistributed-modelparallel
    1.12-1.13 (its ``config.yaml`` schema and the SageMaker Python SDK docs).
    """

    # --- smp v1 parameters -------------------------------------------------------------------------------
    pipeline_parallel_degree: int = 1
    """Number of pipeline stages the model is split into (smp's old name: ``partitions``)."""
    tensor_parallel_degree: int = 1
    """Number of ranks each tensor-parallel layer is split over."""
    context_parallel_degree: int = 1
    """lightning_smp (smp v2's name; smp v1 had none): number of ranks each sequence is split over (context
    parallelism). The ranks of a context-parallel group read the same batch; the strategy gives each rank two
    chunks of every sequence (chunks r and 2·cp−1−r of 2·cp, so causal attention costs every rank the same), and
    attention runs over the whole sequence by passing keys and values around the group (``cp_comm_type``).
    Parameters are replicated over the group and gradients reduced over data × context parallel ranks. Sequence
    lengths must be multiples of 2 × context_parallel_degree; a model that computes its own positions reads them
    from ``smp.cp_positions`` (docs/long-context.md)."""
    microbatches: int = 1
    """Pieces each batch is split into for pipelining; the batch size must be divisible by it."""
    pipeline: str = "interleaved"
    """Pipeline schedule: "interleaved" runs a backward as soon as it can (1F1B), "simple" runs every forward
    first (GPipe); "zero_bubble" (not smp's) is 1F1B with backwards split into their input and weight gradients,
    the weight gradients moved to fill the pipeline's idle time (ZB-H1: a third of 1F1B's bubble, same memory;
    only the backwards whose move shortens the step are split).
    smp's internal "_only_forward" is accepted from smp_options and runs as "interleaved" (evaluation steps always
    run forward only), with a warning."""
    optimize: str = "speed"
    """smp's choice between tensor-parallel transformer implementations: "speed" or "memory". smp's code
    defaults to "speed" (its docs table says "memory")."""
    placement_strategy: str = "cluster"
    """Order of the parallel dimensions over global ranks: "cluster" (= "DPT"), "spread" (= "TPD") or any
    order of the letters D (data), P (pipeline), T (tensor), optionally with C (context; without it C sits just
    left of T); the right-most letter varies fastest, so it lands on neighbouring ranks. Normalised to lower case
    for the names, upper case for the letters."""
    auto_partition: bool = True
    """Balance the pipeline stages automatically; if False, ``default_partition`` or ``partition`` decides."""
    default_partition: int | None = None
    """Stage index, in [0, pipeline_parallel_degree), for trunk children not placed by ``smp.partition`` or
    ``smp.set_partition``; needed when ``auto_partition`` is False and ``partition`` is not given."""
    memory_weight: float = 0.8
    """Weight of memory, in [0, 1], against compute in the auto-partition cost model (0: balance compute only,
    1: balance memory only)."""
    active_microbatches: int | None = None
    """Most microbatches in flight at once, in [1, microbatches]; None means min(pipeline_parallel_degree + 2,
    microbatches), as in smp. Lower values cap activation memory."""
    ddp: bool = False
    """smp: turn on DistributedDataParallel (smp required it for tensor parallelism)."""
    ddp_port: int | None = None
    """smp: port for the DDP rendezvous."""
    ddp_dist_backend: str = "auto"
    """smp: collective backend for data parallelism, "auto" (SMDDP where possible, else NCCL) or "nccl"."""
    horovod: bool = False
    """smp (TensorFlow): use Horovod for data parallelism."""
    contiguous: bool = True
    """smp (TensorFlow): keep every partition a connected subgraph."""
    deterministic_server: bool = False
    """smp: make the pipeline execution server run requests in the same order on every data-parallel rank."""
    offload_activations: bool = False
    """smp: keep the inputs that checkpointed modules save for their backward in host memory (pinned on a GPU)
    from the end of their forward until their backward loads them back. Needs modules marked with
    smp.set_activation_checkpointing; unlike smp, also with microbatches=1."""
    activation_loading_horizon: int = 4
    """smp: with offload_activations, how many checkpointed modules' inputs are loaded back onto the device
    ahead of their backward (0: each when its backward starts)."""
    fp16: bool = False
    """Train with fp16 parameters, fp32 master weights in the optimizer and loss scaling."""
    bf16: bool = False
    """Train with bf16 parameters; needs fp16 (and fp16_params) off."""
    fp16_params: bool = False
    """smp (deprecated in favour of fp16): create distributed modules' parameters in fp16. True sets fp16=True
    (with a warning naming fp16), as the fp16 training it asked for needs fp16 here."""
    shard_optimizer_state: bool = False
    """smp: shard the fp32 master weights and the optimizer state over the data-parallel replicas (ZeRO-1): each
    replica keeps and updates a contiguous 1/dp share, gradients are reduce-scattered instead of all-reduced and the
    updated parameters all-gathered. Works with fp16, bf16 and fp32, tensor and pipeline parallelism; checkpoints
    store the state by parameter name, so they resume at any dp degree, sharded or not."""
    sharded_data_parallel_degree: int = 1
    """smp: number of data-parallel ranks each parameter, its gradient and its optimizer state are sharded over
    (ZeRO-3; smp ran DeepSpeed's MiCS, lightning_smp runs PyTorch's FSDP2 ``fully_shard``); 1 turns it off. It
    must divide the data-parallel degree: shard groups are neighbouring dp ranks, and the replicas of a shard
    group all-reduce their gradients (HSDP). fp16/bf16 compute on gathered copies, the sharded fp32 parameters
    are the master weights. Combines with tensor parallelism; not with pipeline parallelism or
    shard_optimizer_state (as in smp)."""
    sdp_reduce_bucket_size: int = 500_000_000
    """smp: gradient bucket size in elements, for sharded data parallelism. No FSDP2 equivalent (it reduces one
    module's gradients at a time): accepted, and a changed value warns."""
    sdp_param_persistence_threshold: int = 1_000_000
    """smp: under sharded data parallelism, a parameter with fewer elements than this is kept whole on every rank
    (gathered with its unit, its gradients all-reduced rather than reduce-scattered), as smp kept such parameters
    whole. 0 shards everything; the default keeps a small model whole, as smp did."""
    sdp_max_live_parameters: int = 1_000_000_000
    """smp: most parameters gathered at once, for sharded data parallelism. No FSDP2 equivalent (it gathers one
    module at a time and prefetches the next): accepted, and a changed value warns."""
    sdp_hierarchical_allgather: bool = True
    """smp: all-gather within each node first, then across nodes, for sharded data parallelism. No FSDP2
    equivalent: accepted, and a changed value warns; a shard group within one node gives the same traffic."""
    sdp_gradient_clipping: float = 1.0
    """smp: under sharded data parallelism, every optimizer step clips the gradients to this global norm (over
    every rank, each value counted once), after any ``gradient_clip_val`` clipping, as smp did."""
    prescaled_batch: bool = False
    """smp: whether the ranks of a tensor-parallel group read one batch. False (smp's default): every rank reads
    its own (Lightning's sampler shards over smp's dp ranks, world / pp of them, as a DistributedSampler over
    smp.dp_size() / smp.dp_rank() does) and the group trains on the union of its ranks' batches, gathered over the
    group each step: the global batch is world / pp times the loader's. True: the ranks of a group read the same
    batch (a sampler over smp.rdp_size() / smp.rdp_rank()): the global batch is the data-parallel degree times the
    loader's. The first batch of each loop is checked against the setting."""
    delayed_parameter_initialization: bool = False
    """smp: build the model in ``configure_model`` on the meta device and materialise at setup only what each
    rank keeps (its pipeline stage, its tensor-parallel shards), with the values a single-device build with the
    same seed gives; no rank ever holds the whole model. ``trainer.init_module(empty_init=True)`` does the same."""
    skip_tracing: bool = False
    """smp: skip the tracing pass that measures module costs before partitioning."""
    tensor_parallel_seed: int = 0
    """Seed of the random ops (initialisation, dropout) inside tensor-parallel layers."""

    # --- lightning_smp settings (not smp parameters) -----------------------------------------------------
    static_loss_scale: float = 1.0
    """lightning_smp: fixed loss scale (> 0) used when ``dynamic_loss_scale`` is False; smp took it in
    ``smp.DistributedOptimizer``."""
    dynamic_loss_scale: bool = True
    """lightning_smp: adjust the fp16 loss scale on overflow. smp's DistributedOptimizer defaulted to False;
    we default to True because fp16 without it silently underflows or overflows."""
    dynamic_loss_args: Mapping[str, Any] | None = None
    """lightning_smp: settings of the dynamic loss scaler, any of init_scale, scale_factor, scale_window,
    min_scale, delayed_shift, consecutive_hysteresis (smp's ``dynamic_loss_args``); stored read-only. Keys
    left out take the loss scaler's smp defaults."""
    pipeline_module: str | None = None
    """lightning_smp: dotted path, from the LightningModule, of the sequential trunk to pipeline (for example
    "model.blocks"); None picks the sequential container with the most parameters."""
    partition: tuple[int, ...] | None = None
    """lightning_smp: manual stage sizes, one per stage, counted in children of the pipelined trunk (for
    example (3, 3, 2)); a list is accepted and stored as a tuple."""
    virtual_stages: int = 1
    """lightning_smp: chunks of the pipelined trunk per pipeline rank (Megatron's virtual pipeline stages): rank r
    runs chunks r, r + pp, r + 2 pp, ... With 2 or more, pipeline="interleaved" runs Megatron's interleaved 1F1B,
    whose bubble is this many times smaller, for this many times more messages. Needs microbatches to be a
    multiple of pipeline_parallel_degree; ``partition`` then gives one size per chunk."""
    tensor_parallel_plan: Mapping[str, str] | None = None
    """lightning_smp: modules to split over the tensor-parallel ranks, as dotted module-path patterns (``*`` matches
    one component) mapped to a style: colwise, rowwise, colwise_gather_output (= colwise_rep), rowwise_split_input
    (= rowwise_rep), packed_colwise, embedding_rowwise (= vocab), replicated_with_grad_allreduce, sequence_parallel,
    auto or replicate (Hugging Face transformers' names; docs/tensor-parallelism.md, "Plan styles", says what each
    does), for example
    ``{"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}``; stored read-only. Applies on top of
    ``smp.tensor_parallelism()`` and of the plan of a Hugging Face transformers model created tensor-parallel
    (``model.tp_plan``), whose entries for the same modules it overrides; a pattern that matches no module raises
    when training starts."""
    cp_comm_type: str = "p2p"
    """lightning_smp (smp v2's ``cp_comm_type``): how attention sees the whole sequence under context parallelism:
    "p2p" passes key/value blocks around the context-parallel ranks in a ring, each rank holding two blocks at a
    time; "all_gather" gathers every rank's keys and values at once (fewer, larger messages; the whole sequence's
    keys and values on every rank), for short rings."""
    sequence_parallel: bool = False
    """lightning_smp: with tensor_parallel_degree > 1, the layers lightning_smp splits (nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer, the decoder layers of a Hugging Face model split by its own plan) keep 1/tp of the
    sequence in their norms, dropouts and residual adds (Megatron's sequence parallelism): an all-gather and a
    reduce-scatter replace each all-reduce, the same bytes, and those activations shrink by tp. Sequence lengths
    must then be multiples of tensor_parallel_degree. Off by default, also with tp > 1: measured, the layers keep
    0.66 (tp2) to 0.42 (tp4) of their activation bytes for 2.9% more CPU per tp2 step, but turning it on would stop
    jobs whose sequence lengths do not divide by tp (docs/memory.md, "Sequence parallelism")."""
    async_checkpoint: bool = False
    """lightning_smp: a checkpoint save (``ModelCheckpoint``, ``trainer.save_checkpoint``) copies this rank's part to
    host memory and returns; a background thread writes and publishes it while training goes on. The next save, a
    preemption save, a load and the end of the run wait for it, and its error is raised there. Costs host memory
    for one copy of the rank's part of the checkpoint. Off by default: a save is then whole when it returns."""

    def __post_init__(self) -> None:
        # With `from __future__ import annotations` field types are strings, hence "bool".
        for field in dataclasses.fields(self):
            if field.type == "bool" and not isinstance(getattr(self, field.name), bool):
                value = getattr(self, field.name)
                raise ValueError(f"{field.name}={value!r} is not a bool; pass {field.name}=True or False.")
        for name, (low, meaning) in _INT_MINIMUMS.items():
            _require_int(name, getattr(self, name), low, meaning=meaning)
        self._validate_choices()
        self._validate_pipeline()
        self._validate_precision()
        self._validate_sharding()
        if self.tensor_parallel_plan is not None:
            object.__setattr__(self, "tensor_parallel_plan", _normalise_tp_plan(self.tensor_parallel_plan))

    def _validate_choices(self) -> None:
        _require_choice("pipeline", self.pipeline, _PIPELINES)
        _require_choice("optimize", self.optimize, _OPTIMIZE)
        _require_choice("ddp_dist_backend", self.ddp_dist_backend, _DDP_BACKENDS)
        _require_choice("cp_comm_type", self.cp_comm_type, _CP_COMM_TYPES)
        if self.ddp and self.horovod:
            raise ValueError(
                "ddp=True and horovod=True name two data-parallel backends, which smp refused; drop horovod (a "
                "TensorFlow setting): data parallelism runs on torch.distributed either way."
            )
        object.__setattr__(self, "placement_strategy", _normalise_placement(self.placement_strategy))
        weight = _require_float("memory_weight", self.memory_weight, lambda v: 0 <= v <= 1, "in [0, 1]")
        object.__setattr__(self, "memory_weight", weight)
        clip = _require_float("sdp_gradient_clipping", self.sdp_gradient_clipping, lambda v: v > 0, "> 0")
        object.__setattr__(self, "sdp_gradient_clipping", clip)
        if self.ddp_port is not None:
            _require_int("ddp_port", self.ddp_port, 0, 65535, meaning="a TCP port")

    def _validate_pipeline(self) -> None:
        pp = self.pipeline_parallel_degree
        if self.active_microbatches is not None:
            _require_int(
                "active_microbatches",
                self.active_microbatches,
                1,
                self.microbatches,
                meaning=f"at most microbatches={self.microbatches} exist, or leave it None for smp's default",
            )
        if self.default_partition is not None:
            _require_int(
                "default_partition",
                self.default_partition,
                0,
                pp - 1,
                meaning=f"a stage index below pipeline_parallel_degree={pp}",
            )
        if self.partition is not None:
            object.__setattr__(self, "partition", _normalise_partition(self.partition, pp, self.virtual_stages))
        if self.virtual_stages > 1 and self.pipeline == "zero_bubble":
            raise ValueError(
                f"pipeline='zero_bubble' runs ZB-H1 with one trunk chunk per stage; virtual_stages="
                f"{self.virtual_stages} chunks per stage are not supported with it (ZB-V is not implemented). Set "
                "virtual_stages=1 to fill the bubble with weight gradients, or pipeline='interleaved' for Megatron's "
                "interleaved schedule."
            )
        if self.virtual_stages > 1 and (self.pipeline != "interleaved" or self.microbatches % pp):
            raise ValueError(
                f"virtual_stages={self.virtual_stages} runs Megatron's interleaved schedule, which needs "
                f"pipeline='interleaved' (got {self.pipeline!r}) and microbatches a multiple of "
                f"pipeline_parallel_degree={pp} (got {self.microbatches}); change those, or set virtual_stages=1."
            )
        if not self.auto_partition and self.default_partition is None and self.partition is None:
            raise ValueError(
                "auto_partition=False needs default_partition (the stage for trunk children not placed by "
                "smp.partition / smp.set_partition) or partition=(one size per stage); set one of them, or "
                "leave auto_partition=True."
            )
        if self.pipeline_module is not None:
            parts = self.pipeline_module.split(".") if isinstance(self.pipeline_module, str) else []
            if not parts or not all(part.isidentifier() or part.isdigit() for part in parts):
                raise ValueError(
                    f"pipeline_module={self.pipeline_module!r} is invalid; give the dotted attribute path of "
                    "the sequential trunk inside the LightningModule, for example 'model.blocks', or None to "
                    "pick the sequential container with the most parameters."
                )

    def _validate_precision(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("bf16 needs fp16 off: pick one of fp16=True or bf16=True")
        if self.bf16 and self.fp16_params:
            raise ValueError("bf16 needs fp16_params off: fp16_params=True asks for fp16 parameters.")
        if self.fp16_params:
            object.__setattr__(self, "fp16", True)
        scale = _require_float("static_loss_scale", self.static_loss_scale, lambda v: v > 0, "> 0")
        object.__setattr__(self, "static_loss_scale", scale)
        if self.dynamic_loss_scale and scale != 1.0:
            raise ValueError(
                f"static_loss_scale={scale} is ignored while dynamic_loss_scale=True (lightning_smp's "
                "default); set dynamic_loss_scale=False to train with a fixed scale, or start the dynamic "
                f"scaler there with dynamic_loss_args={{'init_scale': {scale}}}."
            )
        if self.dynamic_loss_args is not None:
            args = _normalise_loss_args(self.dynamic_loss_args)
            if not self.dynamic_loss_scale:
                raise ValueError(
                    f"dynamic_loss_args={dict(args)!r} has no effect with dynamic_loss_scale=False; set "
                    "dynamic_loss_scale=True or drop dynamic_loss_args."
                )
            object.__setattr__(self, "dynamic_loss_args", args)

    def _validate_sharding(self) -> None:
        sdp = self.sharded_data_parallel_degree
        if sdp > 1 and self.pipeline_parallel_degree > 1:
            raise ValueError(
                f"sharded_data_parallel_degree={sdp} cannot be combined with pipeline_parallel_degree="
                f"{self.pipeline_parallel_degree} (nor could it in smp); set pipeline_parallel_degree=1, or "
                "sharded_data_parallel_degree=1 and shard_optimizer_state=True to shard the optimizer state."
            )
        if sdp > 1 and self.shard_optimizer_state:
            raise ValueError(
                f"sharded_data_parallel_degree={sdp} already shards the optimizer state (with the parameters and "
                "gradients); set shard_optimizer_state=False, as smp required."
            )

    def __reduce__(self) -> tuple[Callable[[dict[str, Any]], SMPConfig], tuple[dict[str, Any]]]:
        # A mappingproxy cannot be pickled or deep-copied; rebuild from plain values so that spawn launchers
        # and copy.deepcopy still work.
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        if self.dynamic_loss_args is not None:
            values["dynamic_loss_args"] = dict(self.dynamic_loss_args)
        if self.tensor_parallel_plan is not None:
            values["tensor_parallel_plan"] = dict(self.tensor_parallel_plan)
        return _rebuild, (values,)

    # --- derived values ----------------------------------------------------------------------------------
    @property
    def model_parallel_degree(self) -> int:
        """Ranks holding one model replica: pipeline_parallel_degree * tensor_parallel_degree."""
        return self.pipeline_parallel_degree * self.tensor_parallel_degree

    @property
    def replica_parallel_degree(self) -> int:
        """Ranks that are not data-parallel replicas of each other's data: pipeline × tensor × context parallel."""
        return self.model_parallel_degree * self.context_parallel_degree

    @property
    def resolved_active_microbatches(self) -> int:
        """``active_microbatches``, or smp's default min(pipeline_parallel_degree + 2, microbatches)."""
        if self.active_microbatches is not None:
            return self.active_microbatches
        return min(self.pipeline_parallel_degree + 2, self.microbatches)

    @property
    def placement_order(self) -> str:
        """``placement_strategy`` as letters of D/P/T (and C when given), slowest-varying first ("cluster" -> "DPT");
        `topology.placement_letters` places C when it is absent."""
        return _NAMED_PLACEMENTS.get(self.placement_strategy, self.placement_strategy)

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The 16-bit parameter dtype, or None when training in fp32."""
        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return None

    def data_parallel_degree(self, world_size: int) -> int:
        """Number of model replicas in a job of ``world_size`` ranks; raises when the degrees do not fit."""
        _require_int("world_size", world_size, 1, meaning="the number of processes in the job")
        pp, tp, mp = self.pipeline_parallel_degree, self.tensor_parallel_degree, self.model_parallel_degree
        cp = self.context_parallel_degree
        if cp > 1 and world_size % (mp * cp):
            fitting = max(d for d in range(1, cp + 1) if world_size % (mp * d) == 0) if world_size % mp == 0 else 1
            raise ValueError(
                f"pipeline_parallel_degree={pp} × tensor_parallel_degree={tp} × context_parallel_degree={cp} = "
                f"{mp * cp} does not divide the world size {world_size}; pick degrees whose product divides "
                f"{world_size} (for example context_parallel_degree={fitting})."
            )
        if world_size % mp:
            good_pp, good_tp = _fitting_degrees(world_size, pp, tp)
            raise ValueError(
                f"pipeline_parallel_degree={pp} × tensor_parallel_degree={tp} = {mp} does not divide "
                f"the world size {world_size}; pick degrees whose product divides {world_size} (for example "
                f"pipeline_parallel_degree={good_pp}, tensor_parallel_degree={good_tp} → data parallel "
                f"degree {world_size // (good_pp * good_tp)})"
            )
        dp = world_size // (mp * cp)
        sdp = self.sharded_data_parallel_degree
        if (dp * cp) % sdp:
            fitting = max(d for d in range(1, min(sdp, dp * cp) + 1) if (dp * cp) % d == 0)
            context = f" × context_parallel_degree={cp}" if cp > 1 else ""
            raise ValueError(
                f"sharded_data_parallel_degree={sdp} does not divide the data-parallel degree {dp * cp} (world size "
                f"{world_size} / (pipeline_parallel_degree={pp} × tensor_parallel_degree={tp}){context}); pick a "
                f"divisor of {dp * cp}, for example sharded_data_parallel_degree={fitting}."
            )
        return dp

    def deprecated_settings(self) -> list[str]:
        """One line per deprecated smp parameter that is set, naming the one that replaces it."""
        return [
            f"{name}=True is deprecated in smp in favour of {new}; lightning_smp reads it as {new}=True: set "
            f"{new}=True instead."
            for name, new in _DEPRECATED.items()
            if getattr(self, name)
        ]

    def inactive_settings(self) -> list[str]:
        """One line per setting changed from its default that lightning_smp accepts but ignores for now."""
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        return [
            f"{name}={getattr(self, name)!r} has no effect in lightning_smp yet: {reason}"
            for name, reason in _INACTIVE_SETTINGS.items()
            if getattr(self, name) != defaults[name]
        ]

    def as_smp_parameters(self) -> dict[str, Any]:
        """The smp parameters only, as ``smp.state.cfg`` shows them (active_microbatches resolved)."""
        params = {
            field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name not in _OWN_FIELDS
        }
        params["active_microbatches"] = self.resolved_active_microbatches
        return params

    # --- constructors ------------------------------------------------------------------------------------
    @classmethod
    def from_smp_options(cls, options: Mapping[str, Any], **overrides: Any) -> SMPConfig:
        """Build from SageMaker's ``smp_options`` as pasted (``{"enabled": True, "parameters": {...}}``) or
        from its inner parameters dict; ``overrides`` are further field values and win over the dict."""
        sources = _sources.smp_parameters(
            options, source="smp_options", smp_names=_SMP_NAMES, own_names=_OWN_FIELDS - _SMP_V2_NAMES
        )
        sources.fields.update(_sources.canonical(overrides, source="keyword arguments", accepted=_FIELD_NAMES))
        return cls._from(sources)

    @classmethod
    def of(cls, config: SMPConfig | Mapping[str, Any] | None) -> SMPConfig:
        """``config`` as an `SMPConfig`: itself, the defaults for None, or built from a mapping of `SMPStrategy`
        keyword arguments (``smp_options``, SageMaker's dict, among them) as `from_sources` builds it. What the
        memory planner and ``smp.preview`` take, so that they read a config as the strategy does."""
        if config is None:
            return cls()
        if isinstance(config, SMPConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(
                f"config={type(config).__name__} is neither an SMPConfig nor a mapping of SMPStrategy keyword "
                "arguments; pass e.g. config={'pipeline_parallel_degree': 2, 'fp16': True}."
            )
        kwargs = dict(config)
        smp_options = kwargs.pop("smp_options", None)
        return cls.from_sources(kwargs, smp_options=smp_options)

    @classmethod
    def from_sources(
        cls,
        kwargs: Mapping[str, Any],
        *,
        smp_options: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> SMPConfig:
        """Merge defaults < ``smp_options`` < ``kwargs`` < ``SM_HP_MP_PARAMETERS`` (as smp.init does).

        ``kwargs`` are the keyword arguments the caller gave (a value equal to the default too): each wins over
        ``smp_options``, with a warning when it changes a value there. The environment variable, set by a
        SageMaker job, overrides both, with a warning for each value it changes.
        """
        return cls._from(
            _sources.merge_sources(
                kwargs, smp_options=smp_options, environ=environ, smp_names=_SMP_NAMES, all_names=_FIELD_NAMES
            )
        )

    @classmethod
    def _from(cls, sources: _sources.Sources) -> SMPConfig:
        config = cls(**sources.fields)
        sources.warn_and_check(config)
        return config


_FIELD_NAMES = frozenset(field.name for field in dataclasses.fields(SMPConfig))
_SMP_NAMES = (_FIELD_NAMES - _OWN_FIELDS) | _SMP_V2_NAMES


def _rebuild(values: dict[str, Any]) -> SMPConfig:
    return SMPConfig(**values)


def _require_int(name: str, value: object, low: int, high: int | None = None, *, meaning: str) -> None:
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value!r} is invalid; set it to an int {bounds} ({meaning}).")


def _require_float(name: str, value: object, ok: Callable[[float], bool], requirement: str) -> float:
    if not _is_number(value) or not ok(value):
        raise ValueError(f"{name}={value!r} is invalid; set it to a number {requirement}.")
    return float(value)


def _require_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid; choose one of {', '.join(map(repr, choices))}.")


def _normalise_placement(value: object) -> str:
    if isinstance(value, str):
        if value.lower() in _NAMED_PLACEMENTS:
            return value.lower()
        if sorted(value.upper()) in (["D", "P", "T"], ["C", "D", "P", "T"]):
            return value.upper()
    raise ValueError(
        f"placement_strategy={value!r} is invalid; use 'cluster' (= 'DPT'), 'spread' (= 'TPD') or another "
        "order of the three letters D, P, T such as 'PDT' (the right-most letter varies fastest over ranks), "
        "optionally with C (context parallel) among them, such as 'DPCT'."
    )


def _normalise_partition(sizes: object, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    if (
        isinstance(sizes, str | bytes)
        or not isinstance(sizes, Sequence)
        or not sizes
        or not all(_is_int(size) and size >= 1 for size in sizes)
    ):
        raise ValueError(
            f"partition={sizes!r} is invalid; give one int >= 1 per pipeline stage, the number of trunk "
            "children each stage holds, for example partition=(3, 3, 2), or None to balance automatically."
        )
    if virtual_stages > 1 and len(sizes) != pp * virtual_stages:
        raise ValueError(
            f"partition={tuple(sizes)} has {len(sizes)} sizes but pipeline_parallel_degree={pp} x "
            f"virtual_stages={virtual_stages} makes {pp * virtual_stages} chunks; give one size per chunk."
        )
    if virtual_stages == 1 and len(sizes) != pp:
        raise ValueError(
            f"partition={tuple(sizes)} has {len(sizes)} stage sizes but pipeline_parallel_degree={pp}; give "
            f"exactly {pp} sizes, one per stage, or set pipeline_parallel_degree={len(sizes)}."
        )
    return tuple(sizes)


def _normalise_loss_args(args: object) -> types.MappingProxyType[str, Any]:
    if not isinstance(args, Mapping):
        raise ValueError(
            f"dynamic_loss_args={args!r} is invalid; pass a dict such as "
            "{'scale_window': 1000, 'min_scale': 1, 'delayed_shift': 2}."
        )
    for key, value in args.items():
        if key not in _LOSS_ARG_CHECKS:
            raise _sources.unknown_key("dynamic_loss_args key", key, _LOSS_ARG_CHECKS)
        ok, requirement = _LOSS_ARG_CHECKS[key]
        if not ok(value):
            raise ValueError(f"dynamic_loss_args[{key!r}]={value!r} is invalid; set it to {requirement}.")
    return types.MappingProxyType(dict(args))


def _normalise_tp_plan(plan: object) -> types.MappingProxyType[str, str]:
    example = "{'blocks.*.mlp.fc': 'colwise', 'blocks.*.mlp.proj': 'rowwise'}"
    if not isinstance(plan, Mapping):
        raise ValueError(f"tensor_parallel_plan={plan!r} is invalid; pass a dict of module-path patterns: {example}")
    for pattern, style in plan.items():
        parts = pattern.split(".") if isinstance(pattern, str) else [""]
        if any(not part or part.strip() != part or " " in part for part in parts):
            raise ValueError(
                f"tensor_parallel_plan pattern {pattern!r} is invalid; give a dotted module path such as "
                "'blocks.*.mlp.fc' (no empty components or spaces; '*' matches one component)."
            )
        if style not in TENSOR_PARALLEL_STYLES:
            close = difflib.get_close_matches(str(style), TENSOR_PARALLEL_STYLES, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(TENSOR_PARALLEL_STYLES)}."
            raise ValueError(f"tensor_parallel_plan[{pattern!r}]={style!r} is not a style; {hint}")
    return types.MappingProxyType(dict(plan))


def _fitting_degrees(world_size: int, pp: int, tp: int) -> tuple[int, int]:
    """The largest degrees up to ``pp`` and ``tp`` whose product divides ``world_size`` (tp chosen first)."""
    tp = max(d for d in range(1, min(tp, world_size) + 1) if world_size % d == 0)
    pp = max(d for d in range(1, min(pp, world_size) + 1) if world_size % (d * tp) == 0)
    return pp, tp
