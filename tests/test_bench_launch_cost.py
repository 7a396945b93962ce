"""bench/launch_cost.py: the launch-cost fit over timed rows of several sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import launch_cost as lc


def rows(points: list[tuple[int, float]]) -> list[dict]:
    return [{"case": f"c{i}", "bytes": b, "us": t} for i, (b, t) in enumerate(points)]


def test_fit_recovers_launch_cost_and_rate():
    # 2.5 us per launch plus bytes at 4000 GB/s (4000 bytes per ns = 4e6 bytes per us)
    pts = [(b, 2.5 + b / 4e6) for b in (20_000_000, 40_000_000, 90_000_000, 600_000_000)]
    fit = lc.fit_launch_cost(rows(pts))
    assert fit["t0_us"] == pytest.approx(2.5)
    assert fit["stream_gbps"] == pytest.approx(4000)
    assert fit["cases"] == 4


def test_fit_leaves_out_cases_below_min_bytes():
    pts = [(b, 1.0 + b / 2e6) for b in (20_000_000, 50_000_000, 100_000_000)]
    pts.append((65_536, 9.0))  # a 64 KB read far off the line must not move the fit
    fit = lc.fit_launch_cost(rows(pts), min_bytes=16 * 10**6)
    assert fit["t0_us"] == pytest.approx(1.0)
    assert fit["stream_gbps"] == pytest.approx(2000)
    assert fit["cases"] == 3


def test_fit_refuses_fewer_than_two_sizes():
    with pytest.raises(ValueError, match="two sizes"):
        lc.fit_launch_cost(rows([(20_000_000, 7.0), (20_000_000, 7.2), (1_000, 2.0)]))


def test_describe_fit_states_cost_rate_and_cases():
    pts = [(b, 2.5 + b / 4e6) for b in (20_000_000, 90_000_000)]
    line = lc.describe_fit(lc.fit_launch_cost(rows(pts)))
    assert line == "fit over the 2 cases of >= 16 MB: every launch 2.50 us + bytes at 4000 GB/s"
