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
    # the served path: vLLM 0.22.1's float32 state (tests/test_plan_vllm_parity.py)
    assert d["path"] == "served" and d["gdn_state_dtype"] == "float32"
    assert d["gdn_page_bytes"]["total"] == 1_634_304
    assert g["pool"]["block_size"] == 1584 and g["pool"]["num_blocks"] == 379


def test_too_long_max_model_len_fails_naming_the_item(tmp_path):
    r = run(["--max-model-len", "1048576", "--gpus", "2xv100", "--json"], tmp_path)
    assert r.returncode == 1
    # 1,048,576 tokens: 662 blocks of 1,584 tokens + 3 GDN groups x 5 state pages, each
    # block 17 layers x 1,647,360 B, against the 10,630,627,328 B pool
    short = (662 + 15) * 17 * 1_647_360 - 10_630_627_328
    assert "KV cache pool" in r.stderr and f"short by {short:,} B" in r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] is False and d["overflow"]["by_bytes"] == short == 8_328_838_912
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
    (["--gpus", "2x"], 2, "'2x' is not a memory size"),
    (["--gpus", "0x32GiB"], 2, "count must be 1..64"),
    (["--gpus", "3x-1GiB"], 2, "'-1GiB' is not a memory size"),
    # an empty spec is a mistake, not "ask NVML"
    (["--gpus", ""], 2, "'' is not a memory size"),
    # more digits than a float holds: inf, once a traceback
    (["--gpus", "2x1" + "0" * 400 + "GiB"], 2, "more than 1 PiB per GPU"),
    (["--svg", "/proc/no-such-dir/plan.svg"], 1, "--svg /proc/no-such-dir/plan.svg: cannot write"),
    # a component the OS refuses (once an OSError traceback)
    (["--model-dir", "/tmp/" + "a" * 300], 2, "a path component is 300 bytes long"),
    (["--config", "/tmp/" + "a" * 300 + "/config.json"], 1, "a path component is 300 bytes"),
    # once "0 sequence(s) at once" and exit 0
    (["--context", "99999999999"], 2,
     "--context 99,999,999,999 is longer than SM70_MAX_MODEL_LEN=262,144"),
])
def test_bad_input_is_one_line(tmp_path, args, code, needle):
    r = run(args, tmp_path)
    assert r.returncode == code, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_overrides_get_the_variables_rules(tmp_path):
    # --max-model-len / --max-num-seqs were planned unchecked (1e20 tokens, 5000 seqs)
    r = run(["--max-model-len", "99999999999999999999", "--max-num-seqs", "5000", "--json"],
            tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["exit_code"] == 2
    assert ("SM70_MAX_MODEL_LEN='99999999999999999999' [--max-model-len]: out of range "
            "(allowed: >= 1024 and <= 1048576)") in r.stderr
    assert "SM70_MAX_NUM_SEQS='5000' [--max-num-seqs]: out of range" in r.stderr
    # the environment's own bad value is still exit 1, the option wins over it
    r = run(["--json", "--max-model-len", "131072"], tmp_path, SM70_MAX_MODEL_LEN="9")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["max_model_len"] == 131072
    r = run(["--json"], tmp_path, SM70_MAX_NUM_SEQS="5000")
    assert r.returncode == 1 and "SM70_MAX_NUM_SEQS='5000' [environment]" in r.stderr


def test_diagnostics_are_not_wrapped(tmp_path):
    # rich used to wrap long diagnostics at the console width; each stays one line now
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env.update(SM70_MODEL_DIR=str(tmp_path / "no-model"), COLUMNS="60")
    r = subprocess.run([sys.executable, "-m", "sm70ctl", "plan", "--gpus", "2x16GiB"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("error: GPU 0: ") and lines[0].endswith(" B")
    assert lines[1].startswith("  fix: what fits on these GPUs: with ")
    assert lines[1].endswith("the table lists each step")


def test_nothing_fits_says_so(tmp_path):
    # not even the last relaxation leaves room for one sequence: no "set it at or below 0"
    r = run(["--gpus", "2x1GiB", "--json"], tmp_path)
    assert r.returncode == 1
    d = json.loads(r.stdout)
    assert d["fits"] is False and all(s["longest_sequence"] == 0 for s in d["what_fits"])
    assert "nothing fits on these GPUs: even with SM70_KV_CACHE_BYTES=0" in r.stderr
    assert "SM70_MAX_NUM_SEQS=1 the weights" in r.stderr
    # the served path reserves no state slots: the multiplier is never offered there
    assert "SM70_STATE_BLOCK_MULTIPLIER" not in r.stderr
    assert "longest single sequence is 0 tokens" not in r.stderr


@pytest.mark.parametrize("patch,needle", [
    ({"num_key_value_heads": "2"}, "`num_key_value_heads` = '2' is not a positive integer"),
    ({"head_dim": "64"}, "`head_dim` = '64' is not an integer >= 0"),
    ({"layer_types": 4}, "`layer_types` = 4 is not a list of names"),
    ({"linear_num_value_heads": "4"}, "`linear_num_value_heads` = '4' is not an integer"),
    ({"mtp_num_hidden_layers": "1"}, "`mtp_num_hidden_layers` = '1' is not an integer"),
    ({"quantization_config": "gptq"}, "`quantization_config` = 'gptq' is not a JSON object"),
    ({"quantization_config": {"bits": 8, "group_size": 128, "dynamic": ["x"]}},
     "`dynamic` must be a JSON object"),
    ({"vision_config": {"depth": 2, "hidden_size": 8, "intermediate_size": 8, "num_heads": 1,
                        "patch_size": 2, "out_hidden_size": 8,
                        "deepstack_visual_indexes": 3}}, "deepstack_visual_indexes` = 3"),
    ({"num_attention_heads": 0}, "`num_attention_heads` = 0 is not a positive integer"),
])
def test_config_of_the_wrong_types_is_one_line(tmp_path, patch, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, **patch}))
    r = run(["--json", "--gpus", "1x4GiB", "--config", str(cfg)], tmp_path,
            SM70_TENSOR_PARALLEL_SIZE="1", SM70_GPUS="0")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and needle in r.stderr
    # --json: the failure as one document on stdout
    assert needle in json.loads(r.stdout)["error"]["message"]


def test_other_model_is_named(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096,
                               "intermediate_size": 11008, "num_hidden_layers": 32,
                               "num_attention_heads": 32, "vocab_size": 32000}))
    r = run(["--config", str(cfg)], tmp_path)
    assert r.returncode == 1
    assert "(model_type 'llama')" in r.stderr and "qwen3_5" in r.stderr


def test_help_has_examples(tmp_path):
    r = run(["--help"], tmp_path)
    assert r.returncode == 0 and "sm70ctl plan --gpus 2x16GiB" in r.stdout
