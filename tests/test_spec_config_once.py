"""`--speculative-config` reaches vLLM exactly once (issue 24 item 3; the reference's bug:
given twice, it silently ran at k=1).

What vLLM 0.22.1 does with a repeated flag, shown through its own parser and engine-config
builder (tests/vllm_config_probe.py, run by tests/vllm_cpu_tree.py): the
last copy wins, with a "Found duplicate keys" warning as the only trace, and every spelling
`sm70ctl.runtime.spec_flag` flags is read as that flag. Our side: `vllm_argv` emits it once
(none without speculation) for every speculation setting, refuses a setting's value that
vLLM would read as a second copy, and `sm70ctl serve` / `sm70ctl warmup` take no vLLM
arguments through (an extra flag is a usage error, exit 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner
from vllm_cpu_tree import CONFIG_PROBE, model_folder, require_tree, run_probe

from sm70ctl.cli import app
from sm70ctl.errors import Sm70Error
from sm70ctl.runtime import config_parity as cp
from sm70ctl.runtime.command_line import vllm_argv
from sm70ctl.runtime.environment import vllm_env
from sm70ctl.runtime.spec_flag import reads_as_speculative_config, speculative_config_words
from sm70ctl.settings import load_settings

K1 = '{"method":"mtp","num_speculative_tokens":1}'
# Spelling -> the words appended after our command line (which carries k=3). Each is a
# second --speculative-config asking for k=1; vLLM must end up at k=1 for every one.
SECOND_COPIES: dict[str, list[str]] = {
    "plain": ["--speculative-config", K1],
    "equals": [f"--speculative-config={K1}"],
    "underscores": ["--speculative_config", K1],
    "short": ["-sc", K1],
    "abbreviated": ["--speculative", K1],
    "dotted": ["--speculative-config.method", "mtp",
               "--speculative-config.num_speculative_tokens", "1"],
}
# Not the flag: our detector says so, and vLLM refuses the word instead of reading it.
NEAR_MISS = ["--speculative-configs", K1]


def _settings(**extra: str) -> Any:
    return load_settings(environ={"SM70_MODEL_DIR": "/m", **extra})


# --- our side (pure) --------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    {}, {"SM70_SPEC_TOKENS": "1", "SM70_CUDAGRAPH_SIZES": "2,4,8,16,32"},
    # more verification rows than SM70_PAGED's decode kernel takes: vLLM's own backend
    {"SM70_SPEC_TOKENS": "7", "SM70_CUDAGRAPH_SIZES": "8,16,32,64",
     "SM70_ATTENTION_BACKEND": "TRITON_ATTN"},
    {"SM70_SPEC_METHOD": "ngram"}, {"SM70_ENFORCE_EAGER": "true"},
    {"SM70_API_KEY": "-sc-secret-looking"},
])
def test_the_command_line_carries_the_flag_once(extra: dict[str, str]) -> None:
    argv = vllm_argv(_settings(**extra))
    assert speculative_config_words(argv) == ["--speculative-config"]
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["num_speculative_tokens"] == int(extra.get("SM70_SPEC_TOKENS", "3"))


def test_without_speculation_there_is_no_flag() -> None:
    assert speculative_config_words(vllm_argv(_settings(SM70_SPEC_METHOD="none"))) == []


@pytest.mark.parametrize(("var", "value"), [
    ("SM70_MODEL_DIR", "--speculative-config.num_speculative_tokens=1"),
    ("SM70_MODEL_DIR", "-sc"),
    ("SM70_GENERATION_CONFIG", "--speculative_config"),
])
def test_a_setting_read_as_a_second_flag_is_refused(var: str, value: str) -> None:
    with pytest.raises(Sm70Error) as err:
        vllm_argv(_settings(**{var: value}))
    assert f"{var}={value!r}" in err.value.message and "2 times" in err.value.message
    with pytest.raises(Sm70Error, match="1 times \\(want 0\\)"):
        vllm_argv(_settings(SM70_SPEC_METHOD="none", **{var: value}))


def test_the_detector_knows_each_spelling() -> None:
    for words in SECOND_COPIES.values():
        assert reads_as_speculative_config(words[0])
    assert not reads_as_speculative_config(NEAR_MISS[0])
    for word in ("--served-model-name", "--", "-O3", "--model", "x", "--speculative-configx"):
        assert not reads_as_speculative_config(word)


@pytest.mark.parametrize("command", [["serve", "--dry-run"], ["warmup", "--check"]])
def test_cli_takes_no_vllm_flags_through(command: list[str], tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"SM70_MODEL_DIR": "/m", "SM70_CACHE_DIR": str(tmp_path / "cache"),
           "SM70_LOCK_DIR": str(tmp_path / "locks"), "SM70_LOG_DIR": str(tmp_path / "logs")}
    control = runner.invoke(app, command, env=env)
    assert control.exit_code != 2, control.output  # the command itself is no usage error
    for extra in (["--speculative-config", K1], ["--", "--speculative-config", K1], ["-sc", K1]):
        result = runner.invoke(app, [*command, *extra], env=env)
        assert result.exit_code == 2, (extra, result.output)
        assert "No such option" in result.output or "unexpected extra argument" in result.output


# --- vLLM 0.22.1's parser (the probe) -------------------------------------------------


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    tmp = tmp_path_factory.mktemp("spec-twice")
    model_dir = model_folder(tmp)
    s = load_settings(environ={"SM70_MODEL_DIR": str(model_dir)})
    ours = vllm_argv(s)[3:]
    env = vllm_env(s, cache_entry=tmp / "cache")
    at = ours.index("--speculative-config")
    cases = {"ours": ours, "near-miss": ours + NEAR_MISS,
             "ours-last": [*ours[:at], "--speculative-config", K1, *ours[at:]]}
    cases.update({f"second-{name}": ours + words for name, words in SECOND_COPIES.items()})
    out, log = run_probe(CONFIG_PROBE, {
        "model_dir": str(model_dir), "fields": dict(cp.FIELDS),
        "cases": [{"name": n, "argv": a, "env": env} for n, a in cases.items()]}, tmp)
    out["log"] = log
    return out


def _k(probe: dict[str, Any], name: str) -> object:
    case = probe["cases"][name]
    assert "error" not in case, f"{name}: vLLM refused: {case['error']}"
    return case["values"]["num_speculative_tokens"]


def test_our_command_line_gives_k3(probe: dict[str, Any]) -> None:
    assert _k(probe, "ours") == 3


@pytest.mark.parametrize("name", list(SECOND_COPIES))
def test_vllm_silently_takes_a_second_copy(probe: dict[str, Any], name: str) -> None:
    """Why it must be refused: vLLM 0.22.1 runs at the second copy's k=1, no error."""
    assert _k(probe, f"second-{name}") == 1
    assert probe["cases"][f"second-{name}"]["values"]["speculative_method"] == "mtp"


def test_the_last_copy_wins_and_only_a_warning_says_so(probe: dict[str, Any]) -> None:
    assert _k(probe, "ours-last") == 3
    assert "Found duplicate keys --speculative-config" in probe["log"]


def test_a_word_the_detector_passes_is_refused_by_vllm(probe: dict[str, Any]) -> None:
    assert "error" in probe["cases"]["near-miss"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
