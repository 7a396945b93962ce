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


def test_sm70_chunk_turns_our_prefill_on_as_well() -> None:
    from sm70ctl.runtime.plugin_config import plugin_config_obj
    from sm70ctl.settings.loader import load_settings

    chunk = plugin_config_obj(load_settings({"SM70_GDN_KERNEL": "sm70_chunk"}))
    decode = plugin_config_obj(load_settings({"SM70_GDN_KERNEL": "sm70"}))
    # the same layer (kernel sm70, so int16_pool.wanted and the plan see it), prefill ours
    assert (chunk.gdn.decode_layer, chunk.gdn.kernel, chunk.gdn.prefill) == (True, "sm70", "sm70")
    assert (decode.gdn.decode_layer, decode.gdn.prefill) == (True, "fla")
    assert PluginConfig().gdn.prefill == "fla"


def test_a_bad_prefill_choice_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"gdn\.prefill is 'cuda'"):
        PluginConfig.from_json('{"gdn": {"prefill": "cuda"}}')


def test_the_plugin_hands_the_prefill_choice_to_the_layer(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import sys
    import types

    seen: list[tuple[bool, str]] = []
    fake = types.ModuleType("vllm_patch.gdn.layer")
    fake.register = lambda int16_state=False, prefill="fla": seen.append(  # type: ignore[attr-defined]
        (int16_state, prefill)) or "ok"
    monkeypatch.setitem(sys.modules, "vllm_patch.gdn.layer", fake)
    import vllm_patch.gdn as gdn_pkg

    monkeypatch.setattr(gdn_pkg, "layer", fake, raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    got = plugin._register_gdn_layer(with_gdn(decode_layer=True, kernel="sm70",
                                              state_dtype="float32", prefill="sm70"))
    assert got == "ok" and seen == [(False, "sm70")]
