"""`sm70ctl plan` end to end, in real subprocesses with a clean SM70_* environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.test_plan_config import TINY


def run(args, tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    # an empty model folder, so the built-in description is used unless a test says otherwise
    base["SM70_MODEL_DIR"] = str(tmp_path / "no-model")
    base.update(env)
    r = subprocess.run([sys.executable, "-m", "sm70ctl", "plan", *args], env=base,
                       capture_output=True, text=True, timeout=120)
    # rich wraps long diagnostics at the console width: compare with whitespace folded
    r.stderr = " ".join(r.stderr.split())
    return r


def test_json_without_args_is_the_reference_plan(tmp_path):
    from sm70ctl.plan.gpus import probe_nvml

    # without NVML (CI) no arguments at all; on a GPU machine name the reference pair
    r = run(["--json"] if probe_nvml() is None else ["--json", "--gpus", "2xv100"], tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["source"].startswith("built-in")
    assert d["gpus_source"] in ("reference", "--gpus")
    if d["gpus_source"] == "reference":
        assert "no NVML" in d["gpus_note"]
    assert [g["total_bytes"] for g in d["gpus"]] == [34_089_730_048] * 2
    assert d["fits"] is True and d["longest_sequence_tokens"] >= 262_144
    g = d["gpus"][0]
    assert all(isinstance(i["bytes"], int) for i in g["items"])
    assert g["used_bytes"] == sum(i["bytes"] for i in g["items"])
    keys = {i["key"] for i in g["items"]}
    assert {"weights.embed", "weights.mlp", "pool.kv", "pool.state", "cuda_context"} <= keys
    assert d["kv_bytes_per_token_per_layer"] == 1040
    assert d["gdn_page_bytes"]["total"] == 828 * 1024


def test_too_long_max_model_len_fails_naming_the_item(tmp_path):
    r = run(["--max-model-len", "1048576", "--gpus", "2xv100", "--json"], tmp_path)
    assert r.returncode == 1
    assert "KV cache pool" in r.stderr and "short by 13,117,521,920 B" in r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] is False and d["overflow"]["by_bytes"] == 13_117_521_920
    assert d["what_fits"] and all(s["longest_sequence"] > 262_144 for s in d["what_fits"])


def test_small_gpus_report_what_fits(tmp_path):
    r = run(["--gpus", "2x16GiB", "--json"], tmp_path)
    assert r.returncode == 1
    d = json.loads(r.stdout)
    assert d["fits"] is False and "overflows the budget" in d["overflow"]["message"]
    best = max(s["longest_sequence"] for s in d["what_fits"])
    assert best > 0
    assert f"{best:,} tokens" in r.stderr
    # the table form says the same
    t = run(["--gpus", "2x16GiB"], tmp_path)
    assert t.returncode == 1 and "What fits instead" in t.stdout


def test_table_and_svg(tmp_path):
    svg = tmp_path / "plan.svg"
    r = run(["--context", "32768", "--svg", str(svg)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "KV cache pool" in r.stdout and "MiB" in r.stdout and "GiB" in r.stdout
    assert "sequence(s) at once" in r.stdout
    root = ET.parse(svg).getroot()
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "GPU 0" in texts and "GPU 1" in texts and "KV cache pool" in texts
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_model_sources(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    env = {"SM70_TENSOR_PARALLEL_SIZE": "1", "SM70_GPUS": "0", "SM70_KV_CACHE_BYTES": "0",
           "SM70_MAX_MODEL_LEN": "4096"}
    r = run(["--json", "--gpus", "1x4GiB", "--config", str(model / "config.json")], tmp_path,
            **env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["source"] == "--config"
    r = run(["--json", "--gpus", "1x4GiB", "--model-dir", str(model)], tmp_path, **env)
    assert json.loads(r.stdout)["model"]["source"] == "--model-dir"
    r = run(["--json", "--gpus", "1x4GiB"], tmp_path, **{**env, "SM70_MODEL_DIR": str(model)})
    d = json.loads(r.stdout)
    assert d["model"]["source"] == "SM70_MODEL_DIR" and d["model"]["layers"] == 4


@pytest.mark.parametrize("args,code,needle", [
    (["--gpus", "lots"], 2, "not a memory size"),
    (["--model-dir", "/nonexistent-dir"], 2, "no config.json"),
    (["--gpus", "1x32GiB"], 1, "needs 2"),
])
def test_bad_input_is_one_line(tmp_path, args, code, needle):
    r = run(args, tmp_path)
    assert r.returncode == code
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_help_has_examples(tmp_path):
    r = run(["--help"], tmp_path)
    assert r.returncode == 0 and "sm70ctl plan --gpus 2x16GiB" in r.stdout
