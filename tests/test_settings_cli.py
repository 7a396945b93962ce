"""`sm70ctl env ...` end to end, as a real subprocess with a controlled environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sm70ctl.settings.docs import render

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("SM70_")}
    base["COLUMNS"] = "250"
    return subprocess.run(
        [sys.executable, "-m", "sm70ctl", "env", *args],
        env={**base, **(env or {})}, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )


def test_check_passes_with_no_sm70_variables():
    done = run("check")
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stderr
    data = json.loads(run("check", "--json").stdout)
    assert data == {"ok": True, "set": {}, "not_consumed_yet": {}}


def test_check_reports_every_problem_as_a_table():
    done = run("check", env={"SM70_SPEC_TOKENS": "2", "SM70_MAX_NUM_SEQ": "8",
                             "SM70_PORT": "99999"})
    assert done.returncode == 1
    out = done.stdout
    for text in ("SM70_SPEC_TOKENS", "k + 1 must be a captured CUDA-graph size",
                 "did you mean SM70_MAX_NUM_SEQS?", "SM70_PORT", "out of range",
                 "3 problem(s)", "rule broken", "allowed"):
        assert text in out, text
    assert "Traceback" not in done.stderr


def test_check_json_and_env_file(tmp_path):
    env_file = tmp_path / "prod.env"
    env_file.write_text("SM70_PORT=8100\nSM70_GPUS=0\n")
    done = run("check", "--env-file", str(env_file), "--json")
    assert done.returncode == 1
    (p,) = json.loads(done.stdout)["problems"]
    assert p["variable"] == "SM70_GPUS" and p["source"] == f"file:{env_file}:2"
    ok = run("check", "--env-file", str(env_file), "--json",
             env={"SM70_TENSOR_PARALLEL_SIZE": "1"})
    assert ok.returncode == 0, ok.stdout
    assert json.loads(ok.stdout)["set"]["SM70_PORT"] == {"value": "8100",
                                                         "source": f"file:{env_file}:1"}


def test_list_counts_98_and_filters_by_category():
    data = json.loads(run("list", "--json").stdout)
    assert len(data) == 98
    spec = json.loads(run("list", "--category", "spec", "--json").stdout)
    assert {d["name"] for d in spec} >= {"SM70_SPEC_TOKENS", "SM70_SPEC_METHOD"}
    assert all(d["category"] == "spec" for d in spec)
    bad = run("list", "--category", "nonsense")
    assert bad.returncode == 2 and "unknown category" in bad.stderr


def test_explain_and_did_you_mean():
    done = run("explain", "spec_tokens", "--json")
    data = json.loads(done.stdout)
    assert data["name"] == "SM70_SPEC_TOKENS" and data["attribute"] == "spec_tokens"
    assert {"kind": "vllm_flag", "target": "--speculative-config"} in data["consumers"]
    text = run("explain", "SM70_KV_CACHE_BYTES").stdout
    assert "--kv-cache-memory-bytes" in text and "10630627328" in text
    bad = run("explain", "SM70_KV_CACHE_BYTE")
    assert bad.returncode == 2 and "did you mean SM70_KV_CACHE_BYTES?" in bad.stderr


def test_show_masks_secrets_and_reports_sources(tmp_path):
    env_file = tmp_path / "s.env"
    env_file.write_text("SM70_HF_TOKEN=hf_from_file_secret\nSM70_PORT=8100\n")
    done = run("show", "--json", "--env-file", str(env_file),
               env={"SM70_API_KEY": "sk-env-secret", "SM70_PORT": "8200"})
    assert done.returncode == 0, done.stderr
    assert "hf_from_file" not in done.stdout and "sk-env" not in done.stdout
    rows = {d["name"]: d for d in json.loads(done.stdout)}
    assert rows["SM70_API_KEY"] == {"name": "SM70_API_KEY", "value": "***",
                                    "source": "environment"}
    assert rows["SM70_HF_TOKEN"]["value"] == "***"
    assert rows["SM70_HF_TOKEN"]["source"] == f"file:{env_file}:1"
    assert rows["SM70_PORT"] == {"name": "SM70_PORT", "value": "8200", "source": "environment"}
    assert rows["SM70_KV_CACHE_BYTES"]["source"] == "default"
    bad = run("show", env={"SM70_PORT": "x"})
    assert bad.returncode == 1 and "SM70_PORT" in bad.stderr and "Traceback" not in bad.stderr


def test_checked_in_docs_are_current():
    assert (ROOT / "docs" / "env.md").read_text() == render(), "run `sm70ctl env docs`"
    done = run("docs", "--check")
    assert done.returncode == 0, done.stderr


def test_docs_writes_and_detects_stale(tmp_path):
    target = tmp_path / "env.md"
    assert run("docs", "--check", "-o", str(target)).returncode == 1
    assert run("docs", "-o", str(target)).returncode == 0
    assert target.read_text() == render()
    assert run("docs", "--check", "-o", str(target)).returncode == 0
    target.write_text(target.read_text() + "edit\n")
    assert run("docs", "--check", "-o", str(target)).returncode == 1


def test_docs_output_odd_paths_are_one_line(tmp_path):
    # a folder, a missing parent under /proc, a non-UTF-8 file: once three tracebacks
    done = run("docs", "-o", str(tmp_path))
    assert done.returncode == 2 and "is a directory" in done.stderr
    done = run("docs", "-o", "/proc/no-such-dir/env.md")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: --output /proc/no-such-dir/env.md: cannot write: ")
    binary = tmp_path / "env.md"
    binary.write_bytes(b"\xff\xfe\x00")
    done = run("docs", "--check", "-o", str(binary))
    assert done.returncode == 1 and "is stale" in done.stderr and "Traceback" not in done.stderr
    assert run("docs", "-o", str(binary)).returncode == 0
    assert binary.read_text(encoding="utf-8") == render()


def test_explain_an_empty_name():
    done = run("explain", "")
    assert done.returncode == 2
    assert done.stderr.startswith("error: give a variable name, e.g. SM70_PORT")


def test_docs_list_every_variable():
    text = render()
    from sm70ctl.settings import load_schema

    for v in load_schema().variables:
        assert f"`{v.name}`" in text


@pytest.mark.parametrize("command", ["check", "list", "explain", "show", "docs"])
def test_help_has_a_worked_example(command):
    done = run(command, "--help")
    assert done.returncode == 0
    assert "Example" in done.stdout and "sm70ctl env" in done.stdout
