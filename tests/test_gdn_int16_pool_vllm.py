"""The int16 GDN pool inside vLLM 0.22.1's Python tree on the CPU (issue 23 item 3; opt-in,
no GPU has run it): with SM70_GDN_KERNEL=sm70 and the int16 state, what vLLM computes with our
model and layer subclasses (block size alignment, page, blocks, the three state tensors)
equals `sm70ctl plan` (served path, and the target path's page); our layer hands the scales
to the op, runs prefill steps on a float32 copy of exactly their slots, and refuses what it
cannot serve in one line (tests/test_gdn_int16_pool_probe.py). Needs the serving venv and the
0.22.1 tree (tests/vllm_cpu_tree.py): skips without them, fails under CI=true.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_plan_vllm_parity import mismatches
from vllm_cpu_tree import REPO, launch, model_folder, require_tree, run_probe

from sm70ctl.plan import pools
from sm70ctl.plan.plan import Plan, compute_plan
from sm70ctl.plan.run import plan_for_settings

PROBE = REPO / "tests" / "test_gdn_int16_pool_probe.py"
ON = {"SM70_GDN_KERNEL": "sm70", "SM70_GDN_STATE_DTYPE": "int16"}
CASES: dict[str, dict[str, str]] = {
    "int16": ON,
    "int16-no-spec-8-seqs": {**ON, "SM70_SPEC_METHOD": "none", "SM70_MAX_NUM_SEQS": "8",
                             "SM70_KV_CACHE_BYTES": "6GiB"},
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    tmp = tmp_path_factory.mktemp("int16_pool")
    model_dir = model_folder(tmp)
    cases, plans, targets = [], {}, {}
    for name, extra in CASES.items():
        s, case = launch(name, model_dir, extra, tmp)
        cases.append(case)
        plans[name] = plan_for_settings(s, gpus="2xv100").plan
        targets[name] = plan_for_settings(s, gpus="2xv100", path=pools.TARGET).plan
    out, _ = run_probe(PROBE, {"model_dir": str(model_dir), "cases": cases, "layer": True}, tmp)
    assert "error" not in out, out.get("traceback")
    out["plans"], out["targets"] = plans, targets
    return out


def _vllm(probe: dict[str, Any], name: str) -> dict[str, Any]:
    case = probe["cases"][name]
    assert "error" not in case, f"vLLM 0.22.1 refused the {name} launch: {case['error']}"
    return case


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_allocates_int16_codes_and_row_scales(probe: dict[str, Any], name: str) -> None:
    v = _vllm(probe, name)
    assert probe["vllm_version"] == "0.22.1"
    assert v["model_class"] == "Sm70Qwen3_5Int16"  # the block size came from our classmethods
    assert v["gdn_layer_class"] == "Sm70GatedDeltaNetInt16"
    assert v["gdn_dtypes"] == ["float16", "int16", "float32"]
    conv, codes, scales = v["gdn_shapes"]
    # SD layout: kernel - 1 rows (+ 1 per MTP token) x conv_dim / TP
    assert conv == [3 + (0 if "no-spec" in name else 3), 5120]
    assert codes == [24, 128, 128] and scales == [24, 128]


@pytest.mark.parametrize("name", list(CASES))
def test_served_plan_equals_what_vllm_allocates(probe: dict[str, Any], name: str) -> None:
    plan = probe["plans"][name]
    assert plan.gdn_state_dtype == "int16"
    bad = mismatches(plan, _vllm(probe, name))
    assert not bad, f"{name}: the plan differs from vLLM 0.22.1:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", list(CASES))
def test_target_plan_page_equals_vllm_page(probe: dict[str, Any], name: str) -> None:
    """`sm70ctl plan --path target` plans the same GDN page vLLM sizes (before padding)."""
    target = probe["targets"][name]
    assert target.inputs.path == pools.TARGET and target.gdn_state_dtype == "int16"
    assert target.gdn_page.total == _vllm(probe, name)["gdn_page_bytes"]


def test_reference_int16_figures(probe: dict[str, Any]) -> None:
    """TP=2, 3 MTP tokens, int8 KV at 1040 B per token: 786,432 B of codes + 12,288 B of
    scales + 61,440 B of conv state = 860,160 B, which the 1040 B/token attention page first
    holds at 832 tokens (align mode: the mamba block follows the attention block)."""
    v = _vllm(probe, "int16")
    assert v["gdn_page_bytes"] == 24 * 128 * 128 * 2 + 24 * 128 * 4 + 6 * 5120 * 2 == 860_160
    assert v["block_size"] == v["mamba_block_size"] == 832
    assert v["page_bytes"] == v["gdn_padded_page_bytes"] == 832 * 1040


def _replan(probe: dict[str, Any], name: str, **inputs: Any) -> Plan:
    plan = probe["plans"][name]
    return compute_plan(plan.model, dataclasses.replace(plan.inputs, **inputs),
                        [g.gpu for g in plan.gpus])


def test_replanning_is_faithful(probe: dict[str, Any]) -> None:
    """The control of the two tests below."""
    assert not mismatches(_replan(probe, "int16"), _vllm(probe, "int16"))


def test_a_plan_without_row_scales_fails(probe: dict[str, Any],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "INT16_ROW_SCALE_BYTES", 0)
    bad = mismatches(_replan(probe, "int16"), _vllm(probe, "int16"))
    assert any(m.startswith("gdn_page_bytes") for m in bad)
    assert any(m.startswith("block_size") for m in bad)


def test_a_plan_of_the_fp32_pool_fails(probe: dict[str, Any]) -> None:
    """The served plan with the plugin's GDN layer off (fp32) is not this allocation."""
    assert mismatches(_replan(probe, "int16", gdn_kernel="triton"), _vllm(probe, "int16"))


@pytest.mark.parametrize("kind", ["decode", "spec"])
def test_decode_steps_hand_the_scales_to_our_op(probe: dict[str, Any], kind: str) -> None:
    r = probe["layer"][kind]
    assert r["scale_passed"], "the op did not get the pool's scale view"
    assert r["out_equal"] and r["codes_equal"] and r["scales_equal"]
    assert r["states_changed"]  # not vacuous
    assert r["other_slots_untouched"]


def test_a_prefill_step_runs_vllm_on_a_float32_copy_of_its_slots(probe: dict[str, Any]) -> None:
    r = probe["layer"]["prefill"]
    assert r["state_dtype"] == "torch.float32"
    # slots 17, 5, 9 renumbered into [0, 5, 9, 17] (the null block first, so no real slot
    # becomes 0, which our kernels skip); PAD kept
    assert r["indices"] == [3, 1, 2, -1]
    assert r["scratch_holds_the_slots"]
    assert r["stock_output"]
    assert r["state_stored"] and r["state_changed"] and r["conv_stored"]
    assert r["other_slots_untouched"]
    assert r["pool_restored"] and r["meta_restored"]
    assert r["calls"].get("stock:prefill") == 1


def test_refusals_name_the_setting(probe: dict[str, Any]) -> None:
    r = probe["layer"]["refusals"]
    # refused while the model is built (the engine fails at start-up), not at a request
    assert r["ds_layout"] is not None and "DS" in r["ds_layout"]
    assert "SM70_GDN_STATE_DTYPE=float32" in r["ds_layout"]
    assert r["bf16_at_construction"] is not None and "bfloat16" in r["bf16_at_construction"]
    assert "SM70_GDN_STATE_DTYPE=float32" in r["bf16_at_construction"]
    # the supported int16 layer is built; the plain layer leaves such layers to vLLM
    assert r["ok_int16"] is None and r["bf16_plain"] is None and r["ds_plain"] is None
    assert r["built"] == ["Sm70GatedDeltaNetInt16", "Sm70GatedDeltaNet", "Sm70GatedDeltaNet"]
    assert r["ds_layout_forward"] == r["ds_layout"]  # the forward's guard says the same
    assert r["fp16_base"] is not None and "float16" in r["fp16_base"]
    assert "SM70_GDN_STATE_DTYPE=float32" in r["fp16_base"]
    assert "\n" not in r["ds_layout"] + r["fp16_base"] + r["bf16_at_construction"]
