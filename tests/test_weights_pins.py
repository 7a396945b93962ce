"""Model pins in the lock file: parsing rules, the packaged pins, and `--help` showing them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from sm70ctl.errors import UsageError
from sm70ctl.weights.pins import (
    COMMIT,
    PinError,
    default_lock_path,
    load_model_pins,
    parse_model_pins,
    select_pins,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SHA = "a" * 40


def _parse(text: str):
    return parse_model_pins(tomllib.loads(text), "t.lock")


def test_valid_pin():
    (pin,) = _parse(f'[models.base]\nrepo_id = "o/r"\nrevision = "{SHA}"\n'
                    'include = ["*.json"]\ncheck_quant = true\n')
    assert pin.revision == SHA and not pin.is_placeholder
    assert pin.local_dir == "base" and pin.include == ("*.json",) and pin.check_quant


def test_unverified_pin_is_a_placeholder():
    (pin,) = _parse('[models.base]\nrepo_id = "o/r"\nunverified = "not checked"\n')
    assert pin.is_placeholder and pin.describe_revision() == "UNVERIFIED PLACEHOLDER"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('repo_id = "o/r"\nrevision = "main"', "40-character"),
        ('repo_id = "o/r"\nrevision = "abc123"', "40-character"),
        (f'repo_id = "o/r"\nrevision = "{"A" * 40}"', "40-character"),
        ('repo_id = "o/r"', "unverified"),
        (f'repo_id = "o/r"\nrevision = "{SHA}"\nunverified = "x"', "keep one"),
        (f'repo_id = "just-a-name"\nrevision = "{SHA}"', "owner/name"),
        (f'repo_id = "o/r"\nrevision = "{SHA}"\nlocal_dir = "../up"', "plain folder"),
        (f'repo_id = "o/r"\nrevision = "{SHA}"\nlocal_dir = "a/b"', "plain folder"),
        (f'repo_id = "o/r"\nrevision = "{SHA}"\ninclude = "*.json"', "glob patterns"),
        (f'repo_id = "o/r"\nrevision = "{SHA}"\noptional = "yes"', "true or false"),
        (f'repo_id = "o/r"\nrevision = "{SHA}"\nrepo_type = "space"', "repo_type"),
    ],
)
def test_bad_pins_name_the_field(body, needle):
    with pytest.raises(PinError) as err:
        _parse(f"[models.base]\n{body}\n")
    assert needle in err.value.message and "[models.base]" in err.value.message


def test_two_pins_cannot_share_a_folder():
    text = (f'[models.a]\nrepo_id = "o/a"\nrevision = "{SHA}"\nlocal_dir = "x"\n'
            f'[models.b]\nrepo_id = "o/b"\nrevision = "{SHA}"\nlocal_dir = "x"\n')
    with pytest.raises(PinError, match="also used by"):
        _parse(text)


def test_selection():
    pins = _parse(f'[models.a]\nrepo_id = "o/a"\nrevision = "{SHA}"\n'
                  f'[models.b]\nrepo_id = "o/b"\nrevision = "{SHA}"\noptional = true\n')
    assert [p.name for p in select_pins(pins, [], False)] == ["a"]
    assert [p.name for p in select_pins(pins, [], True)] == ["a", "b"]
    assert [p.name for p in select_pins(pins, ["b"], False)] == ["b"]
    with pytest.raises(UsageError, match="no model pin named 'c'"):
        select_pins(pins, ["c"], False)


def test_packaged_lock_pins_the_base_checkpoint():
    pins = {p.name: p for p in load_model_pins()}
    assert "base" in pins, f"{default_lock_path()} lost its [models.base] table"
    base = pins["base"]
    assert base.check_quant and not base.optional
    # SM70_MODEL_DIR's default is SM70_WEIGHTS_DIR/<this folder>
    assert base.local_dir == "qwen3.8-27b-gptq-int8"
    for pin in pins.values():
        # either a real commit or an explicit, explained placeholder; nothing in between
        assert COMMIT.match(pin.revision) or (pin.revision == "" and pin.unverified), pin


def test_help_shows_the_pinned_revisions():
    from sm70ctl.cli import app

    result = CliRunner().invoke(app, ["weights", "fetch", "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0
    for pin in load_model_pins():
        assert pin.repo_id in result.output
        assert pin.describe_revision() in result.output


def test_fetch_refuses_the_placeholder_and_unknown_names(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SM70_WEIGHTS_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    placeholder = [p for p in load_model_pins() if p.is_placeholder]
    if placeholder:
        res = subprocess.run([sys.executable, "-m", "sm70ctl", "weights", "fetch",
                              placeholder[0].name], env=env, text=True, capture_output=True,
                             timeout=60)
        assert res.returncode == 1
        said = " ".join(res.stderr.split())  # rich wraps long lines
        assert "no verified revision" in said and placeholder[0].unverified in said
    res = subprocess.run([sys.executable, "-m", "sm70ctl", "weights", "fetch", "nope"],
                         env=env, text=True, capture_output=True, timeout=60)
    assert res.returncode == 2 and "no model pin named 'nope'" in res.stderr
