"""SageMaker's ways of passing smp parameters, read as smp v1 read them: the ``smp_options`` dict and the
``SM_HP_MP_PARAMETERS`` variable.

Owns the names smp's schema (``smdistributed/modelparallel/backend/config.yaml``) accepts beyond `SMPConfig`'s
fields (the ``partitions`` alias), the shape of the pasted dict, the JSON of the environment variable, and the
precedence of the sources. It returns plain dicts of field values; `SMPConfig` checks the values, so this module
knows no defaults and builds no config.
"""

from __future__ import annotations

import difflib
import json
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ALIAS", "ALIAS_OF", "ENV_VAR", "merge_sources", "smp_parameters", "unknown_key"]

ENV_VAR = "SM_HP_MP_PARAMETERS"
# smp's schema has exactly one alias (config.yaml: pipeline_parallel_degree.alias = partitions).
ALIAS, ALIAS_OF = "partitions", "pipeline_parallel_degree"


def unknown_key(kind: str, key: object, accepted: Iterable[str]) -> ValueError:
    """The error for an unknown name, suggesting the nearest accepted one (or listing them all)."""
    accepted = sorted(accepted)
    close = difflib.get_close_matches(str(key), accepted, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"accepted names: {', '.join(accepted)}."
    return ValueError(f"unknown {kind} {key!r}; {hint}")


def smp_parameters(
    options: Mapping[str, Any], *, source: str, smp_names: frozenset[str], own_names: frozenset[str]
) -> dict[str, Any]:
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
    return canonical(options, source=source, accepted=smp_names, own_names=own_names)


def canonical(
    params: Mapping[str, Any], *, source: str, accepted: frozenset[str], own_names: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``params`` with the ``partitions`` alias resolved and every key checked against ``accepted``; a key in
    ``own_names`` (lightning_smp's settings, when only smp parameters are accepted) gets its own message."""
    params = dict(params)
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


def environ_parameters(
    environ: Mapping[str, str], *, smp_names: frozenset[str], own_names: frozenset[str]
) -> dict[str, Any]:
    """The smp parameters SageMaker put in ``SM_HP_MP_PARAMETERS`` (a JSON object), or none."""
    raw = environ.get(ENV_VAR)
    if raw is None:
        return {}
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
    return canonical(params, source=ENV_VAR, accepted=smp_names, own_names=own_names)


def merge_sources(
    kwargs: Mapping[str, Any],
    *,
    smp_options: Mapping[str, Any] | None,
    environ: Mapping[str, str],
    smp_names: frozenset[str],
    all_names: frozenset[str],
) -> dict[str, Any]:
    """Field values from defaults < ``smp_options`` < ``kwargs`` < ``SM_HP_MP_PARAMETERS`` (as smp.init did).

    A key given in both ``smp_options`` and ``kwargs`` must agree. The environment variable, set by a SageMaker
    job, overrides both, with a warning for each value it changes.
    """
    own_names = all_names - smp_names
    explicit = canonical(kwargs, source="keyword arguments", accepted=all_names)
    merged = (
        {}
        if smp_options is None
        else smp_parameters(smp_options, source="smp_options", smp_names=smp_names, own_names=own_names)
    )
    for name, value in explicit.items():
        if name in merged and merged[name] != value:
            raise ValueError(
                f"{name} is given twice with different values: {merged[name]!r} in smp_options and "
                f"{value!r} as a keyword argument; keep only one of them."
            )
    merged.update(explicit)
    for name, value in environ_parameters(environ, smp_names=smp_names, own_names=own_names).items():
        if name in merged and merged[name] != value:
            warnings.warn(
                f"{ENV_VAR} sets {name}={value!r}, overriding {merged[name]!r} given in the script "
                "(as in smp, the SageMaker job's parameters win).",
                stacklevel=3,
            )
        merged[name] = value
    return merged
