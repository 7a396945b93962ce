"""The MTP set of the backend A/B (device_backend_ab.py --set mtp, mtp_side.py, step_kinds.py)
on the CPU: the prompts and engine settings, how the pairs are judged (against plain decoding
strictly, against stock without the requests stock served from its cache), and what each
side must show to count (a side that fell back, never verified on our decode, or ran the
other prefill kernel fails)."""

from __future__ import annotations

import copy
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE.parent / "ab", HERE.parent / "serving", HERE):
    sys.path.insert(0, str(p))


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


dev = _load("device_backend_ab")
side = _load("mtp_side")
sk = _load("step_kinds")


# ------------------------------------------------------------------ prompts and engines
def test_the_prompts_are_fixed_and_fit() -> None:
    plan = side.phase_prompts()
    assert plan == side.phase_prompts()  # every side gets the same prompts
    assert set(plan) == set(side.PHASES)
    (long,), = plan["p32k"]
    (hit,), = plan["p32k_hit"]
    assert len(long) == side.P32K > 32000 and side.P32K % 528  # ends mid-block
    assert hit[:side.P32K_SHARED] == long[:side.P32K_SHARED] and hit != long[:len(hit)]
    assert len(side.phase_prompts()["p4k"][0][0]) == 4000
    assert len(plan["p100"][0][0]) == 100
    for phase, batches in plan.items():
        for batch in batches:
            assert len(batch) <= 16  # max_num_seqs
            for prompt in batch:  # prompt + new tokens + one verification step fit
                assert len(prompt) + side.max_tokens(phase) + side.K + 1 <= side.MAX_LEN
    (mix,) = plan["mix"]
    assert sum(len(p) <= 200 for p in mix) == 8
    assert sum(len(p) > side.MAX_BATCHED // 2 for p in mix) == 3  # chunks beside decodes
    assert len(plan["p32k"][0][0]) > 15 * side.MAX_BATCHED  # 16 chunks
    assert side.max_tokens("loop") == 512 and side.max_tokens("p32k") == 64


def test_the_engine_settings() -> None:
    ours = side.side_kwargs("m", True, True, True, 2, 0.04)
    stock = side.side_kwargs("m", False, True, True, 2, 0.04)
    plain = side.side_kwargs("m", True, False, False, 2, 0.04)
    assert ours["attention_backend"] == "CUSTOM"
    assert ours["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3,
                                          "attention_backend": "CUSTOM"}
    assert stock["speculative_config"]["attention_backend"] == "TRITON_ATTN"
    assert stock["attention_backend"] == "TRITON_ATTN"
    for kw in (ours, stock):
        assert kw["enable_prefix_caching"] and kw["mamba_cache_mode"] == "align"
        # 1-16 sequences of 1 + k rows, the launcher's sizes
        assert kw["compilation_config"]["cudagraph_capture_sizes"] == [4, 8, 16, 32, 64]
        assert kw["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert "speculative_config" not in plain and not plain["enable_prefix_caching"]
    assert plain["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16]
    for kw in (ours, stock, plain):
        assert kw["max_model_len"] >= 33000 and kw["max_num_batched_tokens"] == 2048
        assert kw["kv_cache_memory_bytes"] == 2 << 30 and kw["dtype"] == "float16"
        assert kw["kv_cache_dtype"] == "int8_per_token_head"


def test_the_mtp_side_commands() -> None:
    out = Path("/o")
    cmds = {n: dev.side_command("mtp", n, Path("/m"), out, 0.04) for n in dev.SETS["mtp"]}
    for n, cmd in cmds.items():
        assert cmd[1].endswith("mtp_side.py") and cmd[cmd.index("--kv-gib") + 1] == "2"
        assert cmd[cmd.index("--mode") + 1] == "graphs"
        assert ("--spec" in cmd) == (n != "ours_plain")
        assert ("--prefix-caching" in cmd) == (n != "ours_plain")
    f = cmds["fmha_mtp"]
    assert "--fmha" in f and f[f.index("--arch-path") + 1] == "sm70"
    assert "--fmha" not in cmds["ours_mtp"] and cmds["stock_mtp"][
        cmds["stock_mtp"].index("--side") + 1] == "stock"
    assert len(dev.SETS["mtp"]) <= 4 and dev.side_util(0.2, 4) * 4 <= 0.2
    assert set(dev.MTP_ROLES) == set(dev.SETS["mtp"])


# ------------------------------------------------------------------ step kinds
def test_step_kinds() -> None:
    assert sk.step_kind(3, 4, 0, "triton") == "decode_q4"
    assert sk.step_kind(8, 4, 2, "cutlass_fmha") == "decode_q4+prefill:cutlass_fmha"
    assert sk.step_kind(0, 0, 1, "triton") == "prefill:triton"
    assert sk.step_kind(0, 0, 0, "triton") == "empty"
    assert sk.group_role("mtp.layers.4.self_attn.attn") == "drafter"
    assert sk.group_role("language_model.model.layers.3.self_attn.attn") == "target"
    tally = {"language_model.model.layers.3.self_attn.attn": {"decode_q4": 5},
             "mtp.layers.4.self_attn.attn": {"decode_q4": 2, "decode_q1": 7}}
    assert sk.by_role(tally) == {"target": {"decode_q4": 5},
                                 "drafter": {"decode_q4": 2, "decode_q1": 7}}
    assert sk.delta({"target": {"a": 5, "b": 2}}, {"target": {"a": 3, "b": 2}}) == {
        "target": {"a": 2}}


def test_the_builder_wrapper_counts_served_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """install() on a stand-in builder class: each build() tallies its split under the
    group's first layer, capture builds that bypass build() do not, installing twice wraps
    once."""

    class Meta:
        def __init__(self, nd: int, q: int, npf: int) -> None:
            self.num_decodes, self.q_per_seq, self.num_prefills = nd, q, npf

    class Builder:
        layer_names = ("model.layers.3.self_attn.attn",)
        prefill_kernel = "cutlass_fmha"

        def build(self, common_prefix_len: int, cm: Any, fast_build: bool = False) -> Meta:
            return Meta(*cm)

        def build_for_cudagraph_capture(self, cm: Any) -> Meta:
            return Meta(*cm)

    fake = types.ModuleType("vllm_patch.attention.backend")
    fake.Sm70PagedMetadataBuilder = Builder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_patch.attention.backend", fake)
    monkeypatch.setattr(sk, "TALLY", {})
    tally = sk.install()
    assert sk.install() is tally
    b = Builder()
    b.build(0, (4, 4, 0))
    b.build(0, (4, 4, 1), fast_build=True)
    b.build(0, (4, 4, 1))
    b.build_for_cudagraph_capture((16, 4, 0))
    assert tally == {"model.layers.3.self_attn.attn": {
        "decode_q4": 1, "decode_q4+prefill:cutlass_fmha": 2}}


# ------------------------------------------------------------------ sides and their checks
def _rows(n: int, tokens: list[int], cached: int = 0, lp: float = -1.0,
          margin: float = 0.5) -> list[dict[str, Any]]:
    return [{"prompt_len": 10, "tokens": list(tokens), "logprobs": [lp] * len(tokens),
             "top2": [[t, lp, 0, lp - margin] for t in tokens], "num_cached_tokens": cached}
            for _ in range(n)]


def _phases(cached: int = 0) -> dict[str, list[dict[str, Any]]]:
    out = {p: _rows(1, [1, 2, 3]) for p in dev.MTP_REQUIRED}
    out["p32k_hit"] = _rows(1, [1, 2, 3], cached=cached)
    out["loop"] = _rows(1, list(range(20)))
    return out


def _side(role: str) -> dict[str, Any]:
    stock = role == "stock"
    cls = dev.STOCK_CLASS if stock else dev.OURS_CLASS
    layers = {f"{cls}:Impl": 1}
    spec = None if role == "plain" else {"method": "mtp", "num_speculative_tokens": 3}
    s: dict[str, Any] = {
        "attention_layers": layers, "phases": _phases(0 if role == "plain" else 528 * 60),
        "engine": {"speculative": spec, "enable_prefix_caching": role != "plain"},
        "drafter_attention": None if role == "plain" else dict(layers)}
    if stock:
        return s
    kernel = "cutlass_fmha" if role == "fmha" else "triton"
    q = "decode_q1" if role == "plain" else "decode_q4"
    s.update(prefill_kernel=kernel, step_kinds={
        "target": {q: 50, f"{q}+prefill:{kernel}": 6, f"prefill:{kernel}": 20},
        "drafter": {"decode_q1": 99}},
        attention_calls={"decode": 10, "kv_write": 30,
                         "prefill_triton": 20 if kernel == "triton" else 0,
                         "prefill_fmha": 20 if kernel == "cutlass_fmha" else 0,
                         "prefill_fmha_beside_decode": 6 if kernel == "cutlass_fmha" else 0},
        attention_device={"decode": 500, "prefill_fmha": 20 if kernel == "cutlass_fmha"
                          else 0})
    if role == "fmha":
        s["arch_path"] = "sm70"
    return s


def _sides() -> dict[str, dict[str, Any]]:
    return {n: _side(r) for n, r in dev.MTP_ROLES.items()}


def test_sides_that_ran_what_they_should_pass() -> None:
    for n, s in _sides().items():
        assert dev.mtp_check(s, dev.MTP_ROLES[n])["ok"], n


@pytest.mark.parametrize("name,breakage", [
    ("ours_mtp", lambda s: s.update(drafter_attention={f"{dev.STOCK_CLASS}:I": 1})),
    ("ours_mtp", lambda s: s["step_kinds"]["target"].pop("decode_q4")),  # never verified
    ("ours_mtp", lambda s: s["step_kinds"]["target"].pop("decode_q4+prefill:triton")),
    ("ours_mtp", lambda s: s["step_kinds"]["target"].update({"prefill:cutlass_fmha": 1})),
    ("ours_mtp", lambda s: s["attention_calls"].update(prefill_fmha=1)),
    ("ours_mtp", lambda s: s["phases"]["p32k_hit"][0].update(num_cached_tokens=0)),  # no hit
    ("ours_mtp", lambda s: s["engine"].update(speculative=None)),
    ("ours_mtp", lambda s: s["engine"].update(enable_prefix_caching=False)),
    ("ours_mtp", lambda s: s.update(attention_layers={f"{dev.STOCK_CLASS}:I": 1})),
    ("fmha_mtp", lambda s: s.update(arch_path=None)),
    ("fmha_mtp", lambda s: s.update(prefill_kernel="triton")),
    ("fmha_mtp", lambda s: s["step_kinds"]["target"].update({"decode_q4+prefill:triton": 1})),
    ("fmha_mtp", lambda s: s["attention_calls"].update(prefill_triton=3)),
    ("stock_mtp", lambda s: s.update(drafter_attention={f"{dev.OURS_CLASS}:I": 1})),
    ("stock_mtp", lambda s: s["engine"]["speculative"].update(num_speculative_tokens=1)),
    ("ours_plain", lambda s: s["step_kinds"]["target"].pop("decode_q1")),
    ("ours_plain", lambda s: s.update(drafter_attention={f"{dev.OURS_CLASS}:I": 1})),
])
def test_a_side_that_missed_its_path_fails(name: str, breakage: Any) -> None:
    s = copy.deepcopy(_sides()[name])
    breakage(s)
    assert not dev.mtp_check(s, dev.MTP_ROLES[name])["ok"]


# ------------------------------------------------------------------ the pairs
def test_equal_sides_pass_every_pair_and_the_verdict() -> None:
    sides = _sides()
    comps = dev.judge_mtp(sides)
    assert set(comps) == set(dev.PAIR_SETS["mtp"]) and all(c["passed"] for c in comps.values())
    checks = {n: dev.mtp_check(s, dev.MTP_ROLES[n]) for n, s in sides.items()}
    assert dev.verdict(None, checks, comps, "mtp", tests_asked=False)
    # stock's hit request is left out of the stock pairs, and said so
    assert comps["ours_vs_stock"]["stock_hits_skipped"] == [
        {"phase": "p32k_hit", "request": 0, "cached": 528 * 60}]
    assert not dev.verdict(None, checks, {k: v for k, v in comps.items()
                                          if k != "fmha_vs_plain"}, "mtp", tests_asked=False)


def _diverge(s: dict[str, Any], phase: str, token: int = 999) -> None:
    """The side's request of `phase` takes another token at step 1 (the caller sets the
    reference's top-1/top-2 margin there)."""
    s["phases"][phase][0]["tokens"][1] = token


def test_speculation_that_changes_tokens_fails_against_plain() -> None:
    sides = _sides()
    # a loss on a cached request (bug B's signature): stock is excused, ours is not
    for name, token in (("stock_mtp", 998), ("ours_mtp", 999)):
        _diverge(sides[name], "p32k_hit", token)
    sides["ours_plain"]["phases"]["p32k_hit"][0]["top2"][1][3] = -2.5  # margin 1.5
    comps = dev.judge_mtp(sides)
    assert not comps["ours_vs_plain"]["passed"] and comps["ours_vs_plain"]["lost"]
    assert comps["fmha_vs_plain"]["passed"]
    assert comps["ours_vs_stock"]["passed"]  # the stock request is skipped, not excused
    loss = dev.stock_loss(sides)
    assert loss is not None and not loss["passed"] and loss["lost_on_stock_hits"] == 1


def test_a_divergence_from_stock_where_stock_had_no_hit_fails() -> None:
    sides = _sides()
    _diverge(sides["fmha_mtp"], "p32k")
    sides["stock_mtp"]["phases"]["p32k"][0]["top2"][1][3] = -2.0  # margin 1.0
    comps = dev.judge_mtp(sides)
    assert not comps["fmha_vs_stock"]["passed"] and comps["ours_vs_stock"]["passed"]


def test_a_rounding_flip_passes_and_a_logprob_gap_fails_against_plain() -> None:
    sides = _sides()
    sides["ours_plain"]["phases"]["mix"][0]["top2"][1][3] = -1.01  # margin 0.01: a tie
    _diverge(sides["ours_mtp"], "mix")
    sides["ours_mtp"]["phases"]["p4k"][0]["logprobs"][0] = -1.0 + 0.05
    assert dev.judge_mtp(sides)["ours_vs_plain"]["passed"]
    sides["fmha_mtp"]["phases"]["p4k"][0]["logprobs"][0] = -1.0 + 0.5  # half a nat off
    assert not dev.judge_mtp(sides)["fmha_vs_plain"]["passed"]


def test_a_missing_required_phase_fails_a_missing_loop_does_not() -> None:
    sides = _sides()
    del sides["fmha_mtp"]["phases"]["loop"]  # killed at the budget in its last phase
    comps = dev.judge_mtp(sides)
    assert comps["fmha_vs_plain"]["passed"] and "loop" not in comps["fmha_vs_plain"][
        "phases_judged"]
    assert "loop" in comps["ours_vs_plain"]["phases_judged"]
    del sides["ours_mtp"]["phases"]["p32k"]
    comps = dev.judge_mtp(sides)
    assert not comps["ours_vs_plain"]["passed"] and not comps["ours_vs_stock"]["passed"]
    assert comps["ours_vs_plain"]["missing_required"] == ["p32k"]
    sides["stock_mtp"] = {"error": "RuntimeError: start-up", "phases": {}}
    comps = dev.judge_mtp(sides)
    assert "fmha_vs_stock" not in comps  # an engine that never ran leaves its pairs out


def test_served_by_gives_each_phase_its_own_counts() -> None:
    s = {"calls_after_startup": {"decode": 2, "kv_write": 2},
         "step_kinds_after_startup": {},
         "calls_by_phase": {
             "p100": {"calls": {"decode": 5, "kv_write": 9}, "device": {"decode": 40},
                      "step_kinds": {"target": {"decode_q4": 30, "prefill:triton": 1}}},
             "p4k": {"calls": {"decode": 5, "kv_write": 12}, "device": {"decode": 90},
                     "step_kinds": {"target": {"decode_q4": 80, "prefill:triton": 3}}}}}
    got = dev.served_by(s)
    assert got["p100"] == {"calls": {"decode": 3, "kv_write": 7}, "device": {"decode": 40},
                           "step_kinds": {"target": {"decode_q4": 30, "prefill:triton": 1}}}
    assert got["p4k"] == {"calls": {"kv_write": 3}, "device": {"decode": 50},
                          "step_kinds": {"target": {"decode_q4": 50, "prefill:triton": 2}}}


def test_the_default_set_is_mtp() -> None:
    import subprocess

    r = subprocess.run([sys.executable, str(HERE / "device_backend_ab.py"), "--help"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "mtp" in r.stdout
    src = (HERE / "device_backend_ab.py").read_text()
    assert 'default="mtp"' in src


def test_the_driver_end_to_end_on_stand_in_sides(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """main() with a stand-in side runner that writes prepared side JSON: the sides start,
    are read, checked, judged and summarised; one side losing tokens fails the run."""
    import json

    def run(sides: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
        src = out.parent / f"{out.name}_src"
        src.mkdir()
        for n, s in sides.items():
            (src / f"{n}.json").write_text(json.dumps(s))
        fake = out.parent / f"{out.name}_side.py"
        fake.write_text("import pathlib, shutil, sys\n"
                        "a = sys.argv\nout = pathlib.Path(a[a.index('--out') + 1])\n"
                        f"shutil.copy(pathlib.Path({str(src)!r}) / out.name, out)\n")
        monkeypatch.setitem(dev.RUNNERS, "mtp", fake)
        monkeypatch.setattr(sys, "argv", ["device_backend_ab.py", "--out", str(out),
                                          "--budget-s", "60", "--skip-pytest",
                                          "--skip-mutant"])
        rc = dev.main()
        summary = json.loads((out / "summary.json").read_text())
        assert (rc == 0) == summary["passed"]
        return summary

    good = run(_sides(), tmp_path / "good")
    assert good["passed"] is True and good["set"] == "mtp" and not good["errors"]
    assert set(good["comparisons"]) == set(dev.PAIR_SETS["mtp"])
    assert set(good["served_by"]) == {"ours_mtp", "fmha_mtp", "ours_plain"}
    assert good["stock_mtp_vs_plain"]["stock_cache_hits"] == 1
    bad = _sides()
    _diverge(bad["fmha_mtp"], "p100")
    bad["ours_plain"]["phases"]["p100"][0]["top2"][1][3] = -3.0  # a 2-nat margin
    summary = run(bad, tmp_path / "bad")
    assert summary["passed"] is False
    assert not summary["comparisons"]["fmha_vs_plain"]["passed"]
