"""The pure parts of tests/gpu/serving/device_assist.py (the H200 proof of the n-gram
assist): argument parsing, the engines' settings, the plans, and the verdict on made-up
engine outputs (lossless, a corrupted token, an assist that never ran, E1 with the assist
on, an engine that produced nothing)."""

from __future__ import annotations

import copy
import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent / "gpu" / "serving" / "device_assist.py"


@pytest.fixture(scope="module")
def da() -> Any:
    spec = importlib.util.spec_from_file_location("device_assist", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_assist"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_parse_driver_and_engine(da: Any, tmp_path: Path) -> None:
    a = da.parse(["--out", str(tmp_path), "--budget-s", "300"])
    assert a.mode is None and a.out == tmp_path and a.budget_s == 300
    e = da.parse(["engine", "--name", "E2", "--kwargs", "k.json", "--out", "o.json",
                  "--plan-dir", "p", "--deadline", "12.5"])
    assert e.mode == "engine" and e.name == "E2" and e.deadline == 12.5
    with pytest.raises(SystemExit):
        da.parse(["--budget-s", "3"])


def test_engines_differ_only_in_speculation_and_assist(da: Any) -> None:
    cfg = da.engine_configs("/m", 0.026, 1 << 29)
    assert "speculative_config" not in cfg["E0"]
    for n in ("E1", "E2"):
        assert cfg[n]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
        assert cfg[n]["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
        assert cfg[n]["async_scheduling"] is False and cfg[n]["disable_log_stats"] is False
        assert cfg[n]["gpu_memory_utilization"] == 0.026
        assert cfg[n]["kv_cache_memory_bytes"] == 1 << 29
    assert cfg["E1"] == cfg["E2"]
    pc = da.plugin_configs()
    assert pc["E1"]["spec"]["ngram_assist"] is False and pc["E2"]["spec"]["ngram_assist"]
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1\.5"):
        da.engine_configs("/m", 1.5, 1)


def test_plans(da: Any) -> None:
    s1 = da.stage1_plan()
    (seed,) = s1["phases"]["seed"][0]
    assert len(seed["prompt"]) == 48 and seed["max_tokens"] == 512
    s2 = da.stage2_plan(seed["prompt"], list(range(512)))
    assert set(s2["phases"]) == {"accept_tail", "accept_repeat2", "accept_cycle16",
                                 "accept_random", "mixed"}
    mixed = s2["phases"]["mixed"][0]
    assert [r["max_tokens"] for r in mixed] == list(da.MIXED_TOKENS)
    assert len({r["max_tokens"] for r in mixed}) == len(mixed)  # rows finish apart
    with pytest.raises(ValueError):
        da.stage2_plan(seed["prompt"], [1, 2])


def _row(prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    return {"prompt_len": len(prompt), "tokens": tokens, "logprobs": [-0.5] * len(tokens),
            "top2": [[t, -0.5, t + 1, -3.0] for t in tokens]}


def _engines(da: Any) -> tuple[dict[str, Any], dict[str, list[int]]]:
    rng = random.Random(5)
    loop = [rng.randrange(900) for _ in range(10)]
    out = (loop * 52)[:512]
    s1 = da.stage1_plan()
    prompt = s1["phases"]["seed"][0][0]["prompt"]
    s2 = da.stage2_plan(prompt, out)
    phases = {"seed": [_row(prompt, out)]}
    for ph, subs in s2["phases"].items():
        phases[ph] = [_row(r["prompt"], [rng.randrange(900) for _ in range(r["max_tokens"])])
                      for r in subs[0]]
    # a tail case whose continuation copies the loop (what n-gram would accept)
    phases["accept_tail"] = [_row(s2["phases"]["accept_tail"][0][0]["prompt"], out[384:448])]
    zero = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
            "vllm:spec_decode_num_accepted_tokens": 0}
    after = {"vllm:spec_decode_num_drafts": 21, "vllm:spec_decode_num_draft_tokens": 63,
             "vllm:spec_decode_num_accepted_tokens": 42}
    engines: dict[str, Any] = {}
    for n in da.ENGINES:
        on = n == "E2"
        final = ({"active": True, "calls": 90, "rows": 120, "rows_with_ngram_draft": 60,
                  "rows_chose_ngram": 40, "rows_measured": 100} if on else
                 {"active": False, "why": "not called yet"})
        records = {ph: {"before": zero, "after": after,
                        "assist_before": {"active": on, "rows": 0, "rows_chose_ngram": 0},
                        "assist_after": {"active": on, "rows": 20, "rows_chose_ngram": 15}}
                   for ph in phases}
        engines[n] = {"phases": copy.deepcopy(phases), "records": records,
                      "assist_final": final, "error": None}
    prompts = {ph: subs[0][0]["prompt"] for ph, subs in s2["phases"].items()
               if ph.startswith("accept_")}
    return engines, prompts


def test_judge_passes_lossless_with_assist_on(da: Any) -> None:
    engines, prompts = _engines(da)
    s = da.judge(engines, prompts)
    assert s["passed"] is True
    assert s["repetitive_case"] == "accept_tail"
    tail = s["cases"]["accept_tail"]["E2"]
    assert tail["assist"]["chose_ngram_share"] == 0.75
    assert tail["tokens_per_step"] == pytest.approx(63 / 21)
    h = s["headline"]
    assert h["repetitive"]["case"] == "accept_tail"
    assert h["repetitive"]["ngram_only_predicted_tokens_per_step"] > 1.5
    assert h["non_repetitive"]["case"] == "accept_random"


@pytest.mark.parametrize("bug", ["corrupt_E2", "assist_never_ran", "assist_on_in_E1",
                                 "E2_missing_phase"])
def test_judge_fails(da: Any, bug: str) -> None:
    engines, prompts = _engines(da)
    if bug == "corrupt_E2":  # a token flipped where the reference margin is wide
        engines["E2"]["phases"]["accept_random"][0]["tokens"][5] += 1
    elif bug == "assist_never_ran":
        engines["E2"]["assist_final"] = {"active": False, "why": "off: failed (X: y)"}
    elif bug == "assist_on_in_E1":
        engines["E1"]["assist_final"] = dict(engines["E2"]["assist_final"])
    else:
        del engines["E2"]["phases"]["mixed"]
    assert da.judge(engines, prompts)["passed"] is False


def test_judge_without_output_is_undecided(da: Any) -> None:
    engines, prompts = _engines(da)
    engines["E1"] = {"error": "RuntimeError: refused", "phases": {}}
    assert da.judge(engines, prompts)["passed"] is None


def test_driver_end_to_end_on_the_stand_in_vllm(tmp_path: Path) -> None:
    """The driver, its three engine processes and the judge against the stand-in vLLM of
    tests/gpu/serving/fake_vllm: every phase reaches every engine and compares equal, and
    the verdict is False because the stand-in has no runner, so no assist ran in E2."""
    import json
    import os
    import subprocess

    fake = SCRIPT.parent / "fake_vllm"
    env = dict(os.environ, PYTHONPATH=str(fake), SM70_GPU_SHARE="0.08",
               SM70_AB_TINY=str(tmp_path / "none"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work"), "--budget-s", "90"],
                          env=env, capture_output=True, text=True, timeout=150, check=False)
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s.get("judge_error") is None, s.get("judge_traceback")
    for n in ("E1", "E2"):
        lossless = s["headline"]["lossless"][n]
        assert lossless["passed"] and lossless["requests"] == 9, proc.stdout[-2000:]
    assert set(s["cases"]) == {"seed", "accept_tail", "accept_repeat2", "accept_cycle16",
                               "accept_random", "mixed"}
    assert s["assist_active"]["E2"] is None and s["passed"] is False
    assert proc.returncode == 1
