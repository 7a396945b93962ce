"""The plugin installs our GDN layer only when gdn.decode_layer asks for it (off by default),
never with gdn.kernel=triton, and says so in its report."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from vllm_patch import plugin
from vllm_patch.config import PluginConfig


def with_gdn(**kw: object) -> PluginConfig:
    c = PluginConfig()
    return dataclasses.replace(c, gdn=dataclasses.replace(c.gdn, **kw))


def test_off_by_default() -> None:
    assert PluginConfig().gdn.decode_layer is False
    assert plugin._register_gdn_layer(PluginConfig()) == "off (gdn.decode_layer is false)"


def test_triton_kernel_keeps_it_off() -> None:
    got = plugin._register_gdn_layer(with_gdn(decode_layer=True, kernel="triton"))
    assert got == "off (gdn.kernel is triton)"


def test_the_config_json_turns_it_on() -> None:
    c = PluginConfig.from_json('{"gdn": {"decode_layer": true, "kernel": "sm70"}}')
    assert c.gdn.decode_layer is True and c.gdn.kernel == "sm70"


def test_the_setting_turns_it_on() -> None:
    from sm70ctl.runtime.plugin_config import plugin_config_obj
    from sm70ctl.settings.loader import load_settings

    on = plugin_config_obj(load_settings({"SM70_GDN_KERNEL": "sm70"}))
    off = plugin_config_obj(load_settings({}))
    assert (on.gdn.decode_layer, on.gdn.kernel) == (True, "sm70")
    assert (off.gdn.decode_layer, off.gdn.kernel) == (False, "triton")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_on_without_vllm_registers_nothing() -> None:
    got = plugin._register_gdn_layer(with_gdn(decode_layer=True, kernel="sm70"))
    assert got == "absent (vLLM not installed)"
