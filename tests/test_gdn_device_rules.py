"""The pure rules of the GDN device run (tests/gpu/gdn/): the drift verdict, the check that
our op really ran in the A/B, and the state-bytes arithmetic of bench/bench_gdn.py."""

from __future__ import annotations

import importlib.util
import json
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


def ours_side(prefill: int = 60, decode: int = 600, spec: int = 0,
              state: str = "float32", **kw: Any) -> dict[str, Any]:
    side: dict[str, Any] = {
        "gdn_layer_classes": {device.OURS_CLASSES[state]: device.GDN_LAYERS_TINY},
        "gdn_unsupported": {},
        "gdn_prefill_mode": "sm70",
        "gdn_device_calls": {"sm70:decode": decode, "sm70:spec": spec},
        "gdn_calls": {"sm70:decode": 40, "sm70:prefill": prefill, "stock:no_metadata": 2},
        "gdn_calls_at_start": {"stock:no_metadata": 2},
        "gdn_prefill_ops": {"chunk_two_pass": prefill, "decode_rows": 5, "mtp_rows": 0},
        "phases": {},
    }
    side.update(kw)
    return side


def test_ours_ran_accepts_a_side_whose_prefill_and_decode_ran_our_ops() -> None:
    assert device.ours_ran(ours_side(), "float32", "none")["ok"]
    assert device.ours_ran(ours_side(state="int16"), "int16", "none")["ok"]
    # MTP: fewer steps, some of them verification rows (and prefill + MTP steps)
    mtp = ours_side(prefill=0, decode=100, spec=100)
    mtp["gdn_calls"]["sm70:prefill+spec"] = 70
    mtp["gdn_prefill_ops"] = {"chunk_two_pass": 70, "decode_rows": 0, "mtp_rows": 90}
    assert device.ours_ran(mtp, "float32", "mtp3")["ok"]
    assert not device.ours_ran(ours_side(decode=200), "float32", "mtp3")["ok"]  # no MTP row


@pytest.mark.parametrize(("side", "words"), [
    (ours_side(prefill=0), "prefill steps on our ops"),  # prefill left on FLA
    (ours_side(gdn_calls={"sm70:prefill": 60, "stock:prefill": 3}), "went to vLLM's path"),
    # prefill steps counted before any request (warm-up) are not the requests'
    (ours_side(gdn_calls_at_start={"sm70:prefill": 30}), "prefill steps on our ops"),
    (ours_side(decode=0), "ran 0 times"),  # a silent decode fallback
    (ours_side(gdn_prefill_mode="fla"), "prefill mode"),
    (ours_side(gdn_prefill_ops={"chunk_one_pass": 60}), "two-pass"),
    (ours_side(gdn_layer_classes={"vllm.QwenGatedDeltaNetAttention": 3}), "GDN layer classes"),
    (ours_side(gdn_unsupported={"layers.0": "why"}), "refused"),
])
def test_ours_ran_catches_a_fallback(side: dict[str, Any], words: str) -> None:
    r = device.ours_ran(side, "float32", "none")
    assert not r["ok"] and any(words in p for p in r["problems"]), r


def test_the_int16_side_needs_the_int16_class() -> None:
    r = device.ours_ran(ours_side(), "int16", "none")  # the float32 class on an int16 side
    assert not r["ok"] and "GDN layer classes" in r["problems"][0]


def test_state_bytes_per_layer() -> None:
    # TP=2: 24 value heads of 128 x 128 float32 = 1.5 MiB; int16 halves it plus a float32
    # scale per row (24 x 128 x 4 bytes)
    assert bench.state_bytes(24, "float32") == 1_572_864
    assert bench.state_bytes(24, "int16") == 786_432 + 12_288
    assert bench.conv_state_bytes(5120, 3) == 6 * 5120 * 2
    with pytest.raises(ValueError, match="float32 or int16"):
        bench.state_bytes(24, "float16")


ROW = {"prompt_len": 5, "tokens": [1, 2], "logprobs": [-0.1, -0.2],
       "top2": [[1, -0.1, 3, -2.0], [2, -0.2, 3, -2.0]]}


def sides(**change: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every side of device.SIDES, good; `change` replaces fields of the named ones."""
    out: dict[str, dict[str, Any]] = {"stock": {"phases": {"p100": [ROW]}, "error": None}}
    for name, (_side, _ckpt, args, dtype) in device.SIDES.items():
        if dtype is None:
            continue
        mtp = "mtp3" in args
        s = ours_side(decode=200 if mtp else 600, spec=100 if mtp else 0, state=dtype)
        s["phases"] = {"p100": [ROW]}
        out[name] = s
    for name, fields in change.items():
        out[name] = dict(out[name], **fields)
    return out


def test_ab_verdict_needs_every_ours_side_to_match_and_to_run_our_ops() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "gpu" / "ab"))
    v = device.ab_verdict(sides())
    assert v["passed"] is True, v
    assert set(v["comparisons"]) == {"ours_chunk", "ours_mtp", "ours_int16"}
    assert device.ab_verdict(sides(ours_chunk={"gdn_calls": {"stock:prefill": 9}}))[
        "passed"] is False
    assert device.ab_verdict(sides(stock={"error": "ValueError: no"}))["passed"] is False
    assert device.ab_verdict(sides(ours_int16={"phase_errors": {"p32k": "boom"}}))[
        "passed"] is False
    # a flipped token far above rounding fails, and so does a log-prob gap over the bound
    flipped = dict(ROW, tokens=[1, 3], logprobs=[-0.1, -2.0])
    assert device.ab_verdict(sides(ours_mtp={"phases": {"p100": [flipped]}}))[
        "passed"] is False
    shifted = dict(ROW, logprobs=[-0.1, -0.48])  # 0.28: within int16's bound, not fp32's
    assert device.ab_verdict(sides(ours_chunk={"phases": {"p100": [shifted]}}))[
        "passed"] is False
    assert device.ab_verdict(sides(ours_int16={"phases": {"p100": [shifted]}}))[
        "passed"] is True


def test_the_plugin_config_is_what_sm70_chunk_gives() -> None:
    from sm70ctl.runtime.plugin_config import plugin_config_obj
    from sm70ctl.settings.loader import load_settings

    want = plugin_config_obj(load_settings({"SM70_GDN_KERNEL": "sm70_chunk",
                                            "SM70_GDN_STATE_DTYPE": "float32"})).gdn
    got = json.loads(device.gdn_config("float32"))["gdn"]
    assert {k: getattr(want, k) for k in got} == got


def test_the_side_prompts_fit_the_engine() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "gpu" / "ab"))
    side = load(ROOT / "tests" / "gpu" / "gdn" / "gdn_side.py")
    plan = side.plan(side.PHASES.split(","))
    lens = {ph: [len(p) for batch in plan[ph] for p in batch] for ph in plan}
    assert lens["p100"] == [100] and lens["p4k"] == [4000] and lens["p32k"] == [32000]
    longest = max(n for ns in lens.values() for n in ns)
    assert longest + side.NEW_TOKENS <= side.MAX_LEN  # max_model_len >= 33K
    # the three long prompts in 2048-token chunks: what MIN_PREFILL_STEPS counts per layer
    chunks = sum(-(-lens[ph][0] // side.MAX_BATCHED) for ph in ("p100", "p4k", "p32k"))
    want = device.GDN_LAYERS_TINY * chunks
    assert want == device.MIN_PREFILL_STEPS
    assert len(lens["batch16"]) == 16 and any(n > 1 for n in map(len, plan["prefix"]))
    with pytest.raises(SystemExit, match="unknown phase"):
        side.plan(["p64k"])


def test_only_the_wanted_sides_are_judged() -> None:
    # a run of stock + ours_int16 judges ours_int16 alone; a wanted side without output fails
    only = {k: v for k, v in sides().items() if k in ("stock", "ours_int16")}
    assert device.ab_verdict(only, frozenset({"stock", "ours_int16"}))["passed"] is True
    assert device.ab_verdict(only)["passed"] is False  # the others are wanted by default
    broken = dict(only, ours_int16={"error": "no output"})
    assert device.ab_verdict(broken, frozenset({"stock", "ours_int16"}))["passed"] is False
