"""The verdicts of tests/gpu/clef/device_clef_vllm.py on made-up engine results: each check
passes on good figures and fails on the failure it exists for (pure: no torch, no vLLM)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE / "gpu" / "clef", HERE / "gpu" / "ab"):
    sys.path.insert(0, str(p))

import device_clef_vllm as d  # noqa: E402
from clef_vllm_fixtures import results  # noqa: E402


def test_good_figures_pass() -> None:
    r = results()
    assert d.check_chat_bits(r["ours"])["passed"]
    assert d.check_clef_vs_merged(r["ours"], r["merged"])["passed"]


def test_a_chat_row_off_by_one_ulp_fails_the_bit_check() -> None:
    assert not d.check_chat_bits(results(chat_change=1e-12)["ours"])["passed"]


def test_an_unapplied_correction_fails_both_checks() -> None:
    r = results(clef_shift=0.0, merged_off=-0.4)  # Clef rows equal the chat-only rows
    assert not d.check_chat_bits(r["ours"])["passed"]
    assert not d.check_clef_vs_merged(r["ours"], r["merged"])["passed"]


def test_clef_rows_off_the_merged_reference_fail() -> None:
    r = results(merged_off=0.1)
    c = d.check_clef_vs_merged(r["ours"], r["merged"])
    assert not c["passed"] and c["tolerance"] == pytest.approx(0.02)


def test_no_divergence_is_excused_by_a_small_margin() -> None:
    tol = 0.02
    base = {"max_abs_dlogprob": 0.001, "equal": False}
    assert not d.row_within({**base, "first_diff": {"ref_margin": 0.001, "step": 3}}, tol)
    assert d.row_controlled({**base, "first_diff": {"ref_margin": 0.001, "step": 3}}, tol)
    same = {"max_abs_dlogprob": 0.001, "equal": True}
    assert d.row_within(same, tol) and not d.row_controlled(same, tol)
    far = {"max_abs_dlogprob": 0.05, "equal": True}  # same tokens, log-probs off: caught
    assert not d.row_within(far, tol) and d.row_controlled(far, tol)


# the last H200 run: its per-row comparisons are recorded beside its figures
LATEST = HERE / "gpu" / "results" / "h200_clef_vllm.json"


def latest_rows() -> tuple[dict[str, Any], list[dict], list[dict]]:
    part = json.loads(LATEST.read_text())["parts"]["clef_vs_merged"]
    return part, part["clef"], part["uncorrected"]


def test_the_latest_runs_rows_give_its_recorded_verdict() -> None:
    part, clef, unc = latest_rows()
    tol = d.clef_tolerance(part["noise"])
    assert tol == pytest.approx(part["tolerance"])
    assert all(d.row_within(r, tol) for r in clef)
    v = d.control_verdict(unc, tol)
    assert v["passed"] and v["controlled"] == len(unc) == 4
    assert v["first_divergence"] == part["figures"]["uncorrected_first_divergence"]


def test_a_dropped_correction_fails_on_the_latest_runs_rows() -> None:
    """With the correction gone, the Clef rows are the uncorrected ones (diverging from the
    merged engine, some at small reference margins) and the control's rows are the
    corrected ones (no divergence): both checks must refuse."""
    part, clef, unc = latest_rows()
    tol = d.clef_tolerance(part["noise"])
    assert min(r["first_diff"]["ref_margin"] for r in unc) < tol  # a near tie among them
    assert not any(d.row_within(r, tol) for r in unc)
    assert not d.control_verdict(clef, tol)["passed"]
    assert not d.control_verdict([], tol)["passed"]


def test_memory_must_not_grow_after_the_first_burst() -> None:
    b = [{"allocated": 100, "reserved": 200}] * 2
    assert d.no_growth(b)
    assert not d.no_growth([*b, {"allocated": 100 + (5 << 20), "reserved": 200}])
    assert not d.no_growth(b[:1])  # one burst proves nothing


def test_memory_fails_unless_the_one_allocation_is_the_plans() -> None:
    m = {"correction_bytes": 4000, "format_bytes": 4000, "arena_rule_bytes": 2 << 20,
         "storages": 1, "head_bytes": 10, "hook": ["installed"],
         "allocator": {"block_bytes": 2 << 20}}
    assert d.check_memory({"phases": {"memory": m}})["passed"]
    for key, value in (("storages", 372), ("allocator", {"block_bytes": (2 << 20) + 512}),
                       ("allocator", {"error": "no allocator block"}),
                       ("correction_bytes", 3488), ("hook", [])):
        bad = {**m, key: value}
        assert not d.check_memory({"phases": {"memory": bad}})["passed"], key


def test_scoring_fails_on_a_wrong_row_or_a_leak() -> None:
    case = {"got_scores": True, "got_hidden": True, "max_abs_err": 1e-5, "ref_scale": 0.02,
            "top5_overlap": 5, "top5_max_dlogprob": 1e-3}
    ok = {"phases": {"scoring": {"cases": [case], "left_in_store": {"partial": 0, "done": 0}}}}
    assert d.check_scoring(ok)["passed"]
    wrong_row = copy.deepcopy(ok)
    wrong_row["phases"]["scoring"]["cases"][0]["top5_overlap"] = 1
    assert not d.check_scoring(wrong_row)["passed"]
    leak = copy.deepcopy(ok)
    leak["phases"]["scoring"]["left_in_store"]["done"] = 1
    assert not d.check_scoring(leak)["passed"]
