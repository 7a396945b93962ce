"""The quantization-config validator (pure): the reference config passes, every rule from
FACTS.md fails with its own message, and `dynamic` is read the way vLLM reads it."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sm70ctl.weights.quant import (
    dynamic_decision,
    fused_module_names,
    runtime_prefix,
    validate_quant_config,
)

REFERENCE = Path(__file__).resolve().parent.parent / "sm70ctl/data/qwen3.8-27b/config.json"


@pytest.fixture
def reference() -> dict:
    if not REFERENCE.exists():
        pytest.fail(f"the reference config {REFERENCE} is missing")
    return json.loads(REFERENCE.read_text())


def _fields(config: dict) -> list[str]:
    return [p.field for p in validate_quant_config(config)]


def test_reference_config_passes(reference):
    assert validate_quant_config(reference) == []


def test_bare_quantization_config_is_accepted(reference):
    # A bare quantization_config is checked against the default layout (64 layers).
    assert validate_quant_config(reference["quantization_config"]) == []


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("bits", 4, "quantization_config.bits"),
        ("bits", None, "quantization_config.bits"),
        ("bits", True, "quantization_config.bits"),
        ("group_size", 64, "quantization_config.group_size"),
        ("group_size", -1, "quantization_config.group_size"),
        ("quant_method", "awq", "quantization_config.quant_method"),
        ("modules_to_not_convert", None, "quantization_config.modules_to_not_convert"),
        ("modules_to_not_convert", [], "quantization_config.modules_to_not_convert"),
    ],
)
def test_each_rule_fails_on_its_own(reference, key, value, field):
    config = copy.deepcopy(reference)
    if value is None:
        config["quantization_config"].pop(key)
    else:
        config["quantization_config"][key] = value
    problems = validate_quant_config(config)
    assert [p.field for p in problems] == [field]
    assert key in problems[0].message


def test_missing_quantization_config():
    problems = validate_quant_config({"architectures": ["Qwen3_5ForConditionalGeneration"]})
    assert len(problems) == 1 and "no quantization_config" in problems[0].message


def test_dynamic_missing(reference):
    del reference["quantization_config"]["dynamic"]
    problems = validate_quant_config(reference)
    assert [p.field for p in problems] == ["quantization_config.dynamic"]


def test_dynamic_written_for_unfused_names_misses_the_fused_modules(reference):
    # Rules naming only q_proj/k_proj/v_proj and in_proj_b/in_proj_a look right but vLLM
    # matches them against the fused runtime names: qkv_proj and in_proj_ba stay int8.
    reference["quantization_config"]["dynamic"] = {
        "-:.*\\.self_attn\\.(q_proj|k_proj|v_proj)$": {},
        "-:.*\\.linear_attn\\.(in_proj_b|in_proj_a)$": {},
    }
    problems = validate_quant_config(reference)
    messages = " ".join(p.message for p in problems)
    assert "qkv_proj" in messages and "in_proj_ba" in messages
    assert "16 of 16 layers" in messages and "48 of 48 layers" in messages


def test_a_positive_rule_before_the_negative_one_wins(reference):
    # First match wins in vLLM: a '+:' rule matching qkv_proj shadows the later '-:' rule.
    dyn = reference["quantization_config"]["dynamic"]
    reference["quantization_config"]["dynamic"] = {"+:.*self_attn.*": {"bits": 8}, **dyn}
    problems = validate_quant_config(reference)
    assert len(problems) == 1 and "qkv_proj" in problems[0].message


def test_rule_covering_only_some_layers_is_reported_with_a_count(reference):
    reference["quantization_config"]["dynamic"] = {
        "-:.*layers\\.(3|7)\\.self_attn\\.qkv_proj$": {},
        "-:.*\\.linear_attn\\.in_proj_ba$": {},
    }
    problems = validate_quant_config(reference)
    assert len(problems) == 1
    assert "14 of 16 layers" in problems[0].message
    assert "layers.11.self_attn.qkv_proj" in problems[0].message


def test_dynamic_override_of_bits_is_a_problem(reference):
    reference["quantization_config"]["dynamic"]["+:.*mlp.*"] = {"bits": 4, "group_size": 32}
    assert sorted(_fields(reference)) == [
        "quantization_config.dynamic['+:.*mlp.*'].bits",
        "quantization_config.dynamic['+:.*mlp.*'].group_size",
    ]


def test_bad_regex_is_reported(reference):
    reference["quantization_config"]["dynamic"]["-:(unclosed"] = {}
    problems = validate_quant_config(reference)
    assert len(problems) == 1 and "not a valid regular expression" in problems[0].message


def test_runtime_names_follow_the_architecture(reference):
    assert runtime_prefix(reference) == "language_model.model.layers"
    assert runtime_prefix({"architectures": ["Qwen3_5ForCausalLM"]}) == "model.layers"
    names = fused_module_names(reference)
    assert len(names["qkv_proj"]) == 16 and len(names["in_proj_ba"]) == 48
    assert names["qkv_proj"][0] == "language_model.model.layers.3.self_attn.qkv_proj"


def test_prefix_bound_rules_are_checked_against_the_runtime_prefix(reference):
    # Written with the checkpoint's (HF) prefix, these rules never match in vLLM.
    reference["quantization_config"]["dynamic"] = {
        "-:model\\.language_model\\.layers\\.\\d+\\.self_attn\\.qkv_proj": {},
        "-:model\\.language_model\\.layers\\.\\d+\\.linear_attn\\.in_proj_ba": {},
    }
    assert len(validate_quant_config(reference)) == 2


@given(st.lists(st.sampled_from(["-:.*qkv_proj$", "+:.*qkv_proj$", "-:.*in_proj_ba$",
                                 "+:.*", "-:.*mlp.*"]), unique=True))
def test_dynamic_decision_is_first_match(keys):
    name = "language_model.model.layers.3.self_attn.qkv_proj"
    dynamic = {k: {} for k in keys}
    decision, key = dynamic_decision(dynamic, name)
    matching = [k for k in keys if k in ("-:.*qkv_proj$", "+:.*qkv_proj$", "+:.*")]
    if not matching:
        assert (decision, key) == ("default", None)
    else:
        assert key == matching[0]
        assert decision == ("skip" if key.startswith("-:") else "override")


def test_check_quant_command(tmp_path, reference):
    good = tmp_path / "good" / "config.json"
    good.parent.mkdir()
    good.write_text(json.dumps(reference))
    bad_cfg = copy.deepcopy(reference)
    bad_cfg["quantization_config"]["bits"] = 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(bad_cfg))

    def run(*args: str):
        return subprocess.run([sys.executable, "-m", "sm70ctl", "weights", "check-quant", *args],
                              text=True, capture_output=True, timeout=60)

    ok = run(str(good.parent))
    assert ok.returncode == 0, ok.stderr
    res = run(str(bad), "--json")
    assert res.returncode == 1
    data = json.loads(res.stdout)
    assert data["ok"] is False and data["problems"][0]["field"] == "quantization_config.bits"
