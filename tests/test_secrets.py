"""The one masking rule (sm70ctl.secrets): names, near-misses, values in text, fingerprints."""

from __future__ import annotations

import pytest

from sm70ctl.secrets import (
    MASK,
    SCHEMA_SECRETS,
    edit_distance,
    fingerprint_env,
    is_secret_name,
    mask_argv,
    mask_env,
    mask_value,
    redact,
    scrub,
    secret_values,
)
from sm70ctl.settings.schema import load_schema


def test_schema_secrets_match_the_schema() -> None:
    assert {v.name for v in load_schema().variables if v.secret} == SCHEMA_SECRETS


def test_no_plain_schema_variable_reads_as_secret() -> None:
    plain = [v.name for v in load_schema().variables if not v.secret]
    assert [n for n in plain if is_secret_name(n)] == []


@pytest.mark.parametrize("name", [
    "SM70_API_KEY", "SM70_HF_TOKEN", "VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
    "OPENAI_API_KEY", "MY_SERVICE_TOKEN", "DB_PASSWORD", "XPASSWORDX", "APP_SECRET",
    "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "sm70_api_key", "DB_PWD", "MY_PASSWD",
    # near-misses of secret names by one or two edits
    "SM70_API_KYE", "SM70_APIKEY", "SM70_API_KE", "SM70_API_KEYS", "SM70_HF_TOKN",
    "SM70_HF_TOKNE", "SM70_HFTOKEN", "SM70_AIP_KEY", "SM70_SECERT", "VLLM_API_KYE",
    "SM70_PASWORD", "HF_TOEKN",
])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "PATH", "HOME", "PWD", "OLDPWD", "CUDA_VISIBLE_DEVICES", "SM70_SPEC_TOKENS",
    "SM70_MAX_NUM_BATCHED_TOKENS", "LD_LIBRARY_PATH", "SM70_HOST",
    "SM70_PORT", "NCCL_P2P_DISABLE", "VLLM_USE_V1", "LANG",
])
def test_plain_names(name: str) -> None:
    assert not is_secret_name(name)


def test_edit_distance() -> None:
    assert edit_distance("KEY", "KYE") == 1  # a swap is one edit
    assert edit_distance("TOKEN", "TOKEN") == 0
    assert edit_distance("ABC", "") == 3
    assert edit_distance("SM70_API_KEY", "SM70_APIKEY") == 1


def test_mask_value_and_env() -> None:
    assert mask_value("SM70_API_KYE", "sk-1") == MASK
    assert mask_value("SM70_API_KEY", "") == ""
    assert mask_value("SM70_PORT", "8000") == "8000"
    env = {"A": "x sk-1234 y", "HF_TOKEN": "hf_x", "B": "plain"}
    assert mask_env(env, ["sk-1234"]) == {"A": MASK, "HF_TOKEN": MASK, "B": "plain"}


def test_redact_longest_first() -> None:
    assert redact("key=abcdef and abc", ["abc", "abcdef"]) == f"key={MASK} and {MASK}"
    assert redact("nothing", ["", "zz"]) == "nothing"


def test_secret_values_collects_secret_named_and_extra() -> None:
    got = secret_values({"MY_TOKEN": "t0k", "PATH": "/bin", "E": ""}, extra=["k3y", None])
    assert set(got) == {"t0k", "k3y"}


def test_fingerprint_env_hides_value_keeps_fact() -> None:
    fp = fingerprint_env({"VLLM_API_KEY": "sk-secret", "X": "1", "HF_TOKEN": ""})
    assert fp == {"VLLM_API_KEY": "<set>", "X": "1", "HF_TOKEN": ""}
    assert "sk-secret" not in repr(fp)


def test_mask_argv() -> None:
    argv = ["vllm", "--api-key", "k1", "--api-key=k2", "--x", "a-k3-b"]
    assert mask_argv(argv, secrets=["k3"]) == [
        "vllm", "--api-key", MASK, f"--api-key={MASK}", "--x", f"a-{MASK}-b"]


def test_scrub_nested() -> None:
    data = {"env": {"SM70_API_KYE": "sk-9", "N": "ok"}, "log": ["said sk-9"], "n": 3}
    assert scrub(data, ["sk-9"]) == {"env": {"SM70_API_KYE": MASK, "N": "ok"},
                                     "log": [f"said {MASK}"], "n": 3}


def test_compile_fingerprint_holds_only_the_fact_of_a_secret() -> None:
    from sm70ctl.runtime.fingerprint import fingerprint, inherited_compile_env

    a = inherited_compile_env({"VLLM_API_KEY": "sk-one", "VLLM_X": "1"}, set())
    b = inherited_compile_env({"VLLM_API_KEY": "sk-two", "VLLM_X": "1"}, set())
    none = inherited_compile_env({"VLLM_X": "1"}, set())
    assert a == b == {"env:VLLM_API_KEY": "<set>", "env:VLLM_X": "1"}
    assert fingerprint(a) == fingerprint(b) != fingerprint(none)


def _one_edit(name: str, pos: int, ch: str, kind: int) -> str:
    pos %= len(name) + 1
    if kind == 0:
        return name[:pos] + ch + name[pos:]
    pos = min(pos, len(name) - 1)
    if kind == 1:
        return name[:pos] + name[pos + 1:]
    if kind == 2:
        return name[:pos] + ch + name[pos + 1:]
    pos = min(pos, len(name) - 2)
    return name[:pos] + name[pos + 1] + name[pos] + name[pos + 2:]


def test_every_one_edit_typo_of_a_secret_is_masked() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.sampled_from(sorted(SCHEMA_SECRETS | {"VLLM_API_KEY"})), st.integers(0, 20),
           st.sampled_from("ABEIKNOTY_0"), st.integers(0, 3))
    def check(name: str, pos: int, ch: str, kind: int) -> None:
        typo = _one_edit(name, pos, ch, kind)
        assert is_secret_name(typo), typo

    check()
