"""The SM70_* schema, loader and cross-field rules (sm70ctl/settings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from sm70ctl.errors import Sm70Error
from sm70ctl.settings import SettingsError, load_schema, load_settings
from sm70ctl.settings.schema import SCHEMA_PATH, parse_schema

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = load_schema()


def problems_of(environ: dict[str, str], env_file: Path | None = None,
                overrides: dict[str, tuple[str, str]] | None = None) -> list:
    with pytest.raises(SettingsError) as info:
        load_settings(environ, env_file=env_file, overrides=overrides)
    assert isinstance(info.value, Sm70Error)
    return info.value.problems


# --- the schema --------------------------------------------------------------------------
def test_schema_has_exactly_the_98_contract_names_in_order():
    table = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    contract = re.findall(r"^\| \d+ \| (SM70_\w+) \|", table, flags=re.M)
    assert len(contract) == 98
    assert [v.name for v in SCHEMA.variables] == contract


def test_packaged_schema_is_identical_to_the_root_schema():
    assert SCHEMA_PATH.read_bytes() == (ROOT / "env_schema.yaml").read_bytes(), (
        "copy env_schema.yaml to sm70ctl/data/env_schema.yaml"
    )


def test_every_category_is_used_and_every_variable_documented():
    used = {v.category for v in SCHEMA.variables}
    assert used == set(SCHEMA.categories)
    assert len(SCHEMA.categories) == 19
    for v in SCHEMA.variables:
        assert v.summary and v.help and v.consumers, v.name
        assert v.example is not None and v.example != v.default, v.name


def test_secrets_are_exactly_the_token_and_the_api_key():
    assert {v.name for v in SCHEMA.variables if v.secret} == {"SM70_HF_TOKEN", "SM70_API_KEY"}


def test_schema_rejects_malformed_entries():
    doc = {"version": 1, "categories": {"c": {"title": "C", "summary": "s"}},
           "variables": [{"name": "SM70_X", "category": "c", "type": "int", "default": 1,
                          "summary": "s", "help": "h",
                          "consumers": [{"kind": "plan", "target": "x"}]}]}
    assert parse_schema(doc).variables[0].default == "1"
    for patch in ({"type": "complex"}, {"category": "nope"}, {"name": "X"},
                  {"consumers": [{"kind": "somewhere", "target": "x"}]}, {"colour": "red"}):
        bad = {**doc, "variables": [{**doc["variables"][0], **patch}]}
        with pytest.raises(Sm70Error):
            parse_schema(bad)


# --- defaults ------------------------------------------------------------------------------
def test_no_sm70_variables_loads_the_reference_defaults():
    s = load_settings({"PATH": "/usr/bin", "HOME": "/root"})
    assert s.kv_cache_bytes == 10630627328
    assert s.gpu_memory_utilization == 0.96
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.prefill_chunk) == (16, 2048, 2048)
    assert s.cudagraph_sizes == [4, 8, 16, 32, 64] and s.mamba_cache_mode == "align"
    assert (s.spec_method, s.spec_tokens) == ("mtp", 3)
    assert s.gpus == ["0", "1"] and s.tensor_parallel_size == 2
    assert s.startup_timeout == 1800.0 and s.gpu_busy_mib == 500 * 1024**2
    assert s.api_key is None and s.hf_token is None and s.mirror_dir is None
    assert all(s.source_of(v.name) == "default" for v in SCHEMA.variables)


def test_every_example_is_valid_and_reaches_its_attribute():
    defaults = load_settings({})
    for v in SCHEMA.variables:
        s = load_settings({v.name: v.example, **v.example_with})
        assert getattr(s, v.attr) != getattr(defaults, v.attr), v.name
        assert s.source_of(v.name) == "environment"


def test_settings_are_frozen():
    s = load_settings({})
    with pytest.raises(ValidationError):
        s.port = 1


def test_units_and_lists_are_parsed():
    s = load_settings({
        "SM70_KV_CACHE_BYTES": "9GiB", "SM70_STARTUP_TIMEOUT": "5m",
        "SM70_SHUTDOWN_GRACE": "1500ms", "SM70_CUDAGRAPH_SIZES": " 8, 4,2,1 ,16",
        "SM70_GPU_BUSY_MIB": "1.5GiB", "SM70_LOG_MAX_BYTES": "10MB",
        "SM70_ENABLE_PREFIX_CACHING": "no", "SM70_MAMBA_CACHE_MODE": "none",
        "SM70_SPEC_METHOD": "none",
        "SM70_RESTART": "ON",
    })
    assert s.kv_cache_bytes == 9 * 1024**3
    assert s.startup_timeout == 300.0 and s.shutdown_grace == 1.5
    assert s.cudagraph_sizes == [8, 4, 2, 1, 16]
    assert s.gpu_busy_mib == int(1.5 * 1024**3) and s.log_max_bytes == 10_000_000
    assert s.enable_prefix_caching is False and s.restart is True


def test_secrets_are_secretstr_and_masked():
    s = load_settings({"SM70_API_KEY": "sk-topsecret", "SM70_HF_TOKEN": "hf_secret"})
    assert isinstance(s.api_key, SecretStr)
    assert s.api_key.get_secret_value() == "sk-topsecret"
    assert "topsecret" not in repr(s) and "hf_secret" not in repr(s)
    assert s.env_text("SM70_API_KEY") == "***"
    problems = problems_of({"SM70_API_KEY": "  ", "SM70_HF_TOKEN": "x", "SM70_PORT": "0"})
    assert all(p.value != "x" for p in problems if p.variable == "SM70_HF_TOKEN")


def test_uuid_gpus_are_accepted():
    s = load_settings({"SM70_GPUS": "GPU-5b1c2d3e-aaaa-bbbb-cccc-0123456789ab,1"})
    assert s.gpus[0].startswith("GPU-")


# --- problems ------------------------------------------------------------------------------
def test_invalid_mtp_draft_length_names_the_rule():
    (p,) = problems_of({"SM70_SPEC_TOKENS": "2"})
    assert p.variable == "SM70_SPEC_TOKENS" and p.value == "2"
    assert "k + 1 must be a captured CUDA-graph size" in p.rule
    assert p.allowed == "1, 3, 7"


def test_misspelt_variable_gets_a_suggestion():
    (p,) = problems_of({"SM70_MAX_NUM_SEQ": "8"})
    assert p.rule == "unknown SM70_ variable"
    assert p.allowed == "did you mean SM70_MAX_NUM_SEQS?"
    (p,) = problems_of({"sm70_port": "8100"})
    assert "SM70_PORT" in p.allowed


def test_reserved_names_are_not_unknown():
    load_settings({"SM70_PLUGIN_CONFIG": "{}"})


def test_every_problem_is_reported_at_once():
    problems = problems_of({
        "SM70_PORT": "eighty",
        "SM70_SPEC_TOKENS": "5",
        "SM70_KV_CACHE_BYTES": "9.9QiB",
        "SM70_GPUS": "0,1,2",
        "SM70_HOST": "0.0.0.0",
        "SM70_ASYNC_SCHEDULING": "true",
        "SM70_MAX_NUM_SEQ": "3",
        "SM70_DTYPE": "",
    })
    names = [p.variable for p in problems]
    assert sorted(names) == sorted([
        "SM70_PORT", "SM70_SPEC_TOKENS", "SM70_KV_CACHE_BYTES", "SM70_GPUS", "SM70_HOST",
        "SM70_ASYNC_SCHEDULING", "SM70_MAX_NUM_SEQ", "SM70_DTYPE",
    ])
    for p in problems:
        assert p.rule and p.allowed and p.source == "environment"
    text = str(SettingsError(problems))
    assert "SM70_PORT='eighty'" in text and "8 problems" in text


def test_cross_rules_skip_variables_that_already_failed():
    # PREFILL_CHUNK is broken on its own: no second, confusing chunk-vs-batch complaint.
    problems = problems_of({"SM70_PREFILL_CHUNK": "x", "SM70_MAX_NUM_BATCHED_TOKENS": "1024"})
    assert [p.variable for p in problems] == ["SM70_PREFILL_CHUNK"]


# Each cross-field rule: a combination it refuses, and the nearest one it accepts.
CROSS = [
    ("spec-draft-graph-size", {"SM70_CUDAGRAPH_SIZES": "2,8"},
     {"SM70_CUDAGRAPH_SIZES": "2,8", "SM70_SPEC_TOKENS": "1"}, "SM70_SPEC_TOKENS"),
    ("spec-draft-graph-size (multiples of k+1)", {"SM70_CUDAGRAPH_SIZES": "4,6,8"},
     {"SM70_CUDAGRAPH_SIZES": "4,6,8", "SM70_CUDAGRAPH_MODE": "piecewise"},
     "SM70_CUDAGRAPH_SIZES"),
    ("spec-draft-graph-size (multiples, k=1)", {"SM70_CUDAGRAPH_SIZES": "1,2,4",
     "SM70_SPEC_TOKENS": "1"}, {"SM70_CUDAGRAPH_SIZES": "2,4", "SM70_SPEC_TOKENS": "1"},
     "SM70_CUDAGRAPH_SIZES"),
    ("graph-sizes-within-batch", {"SM70_CUDAGRAPH_SIZES": "4,8,512",
     "SM70_MAX_NUM_BATCHED_TOKENS": "256", "SM70_PREFILL_CHUNK": "256"},
     {"SM70_CUDAGRAPH_SIZES": "4,8,256", "SM70_MAX_NUM_BATCHED_TOKENS": "256",
      "SM70_PREFILL_CHUNK": "256"}, "SM70_CUDAGRAPH_SIZES"),
    ("spec-draft-graph-size (eager is fine)", {"SM70_CUDAGRAPH_SIZES": "1,2,8"},
     {"SM70_CUDAGRAPH_SIZES": "1,2,8", "SM70_ENFORCE_EAGER": "true"}, "SM70_SPEC_TOKENS"),
    ("spec-draft-graph-size (no spec is fine)", {"SM70_CUDAGRAPH_SIZES": "1,2,8"},
     {"SM70_CUDAGRAPH_SIZES": "1,2,8", "SM70_SPEC_METHOD": "none"}, "SM70_SPEC_TOKENS"),
    ("clef-max-model-len", {"SM70_CLEF": "true", "SM70_MAX_MODEL_LEN": "8192"},
     {"SM70_CLEF": "false", "SM70_MAX_MODEL_LEN": "8192"}, "SM70_CLEF_MAX_MODEL_LEN"),
    ("gpu-count", {"SM70_GPUS": "0"}, {"SM70_GPUS": "0", "SM70_TENSOR_PARALLEL_SIZE": "1"},
     "SM70_GPUS"),
    ("gpu-count pp", {"SM70_PIPELINE_PARALLEL_SIZE": "2"},
     {"SM70_PIPELINE_PARALLEL_SIZE": "2", "SM70_GPUS": "0,1,2,3"}, "SM70_GPUS"),
    ("prefill-chunk", {"SM70_PREFILL_CHUNK": "4096"},
     {"SM70_PREFILL_CHUNK": "4096", "SM70_MAX_NUM_BATCHED_TOKENS": "4096"},
     "SM70_PREFILL_CHUNK"),
    ("prompt-logprobs-chunk", {"SM70_PROMPT_LOGPROBS_CHUNK": "4096"},
     {"SM70_PROMPT_LOGPROBS_CHUNK": "2048"}, "SM70_PROMPT_LOGPROBS_CHUNK"),
    ("kv-fits-gpu", {"SM70_KV_CACHE_BYTES": "31GiB"}, {"SM70_KV_CACHE_BYTES": "30GiB"},
     "SM70_KV_CACHE_BYTES"),
    ("kv-fits-gpu utilization", {"SM70_GPU_MEMORY_UTILIZATION": "0.3"},
     {"SM70_GPU_MEMORY_UTILIZATION": "0.4"}, "SM70_KV_CACHE_BYTES"),
    ("int12-needs-tp", {"SM70_ALLREDUCE_MODE": "int12", "SM70_TENSOR_PARALLEL_SIZE": "1",
     "SM70_GPUS": "0"}, {"SM70_ALLREDUCE_MODE": "fp16", "SM70_TENSOR_PARALLEL_SIZE": "1",
     "SM70_GPUS": "0"}, "SM70_ALLREDUCE_MODE"),
    ("mamba-mode-kept all", {"SM70_MAMBA_CACHE_MODE": "all"},
     {"SM70_MAMBA_CACHE_MODE": "align"}, "SM70_MAMBA_CACHE_MODE"),
    ("mamba-mode-kept caching off", {"SM70_ENABLE_PREFIX_CACHING": "false"},
     {"SM70_ENABLE_PREFIX_CACHING": "false", "SM70_MAMBA_CACHE_MODE": "none"},
     "SM70_MAMBA_CACHE_MODE"),
    ("mamba-mode-kept none with caching", {"SM70_MAMBA_CACHE_MODE": "none"},
     {"SM70_MAMBA_CACHE_MODE": "none", "SM70_ENABLE_PREFIX_CACHING": "false"},
     "SM70_MAMBA_CACHE_MODE"),
    ("async-scheduling-spec", {"SM70_ASYNC_SCHEDULING": "true"},
     {"SM70_ASYNC_SCHEDULING": "true", "SM70_SPEC_METHOD": "none"}, "SM70_ASYNC_SCHEDULING"),
    ("custom-allreduce-full-graphs", {"SM70_CUSTOM_ALLREDUCE": "true"},
     {"SM70_CUSTOM_ALLREDUCE": "true", "SM70_CUDAGRAPH_MODE": "piecewise"},
     "SM70_CUSTOM_ALLREDUCE"),
    ("public-host-needs-key", {"SM70_HOST": "10.0.0.5"},
     {"SM70_HOST": "10.0.0.5", "SM70_API_KEY": "k"}, "SM70_HOST"),
    ("loopback v6 needs no key", {"SM70_HOST": "::2"}, {"SM70_HOST": "::1"}, "SM70_HOST"),
    ("ngram-range", {"SM70_NGRAM_MIN": "9"}, {"SM70_NGRAM_MIN": "8"}, "SM70_NGRAM_MIN"),
    ("attention-backend-exists", {"SM70_ATTENTION_BACKEND": "SM70_PAGED"},
     {"SM70_ATTENTION_BACKEND": "FLEX_ATTENTION"}, "SM70_ATTENTION_BACKEND"),
    ("paged-decode-rows", {"SM70_ATTENTION_BACKEND": "SM70_PAGED", "SM70_SPEC_TOKENS": "7",
                           "SM70_CUDAGRAPH_SIZES": "8,16,32"},
     {"SM70_ATTENTION_BACKEND": "SM70_PAGED", "SM70_SPEC_TOKENS": "3"}, "SM70_SPEC_TOKENS"),
    ("paged-kv-dtype", {"SM70_KV_CACHE_DTYPE": "auto"},
     {"SM70_KV_CACHE_DTYPE": "auto", "SM70_ATTENTION_BACKEND": "TRITON_ATTN"},
     "SM70_KV_CACHE_DTYPE"),
]


def test_the_default_backend_is_sm70_paged_and_refuses_more_rows_than_it_verifies():
    assert load_settings({}).attention_backend == "SM70_PAGED"
    problems = problems_of({"SM70_SPEC_TOKENS": "7", "SM70_CUDAGRAPH_SIZES": "8,16,32"})
    assert [p.variable for p in problems] == ["SM70_SPEC_TOKENS"]
    assert "SM70_ATTENTION_BACKEND=SM70_PAGED verifies 8 query rows" in problems[0].rule
    load_settings({"SM70_SPEC_TOKENS": "3"})


def test_paged_decode_rows_only_bind_sm70_paged_with_speculation():
    seven = {"SM70_SPEC_TOKENS": "7", "SM70_CUDAGRAPH_SIZES": "8,16,32"}
    load_settings({**seven, "SM70_ATTENTION_BACKEND": "TRITON_ATTN"})
    load_settings({**seven, "SM70_ATTENTION_BACKEND": "SM70_PAGED", "SM70_SPEC_METHOD": "none"})


@pytest.mark.parametrize(("rule", "bad", "good", "variable"), CROSS, ids=[c[0] for c in CROSS])
def test_cross_field_rule(rule, bad, good, variable, monkeypatch):
    if rule == "attention-backend-exists":  # the shipped tree has the class: take it away
        monkeypatch.setattr("vllm_patch.plugin.attention_backend_defined", lambda: False)
    problems = problems_of(bad)
    assert [p.variable for p in problems] == [variable]
    assert problems[0].rule and problems[0].allowed
    load_settings(good)


def test_every_rule_is_exercised_above():
    from sm70ctl.settings.rules import RULES

    tested = {c[0].split(" ")[0] for c in CROSS}
    assert {rid for rid, _ in RULES} <= tested


# --- .env files ---------------------------------------------------------------------------
def test_env_file_values_and_sources(tmp_path):
    env = tmp_path / "prod.env"
    env.write_text(
        "# production\n"
        "export SM70_PORT=8100\n"
        "SM70_SERVED_MODEL_NAME = \"qwen prod\"\n"
        "SM70_MAX_NUM_SEQS=8   # fewer slots\n"
        "SM70_LOG_LEVEL='debug'\n"
        "\n"
    )
    with pytest.raises(SettingsError) as info:  # a space is not allowed in the name
        load_settings({}, env_file=env)
    (p,) = info.value.problems
    assert p.variable == "SM70_SERVED_MODEL_NAME" and p.source == f"file:{env}:3"

    env.write_text(env.read_text().replace("qwen prod", "qwen-prod"))
    s = load_settings({"SM70_PORT": "8200"}, env_file=env)
    assert s.port == 8200 and s.source_of("SM70_PORT") == "environment"
    assert s.max_num_seqs == 8 and s.source_of("SM70_MAX_NUM_SEQS") == f"file:{env}:4"
    assert s.served_model_name == "qwen-prod" and s.log_level == "debug"


def test_env_file_gets_the_same_checks(tmp_path):
    env = tmp_path / ".env"
    env.write_text("SM70_SPEC_TOKENS=4\nSM70_PORTT=1\nHF_HOME=/x\nnot a line\n")
    problems = problems_of({}, env_file=env)
    by = {p.variable: p for p in problems}
    assert by["SM70_SPEC_TOKENS"].source == f"file:{env}:1"
    assert by["SM70_PORTT"].allowed == "did you mean SM70_PORT?"
    assert "only SM70_" in by["HF_HOME"].rule
    assert by[f"{env}:4"].rule == "not a KEY=VALUE line"


def test_malformed_env_file_lines_never_echo_their_text(tmp_path):
    # a secret typed without `=` must not come back in the problem (table, JSON, error line)
    env = tmp_path / ".env"
    env.write_text("SM70_API_KEY: sk-live-123\nSM70_HF_TOKEN hf_abc456\nhf_bare789\n")
    with pytest.raises(SettingsError) as info:
        load_settings({}, env_file=env)
    by = {p.variable: p for p in info.value.problems}
    assert by[f"{env}:1"].value == "SM70_API_KEY ***"
    assert by[f"{env}:2"].value == "SM70_HF_TOKEN ***"
    assert by[f"{env}:3"].value == "***"  # a bare pasted token
    assert all(p.rule == "not a KEY=VALUE line" for p in by.values())
    text = info.value.message + repr([p.to_dict() for p in info.value.problems])
    assert not any(secret in text for secret in ("sk-live-123", "hf_abc456", "hf_bare789"))


def test_overrides_win_and_are_checked(tmp_path):
    env = tmp_path / ".env"
    env.write_text("SM70_MAX_NUM_SEQS=8\n")
    opt = {"SM70_MAX_NUM_SEQS": ("4", "--max-num-seqs")}
    s = load_settings({"SM70_MAX_NUM_SEQS": "2"}, env_file=env, overrides=opt)
    assert s.max_num_seqs == 4 and s.source_of("SM70_MAX_NUM_SEQS") == "--max-num-seqs"
    (p,) = problems_of({}, overrides={"SM70_MAX_NUM_SEQS": ("0", "--max-num-seqs")})
    assert (p.variable, p.value, p.source) == ("SM70_MAX_NUM_SEQS", "0", "--max-num-seqs")
    with pytest.raises(ValueError):
        load_settings({}, overrides={"SM70_NOPE": ("1", "--nope")})


def test_missing_env_file_is_a_clear_error(tmp_path):
    with pytest.raises(Sm70Error, match=r"env file .*: cannot read"):
        load_settings({}, env_file=tmp_path / "nope.env")


def test_explicit_mapping_ignores_the_process_environment(monkeypatch):
    monkeypatch.setenv("SM70_PORT", "8123")
    monkeypatch.setenv("SM70_MAX_NUM_SEQ", "1")  # misspelt, but not in the mapping
    assert load_settings({}).port == 8000
    monkeypatch.delenv("SM70_MAX_NUM_SEQ")
    s = load_settings()  # None: the process environment
    assert s.port == 8123 and s.source_of("port") == "environment"


def test_settings_model_reads_nothing_by_itself(monkeypatch, tmp_path):
    from sm70ctl.settings import Settings

    monkeypatch.setenv("SM70_PORT", "8123")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("SM70_PORT=8124\n")
    assert Settings().port == 8000
