"""The benches' shared helpers: writing results (bench/bench_io.py) and the timing rules of
bench/gpu_timing.py, the latter against a stand-in torch.cuda whose events report set times
(no GPU here)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_io
import gpu_timing


def test_result_json_and_its_table_beside(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "r.json"
    result = {"rows": [{"a": 1}], "errors": []}
    bench_io.write_result(out, result, lambda rows: f"{len(rows)} rows\n")
    assert json.loads(out.read_text()) == result and out.read_text().startswith("{\n \"rows\"")
    assert (tmp_path / "deep" / "r.md").read_text() == "1 rows\n"
    bench_io.write_json(out, {"x": 1}, indent=2, newline=True)
    assert out.read_text() == '{\n  "x": 1\n}\n'
    bench_io.write_failure(out, "Traceback ...")
    assert out.read_text() == '{"rows": [], "errors": ["Traceback ..."]}'


def test_md_table() -> None:
    got = bench_io.md_table(("a", "b"), [(1, "x"), ("", 2.5)])
    assert got == "| a | b |\n|---|---|\n| 1 | x |\n|  | 2.5 |"


def test_new_result_records_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench/bench_fmha.py", "--out", "x.json"])
    r = bench_io.new_result("what", "GPU", {"h": 1})
    assert r == {"what": "what", "device": "GPU", "command": "python3 bench/bench_fmha.py --out"
                 " x.json", "shape": {"h": 1}, "rows": [], "errors": []}


def test_run_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = types.SimpleNamespace(out=str(tmp_path / "r.json"))
    assert bench_io.run_and_report(lambda a: {"rows": [1], "errors": []}, args,
                                   lambda rows: f"table {rows}") == 0
    assert "table [1]" in capsys.readouterr().out
    assert bench_io.run_and_report(lambda a: {"rows": [], "errors": ["e"]}, args, str) == 1

    def no_gpu(a: Any) -> dict[str, Any]:
        raise RuntimeError("no CUDA")

    with pytest.raises(RuntimeError):
        bench_io.run_and_report(no_gpu, args, str)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["rows"] == [] and "RuntimeError: no CUDA" in saved["errors"][0]


class _Clock:
    """Event times from a script: each timed call lasts the next listed milliseconds (the
    last one again once the list is spent)."""

    def __init__(self, durations_ms: list[float]) -> None:
        self.durations = list(durations_ms)
        self.now = 0.0

    def event(self, enable_timing: bool = False) -> Any:
        clock = self

        class Event:
            t = 0.0

            def record(self) -> None:
                self.t = clock.now

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, other: Any) -> float:
                return other.t - self.t

        return Event()

    def call(self) -> None:
        self.now += self.durations.pop(0) if len(self.durations) > 1 else self.durations[0]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock([])
    cuda = types.SimpleNamespace(Event=c.event, synchronize=lambda: None)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    return c


def test_event_seconds_times_the_call(clock: _Clock) -> None:
    clock.durations = [250.0]
    assert gpu_timing.event_seconds(clock.call) == pytest.approx(0.25)


def test_time_ms_warms_up_then_takes_the_middle(clock: _Clock) -> None:
    clock.durations = [1000.0, 5.0, 1.0, 3.0]  # the warm-up's 1000 is not counted
    assert gpu_timing.time_ms(clock.call, min_reps=3, target_s=0) == 3.0
    clock.durations = [1000.0, 5.0, 1.0, 3.0, 4.0]  # even count: the upper middle
    assert gpu_timing.time_ms(clock.call, min_reps=4, target_s=0) == 4.0


def test_time_against_peaks(clock: _Clock) -> None:
    clock.durations = [9.0, 2.0]
    row: dict[str, Any] = {}
    gpu_timing.time_against_peaks(row, clock.call, 4e12, {"m16n8k16": 4000.0, "m8n8k4": 20.0})
    assert list(row) == ["ms", "tflops", "frac_of_m8n8k4_peak", "frac_of_m16n8k16_peak"]
    assert row["tflops"] == pytest.approx(2000.0)
    assert row["frac_of_m8n8k4_peak"] == pytest.approx(100.0)
    assert row["frac_of_m16n8k16_peak"] == pytest.approx(0.5)
    row = {}
    clock.durations = [1.0]
    gpu_timing.time_against_peaks(row, clock.call, 1.0, {})
    assert "frac_of_m8n8k4_peak" not in row


def test_record_peaks_keeps_a_failure_as_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(kernels: Any) -> dict[str, float]:
        raise RuntimeError("no fmha_tc_peak")

    monkeypatch.setattr(gpu_timing, "measure_peaks", broken)
    result: dict[str, Any] = {"errors": []}
    assert gpu_timing.record_peaks(None, result) == {}
    assert result == {"errors": ["peak: RuntimeError('no fmha_tc_peak')"]}
    monkeypatch.setattr(gpu_timing, "measure_peaks", lambda kernels: {"m8n8k4": 13.9})
    assert gpu_timing.record_peaks(None, result) == {"m8n8k4": 13.9}
    assert result["peak_tflops"] == {"m8n8k4": 13.9}


def test_cell_formats_a_value_and_marks_a_missing_one() -> None:
    assert bench_io.cell(None, ".3f") == "-"
    assert bench_io.cell(0.0, ".1f") == "0.0"  # zero is a value, not a missing one
    assert bench_io.cell(2, ".3f") == "2.000"
    assert bench_io.cell(0.25, ".1f", 100, " %") == "25.0 %"
    assert bench_io.cell(1.5, ".2f", suffix="x") == "1.50x"


def test_tensor_core_parser() -> None:
    ap = bench_io.tensor_core_parser("First paragraph.\n\nMore.", "8192", "tokens per case")
    ap.add_argument("--seqs", default="1")
    args = ap.parse_args(["--out", "r.json"])
    assert (args.out, args.tokens, args.budget_s, args.seqs) == ("r.json", "8192", 600.0, "1")
    args = ap.parse_args(["--out", "r.json", "--tokens", "5,6", "--budget-s", "7"])
    assert (args.tokens, args.budget_s) == ("5,6", 7.0)
    assert ap.description == "First paragraph."
    with pytest.raises(SystemExit):
        ap.parse_args([])  # --out is required


class _Kernels:
    """The arch-path switch of our ops, recorded."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def set_arch_path(self, path: str) -> None:
        self.paths.append(path)


def test_time_on_arch_path_times_then_runs_then_on_that_path(clock: _Clock) -> None:
    kernels = _Kernels()
    clock.durations = [4.0]
    row: dict[str, Any] = {"tokens": 8192, "impl": "sm70_volta"}
    errors: list[str] = []

    def then() -> str:
        return f"output on {kernels.paths[-1]}"

    got = gpu_timing.time_on_arch_path(kernels, row, "sm70", clock.call, 8e9, {"m8n8k4": 4.0},
                                       errors, then=then)
    assert got == "output on sm70" and errors == []
    assert kernels.paths == ["sm70", "native"]
    assert row["ms"] == 4.0 and row["frac_of_m8n8k4_peak"] == pytest.approx(0.5)
    assert gpu_timing.time_on_arch_path(kernels, {"tokens": 1, "impl": "x"}, "native",
                                        clock.call, 1.0, {}, errors) is None


def test_time_on_arch_path_records_a_failure_and_goes_back_to_native(clock: _Clock) -> None:
    kernels = _Kernels()

    def broken() -> None:
        raise RuntimeError("no sm70 path")

    row: dict[str, Any] = {"tokens": 8192, "impl": "sm70_volta"}
    errors: list[str] = []
    assert gpu_timing.time_on_arch_path(kernels, row, "sm70", broken, 1.0, {}, errors) is None
    assert row["error"] == "RuntimeError('no sm70 path')"
    assert errors[0].startswith("sm70_volta 8192: Traceback") and "no sm70 path" in errors[0]
    assert kernels.paths == ["sm70", "native"]
    clock.durations = [1.0]
    row = {"tokens": 64, "impl": "two_pass_native"}
    assert gpu_timing.time_on_arch_path(kernels, row, "native", clock.call, 1.0, {}, errors,
                                        then=broken) is None
    assert "ms" in row and "error" in row and errors[1].startswith("two_pass_native 64: ")
    assert kernels.paths[-1] == "native"
