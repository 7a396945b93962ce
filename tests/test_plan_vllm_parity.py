"""The memory plan says what vLLM 0.22.1 allocates (issue 22 item 4, issue 23 item 3).

For the TP=2 reference settings and variations, tests/vllm_memory_probe.py computes with
vLLM 0.22.1's own functions (block size alignment for TRITON_ATTN, the attention and GDN
layers' KV cache specs, `get_kv_cache_configs` for --kv-cache-memory-bytes) what a CUDA
worker would allocate for the command line `sm70ctl serve` builds, and `sm70ctl plan`'s
served path must give the same block size, pages, blocks per GPU and per-request pages,
byte for byte. The probe runs in the serving venv with the 0.22.1 tree of
.ci/setup.d/35-vllm-0.22.1-py.sh (tests/vllm_cpu_tree.py runs it); without
them these tests skip, under CI=true they fail.

The bottom tests run the same comparison against plans with a plausible bug (scales left
out of the page, block size not aligned, state pages reserved up front) and check it fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from vllm_cpu_tree import REPO, VLLM_TREE, launch, model_folder, require_tree, run_probe

from sm70ctl.errors import Sm70Error
from sm70ctl.plan import pools
from sm70ctl.plan.plan import Plan, compute_plan
from sm70ctl.plan.run import plan_for_settings

PROBE = REPO / "tests" / "vllm_memory_probe.py"

# The reference TP=2 settings (the schema's defaults) and variations that move every figure.
CASES: dict[str, dict[str, str]] = {
    "reference": {},
    "kv-8GiB": {"SM70_KV_CACHE_BYTES": "8GiB"},
    "no-spec-8-seqs": {"SM70_SPEC_METHOD": "none", "SM70_MAX_NUM_SEQS": "8",
                       "SM70_KV_CACHE_BYTES": "6GiB"},
    "no-prefix-caching": {"SM70_ENABLE_PREFIX_CACHING": "false",
                          "SM70_MAMBA_CACHE_MODE": "none", "SM70_MAX_MODEL_LEN": "131072"},
    "block-1600": {"SM70_BLOCK_SIZE": "1600"},
}
# Settings vLLM refuses at start-up, and the plan with it (the setting it must name): align
# mode's 1,584-token block does not fit in a 1,024-token prefill chunk or step.
REFUSED: dict[str, dict[str, str]] = {
    "chunk-1024": {"SM70_PREFILL_CHUNK": "1024"},
    "batched-1024": {"SM70_MAX_NUM_BATCHED_TOKENS": "1024", "SM70_PREFILL_CHUNK": "1024"},
}
REFUSAL_NAMES = {"chunk-1024": "SM70_PREFILL_CHUNK=1024",
                 "batched-1024": "SM70_MAX_NUM_BATCHED_TOKENS=1024"}


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    tmp = tmp_path_factory.mktemp("memory")
    model_dir = model_folder(tmp)
    cases, plans, refusals = [], {}, {}
    for name, extra in {**CASES, **REFUSED}.items():
        s, case = launch(name, model_dir, extra, tmp)
        cases.append(case)
        try:
            plans[name] = plan_for_settings(s, gpus="2xv100").plan
        except Sm70Error as exc:
            refusals[name] = exc.message
    out, _ = run_probe(PROBE, {"model_dir": str(model_dir), "cases": cases}, tmp)
    out["plans"], out["refusals"] = plans, refusals
    return out


def _vllm(probe: dict[str, Any], name: str) -> dict[str, Any]:
    case = probe["cases"][name]
    assert "error" not in case, f"vLLM 0.22.1 refused the {name} launch: {case['error']}"
    return case


def plan_figures(plan: Plan) -> dict[str, Any]:
    """The plan's figures under the probe's names (GPU 0; the TP ranks plan alike)."""
    lay = plan.gpus[0].layout
    page = plan.gdn_page
    return {
        "block_size": lay.block_size,
        "attention_page_bytes": lay.block_size * plan.kv_bytes_per_token_layer,
        "attention_page_bytes_per_token": plan.kv_bytes_per_token_layer,
        "page_bytes": lay.page_bytes,
        "gdn_page_bytes": page.total if page else None,
        "num_blocks": lay.num_blocks,
        "group_size": lay.layer_group,
        "attention_layers": lay.attn_layers,
        "gdn_layers": lay.gdn_layers,
        "gdn_pages_per_request": lay.slots_per_seq,
        "longest_request": lay.kv_tokens,
    }


def mismatches(plan: Plan, vllm: dict[str, Any]) -> list[str]:
    got = plan_figures(plan)
    return [f"{k}: plan {got[k]!r}, vLLM {vllm.get(k)!r}" for k in got if got[k] != vllm.get(k)]


def test_probe_ran_vllm_0_22_1(probe: dict[str, Any]) -> None:
    assert probe["vllm_version"] == "0.22.1"
    # the released tree, with patch 0002 when the launch names SM70_PAGED (links to it)
    assert Path(probe["vllm_file"]).resolve().is_relative_to(VLLM_TREE.resolve())


@pytest.mark.parametrize("name", list(CASES))
def test_plan_equals_what_vllm_allocates(probe: dict[str, Any], name: str) -> None:
    vllm = _vllm(probe, name)
    plan = probe["plans"][name]
    assert plan.inputs.path == pools.SERVED
    bad = mismatches(plan, vllm)
    assert not bad, f"{name}: the plan differs from vLLM 0.22.1:\n" + "\n".join(bad)
    # vLLM refuses to start when one max-model-len request does not fit; the plan fits
    assert plan.fits


@pytest.mark.parametrize("name", list(REFUSED))
def test_plan_refuses_what_vllm_refuses(probe: dict[str, Any], name: str) -> None:
    assert "AssertionError" in probe["cases"][name].get("error", ""), probe["cases"][name]
    assert probe["refusals"][name].startswith(REFUSAL_NAMES[name])
    assert set(probe["refusals"]) == set(REFUSED)  # the CASES plan without refusal


def test_reference_allocation(probe: dict[str, Any]) -> None:
    """The reference figures, as vLLM computes them (docs/plan.md quotes them)."""
    v = _vllm(probe, "reference")
    assert v["attention_backend"] == "SM70_PAGED" and v["mamba_cache_mode"] == "align"
    assert v["attention_page_bytes_per_token"] == 1040  # 2 KV heads x 2 x (256 + 4 B scale)
    assert v["gdn_dtypes"] == ["float16", "float32"]
    assert v["gdn_page_bytes"] == 1_634_304 and v["block_size"] == 1584
    assert v["page_bytes"] == v["gdn_padded_page_bytes"] == 1584 * 1040
    assert sorted(v["group_kinds"]) == ["attention", "gdn", "gdn", "gdn"]
    assert v["group_size"] == 17 and v["num_blocks"] == 379
    assert v["gdn_pages_per_request"] == 5  # align with MTP k=3: 2 + 3


# --- the comparison catches plausible plan bugs -----------------------------------------


def _replan(probe: dict[str, Any], name: str = "reference", **inputs: Any) -> Plan:
    """The case's plan computed again (after a test broke part of the arithmetic)."""
    plan = probe["plans"][name]
    return compute_plan(plan.model, dataclasses.replace(plan.inputs, **inputs),
                        [g.gpu for g in plan.gpus])


def test_replanning_is_faithful(probe: dict[str, Any]) -> None:
    """The control of the tests below: recomputed unbroken, the plan still agrees."""
    assert not mismatches(_replan(probe), _vllm(probe, "reference"))


def test_scales_left_out_of_the_page_fail(probe: dict[str, Any],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(pools.KV_DTYPES, "int8_per_token_head", (1, 0))
    bad = mismatches(_replan(probe), _vllm(probe, "reference"))
    assert any(m.startswith(("attention_page_bytes_per_token", "block_size")) for m in bad)


def test_unaligned_block_size_fails(probe: dict[str, Any],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The block just large enough for a GDN page, not rounded to the 16-token alignment."""
    monkeypatch.setattr(pools, "hybrid_block_size",
                        lambda block, align, kv, gdn: -(-gdn // kv))
    bad = mismatches(_replan(probe), _vllm(probe, "reference"))
    assert any(m.startswith("block_size") for m in bad)


def test_state_reserved_up_front_fails(probe: dict[str, Any]) -> None:
    """The target path (split pools, int16 state, 8 slots per sequence) is not what vLLM
    allocates today: the comparison must see it, unified or split."""
    vllm = _vllm(probe, "reference")
    assert mismatches(_replan(probe, path=pools.TARGET), vllm)
    assert mismatches(_replan(probe, path=pools.TARGET, split_pools=False,
                              gdn_state_dtype="float32"), vllm)


def test_mamba_pages_per_request_follow_the_mode(probe: dict[str, Any]) -> None:
    """none keeps one page less per request than align: planning align for the
    no-prefix-caching case must fail."""
    vllm = _vllm(probe, "no-prefix-caching")
    assert not mismatches(_replan(probe, "no-prefix-caching"), vllm)
    assert mismatches(_replan(probe, "no-prefix-caching", mamba_cache_mode="align"), vllm)
