"""Model configs are checked for what vLLM and the kernels require before any arithmetic:
heads that shard across TP as vLLM shards them, whole GQA ratios, head sizes the attention
backend takes, and counts within sane bounds; hostile files are refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sm70ctl.errors import Sm70Error
from sm70ctl.plan.model_checks import MAX_LAYERS, check_parallel
from sm70ctl.plan.model_config import parse_config
from sm70ctl.plan.plan import Gpu, PlanInputs, compute_plan
from tests.test_plan_config import TINY


def _cli(tmp_path: Path, cfg: Any, tp: int = 1, raw: bytes | None = None):
    path = tmp_path / "config.json"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env.update(SM70_MODEL_DIR=str(tmp_path / "no-model"), SM70_TENSOR_PARALLEL_SIZE=str(tp),
               SM70_GPUS=",".join(str(i) for i in range(tp)), SM70_KV_CACHE_BYTES="0",
               SM70_MAX_MODEL_LEN="4096")
    # the guard is the subprocess limit, not an assertion on time: a 10^8-layer config
    # once ran for minutes
    r = subprocess.run([sys.executable, "-m", "sm70ctl", "plan", "--config", str(path),
                        "--gpus", f"{tp}x8GiB"], env=env, capture_output=True, text=True,
                       timeout=120)
    r.stderr = " ".join(r.stderr.split())
    return r


def test_the_tiny_model_plans_at_tp_1_and_2(tmp_path: Path) -> None:
    # the fixture the refusals below start from is itself accepted
    for tp in (1, 2):
        r = _cli(tmp_path, TINY, tp)
        assert r.returncode == 0, r.stderr


def test_seven_kv_heads_at_tp_2_are_refused_as_vllm_would(tmp_path: Path) -> None:
    cfg = {**TINY, "num_attention_heads": 28, "num_key_value_heads": 7, "head_dim": 64}
    assert _cli(tmp_path, cfg, 1).returncode == 0, "TP=1 takes any KV head count"
    r = _cli(tmp_path, cfg, 2)
    assert r.returncode == 1
    assert ("SM70_TENSOR_PARALLEL_SIZE=2: the model's 7 KV heads (`num_key_value_heads`) can "
            "be neither split evenly across 2 GPUs") in r.stderr
    assert "Traceback" not in r.stderr and "3 heads" not in r.stdout


def test_kv_heads_fewer_than_gpus_are_copied_when_whole() -> None:
    one_kv = parse_config({**TINY, "num_key_value_heads": 1, "linear_num_key_heads": 4,
                           "linear_num_value_heads": 8})
    check_parallel(one_kv, 2, 1)  # 1 KV head, copied to both GPUs: vLLM takes it
    check_parallel(one_kv, 4, 1)
    # attention layers only (no GDN heads to shard)
    three = parse_config({**TINY, "num_attention_heads": 12, "num_key_value_heads": 3,
                          "intermediate_size": 528, "full_attention_interval": 1})
    check_parallel(three, 3, 1)
    with pytest.raises(Sm70Error, match="3 KV heads"):
        check_parallel(three, 2, 1)  # 3 >= 2 and 3 % 2: not evenly split
    with pytest.raises(Sm70Error, match="3 KV heads"):
        check_parallel(three, 4, 1)  # 3 < 4 and 4 % 3: not a whole number of copies


@pytest.mark.parametrize(("patch", "tp", "needle"), [
    ({"num_attention_heads": 6, "num_key_value_heads": 4},
     1, "`num_attention_heads` = 6 is not a multiple of `num_key_value_heads` = 4"),
    ({"head_dim": 16}, 1, "`head_dim` = 16 is below 32"),
    ({"linear_num_key_heads": 3, "linear_num_value_heads": 4},
     1, "`linear_num_value_heads` = 4 is not a multiple of `linear_num_key_heads` = 3"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64},
     4, "SM70_TENSOR_PARALLEL_SIZE=4: the model's 6 attention heads"),
    ({"linear_num_key_heads": 1, "linear_num_value_heads": 4},
     2, "SM70_TENSOR_PARALLEL_SIZE=2: the model's 1 GDN key heads"),
    ({"intermediate_size": 513}, 2, "the model's 513 MLP features"),
    ({"num_hidden_layers": 10**8}, 1, "`num_hidden_layers` = 100,000,000 is above 1,024"),
    ({"num_hidden_layers": 10**8, "layer_types": ["linear_attention"] * 3},
     1, "`num_hidden_layers` = 100,000,000 is above 1,024"),
    ({"mtp_num_hidden_layers": 10**6}, 1, "`mtp_num_hidden_layers` = 1,000,000 is above 64"),
    ({"vocab_size": 10**12}, 1, "`vocab_size` = 1,000,000,000,000 is above"),
    ({"head_dim": "x" * 10**6}, 1, "`head_dim` = 'xxxxx"),
    # each tensor name is matched against every rule: bounded
    ({"quantization_config": {"bits": 8, "group_size": 128,
                              "modules_to_not_convert": ["x"] * 5000}},
     1, "`modules_to_not_convert` has 5,000 entries, more than the 4,096"),
    ({"quantization_config": {"bits": 8, "group_size": 128, "dynamic": {"a" * 600: {}}}},
     1, "longer than 512 characters"),
])
def test_configs_vllm_or_the_kernels_refuse_are_refused(tmp_path: Path, patch: dict[str, Any],
                                                        tp: int, needle: str) -> None:
    r = _cli(tmp_path, {**TINY, **patch}, tp)
    assert r.returncode == 1, r.stdout[-500:]
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr) < 600  # one line, not the megabyte value


def test_layer_bound_is_what_the_parser_enforces() -> None:
    parse_config({**TINY, "num_hidden_layers": MAX_LAYERS, "full_attention_interval": 4})
    with pytest.raises(Sm70Error, match="above 1,024"):
        parse_config({**TINY, "num_hidden_layers": MAX_LAYERS + 1})


@pytest.mark.parametrize(("raw", "needle"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested more than 64 levels deep"),
    (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "nested more than 64 levels deep"),
    (b"\x00\x01binary", "binary content"),
    (b'{"hidden_size": 1, "hidden_size": 2}', "duplicate"),
    (b"{" + b" " * (17 << 20) + b"}", "model config"),
])
def test_hostile_config_files_are_one_line(tmp_path: Path, raw: bytes, needle: str) -> None:
    r = _cli(tmp_path, None, 1, raw=raw)
    assert r.returncode == 1
    assert needle in r.stderr and "Traceback" not in r.stderr and "RecursionError" not in r.stderr


# Structured fuzzing (arbitrary bytes are tests/test_fuzz_readers.py's): well-formed JSON
# with the config's own keys holding any values, nested quantization and vision configs
# included; the parser and the plan either work or refuse in one Sm70Error, never crash.
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**7),
                  st.sampled_from([8, 4, 128, -1, 0, 2**40]), st.floats(allow_nan=False),
                  st.text(max_size=5), st.sampled_from(["-:.*", "+:layers", "[", "model.x"]))
_VALUE = st.recursive(_LEAF, lambda c: st.one_of(
    st.lists(c, max_size=3),
    st.dictionaries(st.sampled_from(["bits", "group_size", "sym", "-:x", "+:y", "z"]), c,
                    max_size=3)), max_leaves=8)
_KEYS = st.sampled_from([*TINY, "quantization_config", "vision_config", "text_config",
                         "layer_types", "mtp_num_hidden_layers"])
_QKEYS = st.sampled_from(["bits", "group_size", "sym", "desc_act", "quant_method",
                          "modules_to_not_convert", "dynamic", "lm_head"])
_VKEYS = st.sampled_from(["depth", "hidden_size", "num_heads", "patch_size", "out_hidden_size",
                          "num_position_embeddings", "deepstack_visual_indexes"])
_VISION = {"depth": 2, "hidden_size": 8, "intermediate_size": 8, "num_heads": 1,
           "patch_size": 2, "out_hidden_size": 256}


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(_KEYS, _VALUE, max_size=4), st.dictionaries(_QKEYS, _VALUE, max_size=4),
       st.dictionaries(_VKEYS, _VALUE, max_size=3), st.sampled_from([1, 2]))
def test_any_config_values_plan_or_refuse_in_one_error(top: dict[str, Any], q: dict[str, Any],
                                                       v: dict[str, Any], tp: int) -> None:
    cfg = {**TINY, "quantization_config": {"bits": 8, "group_size": 128, **q},
           "vision_config": {**_VISION, **v}, **top}
    inputs = PlanInputs(tensor_parallel_size=tp, kv_cache_bytes=0, max_model_len=1024,
                        spec_method="none")
    try:
        compute_plan(parse_config(cfg), inputs, [Gpu(i, "g", 1 << 30) for i in range(tp)])
    except Sm70Error as exc:
        assert "\n" not in exc.message and len(exc.message) < 1000
