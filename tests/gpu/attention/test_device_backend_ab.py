"""The attention device script's own logic on the CPU: which sides count as having run on
our backend, and when the run passes (a silent fallback to TRITON_ATTN, or a decode op that
never ran, must fail it)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "ab"))
spec = importlib.util.spec_from_file_location("device_backend_ab", HERE / "device_backend_ab.py")
assert spec is not None and spec.loader is not None
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)

from ab_side import engine_kwargs  # noqa: E402

spec = importlib.util.spec_from_file_location("fmha_side", HERE / "fmha_side.py")
assert spec is not None and spec.loader is not None
fmha_side = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fmha_side)

OURS = {"attention_layers": {f"{dev.OURS_CLASS}:Sm70PagedImpl": 2},
        "attention_calls": {"decode": 40, "kv_write": 50, "prefill_triton": 3},
        "attention_device_decodes": 400}
STOCK = {"attention_layers": {f"{dev.STOCK_CLASS}:TritonAttentionImpl": 2}}


def test_a_side_on_our_backend_that_ran_its_decode_passes() -> None:
    assert dev.backend_check(OURS, dev.OURS_CLASS, True)["ok"]
    assert dev.backend_check(STOCK, dev.STOCK_CLASS, False)["ok"]


def test_a_silent_fallback_to_triton_fails() -> None:
    fell_back = dict(STOCK, attention_calls={"decode": 0, "kv_write": 0},
                     attention_device_decodes=0)
    assert not dev.backend_check(fell_back, dev.OURS_CLASS, True)["ok"]
    mixed = dict(OURS, attention_layers={**OURS["attention_layers"], **STOCK["attention_layers"]})
    assert not dev.backend_check(mixed, dev.OURS_CLASS, True)["ok"]


def test_our_backend_whose_decode_never_ran_fails() -> None:
    assert not dev.backend_check(dict(OURS, attention_device_decodes=0), dev.OURS_CLASS, True)["ok"]
    assert not dev.backend_check(dict(OURS, attention_device_decodes=None), dev.OURS_CLASS,
                                 True)["ok"]
    assert not dev.backend_check(dict(OURS, attention_calls={"decode": 0, "kv_write": 9}),
                                 dev.OURS_CLASS, True)["ok"]
    assert not dev.backend_check({}, dev.OURS_CLASS, True)["ok"]


def test_the_verdict_needs_every_part() -> None:
    tests = {"rc": 0, "tests": 300, "skipped": 0}
    checks = {n: {"ok": True} for n in dev.SIDES}
    comps = {p: {"passed": True} for p in dev.PAIRS}
    assert dev.verdict(tests, checks, comps)
    assert not dev.verdict(None, checks, comps)
    assert not dev.verdict(dict(tests, skipped=4), checks, comps)  # a skipped GPU test
    assert not dev.verdict(dict(tests, rc=1), checks, comps)
    assert not dev.verdict(tests, {**checks, "ours_graphs": {"ok": False}}, comps)
    assert not dev.verdict(tests, checks, {**comps, "graphs": {"passed": False}})
    del comps["prefix_caching"]
    assert not dev.verdict(tests, checks, comps)


def test_the_engines_fit_the_scripts_share() -> None:
    assert dev.side_util(0.5) * len(dev.SIDES) <= 0.5
    assert dev.side_util(0.01) == 0.03  # the floor vLLM still starts with


def test_ab_side_sets_the_backend_and_prefix_caching() -> None:
    kw = engine_kwargs("m", "eager", 1024, attention_backend="CUSTOM", prefix_caching=True)
    assert kw["attention_backend"] == "CUSTOM" and kw["enable_prefix_caching"] is True
    assert kw["mamba_cache_mode"] == "align"
    stock = engine_kwargs("m", "graphs", 512)
    assert stock["attention_backend"] == "TRITON_ATTN" and not stock["enable_prefix_caching"]
    assert "mamba_cache_mode" not in stock


# ------------------------------------------------------------------ the FMHA set (the default)
FMHA = {**OURS, "prefill_kernel": "cutlass_fmha",
        "attention_calls": {"decode": 40, "kv_write": 50, "prefill_triton": 0,
                            "prefill_fmha": 12, "prefill_fmha_beside_decode": 3},
        "attention_device": {"decode": 400, "prefill_fmha": 12}}
FMHA.pop("attention_device_decodes")


def test_an_fmha_side_whose_prefills_ran_on_the_op_passes() -> None:
    assert dev.backend_check(FMHA, dev.OURS_CLASS, True, fmha=True)["ok"]
    assert dev.backend_check(FMHA, dev.OURS_CLASS, True)["ok"]  # its decode counters read


def test_an_fmha_side_that_missed_the_op_fails() -> None:
    calls = FMHA["attention_calls"]
    bad = [
        dict(FMHA, prefill_kernel="triton"),  # the plugin config did not arrive
        dict(FMHA, attention_calls={**calls, "prefill_triton": 1}),  # a prefill on Triton
        dict(FMHA, attention_calls={**calls, "prefill_fmha": 0}),
        dict(FMHA, attention_calls={**calls, "prefill_fmha_beside_decode": 0}),  # never mixed
        dict(FMHA, attention_device={"decode": 400, "prefill_fmha": 0}),
        dict(FMHA, attention_device={"decode": 400}),
        dict(FMHA, attention_device={"decode": 0, "prefill_fmha": 12}),
        OURS,  # the default route's side
    ]
    for side in bad:
        assert not dev.backend_check(side, dev.OURS_CLASS, True, fmha=True)["ok"], side


def test_the_fmha_verdict_needs_its_four_sides_and_two_pairs() -> None:
    tests = {"rc": 0, "tests": 300, "skipped": 0}
    checks = {n: {"ok": True} for n in dev.SETS["fmha"]}
    comps = {p: {"passed": True} for p in dev.PAIR_SETS["fmha"]}
    assert len(checks) <= 4  # the job's engine budget
    assert dev.verdict(tests, checks, comps, "fmha")
    assert not dev.verdict(tests, checks, comps)  # judged as the triton set: pairs missing
    assert not dev.verdict(tests, {**checks, "fmha_graphs": {"ok": False}}, comps, "fmha")
    assert not dev.verdict(tests, checks, {**comps, "fmha_eager": {"passed": False}}, "fmha")
    # --skip-pytest (the GPU tests ran in another job): the A/B alone decides
    assert dev.verdict(None, checks, comps, "fmha", tests_asked=False)
    assert not dev.verdict(None, checks, comps, "fmha")
    assert not dev.verdict(None, {**checks, "fmha_eager": {"ok": False}}, comps, "fmha",
                           tests_asked=False)
    del comps["fmha_graphs"]
    assert not dev.verdict(tests, checks, comps, "fmha")
    assert not dev.verdict(None, checks, comps, "fmha", tests_asked=False)


def test_the_side_commands() -> None:
    out = Path("/o")
    cmd = dev.side_command("fmha", "fmha_graphs", Path("/m"), out, 0.04)
    assert cmd[1].endswith("fmha_side.py") and "--fmha" in cmd and "--phases" not in cmd
    assert cmd[cmd.index("--mode") + 1] == "graphs" and cmd[cmd.index("--side") + 1] == "ours"
    eager = dev.side_command("fmha", "fmha_eager", Path("/m"), out, 0.04)
    assert eager[eager.index("--arch-path") + 1] == "sm70" and "--prefix-caching" in eager
    # a pair differs only in the backend: the same prefix-caching setting on both sides
    for which, pairs in dev.PAIR_SETS.items():
        for pair, (ref, sut) in pairs.items():
            if which == "mtp" and pair in dev.PLAIN_PAIRS:
                continue  # the plain reference is plain on purpose: no spec, no cache
            assert (("--prefix-caching" in dev.SETS[which][ref][2])
                    == ("--prefix-caching" in dev.SETS[which][sut][2])), (ref, sut)
    stock = dev.side_command("fmha", "stock_eager", Path("/m"), out, 0.04)
    assert "--fmha" not in stock and stock[stock.index("--side") + 1] == "stock"
    old = dev.side_command("triton", "ours_prefix", Path("/m"), out, 0.04)
    assert old[1].endswith("ab_side.py") and "--prefix-caching" in old
    assert old[old.index("--phases") + 1] == dev.PHASES
    for which, sides in dev.SETS.items():  # every pair names two sides of its set
        assert {n for pair in dev.PAIR_SETS[which].values() for n in pair} == set(sides)
    assert dev.side_util(0.2, 4) * 4 <= 0.2


def test_the_fmha_phases_chunk_the_4k_prompt_and_mix() -> None:
    plan = fmha_side.phase_prompts()
    assert plan == fmha_side.phase_prompts()  # both sides get the same prompts
    (p100,), = plan["p100"]
    (p4k,), = plan["p4k"]
    assert len(p100) == 100 and len(p4k) == 4000
    assert len(p4k) > 3 * fmha_side.MAX_BATCHED  # at least four chunks
    assert len(p4k) + 64 <= fmha_side.MAX_LEN
    (mix,) = plan["mix"]
    lens = [len(p) for p in mix]
    assert sum(n <= 200 for n in lens) == 8 and max(lens) + 64 <= fmha_side.MAX_LEN
    assert sum(n > fmha_side.MAX_BATCHED for n in lens) == 3  # chunked beside the decodes
    assert plan["prefix"] and max(len(p) for b in plan["prefix"] for p in b) + 64 <= \
        fmha_side.MAX_LEN


def test_the_fmha_plugin_config_selects_the_op() -> None:
    from vllm_patch.config import PluginConfig

    cfg = PluginConfig.from_json(fmha_side.FMHA_CONFIG)
    assert cfg.attention.prefill_kernel == "cutlass_fmha"
    assert PluginConfig().attention.prefill_kernel == "triton"  # the default stays


def test_the_mutant_result(tmp_path: Path) -> None:
    f = tmp_path / "m.json"
    assert dev.mutant_result(f)["killed"] is None  # not written (killed at the budget)
    f.write_text(json.dumps([{"mutant": dev.MUTANT, "ok": True, "checks": []}]))
    assert dev.mutant_result(f)["killed"] is True
    f.write_text(json.dumps([{"mutant": dev.MUTANT, "ok": False, "error": "build"}]))
    assert dev.mutant_result(f) == {"killed": False, "checks": None, "error": "build"}
