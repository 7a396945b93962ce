"""The float32 scratch a prefill step takes on the int16 GDN pool, per GPU (pure).

With the int16 pool (SM70_GDN_KERNEL=sm70 or sm70_chunk, SM70_GDN_STATE_DTYPE=int16) a step
with a prefill row runs each GDN layer on a copy of the slots the step names
(vllm_patch/gdn/int16_scratch.py `run_on_scratch`). vLLM's profiling run has no metadata, so
it never takes that path: the KV budget vLLM measures leaves no room for it, and the plan
counts it instead.

What one layer call holds at its peak, for S slots (the step's distinct slots plus the null
block 0), per slot:
- the conv rows gathered as they are (model dtype, fp16: 2 B per element);
- the float32 state (HV/TP x V x K x 4 B), live from the dequantise to the store;
- the requantise's two float32 temporaries of the same size (`f * inv` and its rounding,
  then the rounding and its clamp: each expression's input lives until it returns);
- the row maxima and their reciprocal, float32 per stored row (HV/TP x V x 4 B each);
plus the sorted slot list (int64 per slot) and the two renumbered index tensors (their
entries at the index dtype, int32 in vLLM's metadata). The dequantise's own peak (int16
gather, its float32 cast and the scaled product: 10 B per state value) is below the
requantise's 12 B. Everything is a local of the call, so it is freed when the layer
returns and the caching allocator hands the same blocks to the next layer: one layer's
scratch is live at a time. The layer's other activations (the in_proj outputs the core
reads, FLA's chunk states) live meanwhile, so the plan counts the scratch on top of the
largest layer's activations (an upper bound when that layer is not a GDN one).
"""

from __future__ import annotations

from sm70ctl.errors import Sm70Error

FP32, FP16, INT64 = 4, 2, 8
INDEX_BYTES = 4  # vLLM's GDN state indices are int32 (its block table's dtype)
# Bytes per state value at the peak: the float32 state and the requantise's two float32
# temporaries (int16_scratch.quantize_rows = reference_gdn.state_int16_quantize).
STATE_VALUE_BYTES = 3 * FP32
# Bytes per stored row h[v, :] at the peak: the row maxima and their reciprocal.
ROW_BYTES = 2 * FP32


def max_step_slots(max_num_seqs: int, max_num_batched_tokens: int, spec_tokens: int) -> int:
    """The most slots one step with a prefill row makes the scratch hold, the null block
    included. A step carries at most min(max_num_seqs, max_num_batched_tokens) sequences
    (each has a token); at least one is a prefill naming one slot, and every other may be
    an MTP row naming 1 + k (vLLM's builder takes all 1 + k columns of a row with any draft
    count, so a row's tokens do not bound its slots)."""
    for var, value in (("SM70_MAX_NUM_SEQS", max_num_seqs),
                       ("SM70_MAX_NUM_BATCHED_TOKENS", max_num_batched_tokens)):
        if value < 1:
            raise Sm70Error(f"{var}={value}: must be at least 1")
    if spec_tokens < 0:
        raise Sm70Error(f"SM70_SPEC_TOKENS={spec_tokens}: must not be negative")
    seqs = min(max_num_seqs, max_num_batched_tokens)
    return 1 + 1 + (seqs - 1) * (1 + spec_tokens)


def max_index_entries(max_num_seqs: int, spec_tokens: int) -> int:
    """The most entries the step's two index tensors hold (every row of the batch, padded
    rows included, at 1 + k columns at most)."""
    return max_num_seqs * (1 + spec_tokens)


def scratch_bytes(slots: int, value_heads_gpu: int, dv: int, dk: int, conv_elems: int,
                  index_entries: int, index_bytes: int = INDEX_BYTES) -> int:
    """Peak bytes one GDN layer's int16 prefill scratch holds on one GPU (see above)."""
    per_slot = (conv_elems * FP16 + value_heads_gpu * dv * dk * STATE_VALUE_BYTES
                + value_heads_gpu * dv * ROW_BYTES + INT64)
    return slots * per_slot + index_entries * index_bytes
