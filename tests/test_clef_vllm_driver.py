"""device_clef_vllm.py's driver glue on the CPU: stub engines and server write their
results, the driver writes every step and summary.json (no torch, no vLLM, no GPU)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE / "gpu" / "clef", HERE / "gpu" / "ab", HERE / "gpu" / "serving"):
    sys.path.insert(0, str(p))

import clef_vllm_fixtures as fx  # noqa: E402
import device_clef_vllm as d  # noqa: E402


class Done:
    pid = 1

    def poll(self) -> int:
        return 0


def engines(reload_ok: bool = True) -> dict[str, Any]:
    r = fx.results()
    ours = r["ours"]
    ours["phases"].update(
        http_ref={"response": fx.score_body([[0.2, 0.8]])},
        stability=fx.stability([fx.burst() for _ in range(d.BURSTS)])["phases"]["stability"],
        memory={"correction_bytes": 5, "format_bytes": 5, "head_bytes": 3,
                "arena_rule_bytes": 2 << 20, "storages": 1, "hook": ["installed"],
                "allocator": {"block_bytes": 2 << 20}},
        scoring={"cases": [], "left_in_store": {"partial": 0, "done": 0}})
    if not reload_ok:
        r["merged"]["phases"].pop("base16")
        r["merged"]["phases"]["reload"] = {"effective": False}
    return {"ours": ours, "merged": r["merged"]}


def drive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: dict[str, Any],
          http: dict[str, Any]) -> dict[str, Any]:
    monkeypatch.setattr(d.subprocess, "run", lambda *a, **k: types.SimpleNamespace(
        stdout=json.dumps({"passed": True}) + "\n", stderr="", returncode=0))

    def start_engine(run: Any, name: str, spec: Any, side: str, extra: Any) -> Any:
        out = run.out / f"engine_{name}.json"
        out.write_text(json.dumps(fake[name]))
        return Done(), out

    monkeypatch.setattr(d, "start_engine", start_engine)
    monkeypatch.setattr(d, "start_server", lambda *a: types.SimpleNamespace(info={}))
    monkeypatch.setattr(d, "serve_cases", lambda run, server, dl: http)
    run = d.Run(tmp_path, 100)
    assert d.driver(run) == 0
    return json.loads((tmp_path / "summary.json").read_text())


def good_http() -> dict[str, Any]:
    ours = engines()["ours"]["phases"]
    return {"server": {}, "cases": {
        "base_completion": {"status": 200, "row": ours["chat_only"][d.HTTP_PROMPT_IDX]},
        "base_chat": {"passed": True}, "clef_chat_refused": {"passed": True},
        "clef_too_long": {"passed": True},
        "clef_score": {"status": 200, "body": fx.score_body([[0.2, 0.8]])},
        "clef_no_drafts": {"passed": True}}}


def test_good_stub_results_pass_every_step(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    s = drive(tmp_path, monkeypatch, engines(), good_http())
    assert s["passed"] is True, s["steps"]
    assert set(s["steps"]) == {"prepare", "engines", "chat_bits", "clef_vs_merged", "http",
                               "scoring", "stability", "memory"}


def test_no_server_and_no_noise_floor_fail(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    s = drive(tmp_path, monkeypatch, engines(reload_ok=False), {"server": {}})
    assert s["steps"]["http"] is False and s["steps"]["clef_vs_merged"] is False
    assert s["passed"] is False
