"""vllm_patch.gdn.routing: which GDN steps our decode ops take, and the metadata rows they get.

The metadata stand-ins carry the fields vLLM 0.22.1's GDNAttentionMetadata has
(vllm/v1/attention/backends/gdn_attn.py), with lists in place of the int32 tensors (the
routing only slices them), laid out as its builder does: full-graph steps pad the index and
query-start tensors past the real sequence counts with the null block and empty sequences.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_patch.gdn import routing

SHAPE = routing.LayerShape(
    activation_dtype="float16", ssm_state_dtype="float32", conv_state_dtype="float16",
    a_log_dtype="float32", dt_bias_dtype="float16", head_k_dim=128, head_v_dim=128,
    num_k_heads=8, num_v_heads=24, conv_kernel_size=4, activation="silu",
    conv_state_dim_first=False, num_spec=3)


def meta(**kw: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=0,
        spec_sequence_masks=None, spec_query_start_loc=None, non_spec_query_start_loc=None,
        spec_state_indices_tensor=None, non_spec_state_indices_tensor=None,
        num_accepted_tokens=None, chunk_indices=None)
    base.update(kw)
    return SimpleNamespace(**base)


def plain_decode_graph_step() -> SimpleNamespace:
    """3 decodes padded to a graph of 8 tokens (builder: indices filled with 0 past 3,
    query starts filled with the last real one)."""
    return meta(num_decodes=3, num_decode_tokens=3, num_actual_tokens=8,
                non_spec_query_start_loc=[0, 1, 2, 3, 3, 3, 3, 3, 3],
                non_spec_state_indices_tensor=[7, 4, 9, 0, 0, 0, 0, 0])


def spec_graph_step() -> SimpleNamespace:
    """2 MTP rows of 1 + 3 tokens padded to a graph of 16 tokens."""
    idx = [[11, 12, 13, 14], [21, 22, 23, 24]] + [[0, 0, 0, 0]] * 14
    return meta(num_spec_decodes=2, num_spec_decode_tokens=8, num_actual_tokens=16,
                spec_sequence_masks=[True, True] + [False] * 14,
                spec_query_start_loc=[0, 4, 8] + [8] * 14,
                spec_state_indices_tensor=idx, num_accepted_tokens=[2, 4] + [1] * 14)


def test_route_sends_only_decode_only_steps_to_our_ops() -> None:
    assert routing.route(None) == routing.STOCK_NO_METADATA
    assert routing.route(plain_decode_graph_step()) == routing.OURS_DECODE
    assert routing.route(spec_graph_step()) == routing.OURS_SPEC
    # any prefill row sends the whole step to vLLM (FLA), with or without spec rows
    assert routing.route(meta(num_prefills=1, num_decodes=2)) == routing.STOCK_PREFILL
    mixed = spec_graph_step()
    mixed.num_prefills = 1
    assert routing.route(mixed) == routing.STOCK_PREFILL
    both = spec_graph_step()
    both.num_decodes = 1
    assert routing.route(both) == routing.STOCK_MIXED
    assert routing.route(meta()) == routing.STOCK_EMPTY
    assert routing.route(meta(spec_sequence_masks=[False], num_decodes=0)) == routing.STOCK_EMPTY
    # an unsupported layer never reaches our ops, whatever the step
    assert routing.route(plain_decode_graph_step(), "why") == routing.STOCK_UNSUPPORTED
    assert routing.route(None, "why") == routing.STOCK_NO_METADATA


def test_plain_decode_args_are_the_real_rows_only() -> None:
    args = routing.decode_args(plain_decode_graph_step(), routing.OURS_DECODE)
    assert args.num_seqs == 3
    assert args.query_start_loc == [0, 1, 2, 3]
    assert args.state_indices == [7, 4, 9]
    assert args.num_accepted is None
    assert args.num_tokens == 8  # the layer's rows: what vLLM's own path writes back


def test_spec_args_keep_the_per_position_slots_and_acceptance() -> None:
    args = routing.decode_args(spec_graph_step(), routing.OURS_SPEC)
    assert args.num_seqs == 2
    assert args.query_start_loc == [0, 4, 8]
    assert args.state_indices == [[11, 12, 13, 14], [21, 22, 23, 24]]
    assert args.num_accepted == [2, 4]
    assert args.num_tokens == 16


def test_decode_args_refuses_a_stock_route() -> None:
    with pytest.raises(ValueError, match="decode_args takes"):
        routing.decode_args(plain_decode_graph_step(), routing.STOCK_PREFILL)


def test_the_model_layer_is_supported() -> None:
    assert routing.unsupported_reason(SHAPE) is None
    assert routing.unsupported_reason(dataclasses.replace(SHAPE, activation=None)) is None
    assert routing.unsupported_reason(
        dataclasses.replace(SHAPE, dt_bias_dtype="float32", num_spec=0)) is None


@pytest.mark.parametrize(("change", "words"), [
    ({"conv_state_dim_first": True}, "DS layout"),
    ({"activation_dtype": "bfloat16"}, "activations are bfloat16"),
    ({"conv_state_dtype": "bfloat16"}, "conv state is bfloat16"),
    ({"ssm_state_dtype": "float16"}, "recurrent state is float16"),
    ({"a_log_dtype": "float16"}, "A_log is float16"),
    ({"dt_bias_dtype": "bfloat16"}, "dt_bias is bfloat16"),
    ({"head_k_dim": 64}, "head sizes 64/128"),
    ({"head_v_dim": 256}, "head sizes 128/256"),
    ({"num_v_heads": 20}, "do not group"),
    ({"conv_kernel_size": 3}, "conv width 3"),
    ({"activation": "gelu"}, "activation 'gelu'"),
    ({"num_spec": 8}, "8 speculative tokens"),
])
def test_unsupported_layers_say_why(change: dict[str, Any], words: str) -> None:
    reason = routing.unsupported_reason(dataclasses.replace(SHAPE, **change))
    assert reason is not None and words in reason


def mixed_step() -> SimpleNamespace:
    """2 plain decodes then 2 prefills (75 tokens), padded to 80 rows, with FLA's table."""
    return meta(num_decodes=2, num_decode_tokens=2, num_prefills=2, num_prefill_tokens=75,
                num_actual_tokens=80, non_spec_query_start_loc=[0, 1, 2, 72, 77],
                chunk_indices=[[0, 0], [1, 0], [2, 0], [2, 1], [3, 0]])


def test_prefill_steps_go_to_our_ops_only_when_asked() -> None:
    step = mixed_step()
    assert routing.route(step) == routing.STOCK_PREFILL  # the default: vLLM's path
    assert routing.route(step, None, "fla") == routing.STOCK_PREFILL
    assert routing.route(step, None, "sm70") == routing.OURS_PREFILL
    with_spec = spec_graph_step()
    with_spec.num_prefills = 1
    assert routing.route(with_spec, None, "sm70") == routing.OURS_PREFILL_SPEC
    # decode-only steps do not depend on it; an unsupported layer never reaches ours
    assert routing.route(plain_decode_graph_step(), None, "sm70") == routing.OURS_DECODE
    assert routing.route(step, "why", "sm70") == routing.STOCK_UNSUPPORTED
    assert routing.route(None, None, "sm70") == routing.STOCK_NO_METADATA


def test_a_mixed_step_puts_its_decodes_on_the_decode_ops_and_rebases_the_prefills() -> None:
    plan = routing.prefill_plan(mixed_step(), routing.OURS_PREFILL)
    assert (plan.num_decodes, plan.num_prefills, plan.prefill_tokens) == (2, 2, 75)
    assert plan.first_prefill_token == 2 and plan.chunk_rows_skipped == 2
    assert not plan.gathered and plan.num_spec == 0 and plan.num_tokens == 80
    assert plan.two_pass  # the builder's table is there


def test_the_chunk_op_follows_the_table() -> None:
    no_table = mixed_step()
    no_table.chunk_indices = None
    assert not routing.prefill_plan(no_table, routing.OURS_PREFILL).two_pass
    # CuteDSL's table is not FLA's numbering: one-pass then
    assert not routing.prefill_plan(mixed_step(), routing.OURS_PREFILL, "cutedsl").two_pass
    assert routing.prefill_plan(mixed_step(), routing.OURS_PREFILL, "flashinfer").two_pass


def test_a_step_with_mtp_rows_gathers_and_has_no_plain_decodes() -> None:
    step = spec_graph_step()
    step.num_prefills, step.num_prefill_tokens = 2, 67
    step.chunk_indices = [[0, 0], [0, 1], [1, 0]]
    plan = routing.prefill_plan(step, routing.OURS_PREFILL_SPEC)
    assert plan.gathered and plan.num_spec == 2 and plan.num_decodes == 0
    assert (plan.num_prefills, plan.prefill_tokens, plan.chunk_rows_skipped) == (2, 67, 0)
    step.num_decodes = 1  # the builder reclassifies these; a step that has both is refused
    with pytest.raises(ValueError, match="never makes one"):
        routing.prefill_plan(step, routing.OURS_PREFILL_SPEC)
    with pytest.raises(ValueError, match="prefill_plan takes"):
        routing.prefill_plan(step, routing.OURS_SPEC)
