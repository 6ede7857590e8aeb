import math
import struct
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_smp.loss_scaler import DynamicLossScaler, StaticLossScaler

SEED_DYNAMIC_LOSS_ARGS = {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2}
OVERFLOW = torch.tensor(1.0)
CLEAN = torch.tensor(0.0)


def _f32(x: float) -> float:
    """Round to the nearest float32, as the scaler's tensor state does."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


@dataclass
class _ReferenceScaler:
    """smp v1.12.1 ``DynamicLossScaler.update_scale``, in plain Python on float32-rounded scales."""

    cur_scale: float
    scale_factor: float
    scale_window: int
    min_scale: float
    delayed_shift: int
    consecutive_hysteresis: bool
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = field(init=False)

    def __post_init__(self) -> None:
        self.cur_hysteresis = self.delayed_shift

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(_f32(self.cur_scale / self.scale_factor), self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                grown = _f32(self.cur_scale * self.scale_factor)
                # The float32 scale skips a growth that would reach inf (smp's Python float would not).
                if grown != math.inf:
                    self.cur_scale = grown
        self.cur_iter += 1

    def state(self) -> tuple[float, int, int, int]:
        return self.cur_scale, self.cur_iter, self.last_overflow_iter, self.cur_hysteresis


def _state(scaler: DynamicLossScaler) -> tuple[float, int, int, int]:
    sd = scaler.state_dict()
    return sd["cur_scale"], sd["cur_iter"], sd["last_overflow_iter"], sd["cur_hysteresis"]


def _run(scaler, overflows: str) -> list[float]:
    """Feed a pattern such as "xx.x" (x = overflow, . = clean) and return the scale after each update."""
    scales = []
    for char in overflows:
        scaler.update(OVERFLOW if char == "x" else CLEAN)
        scales.append(scaler.loss_scale)
    return scales


@settings(max_examples=200, deadline=None)
@given(
    scale_factor=st.sampled_from([2.0, 4.0, 3.0]),
    scale_window=st.integers(1, 6),
    min_scale=st.sampled_from([1.0, 0.25, 8.0]),
    init_exponent=st.integers(-2, 126),
    delayed_shift=st.integers(1, 4),
    consecutive_hysteresis=st.booleans(),
    overflows=st.lists(st.booleans(), max_size=60),
)
def test_dynamic_matches_reference(
    scale_factor, scale_window, min_scale, init_exponent, delayed_shift, consecutive_hysteresis, overflows
):
    config = dict(
        scale_factor=scale_factor,
        scale_window=scale_window,
        min_scale=min_scale,
        delayed_shift=delayed_shift,
        consecutive_hysteresis=consecutive_hysteresis,
    )
    scaler = DynamicLossScaler(init_scale=2.0**init_exponent, **config)
    reference = _ReferenceScaler(cur_scale=2.0**init_exponent, **config)
    assert _state(scaler) == reference.state()
    for overflow in overflows:
        scaler.update(torch.tensor(float(overflow)))
        reference.update(overflow)
        assert _state(scaler) == reference.state()


def test_defaults_grow_after_1000_clean_steps():
    scaler = DynamicLossScaler()
    assert scaler.dynamic
    assert scaler.scale.dtype == torch.float32
    assert scaler.scale.dim() == 0
    assert scaler.loss_scale == 2.0**32
    scales = _run(scaler, "." * 1000)
    assert scales[998] == 2.0**32
    assert scales[999] == 2.0**33
    assert scaler.inv_scale.item() == 2.0**-33


def test_seed_delayed_shift_needs_two_overflows_before_first_backoff():
    scaler = DynamicLossScaler.from_args(SEED_DYNAMIC_LOSS_ARGS)
    # The second overflow backs off; hysteresis stays spent until a growth refills it, so the third does too.
    assert _run(scaler, "xxx") == [2.0**32, 2.0**31, 2.0**30]
    assert _state(scaler) == (2.0**30, 3, 2, 1)


def test_min_scale_floor():
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    assert _run(scaler, "xxxx") == [2.0, 1.0, 1.0, 1.0]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    refilled = DynamicLossScaler(init_scale=64.0, delayed_shift=3, consecutive_hysteresis=True)
    assert _run(refilled, "xx.xx.xx") == [64.0] * 8
    not_refilled = DynamicLossScaler(init_scale=64.0, delayed_shift=3)
    assert _run(not_refilled, "xx.xx.xx") == [64.0, 64.0, 64.0, 32.0, 16.0, 16.0, 8.0, 4.0]


def test_growth_counts_clean_steps_since_the_last_overflow():
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=3)
    assert _run(scaler, "..x...") == [8.0, 8.0, 4.0, 4.0, 4.0, 8.0]


def test_static_is_constant():
    scaler = StaticLossScaler(128.0)
    assert not scaler.dynamic
    assert _run(scaler, "x.x" * 5) == [128.0] * 15
    assert scaler.inv_scale.item() == 1 / 128
    assert scaler.state_dict() == {"cur_scale": 128.0}


def test_state_dict_round_trip_mid_sequence_continues_identically():
    pattern = "..x.xx...x.." * 3
    config = dict(init_scale=2.0**10, scale_factor=3.0, scale_window=2, delayed_shift=2)
    original = DynamicLossScaler(**config)
    _run(original, pattern[:13])
    state = original.state_dict()
    assert state["scale_window"] == 2
    assert state["consecutive_hysteresis"] is False
    resumed = DynamicLossScaler(**config)
    resumed.load_state_dict(state)
    assert _run(resumed, pattern[13:]) == _run(original, pattern[13:])
    assert _state(resumed) == _state(original)


def test_static_state_dict_round_trip():
    resumed = StaticLossScaler()
    resumed.load_state_dict(StaticLossScaler(4.0).state_dict())
    assert resumed.loss_scale == 4.0


def test_load_state_dict_keeps_constructor_config_and_warns():
    state = DynamicLossScaler(scale_window=5).state_dict()
    scaler = DynamicLossScaler(scale_window=2)
    with pytest.warns(UserWarning, match=r"scale_window: 5 -> 2"):
        scaler.load_state_dict(state)
    assert scaler.state_dict()["scale_window"] == 2


def test_load_state_dict_keeps_tensor_identity():
    scaler = DynamicLossScaler(init_scale=8.0)
    scale = scaler.scale
    scaler.load_state_dict(DynamicLossScaler(init_scale=2.0).state_dict())
    scaler.update(OVERFLOW)
    assert scale is scaler.scale
    assert scale.item() == 1.0


def test_dynamic_state_into_static_raises():
    with pytest.raises(ValueError, match=r"scaler is static.*dynamic_loss_scale=True"):
        StaticLossScaler().load_state_dict(DynamicLossScaler().state_dict())


def test_static_state_into_dynamic_raises():
    with pytest.raises(ValueError, match=r"scaler is dynamic.*dynamic_loss_scale=False"):
        DynamicLossScaler().load_state_dict(StaticLossScaler().state_dict())


def test_from_args_none_gives_smp_defaults():
    state = DynamicLossScaler.from_args(None).state_dict()
    assert state == {
        "cur_scale": 2.0**32,
        "cur_iter": 0,
        "last_overflow_iter": -1,
        "cur_hysteresis": 1,
        "scale_factor": 2.0,
        "scale_window": 1000,
        "min_scale": 1.0,
        "delayed_shift": 1,
        "consecutive_hysteresis": False,
    }


def test_from_args_unknown_key_suggests_nearest():
    with pytest.raises(ValueError, match=r"'scale_windw'; did you mean 'scale_window'\?"):
        DynamicLossScaler.from_args({"scale_windw": 10})
    with pytest.raises(ValueError, match=r"'hysteresis'; did you mean 'consecutive_hysteresis'\?"):
        DynamicLossScaler.from_args({"hysteresis": 2})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 0.0}, r"init_scale=0.0 must be finite and > 0"),
        ({"init_scale": math.inf}, r"init_scale=inf must be finite and > 0"),
        ({"scale_factor": 1.0}, r"scale_factor=1.0 must be finite and > 1"),
        ({"scale_window": 0}, r"scale_window=0 must be an int >= 1"),
        ({"scale_window": 2.5}, r"scale_window=2.5 must be an int >= 1"),
        ({"min_scale": -1.0}, r"min_scale=-1.0 must be finite and > 0"),
        ({"delayed_shift": 0}, r"delayed_shift=0 must be an int >= 1"),
        ({"delayed_shift": True}, r"delayed_shift=True must be an int >= 1"),
    ],
)
def test_dynamic_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def test_static_validation():
    with pytest.raises(ValueError, match=r"StaticLossScaler\(scale=0.0\): the scale must be finite and > 0"):
        StaticLossScaler(0.0)


def test_found_inf_must_be_0_dim_on_the_scaler_device():
    with pytest.raises(ValueError, match=r"found_inf must be a 0-dim tensor on cpu, got shape \(1,\)"):
        DynamicLossScaler().update(torch.ones(1))


def test_update_does_not_synchronise(monkeypatch):
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=2, delayed_shift=2)
    found_infs = [torch.tensor(float(char == "x")) for char in "x..xx."]

    def no_sync(*args, **kwargs):
        raise AssertionError("update() read a tensor on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            patch.setattr(torch.Tensor, name, no_sync)
        for found_inf in found_infs:
            scaler.update(found_inf)
    assert _state(scaler) == (8.0, 6, 4, 1)


def test_to_moves_every_state_tensor():
    scaler = DynamicLossScaler().to("meta")
    assert scaler.scale.device.type == "meta"
    scaler.update(torch.tensor(1.0, device="meta"))
    assert scaler.inv_scale.device.type == "meta"


def test_growth_that_would_overflow_float32_is_skipped():
    scaler = DynamicLossScaler(init_scale=2.0**127, scale_window=1)
    assert _run(scaler, "..x.") == [2.0**127, 2.0**127, 2.0**126, 2.0**127]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_does_not_synchronise_on_cuda():
    scaler = DynamicLossScaler(**SEED_DYNAMIC_LOSS_ARGS, device="cuda")
    found_inf = torch.ones((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            scaler.update(found_inf)
            scaler.scale.mul(scaler.inv_scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _state(scaler) == (2.0**30, 3, 2, 1)
