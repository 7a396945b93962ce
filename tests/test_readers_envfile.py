"""Env files by the dotenv conventions, with bounded values and path settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from sm70ctl.errors import Sm70Error
from sm70ctl.settings.loader import (
    MAX_ENV_FILE_BYTES,
    MAX_VALUE_BYTES,
    load_settings,
    parse_env_text,
)
from sm70ctl.settings.problems import SettingsError


def _values(text: str) -> dict[str, str]:
    values, problems = parse_env_text(text, "x.env")
    assert problems == [], [p.line() for p in problems]
    return {k: v.text for k, v in values.items()}


@pytest.mark.parametrize("text,value", [
    ("SM70_PORT=8001", "8001"),
    ("SM70_PORT='8001' # a comment", "8001"),
    ('SM70_PORT="8001"   # a comment', "8001"),
    ("export SM70_PORT=8001", "8001"),
    ("  export   SM70_PORT = 8001  ", "8001"),
    ("SM70_PORT=8001 # comment", "8001"),
    ("SM70_PORT=8001\r", "8001"),
    ("\ufeffSM70_PORT=8001", "8001"),
    ("SM70_SERVED_MODEL_NAME='a#b'", "a#b"),
    ("SM70_SERVED_MODEL_NAME=a#b", "a#b"),
    ('SM70_SERVED_MODEL_NAME="a \\"q\\" b"', 'a "q" b'),
    ("SM70_SERVED_MODEL_NAME=''", ""),
])
def test_dotenv_conventions(text: str, value: str) -> None:
    key = text.split("=")[0].split()[-1].lstrip("\ufeff")
    assert _values(text) == {key: value}


def test_crlf_file() -> None:
    assert _values("SM70_PORT=8001\r\nSM70_HOST=127.0.0.1\r\n") == {
        "SM70_PORT": "8001", "SM70_HOST": "127.0.0.1"}


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x85", "\r"])
def test_only_newline_ends_a_line(sep: str) -> None:
    # a commented-out setting stays commented out whatever odd separator the comment holds
    assert _values(f"# old value{sep}SM70_PORT=9999\nSM70_HOST=127.0.0.1") == {
        "SM70_HOST": "127.0.0.1"}


@pytest.mark.parametrize("text,rule", [
    ("SM70_PORT='8001", "single quote not closed"),
    ('SM70_PORT="8001', "double quote not closed"),
    ("SM70_PORT='8001' junk", "text after the closing quote"),
    ("SM70_PORT", "not a KEY=VALUE line"),
    ("9BAD=1", "not a KEY=VALUE line"),
])
def test_bad_lines(text: str, rule: str) -> None:
    _, problems = parse_env_text(text, "x.env")
    assert len(problems) == 1 and problems[0].rule.startswith(rule)
    assert problems[0].source == "file:x.env:1"


def test_bad_line_does_not_echo_a_secret() -> None:
    _, problems = parse_env_text("SM70_API_KEY: sk-live-123\nSM70_API_KEY='sk-live-123", "e")
    assert len(problems) == 2
    assert all("sk-live" not in p.line() for p in problems)


def test_duplicate_keys_with_different_values() -> None:
    _, problems = parse_env_text("SM70_PORT=1\nSM70_PORT=1\nSM70_PORT=2\n", "x.env")
    assert len(problems) == 1
    assert "set twice with different values (first at x.env:2)" in problems[0].rule
    assert problems[0].source == "file:x.env:3"


def test_duplicate_secret_not_echoed() -> None:
    _, problems = parse_env_text("SM70_API_KEY=aaa1\nSM70_API_KEY=bbb2\n", "x.env")
    assert "aaa1" not in problems[0].line() and "bbb2" not in problems[0].line()


def test_misspelt_secret_masked_by_env_check(tmp_path: Path) -> None:
    env = tmp_path / "e.env"
    env.write_text("SM70_API_KYE=sk-planted-42\n")
    with pytest.raises(SettingsError) as info:
        load_settings({"SM70_HF_TOKNE": "hf-planted-43"}, env_file=env)
    text = info.value.message + repr([p.to_dict() for p in info.value.problems])
    assert "SM70_API_KYE" in text and "SM70_HF_TOKNE" in text
    assert "planted" not in text


def test_huge_value_refused_with_limit() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({"SM70_SERVED_MODEL_NAME": "x" * (10 * 1024 * 1024)})
    (problem,) = info.value.problems
    assert problem.variable == "SM70_SERVED_MODEL_NAME"
    assert f"at most {MAX_VALUE_BYTES:,} bytes" in problem.allowed
    assert len(info.value.message) < 1000


@pytest.mark.parametrize("path,rule", [
    ("/srv/" + "m" * 256, "256 bytes long (limit 255"),
    ("/" + "/".join(["d" * 200] * 25), "limit 4096"),
])
def test_path_limits_refused(path: str, rule: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({"SM70_MODEL_DIR": path})
    (problem,) = info.value.problems
    assert problem.variable == "SM70_MODEL_DIR" and rule in problem.rule
    assert len(info.value.message) < 1000


def test_env_file_too_big(tmp_path: Path) -> None:
    env = tmp_path / "big.env"
    with env.open("wb") as f:  # sparse: no 32 MiB written
        f.truncate(MAX_ENV_FILE_BYTES + 1)
    with pytest.raises(Sm70Error, match="over the limit"):
        load_settings({}, env_file=env)


def test_env_file_is_a_folder(tmp_path: Path) -> None:
    with pytest.raises(Sm70Error, match="is a folder"):
        load_settings({}, env_file=tmp_path)


def test_huge_override_refused_naming_its_source() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({}, overrides={"SM70_SERVED_MODEL_NAME": ("y" * 20_000, "--name")})
    (problem,) = info.value.problems
    assert problem.source == "--name" and "20,000 bytes" in problem.rule


def test_huge_unknown_name_is_cut() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({"SM70_" + "X" * 100_000: "1"})
    assert len(info.value.message) < 1000 and "100,005 characters" in info.value.message


@pytest.mark.parametrize("quote", ["", "'", '"'])
def test_huge_value_in_env_file_refused_by_name(tmp_path: Path, quote: str) -> None:
    env = tmp_path / "big.env"
    env.write_text(f"SM70_PORT=8001\nSM70_SERVED_MODEL_NAME={quote}{'v' * 10_000_000}{quote}\n")
    with pytest.raises(SettingsError) as info:
        load_settings({}, env_file=env)
    (problem,) = info.value.problems
    assert problem.variable == "SM70_SERVED_MODEL_NAME"
    assert "10,000,000 bytes" in problem.rule and "16,384" in problem.allowed


def test_double_quote_escapes() -> None:
    assert _values('SM70_SERVED_MODEL_NAME="a\\\\b\\nc\\qd"') == {
        "SM70_SERVED_MODEL_NAME": "a\\b\nc\\qd"}
