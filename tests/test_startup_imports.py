"""What the short commands do not import at start-up (the bench scripts time them; these
tests keep the reasons for their speed from coming back), and that the plain diagnostics
printed without rich read exactly as rich would print them into a pipe."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sm70ctl import output

REPO = Path(__file__).resolve().parents[1]

# Modules a short command has no use for; each one was once imported on the way.
HEAVY = ("yaml", "pydantic_settings", "rich", "sm70ctl.build.lock",
         "sm70ctl.weights.pins", "huggingface_hub", "torch", "vllm")


def _imported_by(argv: list[str], env: dict[str, str] | None = None) -> set[str]:
    code = (
        "import json, sys\n"
        "from sm70ctl.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.flush()\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.__stdout__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["env", "check"], ["env", "check", "--json"]])
def test_env_check_imports_nothing_heavy(argv: list[str]) -> None:
    loaded = _imported_by(argv)
    assert "sm70ctl.settings.model" in loaded  # it did check the settings
    assert not [m for m in HEAVY if m in loaded]


def test_warmup_check_imports_nothing_heavy(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env["SM70_CACHE_DIR"] = str(tmp_path / "cache")  # cold: the verdict line is printed too
    loaded = _imported_by(["warmup", "--check", "--device", "cpu", "--env-file",
                           str(REPO / "tests" / "e2e" / "cpu.env")], env)
    assert "sm70ctl.runtime.cache_status" in loaded  # it did answer
    assert not [m for m in HEAVY if m in loaded]


def _stderr_of(monkeypatch: pytest.MonkeyPatch, plain: bool) -> str:
    buffer = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buffer)
    monkeypatch.setattr(output, "_plain", lambda stream: plain)
    out = output.Output()
    out.info("info [bold]not markup[/bold] 50%")
    out.success("ok: SM70_PORT=8000\rhidden")
    out.warn("a [yellow]warning[/] with \\ and \x07 bell")
    out.error("bad value 'x' for SM70_PORT", hint="set SM70_PORT to an integer [1, 65535]")
    out.error("no hint")
    return buffer.getvalue()


def test_plain_diagnostics_match_rich_into_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    rich_text = _stderr_of(monkeypatch, plain=False)
    assert rich_text == _stderr_of(monkeypatch, plain=True)
    assert "error: no hint\n" in rich_text and "  fix: set SM70_PORT" in rich_text


def test_plain_result_line_matches_rich_into_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    texts = []
    for plain in (False, True):
        buffer = io.StringIO()
        monkeypatch.setattr(sys, "stdout", buffer)
        monkeypatch.setattr(output, "_plain", lambda stream, plain=plain: plain)
        output.Output().line("warm [0123abcd]: nothing to compile\r",
                             lambda: f"[green]warm[/green] {output.escape('[0123abcd]')}: "
                                     "nothing to compile\r")
        texts.append(buffer.getvalue())
    assert texts[0] == texts[1] == "warm [0123abcd]: nothing to compile\n"


def test_plain_only_where_rich_would_add_no_colour(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    assert output._plain(io.StringIO())
    assert not output._plain(Tty())
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert not output._plain(io.StringIO())
