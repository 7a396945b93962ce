"""The SM70 backend's opt-in FMHA prefill route (SM70_PREFILL_ATTENTION=cutlass_fmha), on the
CPU only: the start-up rule as pure functions (TRITON_ATTN's 260-byte rows accepted, strides
the op's 4-byte loads cannot address refused), and, through vLLM 0.22.1's CPU tree, the rows
and arguments the backend hands torch.ops.sm70.fmha_prefill (its pure-PyTorch reference
standing in, tests/attention_backend_fmha_probe.py) checked against an independent
attention of the same step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_cpu_tree import require_tree, run_probe

from vllm_patch.attention import rules

PROBE = Path(__file__).resolve().parent / "attention_backend_fmha_probe.py"


# ------------------------------------------------------------------ start-up rules (pure)
def test_the_page_strides_are_triton_attns_260_byte_rows() -> None:
    assert rules.page_strides(16, 2) == (2 * 16 * 2 * 260, 2 * 260, 260)
    assert rules.page_strides(1584, 4) == (2 * 1584 * 4 * 260, 4 * 260, 260)


def test_the_fmha_stride_rule() -> None:
    assert rules.fmha_stride_problem([2 * 16 * 2 * 272, 2 * 272, 272]) is None
    assert rules.fmha_stride_problem(rules.page_strides(16, 2)) is None  # 260-byte rows
    assert rules.fmha_stride_problem(rules.page_strides(1584, 1)) is None  # token stride 260
    problem = rules.fmha_stride_problem([2 * 16 * 2 * 258, 2 * 258, 258])
    assert problem is not None and "multiples of 4" in problem and "258" in problem
    assert rules.fmha_stride_problem([-16, 32, 16]) is not None


def test_triton_prefill_starts_on_the_page() -> None:
    rules.check_prefill_kernel("triton", rules.page_strides(1584, 4))


def test_the_fmha_starts_on_triton_attns_page() -> None:
    for bs, hkv in ((1584, 4), (1584, 2), (528, 2), (16, 1)):
        rules.check_prefill_kernel("cutlass_fmha", rules.page_strides(bs, hkv))
    rules.check_prefill_kernel("cutlass_fmha", [2 * 16 * 2 * 272, 2 * 272, 272])


def test_the_fmha_on_a_page_it_cannot_address_is_refused_naming_the_setting() -> None:
    # 2-byte-aligned rows (a 258-byte row): below the op's narrowest (4-byte) load
    with pytest.raises(rules.AttentionConfigError) as info:
        rules.check_prefill_kernel("cutlass_fmha", [2 * 16 * 2 * 258, 2 * 258, 258])
    msg = str(info.value)
    assert msg.startswith("SM70_PREFILL_ATTENTION=cutlass_fmha ")
    assert "258" in msg and "SM70_PREFILL_ATTENTION=triton" in msg and "\n" not in msg


def test_an_unknown_prefill_kernel_is_refused() -> None:
    with pytest.raises(rules.AttentionConfigError, match="SM70_PREFILL_ATTENTION=flash: not one"):
        rules.check_prefill_kernel("flash", rules.page_strides(16, 2))


# ------------------------------------------------------------------ vLLM 0.22.1 on the CPU
@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_tree()
    out, _log = run_probe(PROBE, {"kernels": ["triton", "cutlass_fmha"]},
                          tmp_path_factory.mktemp("fmha_probe"))
    return out


def test_the_builder_reads_the_setting_and_starts_the_fmha_on_the_page(probe: dict) -> None:
    # None: the real builder started and kept the setting it read
    assert probe["builder"]["triton"] is None
    assert probe["builder"]["cutlass_fmha"] is None


def test_the_prefill_rows_reach_the_fmha_with_their_context(probe: dict) -> None:
    r = probe["routing"]
    assert r["route"]["prefill_fmha"] == 1 and r["route"]["prefill_triton"] == 0
    assert r["route"]["decode"] == 1
    assert r["route"]["prefill_fmha_beside_decode"] == 1  # the step had decode rows too
    assert r["device_route"] == {"decode": 1, "prefill_fmha": 1}  # what graph replays count
    (call,) = r["calls"]
    # the extend (5 tokens after 21 cached) and the fresh prefill (3): offsets within the
    # prefill rows, context = length less chunk, their own block-table rows
    assert call["rows"] == 8 and call["qsl"] == [0, 5, 8] and call["ctx"] == [21, 0]
    assert call["bt"] == [[7, 4, 9], [5, 9, 9]]
    assert call["cs"] == list(rules.page_strides(16, 2)) and call["ss"] == [4160, 130, 65]
    assert call["block_size"] == 16 and call["max_q"] == 5
    assert r["ctx_lens"] == [21, 0]


def test_the_fmha_rows_equal_an_independent_attention(probe: dict) -> None:
    r = probe["routing"]
    assert max(r["errors"]) < 2e-2  # fp16 output of a float64 reference
    assert r["decode_rows"] == [1.0] * 4  # the decode rows stay the decode kernel's
    assert r["padding_rows"] == [0.0] * 3


def test_a_wrong_context_length_is_caught(probe: dict) -> None:
    # every sequence one token longer than its chunk and cache agree on: the check must see it
    assert min(probe["shifted"]["errors"]) > 5e-2
