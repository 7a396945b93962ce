"""`sm70ctl plan` does not contradict itself: every figure it prints is what the plan with
those settings gives (the what-fits rows applied one by one), a plan past the budget claims
no capacity, and the picture agrees with the verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from sm70ctl.plan.plan import what_fits
from sm70ctl.plan.report import gib
from sm70ctl.plan.run import plan_for_settings
from sm70ctl.settings import load_settings

SVG_NS = "{http://www.w3.org/2000/svg}"
# (--gpus, SM70_MAX_MODEL_LEN, other settings): the two refused plans, one past the
# budget and one whose KV pool is short of the max model length; then the latter with
# vLLM's unified pool layout and with two pipeline stages
REFUSED = [("2x16GiB", 262_144, {}), ("2xv100", 1_048_576, {}),
           ("2xv100", 1_048_576, {"SM70_SPLIT_POOLS": "false"}),
           ("4x16GiB", 1_048_576, {"SM70_PIPELINE_PARALLEL_SIZE": "2", "SM70_GPUS": "0,1,2,3"})]


def _settings(tmp_path: Path, **env: Any):
    environ = {"SM70_MODEL_DIR": str(tmp_path / "no-model"),
               **{k: str(v) for k, v in env.items()}}
    return load_settings(environ=environ)


def _plan(tmp_path: Path, gpus: str, **env: Any):
    return plan_for_settings(_settings(tmp_path, **env), gpus=gpus)


def _cli(tmp_path: Path, *args: str,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    base.update(SM70_MODEL_DIR=str(tmp_path / "no-model"), COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-m", "sm70ctl", "plan", *args], env=base,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("gpus", "max_len", "env"), REFUSED)
def test_every_what_fits_row_holds_when_applied(tmp_path: Path, gpus: str, max_len: int,
                                                env: dict[str, str]) -> None:
    def _plan_with(**more: Any):
        return _plan(tmp_path, gpus, **env, **more)

    run = _plan_with(SM70_MAX_MODEL_LEN=max_len)
    assert not run.plan.fits
    needed = run.inputs.tensor_parallel_size * run.inputs.pipeline_parallel_size
    rows = what_fits(run.model, run.inputs, run.gpus.gpus[:needed])
    assert len(rows) >= 2
    applied_some = False
    for row in rows:
        promised = row["longest_sequence"]
        # the row's settings, as a user sets them, with the max model length it promises
        at = _plan_with(**row["settings"], SM70_MAX_MODEL_LEN=max(promised, 1024))
        if promised < 1024:
            assert not at.plan.fits, row
            continue
        applied_some = True
        assert at.plan.fits, (row, at.plan.overflow)
        assert at.plan.longest_sequence == promised, row
        assert min(g.layout.pool_bytes for g in at.plan.gpus) == row["pool_bytes"], row
        # the promise is the longest: one block more does not fit
        block = at.plan.gpus[0].layout.block_size
        if promised + block <= 1_048_576:
            longer = _plan_with(**row["settings"], SM70_MAX_MODEL_LEN=promised + block)
            assert not longer.plan.fits, row
        held = _plan_with(**row["settings"], SM70_MAX_MODEL_LEN=max_len)
        assert held.plan.fits is row["holds_max_model_len"], row
    assert applied_some


def test_first_row_of_the_long_context_plan_is_what_its_setting_gives(tmp_path: Path) -> None:
    # row 1 once promised what the pool holds with one sequence's state slots (809,088
    # tokens then); applying its one setting, SM70_KV_CACHE_BYTES=0, reserves the slots of
    # every sequence and gives fewer. Figures derived here, so the test holds whatever the
    # pool arithmetic becomes.
    run = _plan(tmp_path, "2xv100", SM70_MAX_MODEL_LEN=1_048_576)
    first = what_fits(run.model, run.inputs, run.gpus.gpus[:2])[0]
    assert first["settings"] == {"SM70_KV_CACHE_BYTES": 0}
    applied = _plan(tmp_path, "2xv100", SM70_KV_CACHE_BYTES=0, SM70_MAX_MODEL_LEN=1_048_576)
    one_seq = _plan(tmp_path, "2xv100", SM70_KV_CACHE_BYTES=0, SM70_MAX_MODEL_LEN=1_048_576,
                    SM70_MAX_NUM_SEQS=1, SM70_STATE_BLOCK_MULTIPLIER=1)
    assert first["longest_sequence"] == applied.plan.longest_sequence
    assert 0 < first["longest_sequence"] < one_seq.plan.longest_sequence


def test_a_plan_past_the_budget_claims_no_capacity(tmp_path: Path) -> None:
    ref = json.loads(_cli(tmp_path, "--json").stdout)  # the same pool on 2 x V100
    held = f"{ref['longest_sequence_tokens']:,}"
    r = _cli(tmp_path, "--gpus", "2x16GiB")
    assert r.returncode == 1
    verdict = r.stdout.index("does not fit")
    above = r.stdout[:verdict]
    # once "longest single sequence: 306,624 tokens" (what the fixed pool would hold on
    # 2 x V100) and "1 sequence(s) at once" here
    assert held not in above and "sequence(s) at once" not in above
    assert "longest single sequence: none" in above
    d = json.loads(_cli(tmp_path, "--gpus", "2x16GiB", "--json").stdout)
    assert d["within_budget"] is False
    assert d["longest_sequence_tokens"] == 0 and d["concurrency"]["sequences"] == 0
    # a plan short only of KV keeps its real figures: the pool exists
    d = json.loads(_cli(tmp_path, "--max-model-len", "1048576", "--json").stdout)
    assert d["within_budget"] is True
    assert d["longest_sequence_tokens"] == ref["longest_sequence_tokens"] > 0


def _svg_titles(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    return [t.text or "" for t in root.iter(f"{SVG_NS}title")]


def _svg_text(path: Path) -> str:
    root = ET.parse(path).getroot()
    return " ".join(t.text or "" for t in root.iter(f"{SVG_NS}text"))


def test_svg_draws_no_free_memory_while_the_budget_overflows(tmp_path: Path) -> None:
    ok = tmp_path / "ok.svg"
    assert _cli(tmp_path, "--svg", str(ok)).returncode == 0
    assert any(t.startswith("free inside the budget") for t in _svg_titles(ok))
    for args in (["--max-model-len", "1048576"], ["--gpus", "2x16GiB"]):
        svg = tmp_path / "bad.svg"
        r = _cli(tmp_path, *args, "--svg", str(svg))
        assert r.returncode == 1, r.stderr
        assert not any(t.startswith("free inside the budget") for t in _svg_titles(svg)), args
        text = _svg_text(svg)
        assert "does NOT fit" in text and "over by" in text
    # the KV the max model length needs is what the bar shows
    titles = _svg_titles(tmp_path / "bad.svg")
    assert not any("SM70_MAX_MODEL_LEN" in t for t in titles)  # the budget case: no KV swap
    r = _cli(tmp_path, "--max-model-len", "1048576", "--svg", str(svg))
    need = json.loads(_cli(tmp_path, "--max-model-len", "1048576", "--json").stdout)
    kv = [t for t in _svg_titles(svg) if t.startswith("KV that SM70_MAX_MODEL_LEN=1,048,576")]
    assert kv and f"{need['gpus'][0]['kv_needed_bytes']:,} B" in kv[0]
    # how far past the budget it draws is what the pool misses when it takes the whole
    # budget (SM70_KV_CACHE_BYTES=0): two routes to one figure
    whole = json.loads(_cli(tmp_path, "--max-model-len", "1048576", "--json",
                            env={"SM70_KV_CACHE_BYTES": "0"}).stdout)
    assert whole["overflow"] is not None and whole["overflow"]["kind"] == "kv"
    assert f"{gib(whole['overflow']['by_bytes'])} GiB over the budget" in _svg_text(svg)


@pytest.mark.parametrize("spec", ["2x16", "32GiB,16", "16"])
def test_sizes_without_a_unit_are_refused(tmp_path: Path, spec: str) -> None:
    r = _cli(tmp_path, "--gpus", spec)
    assert r.returncode == 2
    err = " ".join(r.stderr.split())
    assert "--gpus: '16' has no unit: a size needs one" in err and "16GiB" in err
    assert "Traceback" not in r.stderr
