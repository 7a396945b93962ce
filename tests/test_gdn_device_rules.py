"""The pure rules of the GDN device run (tests/gpu/gdn/): the drift verdict, the check that
our op really ran in the A/B, and the state-bytes arithmetic of bench/bench_gdn.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


drift = load(ROOT / "tests" / "gpu" / "gdn" / "drift.py")
device = load(ROOT / "tests" / "gpu" / "gdn" / "device_gdn.py")
bench = load(ROOT / "bench" / "bench_gdn.py")


def check(tokens: int, state: float, out: float = 1e-4) -> dict[str, Any]:
    return {"tokens": tokens, "state_rel_max": state, "out_rel_rms": out}


def test_drift_passes_a_flat_error_within_tolerance() -> None:
    v = drift.verdict([check(10_000, 3e-4), check(20_000, 3.3e-4), check(250_000, 3.1e-4)])
    assert v["passed"] is True, v


@pytest.mark.parametrize(("checks", "words"), [
    ([check(10_000, 3e-4), check(250_000, 2.5e-3)], "state error"),
    ([check(10_000, 3e-4, out=4e-3)], "output error"),
    ([check(10_000, 3e-4), check(250_000, 9e-4)], "grew"),
    ([check(10_000, float("nan"))], "non-finite"),
])
def test_drift_fails_on_each_rule(checks: list[dict[str, Any]], words: str) -> None:
    v = drift.verdict(checks)
    assert v["passed"] is False and words in v["why"], v


def test_drift_without_checkpoints_is_undecided() -> None:
    assert drift.verdict([])["passed"] is None


def ours_side(device_calls: int, python_calls: int | None = None, **kw: Any) -> dict[str, Any]:
    side: dict[str, Any] = {
        "gdn_layer_classes": {device.OURS_CLASS: device.GDN_LAYERS_TINY},
        "gdn_unsupported": {},
        "gdn_device_calls": {"sm70:decode": device_calls, "sm70:spec": 0},
        "gdn_calls": {"sm70:decode": device_calls if python_calls is None else python_calls},
        "phases": {"single": [], "batch4": [], "batch16": []},
    }
    side.update(kw)
    return side


def test_ours_ran_accepts_a_side_that_ran_our_op() -> None:
    assert device.ours_ran(ours_side(800), "eager")["ok"]
    # graphs: replays are counted on the device only
    assert device.ours_ran(ours_side(800, python_calls=40), "graphs")["ok"]
    # with drafts a step takes several tokens: fewer steps, some on the MTP path
    spec = ours_side(150, python_calls=30)
    spec["gdn_device_calls"] = {"sm70:decode": 100, "sm70:spec": 100}
    r = device.ours_ran(spec, "graphs", "ngram")
    assert r["ok"] and r["spec_rows_ran"], r
    assert not device.ours_ran(spec, "graphs", "none")["ok"]


@pytest.mark.parametrize(("side", "mode", "words"), [
    (ours_side(0), "eager", "ran 0 times"),  # a silent fallback
    (ours_side(800, python_calls=40), "eager", "Python calls"),
    (ours_side(800, gdn_layer_classes={"vllm.QwenGatedDeltaNetAttention": 3}), "graphs",
     "GDN layer classes"),
    (ours_side(800, gdn_unsupported={"layers.0": "why"}), "eager", "refused"),
])
def test_ours_ran_catches_a_fallback(side: dict[str, Any], mode: str, words: str) -> None:
    r = device.ours_ran(side, mode)
    assert not r["ok"] and any(words in p for p in r["problems"]), r


def test_state_bytes_per_layer() -> None:
    # TP=2: 24 value heads of 128 x 128 float32 = 1.5 MiB; int16 halves it plus a float32
    # scale per row (24 x 128 x 4 bytes)
    assert bench.state_bytes(24, "float32") == 1_572_864
    assert bench.state_bytes(24, "int16") == 786_432 + 12_288
    assert bench.conv_state_bytes(5120, 3) == 6 * 5120 * 2
    with pytest.raises(ValueError, match="float32 or int16"):
        bench.state_bytes(24, "float16")


def side_pair(ours_calls: int, error: str | None = None) -> dict[str, Any]:
    row = {"prompt_len": 5, "tokens": [1, 2], "logprobs": [-0.1, -0.2],
           "top2": [[1, -0.1, 3, -2.0], [2, -0.2, 3, -2.0]]}
    stock = {"phases": {"single": [row]}, "error": error}
    ours = ours_side(ours_calls)
    ours["phases"] = {"single": [row]}
    return {"stock": stock, "ours": ours}


def sides_for(pairs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{who}_{pair}": d[who] for pair, d in pairs.items() for who in ("stock", "ours")}


def test_ab_verdict_needs_every_plain_pair_and_our_op() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "gpu" / "ab"))
    good = {"eager": side_pair(800), "graphs": side_pair(800), "graphs_ngram": side_pair(800)}
    assert device.ab_verdict(sides_for(good))["passed"] is True
    fallback = dict(good, graphs=side_pair(0))
    assert device.ab_verdict(sides_for(fallback))["passed"] is False
    # stock vLLM failing the speculative pair leaves it out; failing a plain pair does not
    no_spec = dict(good, graphs_ngram=side_pair(800, error="ValueError: no"))
    v = device.ab_verdict(sides_for(no_spec))
    assert v["passed"] is True and v["comparisons"]["graphs_ngram"]["passed"] is None
    no_plain = dict(good, eager=side_pair(800, error="ValueError: no"))
    assert device.ab_verdict(sides_for(no_plain))["passed"] is False
