"""The A/B comparison's arithmetic (CPU): equality, logprob deltas, divergence margins."""

from __future__ import annotations

import pytest

from tests.gpu.ab.compare import compare_request, compare_sides


def _req(tokens, logprobs, top2=None, prompt_len=5):
    top2 = top2 or [[t, lp, t + 1, lp - 1.0] for t, lp in zip(tokens, logprobs, strict=True)]
    return {"prompt_len": prompt_len, "tokens": tokens, "logprobs": logprobs, "top2": top2}


def test_equal_requests_report_the_largest_delta():
    a = _req([1, 2, 3], [-0.1, -0.2, -0.3])
    b = _req([1, 2, 3], [-0.1, -0.25, -0.3])
    r = compare_request(a, b)
    assert r["equal"] and "first_diff" not in r
    assert r["max_abs_dlogprob"] == pytest.approx(0.05)


def test_divergence_reports_the_reference_margin_and_stops_the_deltas():
    top2 = [[1, -0.1, 9, -2.0], [2, -0.5, 7, -0.52], [3, -0.1, 4, -3.0]]
    a = _req([1, 2, 3], [-0.1, -0.5, -0.1], top2)
    b = _req([1, 7, 5], [-0.11, -0.4, -9.0])
    r = compare_request(a, b)
    assert not r["equal"]
    assert r["first_diff"]["step"] == 1
    assert r["first_diff"]["ref_margin"] == pytest.approx(0.02)
    assert r["first_diff"]["sut_took_ref_second"]
    # only the agreeing step 0 counts: the later -9.0 is after the paths split
    assert r["max_abs_dlogprob"] == pytest.approx(0.01)


def test_a_shorter_output_is_a_divergence():
    r = compare_request(_req([1, 2, 3], [0.0] * 3), _req([1, 2], [0.0] * 2))
    assert not r["equal"] and r["first_diff"]["step"] == 2


def test_sides_pass_when_flips_are_within_noise_and_fail_otherwise():
    ref = {"phases": {"single": [
        _req([1, 2], [-0.1, -0.1], [[1, -0.1, 5, -0.2], [2, -0.1, 6, -0.105]]),
        _req([3, 4], [-0.1, -0.1]),
    ]}}
    sut = {"phases": {"single": [_req([1, 6], [-0.103, -0.1]), _req([3, 4], [-0.1, -0.1])]}}
    out = compare_sides(ref, sut)
    assert out["requests"] == 2 and out["equal_requests"] == 1 and not out["all_equal"]
    assert out["noise_bound"] == pytest.approx(0.006)
    assert out["divergences"][0]["within_noise"]  # margin 0.005 <= 0.006
    assert out["passed"]
    # the same flip where the reference was sure (margin 1.0) fails
    ref["phases"]["single"][0]["top2"][1] = [2, -0.1, 6, -1.1]
    assert not compare_sides(ref, sut)["passed"]


def test_a_phase_missing_on_one_side_fails():
    ref = {"phases": {"single": [_req([1], [0.0])], "batch16": [_req([1], [0.0])]}}
    sut = {"phases": {"single": [_req([1], [0.0])]}}
    out = compare_sides(ref, sut)
    assert out["missing_phases"] == ["batch16"] and not out["passed"]


def test_nothing_compared_is_not_a_pass():
    assert not compare_sides({"phases": {}}, {"phases": {}})["passed"]
