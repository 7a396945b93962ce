"""The attention device script's own logic on the CPU: which sides count as having run on
our backend, and when the run passes (a silent fallback to TRITON_ATTN, or a decode op that
never ran, must fail it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "ab"))
spec = importlib.util.spec_from_file_location("device_backend_ab", HERE / "device_backend_ab.py")
assert spec is not None and spec.loader is not None
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)

from ab_side import engine_kwargs  # noqa: E402

OURS = {"attention_layers": {f"{dev.OURS_CLASS}:Sm70PagedImpl": 2},
        "attention_calls": {"decode": 40, "kv_write": 50, "prefill_triton": 3},
        "attention_device_decodes": 400}
STOCK = {"attention_layers": {f"{dev.STOCK_CLASS}:TritonAttentionImpl": 2}}


def test_a_side_on_our_backend_that_ran_its_decode_passes() -> None:
    assert dev.backend_check(OURS, dev.OURS_CLASS, True)["ok"]
    assert dev.backend_check(STOCK, dev.STOCK_CLASS, False)["ok"]


def test_a_silent_fallback_to_triton_fails() -> None:
    fell_back = dict(STOCK, attention_calls={"decode": 0, "kv_write": 0},
                     attention_device_decodes=0)
    assert not dev.backend_check(fell_back, dev.OURS_CLASS, True)["ok"]
    mixed = dict(OURS, attention_layers={**OURS["attention_layers"], **STOCK["attention_layers"]})
    assert not dev.backend_check(mixed, dev.OURS_CLASS, True)["ok"]


def test_our_backend_whose_decode_never_ran_fails() -> None:
    assert not dev.backend_check(dict(OURS, attention_device_decodes=0), dev.OURS_CLASS, True)["ok"]
    assert not dev.backend_check(dict(OURS, attention_device_decodes=None), dev.OURS_CLASS,
                                 True)["ok"]
    assert not dev.backend_check(dict(OURS, attention_calls={"decode": 0, "kv_write": 9}),
                                 dev.OURS_CLASS, True)["ok"]
    assert not dev.backend_check({}, dev.OURS_CLASS, True)["ok"]


def test_the_verdict_needs_every_part() -> None:
    tests = {"rc": 0, "tests": 300, "skipped": 0}
    checks = {n: {"ok": True} for n in dev.SIDES}
    comps = {p: {"passed": True} for p in dev.PAIRS}
    assert dev.verdict(tests, checks, comps)
    assert not dev.verdict(None, checks, comps)
    assert not dev.verdict(dict(tests, skipped=4), checks, comps)  # a skipped GPU test
    assert not dev.verdict(dict(tests, rc=1), checks, comps)
    assert not dev.verdict(tests, {**checks, "ours_graphs": {"ok": False}}, comps)
    assert not dev.verdict(tests, checks, {**comps, "graphs": {"passed": False}})
    del comps["prefix_caching"]
    assert not dev.verdict(tests, checks, comps)


def test_the_engines_fit_the_scripts_share() -> None:
    assert dev.side_util(0.5) * len(dev.SIDES) <= 0.5
    assert dev.side_util(0.01) == 0.03  # the floor vLLM still starts with


def test_ab_side_sets_the_backend_and_prefix_caching() -> None:
    kw = engine_kwargs("m", "eager", 1024, attention_backend="CUSTOM", prefix_caching=True)
    assert kw["attention_backend"] == "CUSTOM" and kw["enable_prefix_caching"] is True
    assert kw["mamba_cache_mode"] == "align"
    stock = engine_kwargs("m", "graphs", 512)
    assert stock["attention_backend"] == "TRITON_ATTN" and not stock["enable_prefix_caching"]
    assert "mamba_cache_mode" not in stock
