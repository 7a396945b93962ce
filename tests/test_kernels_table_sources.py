"""bench/kernels_table.py reads every bench/results file and names each row's run
(bench/result_source.py): machine, date and job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kernels_table as kt
from result_source import NOT_RECORDED, Source, source

RESULTS = kt.RESULTS


def test_each_generation_of_results_gives_machine_date_and_job() -> None:
    old = {"device": "NVIDIA H200", "date": "2026-11-30",
           "command": "BENCH_ARGS=x PYTHON=python3 bash tests/gpu/run_on_device.sh"}
    assert source(old) == Source("H200", "2026-11-30", "run_on_device.sh")
    rc = {"run": {"device": "one NVIDIA H200 (sm_90, CUDA 13), torch 2.11, vLLM 0.22.1,"
                            " 2026-12-01", "job": "attn_decode_bench",
                  "command": "python3 tests/gpu/round_call.py --out $OUT"},
          "started": "2026-11-29T10:00:00+00:00"}
    assert source(rc) == Source("H200", "2026-12-01", "attn_decode_bench")
    stamped = {"device": "Tesla V100-SXM2-32GB", "started": "2026-12-02T01:02:03+00:00",
               "command": "python3 bench/bench_fmha.py --out x.json"}
    assert source(stamped) == Source("Tesla V100-SXM2-32GB", "2026-12-02", "bench_fmha.py")
    assert source({"what": "PROJECTED op mix"}) == Source("none (projected)", NOT_RECORDED,
                                                          NOT_RECORDED)
    assert source({"what": "acceptance, on the CPU"}).machine == "CPU"
    assert source({}).cell() == f"{NOT_RECORDED}, {NOT_RECORDED}, {NOT_RECORDED}"
    assert Source("H200", "2026-12-01", "gdn").cell() == "H200, 2026-12-01, `gdn`"


def test_the_block_indexes_every_results_file_and_tables_the_attention_decode() -> None:
    block = kt.render(*kt.load(kt.DECODE_JSON, kt.READ_CEILING_JSON))
    for path in RESULTS.glob("*.json"):
        assert f"| `{path.name}` |" in block, path.name
    attn = json.loads((RESULTS / "h200_attention_decode.json").read_text())
    rows = kt.attention_rows(attn)
    assert len(rows) == len(attn["rows"]) and all(r in block for r in rows)
    first = attn["rows"][0]
    assert rows[0].startswith(f"| {first['context']:,} | {first['batch']} | {first['q_rows']} |")
    assert rows[0].endswith(f"| {source(attn).cell()} |")
    assert "2026-12-01, `attn_decode_bench` |" in rows[0]  # the run of that file, not the 30th


def test_every_table_row_ends_with_its_files_run() -> None:
    results = kt.load_results(RESULTS)
    decode, ceiling = results["h200_decode_kernels.json"], results["h200_read_ceiling.json"]
    assert all(r.endswith(f"| {source(decode).cell()} |")
               for r in kt.table_rows(decode, ceiling))
    for name, (_title, head, rows) in kt.TABLES.items():
        got = rows(results[name])
        assert got and all(r.endswith(f"| {source(results[name]).cell()} |") for r in got)
        assert all(r.count("|") == head[0].count("|") for r in got), name


def test_a_new_results_file_appears_in_the_index(tmp_path: Path) -> None:
    for path in RESULTS.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "v100_new.json").write_text(json.dumps({
        "device": "Tesla V100-SXM2-32GB", "date": "2026-12-03",
        "command": "python3 bench/bench_gdn.py", "what": "GDN on a V100; timed"}))
    block = kt.render(*kt.load(kt.DECODE_JSON, kt.READ_CEILING_JSON), tmp_path)
    assert ("| `v100_new.json` | Tesla V100-SXM2-32GB | 2026-12-03 | `bench_gdn.py`"
            " | GDN on a V100 |") in block


def test_a_results_file_that_is_not_json_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(kt.TableError, match=r"broken\.json"):
        kt.load_results(tmp_path)
