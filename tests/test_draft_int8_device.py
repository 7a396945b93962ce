"""The verdict of tests/gpu/serving/device_draft_int8.py on made-up engine results (pure), and
its engine configuration: the GPU run must not pass on a drafter left on vLLM's fp16 method,
a GEMV that never saw a draft weight, outputs that differ, or bytes that did not shrink."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu" / "serving" / "device_draft_int8.py"
LAYERS = ["model.fc", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
          "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]


@pytest.fixture(scope="module")
def dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_draft_int8", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _row(tokens: list[int]) -> dict[str, Any]:
    return {"prompt_len": 5, "tokens": tokens, "logprobs": [-0.1] * len(tokens),
            "top2": [[t, -0.1, t + 1, -3.0] for t in tokens]}


def _engines() -> dict[str, dict[str, Any]]:
    phases = {"single": [_row([1, 2, 3])], "batch10": [_row([4, 5, 6]), _row([7, 8, 9])]}
    spec = {"phases": copy.deepcopy(phases),
            "drafter": {"linear_methods": dict.fromkeys(LAYERS, "DraftInt8LinearMethod")},
            "draft_op_calls": {"gptq_gemv": 40, "gptq_gemv_all": 90, "gptq_dequant": 5},
            "draft_int8_calls": {"apply": 50, "rows": 400},
            "conversions": [{"bytes_before": 2 * 1024, "bytes_after": 1024 + 32}] * 5}
    return {"spec": spec, "plain": {"phases": phases, "drafter": None}}


def test_a_good_run_passes(dev: ModuleType) -> None:
    v = dev.judge(_engines())
    assert v["passed"] is True, v["checks"]
    assert v["draft_bytes_before"] == 5 * 2048 and v["draft_bytes_after"] == 5 * 1056
    assert v["all_equal"] and v["requests"] == 3


@pytest.mark.parametrize("broken", ["fp16 method", "no gemv", "tokens differ", "no shrink",
                                    "missing layer", "unconverted"])
def test_each_broken_run_fails(dev: ModuleType, broken: str) -> None:
    e = _engines()
    s = e["spec"]
    if broken == "fp16 method":
        s["drafter"]["linear_methods"]["model.fc"] = "UnquantizedLinearMethod"
    elif broken == "no gemv":
        s["draft_op_calls"]["gptq_gemv"] = 0
    elif broken == "tokens differ":  # where the reference's margin is far above the noise
        s["phases"]["batch10"][1] = _row([7, 99, 9])
    elif broken == "no shrink":
        s["conversions"] = [{"bytes_before": 2048, "bytes_after": 2048}] * 5
    elif broken == "missing layer":
        del s["drafter"]["linear_methods"]["model.layers.0.mlp.down_proj"]
        s["conversions"] = s["conversions"][:4]
    elif broken == "unconverted":
        s["conversions"] = s["conversions"][:3]
    v = dev.judge(e)
    assert v["passed"] is False, broken


@pytest.mark.parametrize(("graphs", "want"), [
    ("missing", True), ("good", True), ("errored", False), ("fp16 method", False),
    ("tokens differ", False)])
def test_the_graphs_engine_fails_the_run_only_when_it_ran_and_failed(
        dev: ModuleType, graphs: str, want: bool) -> None:
    e = _engines()
    g = copy.deepcopy(e["spec"])
    if graphs == "errored":
        g = {"error": "RuntimeError: capture failed", "phases": {}}
    elif graphs == "fp16 method":
        g["drafter"]["linear_methods"]["model.fc"] = "UnquantizedLinearMethod"
    elif graphs == "tokens differ":
        g["phases"]["single"][0] = _row([1, 77, 3])
    if graphs != "missing":
        e["spec_graphs"] = g
    v = dev.judge(e)
    assert v["passed"] is want, (graphs, v["graphs"])


def test_no_rows_is_no_verdict(dev: ModuleType) -> None:
    e = _engines()
    e["spec"]["phases"] = {}
    assert dev.judge(e)["passed"] is None


def test_engines_are_ours_eager_and_only_one_speculates(dev: ModuleType) -> None:
    cfg = dev.engine_configs("/tmp/ab/tiny/int8", 0.04)
    assert set(cfg) == {"spec", "plain", "spec_graphs"}
    for kw in cfg.values():
        assert kw["gpu_memory_utilization"] == 0.04
        assert kw["kv_cache_memory_bytes"] == dev.KV_GIB * 1024**3
    assert cfg["spec"]["enforce_eager"] and cfg["plain"]["enforce_eager"]
    assert "enforce_eager" not in cfg["spec_graphs"]
    assert cfg["spec_graphs"]["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    for name in ("spec", "spec_graphs"):
        assert cfg[name]["speculative_config"]["method"] == "mtp"
        assert cfg[name]["speculative_config"]["num_speculative_tokens"] == 3
    assert "speculative_config" not in cfg["plain"]
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1\.5"):
        dev.engine_configs("/m", 1.5)
    phases = dev.plan_phases()
    assert sum(len(b) for bs in phases.values() for b in bs) == 13  # 3 alone + 10 together


# ---------------------------------------------------------------------- the whole driver
FAKE = ROOT / "tests" / "gpu" / "serving" / "fake_vllm"


def _drive(tmp: Path, **env: str) -> dict[str, Any]:
    """The driver and its engine processes against the stand-in vLLM (no drafter, no
    torch: the run must not pass, but every step until the verdict must run)."""
    import json
    import os
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp / "out"), "--work", str(tmp / "work"),
         "--budget-s", "90"], capture_output=True, text=True, timeout=150, check=False,
        env=dict(os.environ, PYTHONPATH=str(FAKE), SM70_AB_TINY=str(tmp / "none"),
                 SM70_GPU_SHARE="0.08", **env))
    summary = json.loads((tmp / "out" / "summary.json").read_text())
    summary["_log"] = proc.stdout + proc.stderr
    return summary


def test_the_driver_runs_every_engine_and_refuses_a_run_without_our_drafter(
        tmp_path: Path) -> None:
    s = _drive(tmp_path)
    assert s["passed"] is False, s["_log"]
    assert s["requests"] == 13 and s["checks"]["outputs_match"], s.get("comparison")
    assert not s["checks"]["every_draft_linear_is_ours"]
    assert s["spec_counters"]["vllm:spec_decode_num_drafts"] > 0
    assert s["graphs"]["requests"] == 13
    assert (tmp_path / "out" / "engines.json").is_file()
    assert (tmp_path / "out" / "logs.txt").is_file()


def test_a_refused_speculative_engine_gives_no_verdict_and_its_message(tmp_path: Path) -> None:
    s = _drive(tmp_path, FAKE_VLLM_REFUSE="mtp")
    assert s["passed"] is None, s["_log"]
    assert s["engine_errors"]["spec"]["error"] == "ValueError: refused by the fake"
    assert s["progress"]["plain"]["phases_done"] == 2
