"""SageMaker's ways of passing smp parameters, read as smp v1 read them: the ``smp_options`` dict and the
``SM_HP_MP_PARAMETERS`` variable.

Owns the names smp's schema (``smdistributed/modelparallel/backend/config.yaml``) accepts beyond `SMPConfig`'s
fields: the ``partitions`` alias and smp's internal settings (`INTERNAL_SETTINGS`: accepted so that SageMaker
scripts run unchanged, checked as smp checked them, and each one changed from smp's default warns once with what
it did there); the shape of the pasted dict, the JSON of the environment variable, and the precedence of the
sources. It returns plain dicts of field values; `SMPConfig` checks the values, so this module builds no config.
"""

from __future__ import annotations

import difflib
import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

__all__ = [
    "ALIAS",
    "ALIAS_OF",
    "ENV_VAR",
    "INTERNAL_SETTINGS",
    "InternalSetting",
    "Sources",
    "merge_sources",
    "smp_parameters",
    "unknown_key",
]

ENV_VAR = "SM_HP_MP_PARAMETERS"
# smp's schema has exactly one alias (config.yaml: pipeline_parallel_degree.alias = partitions).
ALIAS, ALIAS_OF = "partitions", "pipeline_parallel_degree"


@dataclass(frozen=True, slots=True)
class InternalSetting:
    """An smp parameter that is not an `SMPConfig` field: smp's schema marks it internal (or TensorFlow-only)."""

    default: Any
    """smp's default; another value warns once."""
    kind: str
    """What a value must be: "bool", "int >= 1" or "str or None" (as smp's schema typed it)."""
    did: str
    """What it did on SageMaker."""
    why: str
    """Why it changes nothing in lightning_smp."""


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "int >= 1": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "str or None": lambda v: v is None or isinstance(v, str),
}

INTERNAL_SETTINGS: dict[str, InternalSetting] = {
    "fast_mode": InternalSetting(
        False,
        "bool",
        "sent tensors straight between pipelined child modules when a step's execution repeated the last one's",
        "each pipeline stage sends its output straight to the next stage in every step",
    ),
    "static_mode": InternalSetting(
        False,
        "bool",
        "skipped the pipeline execution server's requests and responses when a step repeated the last one",
        "every rank runs a fixed schedule planned once; there are no requests to skip",
    ),
    "task_level_activation_loading_horizon": InternalSetting(
        4,
        "int >= 1",
        "set how many pipeline server tasks ahead offloaded activations were queued for loading",
        "there are no server tasks; activation_loading_horizon alone sets how far ahead inputs are loaded back",
    ),
    "_shard_offloaded_activations": InternalSetting(
        True,
        "bool",
        "with offload_activations, let only tp_rank 0 offload the inputs its tensor-parallel group shares, and "
        "broadcast them after loading",
        "each rank offloads its own checkpointed inputs",
    ),
    "_match_weights": InternalSetting(
        False,
        "bool",
        "copied the original module's weights into smp's DistributedTransformer (for debugging)",
        "split layers always start from the whole layer's weights, each rank keeping its slice",
    ),
    "_fp32_grad_accumulation": InternalSetting(
        False,
        "bool",
        "accumulated the microbatches' fp16 gradients in fp32 buffers",
        "gradients accumulate in the parameters' dtype and are unscaled into the fp32 master gradients once per "
        "step, as smp's default did",
    ),
    "checkpoint_attentions": InternalSetting(
        False,
        "bool",
        "recomputed the attention scores inside smp's DistributedTransformer in the backward pass",
        "smp's DistributedTransformer is not reproduced; checkpoint whole layers with "
        "smp.set_activation_checkpointing instead",
    ),
    "herring": InternalSetting(
        False,
        "bool",
        "chose the herring data-parallel backend (never functional)",
        "data parallelism runs on torch.distributed",
    ),
    "_sharded_data_parallelism_config": InternalSetting(
        None,
        "str or None",
        "named a DeepSpeed ZeRO-2D JSON config overriding sharded data parallelism's settings",
        "PyTorch's FSDP2 runs sharded data parallelism, set by sharded_data_parallel_degree and the sdp_* settings",
    ),
    "load_partition": InternalSetting(
        False, "bool", "saved and loaded model partitions (TensorFlow only)", "it is a TensorFlow-only smp setting"
    ),
    "partition_file": InternalSetting(
        None,
        "str or None",
        "named the file of saved model partitions (TensorFlow only)",
        "it is a TensorFlow-only smp setting",
    ),
}
"""smp v1's schema keys that are not `SMPConfig` fields, by name."""

# smp's requirements on internal settings (config.yaml ``requires`` / ``requires_either``), checked against the
# config built from the other sources: name -> (field values it needs, how many of them must hold).
_INTERNAL_REQUIREMENTS: dict[str, tuple[dict[str, Any], str]] = {
    "herring": ({"ddp": False, "horovod": False}, "all"),
    "_fp32_grad_accumulation": ({"fp16": True, "fp16_params": True}, "any"),
}

# A value of a field that smp's schema accepts but lightning_smp runs as another: (field, value) -> (runs as, why).
_INTERNAL_VALUES: dict[tuple[str, Any], tuple[Any, str]] = {
    ("pipeline", "_only_forward"): (
        "interleaved",
        "smp's internal forward-only schedule (inference): evaluation steps here always run forward only, and "
        "training runs pipeline='interleaved'",
    ),
}


@dataclass(frozen=True, slots=True)
class Sources:
    """What the sources say: `SMPConfig` field values, and smp's internal settings given (by name)."""

    fields: dict[str, Any]
    internal: dict[str, Any]

    def warn_and_check(self, config: Any) -> None:
        """Check the internal settings' requirements against ``config`` (the `SMPConfig` built from ``fields``)
        and warn once for each one that is not smp's default."""
        for name, value in self.internal.items():
            if (name, value) in _INTERNAL_VALUES:
                runs_as, why = _INTERNAL_VALUES[name, value]
                rank_zero_warn(f"{name}={value!r} runs as {name}={runs_as!r} in lightning_smp: {why}.")
                continue
            setting = INTERNAL_SETTINGS[name]
            if value == setting.default:
                continue
            needs, how = _INTERNAL_REQUIREMENTS.get(name, ({}, "all"))
            held = [getattr(config, field) == wanted for field, wanted in needs.items()]
            if needs and not (all(held) if how == "all" else any(held)):
                wanted = (" and " if how == "all" else " or ").join(f"{k}={v!r}" for k, v in needs.items())
                raise ValueError(
                    f"{name}={value!r} needs {wanted}, as smp required; set those, or leave {name} out (it has no "
                    f"effect in lightning_smp: {setting.why})."
                )
            rank_zero_warn(
                f"{name}={value!r} has no effect in lightning_smp: on SageMaker it {setting.did}; {setting.why}."
            )


def unknown_key(kind: str, key: object, accepted: Iterable[str]) -> ValueError:
    """The error for an unknown name, suggesting the nearest accepted one (or listing them all)."""
    accepted = sorted(accepted)
    close = difflib.get_close_matches(str(key), accepted, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"accepted names: {', '.join(accepted)}."
    return ValueError(f"unknown {kind} {key!r}; {hint}")


def smp_parameters(
    options: Mapping[str, Any], *, source: str, smp_names: frozenset[str], own_names: frozenset[str]
) -> Sources:
    """The smp parameters in ``options``, given whole (``{"enabled": ..., "parameters": ...}``) or inner.

    ``smp_names`` are the `SMPConfig` fields that are smp parameters, ``own_names`` lightning_smp's own settings
    (refused here, with the way to pass them)."""
    if not isinstance(options, Mapping):
        raise ValueError(
            f"{source}={options!r} is invalid; pass a dict, either SageMaker's "
            "{'enabled': True, 'parameters': {...}} or just its parameters."
        )
    if "enabled" in options or "parameters" in options:
        extra = sorted(map(repr, set(options) - {"enabled", "parameters"}))
        if extra:
            raise ValueError(
                f"{source} has 'enabled'/'parameters' and also {', '.join(extra)}; smp parameters belong "
                "inside 'parameters'."
            )
        enabled = options.get("enabled", True)
        if enabled is False:
            raise ValueError(
                f"model parallelism is disabled in this {source} dict ('enabled': False); set "
                "'enabled': True, or pass just its 'parameters', to use it with lightning_smp."
            )
        if enabled is not True:
            raise ValueError(f"{source}['enabled']={enabled!r} is not a bool; set 'enabled': True.")
        options = options.get("parameters", {})
        if not isinstance(options, Mapping):
            raise ValueError(f"{source}['parameters']={options!r} is invalid; make it a dict of parameters.")
    return _smp_source(options, source=source, smp_names=smp_names, own_names=own_names)


def _smp_source(
    params: Mapping[str, Any], *, source: str, smp_names: frozenset[str], own_names: frozenset[str]
) -> Sources:
    """An smp source's parameters: internal settings checked and set apart, the rest as field values."""
    fields, internal = dict(params), {}
    for name in [key for key in fields if key in INTERNAL_SETTINGS]:
        value, setting = fields.pop(name), INTERNAL_SETTINGS[name]
        if not _CHECKS[setting.kind](value):
            raise ValueError(
                f"{name}={value!r} in {source} is invalid; smp takes {setting.kind}: set it to one, or leave it out "
                f"(smp's default {setting.default!r})."
            )
        internal[name] = value
    for (name, value), (runs_as, _) in _INTERNAL_VALUES.items():
        if fields.get(name) == value:
            fields[name], internal[name] = runs_as, value
    return Sources(canonical(fields, source=source, accepted=smp_names, own_names=own_names), internal)


def canonical(
    params: Mapping[str, Any], *, source: str, accepted: frozenset[str], own_names: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``params`` with the ``partitions`` alias resolved and every key checked against ``accepted``; a key in
    ``own_names`` (lightning_smp's settings, when only smp parameters are accepted) gets its own message, and
    so does an internal smp setting outside smp's sources (it belongs in ``smp_options``)."""
    params = dict(params)
    internal = [key for key in params if key in INTERNAL_SETTINGS]
    if internal:
        raise ValueError(
            f"{internal[0]!r} in {source} is an internal smp parameter; pass it in smp_options (or "
            f"{ENV_VAR}), where lightning_smp accepts it so that SageMaker configs run unchanged."
        )
    if ALIAS in params:
        value = params.pop(ALIAS)
        if ALIAS_OF in params and params[ALIAS_OF] != value:
            raise ValueError(
                f"{source} gives both {ALIAS}={value!r} and {ALIAS_OF}={params[ALIAS_OF]!r}; "
                f"'{ALIAS}' is smp's old name for '{ALIAS_OF}', keep only one of them."
            )
        params[ALIAS_OF] = value
    for key in params:
        if key in own_names:
            close = difflib.get_close_matches(key, [*accepted, ALIAS], n=1)
            meant = f" (or did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{key!r} in {source} is a lightning_smp setting, not an smp parameter; pass it to "
                f"SMPStrategy as a keyword argument instead{meant}."
            )
        if key not in accepted:
            kind = "smp parameter" if own_names else "lightning_smp setting"
            raise unknown_key(kind, key, [*accepted, ALIAS])
    return params


def environ_parameters(environ: Mapping[str, str], *, smp_names: frozenset[str], own_names: frozenset[str]) -> Sources:
    """The smp parameters SageMaker put in ``SM_HP_MP_PARAMETERS`` (a JSON object), or none."""
    raw = environ.get(ENV_VAR)
    if raw is None:
        return Sources({}, {})
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not valid JSON ({err}); SageMaker sets it to a JSON object of smp "
            "parameters such as '{\"microbatches\": 4}'; fix or unset it."
        ) from err
    if not isinstance(params, dict):
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not a JSON object; it must map smp parameter names to values, "
            "such as '{\"microbatches\": 4}'."
        )
    return _smp_source(params, source=ENV_VAR, smp_names=smp_names, own_names=own_names)


def merge_sources(
    kwargs: Mapping[str, Any],
    *,
    smp_options: Mapping[str, Any] | None,
    environ: Mapping[str, str],
    smp_names: frozenset[str],
    all_names: frozenset[str],
) -> Sources:
    """What defaults < ``smp_options`` < ``kwargs`` < ``SM_HP_MP_PARAMETERS`` say, later sources winning (smp.init
    let the job's variable win over the script).

    ``kwargs`` are the keyword arguments given explicitly, a value equal to the default included. A keyword that
    changes a value of ``smp_options``, and the variable changing a value given in the script, warn.
    """
    own_names = all_names - smp_names
    explicit = canonical(kwargs, source="keyword arguments", accepted=all_names)
    pasted = (
        Sources({}, {})
        if smp_options is None
        else smp_parameters(smp_options, source="smp_options", smp_names=smp_names, own_names=own_names)
    )
    merged = dict(pasted.fields)
    for name, value in explicit.items():
        if name in merged and merged[name] != value:
            rank_zero_warn(
                f"{name}={value!r} given as a keyword argument overrides {name}={merged[name]!r} in smp_options."
            )
    merged.update(explicit)
    job = environ_parameters(environ, smp_names=smp_names, own_names=own_names)
    for name, value in job.fields.items():
        if name in merged and merged[name] != value:
            warnings.warn(
                f"{ENV_VAR} sets {name}={value!r}, overriding {merged[name]!r} given in the script "
                "(as in smp, the SageMaker job's parameters win).",
                stacklevel=3,
            )
        merged[name] = value
    return Sources(merged, {**pasted.internal, **job.internal})
