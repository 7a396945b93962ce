"""bench/bench_vllm_decode.py's arithmetic (CPU): cases paired by name, ours / stock."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "bench" / "bench_vllm_decode.py"
spec = importlib.util.spec_from_file_location("bench_vllm_decode", PATH)
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_combine_pairs_cases_and_divides_ours_by_stock():
    stock = [{"case": "decode b1 ctx1024", "step_ms": 2.0, "prefill_s": 0.1},
             {"case": "prefill 8192", "prefill_s": 0.5}]
    ours = [{"case": "prefill 8192", "prefill_s": 0.4},
            {"case": "decode b1 ctx1024", "step_ms": 1.1, "prefill_s": 0.2},
            {"case": "decode b4 ctx1024", "step_ms": 1.5}]  # stock lacks it: left out
    rows = bench.combine(stock, ours)
    assert [(r["case"], r["metric"]) for r in rows] == [
        ("prefill 8192", "prefill_s"), ("decode b1 ctx1024", "step_ms")]
    assert rows[1]["ours_over_stock"] == pytest.approx(0.55)
    assert rows[0]["ours_over_stock"] == pytest.approx(0.8)
    assert "| decode b1 ctx1024 | step_ms | 2.0 | 1.1 | 0.55 |" in bench.table(rows)


def test_quick_cases_drop_only_the_largest_case():
    assert set(bench.DECODE_CASES) - set(bench.QUICK_CASES) == {(16, 32768)}


def test_engine_step_is_first_to_last_new_token_per_step():
    from types import SimpleNamespace as NS

    outs = [NS(metrics=NS(num_generation_tokens=33, first_token_ts=10.0, last_token_ts=10.064)),
            NS(metrics=NS(num_generation_tokens=33, first_token_ts=20.0, last_token_ts=20.128))]
    # 32 steps between the first and the last new token: 2 ms and 4 ms, mean 3 ms
    assert bench.engine_step_ms(outs) == pytest.approx(3.0)
    # without request stats (disable_log_stats) or with one token there is no figure
    assert bench.engine_step_ms([NS(metrics=None)]) is None
    assert bench.engine_step_ms([NS(metrics=NS(num_generation_tokens=1, first_token_ts=1.0,
                                               last_token_ts=1.0))]) is None
