"""The verdict of tests/gpu/serving/device_spec_diag.py (the H200 matrix of speculation x
prefix caching x our stack vs stock): pure, on made-up engine rows. A loss is a first
divergence above STRICT_MARGIN or a log-prob gap above STRICT_DLOGPROB on agreeing tokens;
the compare module's self-scaled noise bound must not excuse either."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent / "gpu" / "serving"
sys.path.insert(0, str(HERE.parent / "ab"))
sys.path.insert(0, str(HERE))
spec = importlib.util.spec_from_file_location("device_spec_diag", HERE / "device_spec_diag.py")
assert spec and spec.loader
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def _row(tokens: list[int], lps: list[float], margin: float = 1.0) -> dict[str, Any]:
    return {"tokens": tokens, "logprobs": lps, "prompt_len": 5,
            "top2": [[t, 0.0, t + 1, -margin] for t in tokens]}


def _engine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"phases": {"p": rows}}


def test_equal_rows_pass_and_reference_pairs() -> None:
    ref = _engine([_row([1, 2, 3], [-0.1, -0.2, -0.3])])
    got = diag.judge({"O0": ref, "ON": _engine([_row([1, 2, 3], [-0.11, -0.2, -0.3])]),
                      "S0": ref})
    assert set(got) == {"ON"} and got["ON"]["passed"]
    assert diag.reference_of("ONx") == "O0" and diag.reference_of("SA") == "S0"


def test_a_divergence_with_a_wide_reference_margin_is_a_loss() -> None:
    ref = _engine([_row([1, 2, 3], [-0.1, -0.2, -0.3], margin=2.0)])
    bad = _engine([_row([1, 9, 3], [-0.1, -0.2, -0.3])])
    v = diag.judge({"S0": ref, "SN": bad})["SN"]
    assert not v["passed"] and v["lost"][0]["step"] == 1


def test_a_narrow_margin_flip_is_rounding_but_a_large_gap_is_not() -> None:
    ref = _engine([_row([1, 2, 3], [-0.1, -0.2, -0.3], margin=0.1),
                   _row([4, 5], [-0.1, -0.1])])
    flip = _engine([_row([1, 9, 3], [-0.1, -0.2, -0.3]), _row([4, 5], [-0.1, -0.1])])
    assert diag.judge({"O0": ref, "OA": flip})["OA"]["passed"]
    # a 0.6 gap on agreeing tokens: compare's own noise bound (2x the largest gap) would
    # excuse any flip below 1.2; the strict verdict does not
    gap = _engine([_row([1, 9, 3], [-0.1, -0.2, -0.3]), _row([4, 5], [-0.7, -0.1])])
    v = diag.judge({"O0": ref, "OA": gap})["OA"]
    assert not v["passed"] and v["lost"] == []
    assert v["dlogprob_over"] == [("p", 1, 0.6)]


def test_matrix_names_and_plugin_config() -> None:
    assert set(diag.DEFAULT) <= set(diag.MATRIX)
    assert diag.engine_env("ONx")["SM70_PLUGIN_CONFIG"] == \
        '{"spec": {"settle_accepted_state": false}}'
    assert "SM70_PLUGIN_CONFIG" not in diag.engine_env("ON")
    kw = diag.engine_kwargs(Path("/t"), 0.02, {"ON", "SA"})
    assert kw["ON"]["speculative_config"]["method"] == "ngram"
    assert kw["ON"]["enable_prefix_caching"] is False and "mamba_cache_mode" not in kw["ON"]
    assert kw["SA"]["mamba_cache_mode"] == "align" and kw["SA"]["model"] == "/t/fp16"
    with pytest.raises(KeyError):
        diag.engine_env("XX")
