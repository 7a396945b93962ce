"""The int16 GDN pool's deciding code (pure): when it is on, what the page holds, what the
support rule and the plan say (vllm_patch/gdn/int16_pool.py; vLLM's side is
tests/test_gdn_int16_pool_vllm.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import pytest

from sm70ctl.plan import pools
from sm70ctl.plan.plan import PlanInputs, served_state_dtype
from sm70ctl.runtime.plugin_config import plugin_config_obj
from sm70ctl.settings import load_settings
from vllm_patch import plugin
from vllm_patch.gdn import int16_pool, routing

SHAPE = routing.LayerShape(
    activation_dtype="float16", ssm_state_dtype="int16", conv_state_dtype="float16",
    a_log_dtype="float32", dt_bias_dtype="float32", head_k_dim=128, head_v_dim=128,
    num_k_heads=8, num_v_heads=24, conv_kernel_size=4, activation="silu",
    conv_state_dim_first=False, num_spec=3, ssm_scale_dtype="float32")


def test_on_only_with_the_layer_and_int16() -> None:
    assert int16_pool.wanted(True, "sm70", "int16")
    assert not int16_pool.wanted(False, "sm70", "int16")
    assert not int16_pool.wanted(True, "triton", "int16")
    assert not int16_pool.wanted(True, "sm70", "float32")


def test_defaults_keep_the_float32_pool() -> None:
    """Default settings: the plugin's GDN layer is off, so vLLM's float32 pool as today; a
    hand-written plugin config turning the layer on keeps float32 when it says so (the
    plugin's defaults equal the settings', whose state default is int16)."""
    c = plugin_config_obj(load_settings(environ={}))
    assert not int16_pool.wanted(c.gdn.decode_layer, c.gdn.kernel, c.gdn.state_dtype)
    from vllm_patch.config import PluginConfig

    c = PluginConfig.from_dict({"gdn": {"decode_layer": True, "kernel": "sm70",
                                        "state_dtype": "float32"}})
    assert not int16_pool.wanted(c.gdn.decode_layer, c.gdn.kernel, c.gdn.state_dtype)


def test_settings_turn_it_on() -> None:
    c = plugin_config_obj(load_settings(environ={"SM70_GDN_KERNEL": "sm70"}))
    assert int16_pool.wanted(c.gdn.decode_layer, c.gdn.kernel, c.gdn.state_dtype)
    c = plugin_config_obj(load_settings(environ={"SM70_GDN_KERNEL": "sm70",
                                                 "SM70_GDN_STATE_DTYPE": "float32"}))
    assert not int16_pool.wanted(c.gdn.decode_layer, c.gdn.kernel, c.gdn.state_dtype)


def test_state_shapes_and_page_match_the_plan() -> None:
    conv, codes, scales = int16_pool.state_shapes((6, 5120), (24, 128, 128))
    assert (conv, codes, scales) == ((6, 5120), (24, 128, 128), (24, 128))
    page = int16_pool.page_bytes(24, 128, 128, 6 * 5120, 2)
    assert page == 24 * 128 * 128 * 2 + 24 * 128 * 4 + 6 * 5120 * 2
    assert page == pools.gdn_page(24, 128, 128, 5120, 4, 3, "int16").total
    with pytest.raises(ValueError, match="HV, V, K"):
        int16_pool.state_shapes((6, 5120), (24, 128))


def test_only_a_float32_base_is_replaced() -> None:
    assert int16_pool.base_dtype_problem("float32") is None
    msg = int16_pool.base_dtype_problem("bfloat16")
    assert msg is not None and "bfloat16" in msg and "SM70_GDN_STATE_DTYPE=float32" in msg


def test_support_rule_takes_int16_with_float32_scales_only() -> None:
    assert routing.unsupported_reason(SHAPE) is None
    no_scale = routing.unsupported_reason(dataclasses.replace(SHAPE, ssm_scale_dtype=None))
    assert no_scale is not None and "scales" in no_scale
    half = routing.unsupported_reason(dataclasses.replace(SHAPE, ssm_state_dtype="float16"))
    assert half is not None and "float16" in half
    fp32 = dataclasses.replace(SHAPE, ssm_state_dtype="float32", ssm_scale_dtype=None)
    assert routing.unsupported_reason(fp32) is None


def test_refusal_is_one_line_naming_the_setting() -> None:
    msg = int16_pool.layer_refusal("conv state in the DS layout")
    assert "DS layout" in msg and "SM70_GDN_STATE_DTYPE=float32" in msg and "\n" not in msg


class _Model:
    mamba_ssm_dtype = "float32"


def test_served_plan_follows_the_pool() -> None:
    on = PlanInputs(gdn_kernel="sm70", gdn_state_dtype="int16")
    assert served_state_dtype(_Model(), on) == "int16"  # type: ignore[arg-type]
    for off in (PlanInputs(), PlanInputs(gdn_kernel="sm70", gdn_state_dtype="float32")):
        assert served_state_dtype(_Model(), off) == "float32"  # type: ignore[arg-type]
    inp = PlanInputs.from_settings(load_settings(environ={"SM70_GDN_KERNEL": "sm70"}))
    assert inp.gdn_kernel == "sm70" and inp.gdn_state_dtype == "int16"


def test_plugin_asks_the_layer_for_int16(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm_patch.gdn.layer")
    fake.register = lambda int16_state=False, prefill="fla": f"int16={int16_state}"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_patch.gdn.layer", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda mod, *a: object() if mod == "vllm" else real(mod, *a))
    from vllm_patch.config import PluginConfig

    def registered(**gdn: object) -> str:
        return plugin._register_gdn_layer(PluginConfig.from_dict({"gdn": gdn}))

    assert registered(decode_layer=True, kernel="sm70", state_dtype="int16") == "int16=True"
    assert registered(decode_layer=True, kernel="sm70", state_dtype="float32") == "int16=False"
    assert registered(decode_layer=False, state_dtype="int16").startswith("off")
