"""Tier 1 (pure) tests of SMPConfig: smp's defaults, validation messages, SageMaker entry points."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import pickle
import re
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_smp import config as config_module
from lightning_smp.config import _INACTIVE_SETTINGS, _OWN_FIELDS, SMP_REQUIREMENTS_NOT_ENFORCED, SMPConfig
from lightning_smp.smp_options import INTERNAL_SETTINGS

# smdistributed-modelparallel 1.12/1.13 defaults (config.yaml schema; ddp_dist_backend "auto" since 1.13).
SMP_DEFAULTS = {
    "pipeline_parallel_degree": 1,
    "tensor_parallel_degree": 1,
    "microbatches": 1,
    "pipeline": "interleaved",
    "optimize": "speed",
    "placement_strategy": "cluster",
    "auto_partition": True,
    "default_partition": None,
    "memory_weight": 0.8,
    "active_microbatches": 1,  # min(pp + 2, microbatches), as smp.state.cfg shows it
    "ddp": False,
    "ddp_port": None,
    "ddp_dist_backend": "auto",
    "horovod": False,
    "contiguous": True,
    "deterministic_server": False,
    "offload_activations": False,
    "activation_loading_horizon": 4,
    "fp16": False,
    "bf16": False,
    "fp16_params": False,
    "shard_optimizer_state": False,
    "sharded_data_parallel_degree": 1,
    "sdp_reduce_bucket_size": 500_000_000,
    "sdp_param_persistence_threshold": 1_000_000,
    "sdp_max_live_parameters": 1_000_000_000,
    "sdp_hierarchical_allgather": True,
    "sdp_gradient_clipping": 1.0,
    "prescaled_batch": False,
    "delayed_parameter_initialization": False,
    "skip_tracing": False,
    "tensor_parallel_seed": 0,
}


# --- defaults -------------------------------------------------------------------------------------------


def test_smp_parameters_default_to_smps_values():
    params = SMPConfig().as_smp_parameters()
    assert params == SMP_DEFAULTS
    assert type(params) is dict


def test_own_settings_defaults():
    cfg = SMPConfig()
    assert (cfg.static_loss_scale, cfg.dynamic_loss_scale, cfg.dynamic_loss_args) == (1.0, True, None)
    assert (cfg.pipeline_module, cfg.partition) == (None, None)
    assert set(SMPConfig().as_smp_parameters()).isdisjoint(_OWN_FIELDS)


def test_every_field_has_a_docstring():
    source = inspect.getsource(config_module)
    for field in dataclasses.fields(SMPConfig):
        assert re.search(rf"\n    {field.name}: [^\n]+\n    \"\"\"", source), field.name


def test_config_is_frozen():
    cfg = SMPConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.microbatches = 4


# --- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline_parallel_degree": 0}, r"pipeline_parallel_degree=0 is invalid; set it to an int >= 1"),
        ({"tensor_parallel_degree": 2.0}, r"tensor_parallel_degree=2\.0 is invalid; set it to an int >= 1"),
        ({"microbatches": True}, r"microbatches=True is invalid; set it to an int >= 1"),
        ({"microbatches": 0}, r"microbatches=0 is invalid.*1 means no pipelining"),
        ({"activation_loading_horizon": -1}, r"activation_loading_horizon=-1 is invalid; .* >= 0"),
        ({"sharded_data_parallel_degree": 0}, r"sharded_data_parallel_degree=0 is invalid"),
        ({"tensor_parallel_seed": -3}, r"tensor_parallel_seed=-3 is invalid"),
        (
            {"sdp_reduce_bucket_size": 5e8},
            r"sdp_reduce_bucket_size=500000000\.0 is invalid; set it to an int",
        ),
        ({"ddp": "yes"}, r"ddp='yes' is not a bool; pass ddp=True or False"),
        ({"fp16": 1}, r"fp16=1 is not a bool"),
        ({"pipeline": "1f1b"}, r"pipeline='1f1b' is invalid; choose one of 'interleaved', 'simple'"),
        ({"optimize": "fast"}, r"optimize='fast' is invalid; choose one of 'speed', 'memory'"),
        ({"ddp_dist_backend": "gloo"}, r"ddp_dist_backend='gloo' is invalid; choose one of 'auto', 'nccl'"),
        ({"placement_strategy": "DPP"}, r"placement_strategy='DPP' is invalid; use 'cluster' \(= 'DPT'\)"),
        ({"placement_strategy": "ring"}, r"placement_strategy='ring' is invalid"),
        ({"memory_weight": 1.5}, r"memory_weight=1\.5 is invalid; set it to a number in \[0, 1\]"),
        ({"memory_weight": float("nan")}, r"memory_weight=nan is invalid"),
        ({"sdp_gradient_clipping": 0.0}, r"sdp_gradient_clipping=0\.0 is invalid; set it to a number > 0"),
        ({"ddp_port": 70000}, r"ddp_port=70000 is invalid; set it to an int in \[0, 65535\]"),
        (
            {"microbatches": 4, "active_microbatches": 6},
            r"active_microbatches=6 is invalid; set it to an int in \[1, 4\] \(at most microbatches=4",
        ),
        ({"active_microbatches": 0}, r"active_microbatches=0 is invalid"),
        (
            {"pipeline_parallel_degree": 2, "default_partition": 2},
            r"default_partition=2 is invalid; set it to an int in \[0, 1\] .*pipeline_parallel_degree=2",
        ),
        ({"default_partition": -1}, r"default_partition=-1 is invalid"),
        ({"auto_partition": False}, r"auto_partition=False needs default_partition .* or partition="),
        ({"fp16": True, "bf16": True}, r"^bf16 needs fp16 off: pick one of fp16=True or bf16=True$"),
        ({"fp16_params": True, "bf16": True}, r"bf16 needs fp16_params off"),
        ({"static_loss_scale": 0, "dynamic_loss_scale": False}, r"static_loss_scale=0 is invalid; .* > 0"),
        (
            {"static_loss_scale": 128},
            r"static_loss_scale=128\.0 is ignored while dynamic_loss_scale=True.*"
            r"dynamic_loss_scale=False.*dynamic_loss_args=\{'init_scale': 128\.0\}",
        ),
        (
            {"dynamic_loss_scale": False, "dynamic_loss_args": {"scale_window": 10}},
            r"dynamic_loss_args=\{'scale_window': 10\} has no effect with dynamic_loss_scale=False",
        ),
        (
            {"pipeline_module": "model..blocks"},
            r"pipeline_module='model\.\.blocks' is invalid; .*'model\.blocks'",
        ),
        ({"pipeline_module": ""}, r"pipeline_module='' is invalid"),
        ({"pipeline_module": 3}, r"pipeline_module=3 is invalid"),
        ({"partition": "22"}, r"partition='22' is invalid; give one int >= 1 per pipeline stage"),
        ({"partition": [2, 0]}, r"partition=\[2, 0\] is invalid"),
        ({"partition": []}, r"partition=\[\] is invalid"),
        (
            {"pipeline_parallel_degree": 2, "partition": [1, 2, 3]},
            r"partition=\(1, 2, 3\) has 3 stage sizes but pipeline_parallel_degree=2; give exactly 2 sizes.*"
            r"or set pipeline_parallel_degree=3",
        ),
    ],
)
def test_invalid_values_raise_with_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig(**kwargs)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            {"scale_windows": 10},
            r"unknown dynamic_loss_args key 'scale_windows'; did you mean 'scale_window'\?",
        ),
        ({"init_scale": 0}, r"dynamic_loss_args\['init_scale'\]=0 is invalid; set it to a number > 0"),
        ({"scale_factor": 1}, r"dynamic_loss_args\['scale_factor'\]=1 is invalid; set it to a number > 1"),
        (
            {"scale_window": 1.5},
            r"dynamic_loss_args\['scale_window'\]=1\.5 is invalid; set it to an int >= 1",
        ),
        ({"min_scale": -1}, r"dynamic_loss_args\['min_scale'\]=-1 is invalid"),
        ({"delayed_shift": 0}, r"dynamic_loss_args\['delayed_shift'\]=0 is invalid"),
        (
            {"consecutive_hysteresis": 1},
            r"dynamic_loss_args\['consecutive_hysteresis'\]=1 is invalid; .*True",
        ),
        ([("scale_window", 10)], r"dynamic_loss_args=\[\('scale_window', 10\)\] is invalid; pass a dict"),
    ],
)
def test_invalid_dynamic_loss_args(args, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig(fp16=True, dynamic_loss_args=args)


def test_dynamic_loss_args_are_a_read_only_copy():
    args = {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2}
    cfg = SMPConfig(fp16=True, dynamic_loss_args=args)
    args["min_scale"] = 4
    assert dict(cfg.dynamic_loss_args) == {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2}
    with pytest.raises(TypeError):
        cfg.dynamic_loss_args["min_scale"] = 4


def test_all_documented_dynamic_loss_args_are_accepted():
    args = {
        "init_scale": 2**32,
        "scale_factor": 2.0,
        "scale_window": 1000,
        "min_scale": 1,
        "delayed_shift": 1,
        "consecutive_hysteresis": False,
    }
    assert dict(SMPConfig(dynamic_loss_args=args).dynamic_loss_args) == args


def test_static_loss_scale_with_dynamic_off_is_kept_as_float():
    cfg = SMPConfig(fp16=True, dynamic_loss_scale=False, static_loss_scale=128)
    assert cfg.static_loss_scale == 128.0
    assert type(cfg.static_loss_scale) is float


def test_partition_list_becomes_a_tuple():
    cfg = SMPConfig(pipeline_parallel_degree=3, partition=[3, 3, 2], auto_partition=False)
    assert cfg.partition == (3, 3, 2)


def test_manual_partitioning_accepts_default_partition():
    assert SMPConfig(pipeline_parallel_degree=2, auto_partition=False, default_partition=1).default_partition == 1


def test_pipeline_module_accepts_numbered_children():
    assert SMPConfig(pipeline_module="model.encoders.0.blocks").pipeline_module == "model.encoders.0.blocks"


def test_memory_weight_int_bounds_are_accepted_as_float():
    assert SMPConfig(memory_weight=1).memory_weight == 1.0
    assert type(SMPConfig(memory_weight=0).memory_weight) is float


# --- derived values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "stored", "order"),
    [
        ("cluster", "cluster", "DPT"),
        ("spread", "spread", "TPD"),
        ("Spread", "spread", "TPD"),
        ("tdp", "TDP", "TDP"),
        ("PDT", "PDT", "PDT"),
    ],
)
def test_placement_strategy_is_normalised(given, stored, order):
    cfg = SMPConfig(placement_strategy=given)
    assert (cfg.placement_strategy, cfg.placement_order) == (stored, order)


def test_model_parallel_degree_and_half_dtype():
    cfg = SMPConfig(pipeline_parallel_degree=2, tensor_parallel_degree=4, fp16=True)
    assert cfg.model_parallel_degree == 8
    assert cfg.half_dtype is torch.float16
    assert SMPConfig(bf16=True).half_dtype is torch.bfloat16
    assert SMPConfig().half_dtype is None


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"pipeline_parallel_degree": 2, "microbatches": 8}, 4),  # pp + 2
        ({"pipeline_parallel_degree": 4, "microbatches": 2}, 2),  # capped at microbatches, as smp does
        ({"pipeline_parallel_degree": 2, "microbatches": 8, "active_microbatches": 3}, 3),
    ],
)
def test_resolved_active_microbatches(kwargs, expected):
    assert SMPConfig(**kwargs).resolved_active_microbatches == expected


def test_data_parallel_degree():
    cfg = SMPConfig(pipeline_parallel_degree=2, tensor_parallel_degree=2)
    assert cfg.data_parallel_degree(8) == 2
    assert cfg.data_parallel_degree(4) == 1


def test_data_parallel_degree_names_the_numbers_and_a_fix():
    cfg = SMPConfig(pipeline_parallel_degree=3, tensor_parallel_degree=2)
    expected = (
        "pipeline_parallel_degree=3 × tensor_parallel_degree=2 = 6 does not divide the world size 8; pick "
        "degrees whose product divides 8 (for example pipeline_parallel_degree=2, tensor_parallel_degree=2 → "
        "data parallel degree 2)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        cfg.data_parallel_degree(8)


@pytest.mark.parametrize("world_size", [0, 2.0, True])
def test_data_parallel_degree_rejects_a_bad_world_size(world_size):
    with pytest.raises(ValueError, match=rf"world_size={world_size!r} is invalid; set it to an int >= 1"):
        SMPConfig().data_parallel_degree(world_size)


@given(pp=st.integers(1, 64), tp=st.integers(1, 64), world_size=st.integers(1, 512))
def test_data_parallel_degree_fits_or_suggests_degrees_that_fit(pp, tp, world_size):
    cfg = SMPConfig(pipeline_parallel_degree=pp, tensor_parallel_degree=tp)
    try:
        dp = cfg.data_parallel_degree(world_size)
    except ValueError as err:
        assert world_size % (pp * tp) != 0
        match = re.search(
            r"pipeline_parallel_degree=(\d+), tensor_parallel_degree=(\d+) → data parallel degree (\d+)",
            str(err),
        )
        good_pp, good_tp, good_dp = map(int, match.groups())
        assert good_pp <= pp and good_tp <= tp
        assert good_pp * good_tp * good_dp == world_size
    else:
        assert dp * pp * tp == world_size


# --- from_smp_options -----------------------------------------------------------------------------------

PASTED = {
    "enabled": True,
    "parameters": {
        "microbatches": 4,
        "placement_strategy": "spread",
        "pipeline": "interleaved",
        "optimize": "speed",
        "partitions": 2,
        "ddp": True,
    },
}


def test_from_smp_options_accepts_the_pasted_dict_and_its_parameters():
    whole = SMPConfig.from_smp_options(PASTED)
    inner = SMPConfig.from_smp_options(PASTED["parameters"])
    assert whole == inner
    assert (whole.pipeline_parallel_degree, whole.microbatches, whole.placement_order) == (2, 4, "TPD")


def test_from_smp_options_without_enabled_key_is_accepted():
    assert SMPConfig.from_smp_options({"parameters": {"microbatches": 2}}).microbatches == 2


def test_partitions_is_an_alias_of_pipeline_parallel_degree():
    cfg = SMPConfig.from_smp_options({"partitions": 4, "pipeline_parallel_degree": 4})
    assert cfg.pipeline_parallel_degree == 4
    assert "partitions" not in cfg.as_smp_parameters()


def test_partitions_and_pipeline_parallel_degree_must_agree():
    with pytest.raises(ValueError, match=r"gives both partitions=2 and pipeline_parallel_degree=4; .*keep only one"):
        SMPConfig.from_smp_options({"partitions": 2, "pipeline_parallel_degree": 4})


def test_enabled_false_is_rejected():
    with pytest.raises(
        ValueError, match=r"model parallelism is disabled in this smp_options dict \('enabled': False\)"
    ):
        SMPConfig.from_smp_options({"enabled": False, "parameters": {"partitions": 2}})


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"enabled": "true", "parameters": {}}, r"smp_options\['enabled'\]='true' is not a bool"),
        ({"enabled": True, "parameters": [1]}, r"smp_options\['parameters'\]=\[1\] is invalid"),
        ({"enabled": True, "microbatches": 2}, r"has 'enabled'/'parameters' and also 'microbatches'"),
        ([("microbatches", 2)], r"smp_options=\[\('microbatches', 2\)\] is invalid; pass a dict"),
    ],
)
def test_malformed_smp_options(options, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig.from_smp_options(options)


def test_unknown_smp_parameter_suggests_the_nearest_name():
    with pytest.raises(ValueError, match=r"^unknown smp parameter 'microbatch'; did you mean 'microbatches'\?$"):
        SMPConfig.from_smp_options({"enabled": True, "parameters": {"microbatch": 4}})
    with pytest.raises(ValueError, match=r"'partition' in smp_options is a lightning_smp setting.*'partitions'\?"):
        SMPConfig.from_smp_options({"partition": 2})


def test_unknown_name_without_a_near_match_lists_the_accepted_names():
    with pytest.raises(ValueError, match=r"unknown smp parameter 'zzz'; accepted names: .*microbatches"):
        SMPConfig.from_smp_options({"zzz": 1})


def test_lightning_smp_settings_are_not_smp_parameters():
    with pytest.raises(ValueError, match=r"'pipeline_module' in smp_options is a lightning_smp setting"):
        SMPConfig.from_smp_options({"pipeline_module": "model.blocks"})


def test_from_smp_options_overrides_win_and_are_validated():
    cfg = SMPConfig.from_smp_options(PASTED, microbatches=8, fp16=True, pipeline_module="model.blocks")
    assert (cfg.microbatches, cfg.fp16, cfg.pipeline_module) == (8, True, "model.blocks")
    with pytest.raises(ValueError, match=r"unknown lightning_smp setting 'fp61'; did you mean 'fp16'\?"):
        SMPConfig.from_smp_options(PASTED, fp61=True)
    with pytest.raises(ValueError, match=r"microbatches=0 is invalid"):
        SMPConfig.from_smp_options(PASTED, microbatches=0)


# --- from_sources ---------------------------------------------------------------------------------------


def test_from_sources_merges_defaults_options_and_kwargs():
    cfg = SMPConfig.from_sources({"fp16": True, "microbatches": 4}, smp_options=PASTED, environ={})
    assert (cfg.pipeline_parallel_degree, cfg.microbatches, cfg.fp16, cfg.tensor_parallel_degree) == (
        2,
        4,
        True,
        1,
    )


def test_a_keyword_wins_over_smp_options_with_a_warning_even_at_its_default():
    with pytest.warns(UserWarning, match=r"microbatches=8 given as a keyword argument overrides microbatches=4 in "):
        assert SMPConfig.from_sources({"microbatches": 8}, smp_options=PASTED, environ={}).microbatches == 8
    with pytest.warns(UserWarning, match=r"microbatches=1 given as a keyword argument overrides microbatches=4"):
        assert SMPConfig.from_sources({"microbatches": 1}, smp_options=PASTED, environ={}).microbatches == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # agreeing with smp_options is silent
        assert SMPConfig.from_sources({"microbatches": 4}, smp_options=PASTED, environ={}).microbatches == 4


def test_from_sources_kwargs_accept_the_alias_and_suggest_names():
    assert SMPConfig.from_sources({"partitions": 2}, environ={}).pipeline_parallel_degree == 2
    with pytest.raises(ValueError, match=r"unknown lightning_smp setting 'pipline'; did you mean 'pipeline'\?"):
        SMPConfig.from_sources({"pipline": "simple"}, environ={})


def test_environment_overrides_explicit_values_with_a_warning():
    environ = {"SM_HP_MP_PARAMETERS": json.dumps({"microbatches": 8, "partitions": 2, "ddp": True})}
    with pytest.warns(UserWarning) as record:
        cfg = SMPConfig.from_sources({"microbatches": 2}, smp_options={"partitions": 4}, environ=environ)
    assert (cfg.microbatches, cfg.pipeline_parallel_degree, cfg.ddp) == (8, 2, True)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2  # ddp was not set explicitly, so overriding its default is silent
    assert messages[0].startswith("SM_HP_MP_PARAMETERS sets microbatches=8, overriding 2 given in the script")
    assert messages[1].startswith("SM_HP_MP_PARAMETERS sets pipeline_parallel_degree=2, overriding 4")


def test_environment_agreeing_with_the_script_is_silent():
    environ = {"SM_HP_MP_PARAMETERS": '{"microbatches": 4}'}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SMPConfig.from_sources({"microbatches": 4}, environ=environ).microbatches == 4


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ("{microbatches: 4}", r"SM_HP_MP_PARAMETERS='\{microbatches: 4\}' is not valid JSON"),
        ("[4]", r"SM_HP_MP_PARAMETERS='\[4\]' is not a JSON object"),
        ('{"microbatchs": 4}', r"unknown smp parameter 'microbatchs'; did you mean 'microbatches'\?"),
        ('{"fp16": "true"}', r"fp16='true' is not a bool"),
        ('{"partitions": 0}', r"pipeline_parallel_degree=0 is invalid"),
        (
            '{"static_loss_scale": 8}',
            r"'static_loss_scale' in SM_HP_MP_PARAMETERS is a lightning_smp setting",
        ),
    ],
)
def test_bad_environment_variable(raw, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig.from_sources({}, environ={"SM_HP_MP_PARAMETERS": raw})


# --- inactive settings, round trips ---------------------------------------------------------------------


def test_inactive_settings_lists_only_changed_ones():
    assert SMPConfig().inactive_settings() == []
    cfg = SMPConfig(ddp=True, ddp_dist_backend="nccl", fp16=True, offload_activations=True, contiguous=False)
    assert cfg.inactive_settings() == [
        "ddp=True has no effect in lightning_smp yet: data parallelism is always on "
        "(data parallel degree = world size / (pp * tp))",
        "ddp_dist_backend='nccl' has no effect in lightning_smp yet: Lightning picks the backend: "
        "NCCL on GPU, gloo on CPU",
        "contiguous=False has no effect in lightning_smp yet: it is a TensorFlow-only smp setting",
    ]
    assert SMPConfig(horovod=True).inactive_settings() == [
        "horovod=True has no effect in lightning_smp yet: data parallelism runs on torch.distributed, never Horovod"
    ]


# --- smp v1's whole schema ------------------------------------------------------------------------------

# Every key of smdistributed-modelparallel's config.yaml (1.12-1.15) and of the SageMaker SDK's parameter table, with
# smp's default; `partitions` is the schema's alias of pipeline_parallel_degree.
SMP_SCHEMA = {
    **{name: value for name, value in SMP_DEFAULTS.items() if name != "active_microbatches"},
    "active_microbatches": None,
    "fast_mode": False,
    "static_mode": False,
    "task_level_activation_loading_horizon": 4,
    "_shard_offloaded_activations": True,
    "_match_weights": False,
    "_fp32_grad_accumulation": False,
    "checkpoint_attentions": False,
    "herring": False,
    "_sharded_data_parallelism_config": None,
    "load_partition": False,
    "partition_file": None,
}


def test_every_key_of_smps_schema_is_accepted_at_its_default_silently():
    assert len(SMP_SCHEMA) == 43
    assert set(SMP_SCHEMA) == (set(SMP_DEFAULTS) | set(INTERNAL_SETTINGS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = SMPConfig.from_smp_options({"enabled": True, "parameters": SMP_SCHEMA})
        assert cfg == SMPConfig()
        environ = {"SM_HP_MP_PARAMETERS": json.dumps({**SMP_SCHEMA, "partitions": 1})}
        assert SMPConfig.from_sources({}, environ=environ) == SMPConfig()


@pytest.mark.parametrize(("name", "value"), [("fast_mode", True), ("_match_weights", True), ("partition_file", "p")])
def test_an_internal_smp_setting_changed_warns_once_with_what_it_did(name, value):
    with pytest.warns(UserWarning) as record:
        assert SMPConfig.from_smp_options({name: value}) == SMPConfig()
    assert [str(w.message) for w in record] == [
        f"{name}={value!r} has no effect in lightning_smp: on SageMaker it {INTERNAL_SETTINGS[name].did}; "
        f"{INTERNAL_SETTINGS[name].why}."
    ]


@pytest.mark.parametrize(
    ("parameters", "match"),
    [
        ({"fast_mode": 1}, r"fast_mode=1 in smp_options is invalid; smp takes bool: .*\(smp's default False\)"),
        ({"task_level_activation_loading_horizon": 0}, r"task_level_activation_loading_horizon=0 .* int >= 1"),
        ({"partition_file": 3}, r"partition_file=3 in smp_options is invalid; smp takes str or None"),
        ({"herring": True, "ddp": True}, r"herring=True needs ddp=False and horovod=False, as smp required"),
        ({"_fp32_grad_accumulation": True}, r"_fp32_grad_accumulation=True needs fp16=True or fp16_params=True"),
        ({"ddp": True, "horovod": True}, r"ddp=True and horovod=True name two data-parallel backends"),
        ({"sharded_data_parallel_degree": 2, "partitions": 2}, r"cannot be combined with pipeline_parallel_degree"),
        ({"pipeline": "_only_backward"}, r"pipeline='_only_backward' is invalid"),
    ],
)
def test_smps_schema_constraints_raise_with_the_fix(parameters, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig.from_smp_options(parameters)


def test_internal_requirements_that_hold_only_warn():
    with pytest.warns(UserWarning, match=r"_fp32_grad_accumulation=True has no effect"):
        SMPConfig.from_smp_options({"_fp32_grad_accumulation": True, "fp16": True})


def test_internal_smp_settings_belong_in_smp_options():
    with pytest.raises(ValueError, match=r"'fast_mode' in keyword arguments is an internal smp parameter; pass it"):
        SMPConfig.from_sources({"fast_mode": True}, environ={})


def test_only_forward_pipeline_runs_interleaved_with_a_warning():
    with pytest.warns(UserWarning, match=r"pipeline='_only_forward' runs as pipeline='interleaved'"):
        assert SMPConfig.from_smp_options({"pipeline": "_only_forward"}).pipeline == "interleaved"


def test_fp16_params_is_read_as_fp16_and_named_deprecated():
    cfg = SMPConfig.from_smp_options({"fp16_params": True})
    assert cfg.fp16 and cfg.half_dtype is torch.float16
    assert cfg.deprecated_settings() == [
        "fp16_params=True is deprecated in smp in favour of fp16; lightning_smp reads it as fp16=True: set fp16=True "
        "instead."
    ]
    assert cfg.inactive_settings() == [] and SMPConfig(fp16=True).deprecated_settings() == []


def test_requirements_not_enforced_are_accepted():
    # the configs smp's schema refused that lightning_smp runs, one per entry of the table
    assert len(SMP_REQUIREMENTS_NOT_ENFORCED) == 5
    SMPConfig(tensor_parallel_degree=2)
    SMPConfig(ddp_port=4000)
    SMPConfig(ddp_dist_backend="nccl")
    SMPConfig(prescaled_batch=True, optimize="memory")
    SMPConfig(sharded_data_parallel_degree=2, tensor_parallel_degree=2)


def test_inactive_table_names_smp_fields_only():
    smp_fields = {field.name for field in dataclasses.fields(SMPConfig)} - _OWN_FIELDS
    assert set(_INACTIVE_SETTINGS) <= smp_fields
    assert {"fp16", "pipeline_parallel_degree", "tensor_parallel_degree", "microbatches"}.isdisjoint(_INACTIVE_SETTINGS)


def test_as_smp_parameters_round_trips():
    cfg = SMPConfig(pipeline_parallel_degree=2, microbatches=4, placement_strategy="tdp", fp16=True)
    assert SMPConfig.from_smp_options(cfg.as_smp_parameters()).as_smp_parameters() == cfg.as_smp_parameters()


def test_pickle_and_deepcopy_keep_the_config():
    cfg = SMPConfig(fp16=True, dynamic_loss_args={"scale_window": 1000}, partition=[1], auto_partition=False)
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert clone == cfg
        with pytest.raises(TypeError):
            clone.dynamic_loss_args["scale_window"] = 1


def test_tensor_parallel_plan_is_checked_and_stored_read_only():
    cfg = SMPConfig(tensor_parallel_plan={"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"})
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert clone == cfg
        with pytest.raises(TypeError):
            clone.tensor_parallel_plan["head"] = "colwise"
    with pytest.raises(
        ValueError, match=r"tensor_parallel_plan\['fc'\]='columnwise' is not a style; did you mean 'colwise'"
    ):
        SMPConfig(tensor_parallel_plan={"fc": "columnwise"})
    with pytest.raises(ValueError, match=r"pattern 'blocks\.\.fc' is invalid; give a dotted module path"):
        SMPConfig(tensor_parallel_plan={"blocks..fc": "colwise"})
    with pytest.raises(ValueError, match="pass a dict of module-path patterns"):
        SMPConfig(tensor_parallel_plan=["blocks.*.fc"])
    with pytest.raises(ValueError, match="'tensor_parallel_plan' in smp_options is a lightning_smp setting"):
        SMPConfig.from_smp_options({"parameters": {"tensor_parallel_plan": {"fc": "colwise"}}})
