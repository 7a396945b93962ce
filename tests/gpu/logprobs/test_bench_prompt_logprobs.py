"""bench/bench_prompt_logprobs.py and the device script's pure parts (CPU, no torch)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load("bench_prompt_logprobs", ROOT / "bench" / "bench_prompt_logprobs.py")
device = _load("device_logprobs", Path(__file__).with_name("device_logprobs.py"))


def _lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=None)


# Prompt [7, 3, 9], k = 2: position 1 scores token 3 (rank 4, outside the top 2), position
# 2 scores token 9 (rank 1: it is also the first of the top 2, so vLLM's dict has 2 keys).
PROMPT = [7, 3, 9]
PLP = [None,
       {3: _lp(-4.0, 4), 11: _lp(-0.5, 1), 12: _lp(-1.0, 2)},
       {9: _lp(-0.2, 1), 5: _lp(-2.0, 2)}]


def test_arrays_from_prompt_logprobs() -> None:
    got = bench.arrays_from_prompt_logprobs(PROMPT, PLP, 2)
    assert got == {"target_lp": [-4.0, -0.2], "target_rank": [4, 1],
                   "top_ids": [11, 12, 9, 5], "top_lp": [-0.5, -1.0, -0.2, -2.0]}


def test_arrays_refuse_a_missing_prompt_token() -> None:
    with pytest.raises(ValueError, match="position 1: the prompt token 3 is missing"):
        bench.arrays_from_prompt_logprobs(PROMPT, [None, {11: _lp(-0.5, 1)}, PLP[2]], 2)
    with pytest.raises(ValueError, match="2 prompt-logprob positions for a 3-token prompt"):
        bench.arrays_from_prompt_logprobs(PROMPT, PLP[:2], 2)


def test_arrays_round_trip_and_compare(tmp_path: Path) -> None:
    arrays = bench.arrays_from_prompt_logprobs(PROMPT, PLP, 2)
    bench.save_arrays(arrays, 2, tmp_path / "a")
    back = bench.load_arrays(tmp_path / "a")
    assert back["positions"] == 2 and list(back["top_ids"]) == [11, 12, 9, 5]
    same = bench.compare_arrays(back, back)
    assert same["passed"] and same["target_bitwise_equal"] == 2


def _arrays(target: list[float], ids: list[int], top: list[float], k: int = 2) -> dict:
    return {"positions": len(target), "k": k, "target_lp": target,
            "target_rank": [1] * len(target), "top_ids": ids, "top_lp": top}


def test_compare_finds_a_logprob_difference_above_fp32_rounding() -> None:
    ref = _arrays([-1.0, -2.0], [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4])
    close = _arrays([-1.0 + 2e-6, -2.0], [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4])
    far = _arrays([-1.0, -2.001], [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4])
    assert bench.compare_arrays(ref, close)["passed"]
    got = bench.compare_arrays(ref, far)
    assert not got["passed"] and got["max_abs_dtarget_logprob"] == pytest.approx(1e-3)
    assert bench.compare_arrays(ref, far, tol=2e-3)["passed"]


def test_compare_tells_a_tie_swap_from_a_wrong_token() -> None:
    ref = _arrays([-1.0], [1, 2], [-0.5, -0.5])  # ids 1 and 2 tie
    swapped = _arrays([-1.0], [2, 1], [-0.5, -0.5])
    wrong = _arrays([-1.0], [1, 7], [-0.5, -0.5 - 1e-3])
    got = bench.compare_arrays(ref, swapped)
    assert got["passed"] and got["top_id_mismatch_positions"] == 1
    got = bench.compare_arrays(_arrays([-1.0], [1, 2], [-0.5, -0.6]), wrong)
    assert not got["passed"] and got["top_id_mismatch_untied"] == 1


def _side(rows: int, peak: int, base: int, err: str | None = None) -> dict[str, Any]:
    return {"prompt_chunk": rows, "plugin": {"prompt_logprobs": f"{rows}"},
            "steps": {"no_logprobs": {"peak_over_start": base},
                      "prompt_logprobs": {"peak_over_start": peak, "error": err,
                                          "max_memory_allocated": peak + 10, "seconds": 1.0}}}


def test_combine_and_verdict(tmp_path: Path) -> None:
    g = bench.GIB
    pair = bench.combine(_side(0, 4 * g, g), _side(256, g + g // 2, g))
    assert pair["before"]["logprobs_extra"] == 3 * g
    assert pair["after"]["logprobs_extra"] == g // 2
    assert pair["after_over_before_peak"] == pytest.approx(0.375)
    pair["logprobs"] = {"within_noise": True}
    assert bench.verdict({"int8": pair}) is True
    pair["logprobs"] = {"within_noise": False}
    assert bench.verdict({"int8": pair}) is False
    assert bench.verdict({"fp16": pair}) is False  # without int8, the fp16 pair decides
    assert bench.verdict({"int8": {"before": {}}, "fp16": dict(pair, logprobs={
        "within_noise": True})}) is True
    assert bench.verdict({"int8": {"before": {}}}) is None
    text = bench.write(tmp_path, {"int8": pair})
    assert "| int8 | before | all | 4.000 | 4.000 | 3.000 | - | 1.0 |  |" in text
    assert "| int8 | after | 256 | 1.500 | 1.500 | 0.500 | - | 1.0 |  |" in text
    assert json.loads((tmp_path / "bench_prompt_logprobs.json").read_text())["passed"] is False


def test_verdict_needs_a_smaller_peak() -> None:
    g = bench.GIB
    pair = bench.combine(_side(0, 2 * g, g), _side(256, 2 * g, g))
    pair["logprobs"] = {"within_noise": True}
    assert bench.verdict({"int8": pair}) is False


def test_pair_from_dir(tmp_path: Path) -> None:
    for sub in ("sides", "arrays"):
        (tmp_path / sub).mkdir()
    g = bench.GIB
    after = _side(256, g, g // 2)
    after["steps"]["direct"] = {"max_abs_dlogprob": 5e-4}
    for name, side in (("before", _side(0, 3 * g, g // 2)), ("after", after)):
        (tmp_path / "sides" / f"int8_{name}.json").write_text(json.dumps(side))
    ref = _arrays([-1.0, -2.0], [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4])
    sut = _arrays([-1.0, -2.0 + 4e-4], [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4])
    for name, arr in (("before", ref), ("after", sut)):
        bench.save_arrays(arr, 2, tmp_path / "arrays" / f"int8_{name}")
    pair = bench.pair_from_dir(tmp_path, "int8")
    assert pair is not None
    # 4e-4 is above fp32 rounding but within twice the head's own 5e-4 GEMM difference.
    assert not pair["logprobs"]["passed"] and pair["logprobs"]["within_noise"]
    assert pair["logprobs"]["noise_bound"] == pytest.approx(1e-3)
    assert bench.verdict({"int8": pair}) is True
    assert bench.pair_from_dir(tmp_path, "fp16") is None


def test_device_script_pure_parts() -> None:
    assert json.loads(device.plugin_config(0)) == {"logprobs": {"prompt_chunk": 0}}
    assert device.engine_share(0.3, 2) == 0.15
    with pytest.raises(ValueError, match="SM70_GPU_SHARE is 0"):
        device.engine_share(0, 2)
    assert device.should_start_pair(0, 500, None) is None
    assert device.should_start_pair(1, 100, 150.0) is not None
    assert device.should_start_pair(1, 400, 150.0) is None
    ids = device.prompt_ids(device.PROMPT_LEN, 2)
    assert len(ids) == 32768 and max(ids) < device.TOKEN_CAP
    assert device.PROMPT_LEN + 1 <= device.MAX_LEN
    # The last chunk's rows exceed a slice, so 'after' really slices it.
    assert (device.PROMPT_LEN - 1) % device.MAX_BATCHED > device.ROWS_PER_SLICE


def test_memory_lines() -> None:
    log = ("INFO 12-01 [gpu_model_runner.py:5133] Model loading took 6.1 GiB memory and 3 s\n"
           "INFO noise\n"
           "INFO [gpu_worker.py:377] Initial free memory 120.0 GiB, reserved 2.0 GiB memory\n")
    assert bench.memory_lines(log) == ["Model loading took 6.1 GiB memory and 3 s",
                                       "Initial free memory 120.0 GiB, reserved 2.0 GiB memory"]
