"""docs/kernels.md: its measured-figures table is the one bench/kernels_table.py generates from
the committed bench JSON, and its prose carries no run's timings."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kernels_table as kt

DOC = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def results() -> tuple[dict, dict]:
    return kt.load(kt.DECODE_JSON, kt.READ_CEILING_JSON)


def test_doc_table_is_generated_from_the_committed_bench_json(capsys):
    rc = kt.main(["--check", str(DOC)])
    assert rc == 0, (
        capsys.readouterr().err + " (python bench/kernels_table.py --write docs/kernels.md)"
    )


def test_a_changed_figure_makes_the_doc_stale(tmp_path, capsys):
    decode, _ = results()
    decode["gemv"][0]["us"] += 1.0
    changed = tmp_path / "decode.json"
    changed.write_text(json.dumps(decode))
    rc = kt.main(["--check", str(DOC), "--decode", str(changed)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "stale" in err and "--write" in err and err.count("\n") == 1


def test_write_replaces_only_the_block_and_is_idempotent(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{kt.BEGIN}\nold | table\n{kt.END}\nafter\n")
    assert kt.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert text == "before\n" + kt.render(*results()) + "\nafter\n"
    assert kt.main(["--write", str(doc)]) == 0
    assert doc.read_text() == text
    assert kt.main(["--check", str(doc)]) == 0


def test_doc_without_markers_is_a_one_line_error(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("no markers here\n")
    assert kt.main(["--check", str(doc)]) == 2
    err = capsys.readouterr().err
    assert "markers" in err and err.count("\n") == 1


def test_results_without_a_field_name_it():
    decode, read_ceiling = results()
    del decode["copy_gbps"]
    with pytest.raises(kt.TableError, match="'copy_gbps'"):
        kt.render(decode, read_ceiling)


def test_one_row_per_measured_case_and_the_emulated_path_marked():
    decode, read_ceiling = results()
    rows = kt.table_rows(decode, read_ceiling)
    assert len(rows) == len(decode["gemv"]) + len(decode["decode"])
    emulated = [r for r in rows if "m8n8k4, emulated" in r]
    assert len(emulated) == sum(r.get("mma") == "m8n8k4" for r in decode["gemv"] + decode["decode"])
    qkv = next(r for r in rows if r.startswith("| gptq_gemv | qkv_proj 7168 x 5120, M = 1 |"))
    want = next(r for r in decode["gemv"] if r["shape"] == "qkv_proj" and r["m"] == 1)
    assert f"| {want['us']:.1f} | {100 * want['frac_of_copy']:.0f} % |" in qkv
    assert all(cell.count("|") == 10 for cell in rows)  # 9 columns, the last the run


def test_doc_prose_carries_no_run_timings_or_session_diaries():
    text = DOC.read_text()
    start, end = text.index(kt.BEGIN), text.index(kt.END)
    prose = text[:start] + text[end:]
    timings = re.findall(r"\d(?:\.\d+)? ?(?:us|ms)\b", prose)
    assert not timings, f"run timings outside the generated table: {timings[:5]}"
    assert not re.search(r"\bsessions?\b", prose, re.I), "run diaries belong in git history"
