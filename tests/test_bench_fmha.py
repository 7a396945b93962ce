"""The pure pieces of bench/bench_fmha.py and tests/gpu/fmha/device_fmha.py: argument
rules, FLOP counts, the table, and how the device script reads junit and bench JSON
(tests/gpu/ops_job.py's readers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "tests" / "gpu" / "fmha"))

import bench_fmha  # noqa: E402
import bench_io  # noqa: E402
import device_fmha  # noqa: E402
import gpu_timing  # noqa: E402
import ops_job  # noqa: E402


def test_parse_tokens_and_case_shape():
    assert bench_io.parse_tokens("8192, 16384,") == [8192, 16384]
    for bad in ("", "8k", "0,8192"):
        with pytest.raises(ValueError, match="--tokens"):
            bench_io.parse_tokens(bad)
    assert bench_fmha.case_shape(8192, 2048) == (6144, 2048)
    assert bench_fmha.case_shape(1000, 2048) == (0, 1000)


def test_peak_flops_counts_every_instruction():
    # 8 chains x 8 warps per block, 2048 FLOPs per m8n8k4 (4 quad pairs x 8 x 8 x 4 x 2)
    assert gpu_timing.peak_flops("m8n8k4", 10, 3) == 2048 * 8 * 8 * 10 * 3
    assert gpu_timing.peak_flops("m16n8k16", 1, 1) == 2 * 16 * 8 * 16 * 8 * 8


def test_markdown_rows():
    text = bench_fmha.markdown([
        {"tokens": 8192, "ctx": 6144, "q_len": 2048, "impl": "sm70_volta", "ms": 2.0,
         "tflops": 30.0, "frac_of_m8n8k4_peak": 0.25},
        {"tokens": 8192, "impl": "vllm_triton", "error": "ImportError('x')"},
    ])
    lines = text.strip().splitlines()
    assert len(lines) == 4
    assert "| 8192 | 6144 | 2048 | sm70_volta | 2.000 | 30.0 | 25.0 % |" in lines[2]
    assert "ImportError" in lines[3] and "| - |" in lines[3]


def test_bench_main_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_fmha.main(["--out", "x.json", "--hq", "24", "--hkv", "5"])
    assert exc.value.code == 2
    assert "--hkv" in capsys.readouterr().err


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
errors="1" failures="2" skipped="3" tests="10"><testcase name="test_a"/>
<testcase name="test_b"><failure message="x"/></testcase>
<testcase name="test_c"><error message="y"/></testcase></testsuite></testsuites>"""


def test_junit_counts_and_failed(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    assert ops_job.junit_counts(path) == {"tests": 10, "failures": 2, "errors": 1,
                                              "skipped": 3, "passed": 4}
    assert ops_job.failed_tests(path) == ["test_b", "test_c"]
    assert ops_job.junit_counts(tmp_path / "missing.xml") == {}
    (tmp_path / "bad.xml").write_text("<oops")
    assert ops_job.failed_tests(tmp_path / "bad.xml") == []


def test_bench_figures_and_volta_rows():
    bench = {"peak_tflops": {"m8n8k4": 100.0}, "errors": ["e"], "rows": [
        {"tokens": 8192, "impl": "sm70_volta", "tflops": 40.0, "frac_of_m8n8k4_peak": 0.4},
        {"tokens": 8192, "impl": "sdpa", "tflops": 90.0, "rel_err_vs_sdpa": 1e-4},
        {"tokens": 16384, "impl": "sm70_volta", "error": "boom"},
    ]}
    fig = device_fmha.bench_figures(bench)
    assert fig["by_tokens"]["8192"] == {"sm70_volta_tflops": 40.0,
                                        "volta_frac_of_m8n8k4_peak": 0.4,
                                        "sdpa_tflops": 90.0, "ours_rel_err_vs_sdpa": 1e-4}
    assert fig["by_tokens"]["16384"] == {"sm70_volta_error": "boom"}
    assert ops_job.volta_rows_ok(bench, [8192])
    assert not ops_job.volta_rows_ok(bench, [8192, 16384])
    assert not ops_job.volta_rows_ok({}, [8192])


def test_device_script_refuses_a_tiny_budget(tmp_path, capsys):
    with pytest.raises(SystemExit):
        device_fmha.main(["--out", str(tmp_path), "--budget-s", "5"])
    assert "--budget-s" in capsys.readouterr().err
