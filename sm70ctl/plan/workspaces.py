"""Transient GPU memory a serving step needs besides weights and pools (pure).

Everything is fp16 (2 B) unless said otherwise. T is the tokens one forward pass sees:
the prefill chunk (SM70_PREFILL_CHUNK), never more than SM70_MAX_NUM_BATCHED_TOKENS. R is
the rows the sampler scores per step: every running sequence verifies its k draft tokens
plus one, so R = max_num_seqs x (1 + k). Logits are all-gathered over the TP ranks before
sampling (vLLM's default on CUDA), so every rank holds full-vocabulary fp32 rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sm70ctl.plan.gdn_scratch import max_index_entries, max_step_slots, scratch_bytes
from sm70ctl.plan.model_config import ModelShape
from sm70ctl.plan.shapes import ceil_div, kv_heads_per_gpu, vocab_per_gpu

FP16, FP32 = 2, 4
# vllm_patch/quantization/sm70_gptq.py: on a V100, above INT8_GEMM_MAX_ROWS rows a quantized
# layer is multiplied through a transient fp16 copy of at most DEQUANT_SLICE_BYTES of its
# weights (a test keeps these equal to the plugin's).
INT8_GEMM_MAX_ROWS = 255
DEQUANT_SLICE_BYTES = 32 << 20


@dataclass(frozen=True)
class WorkspaceInputs:
    tp: int
    pp: int
    tokens: int  # T
    max_num_seqs: int
    spec_tokens: int
    max_logprobs: int
    prompt_logprobs_chunk: int
    cudagraph_sizes: tuple[int, ...]
    allreduce_buffer_bytes: int
    decode_max_splits: int
    gdn_chunk: int
    cuda_context_reserve: int
    allocator_reserve: int
    int8_weights: bool = False  # linear layers served by sm70_gptq (a quantized checkpoint)
    int16_state: bool = False  # the int16 GDN pool: prefill steps run on a float32 scratch


@dataclass(frozen=True)
class Item:
    key: str
    label: str
    bytes: int
    detail: dict[str, int | str] = field(default_factory=dict)


def layer_activations(m: ModelShape, tp: int, t: int, chunk: int, kinds: set[str]) -> dict:
    """Peak scratch of one decoder layer for `t` tokens, per layer kind present."""
    hd = m.head_dim
    out: dict[str, int] = {}
    # MLP: gate|up output (2 x I/TP) and the SiLU-and-mul product (I/TP)
    out["mlp"] = t * 3 * (m.intermediate_size // tp) * FP16
    if "full" in kinds:
        q = m.num_attention_heads * hd * (2 if m.attn_output_gate else 1) // tp
        kv = 2 * kv_heads_per_gpu(m, tp) * hd
        attn_out = m.num_attention_heads * hd // tp
        # qkv output, attention output and the gated output; fp32 softmax max and sum
        out["full_attention"] = (t * (q + kv + 2 * attn_out) * FP16
                                 + t * (m.num_attention_heads // tp) * 2 * FP32)
    if "linear" in kinds:
        kd, vd = m.gdn_key_dim // tp, m.gdn_value_dim // tp
        hv = m.linear_num_value_heads // tp
        proj = (2 * kd + vd) + vd + 2 * hv  # in_proj qkv, z, b and a outputs
        conv = 2 * kd + vd
        # the chunked delta rule keeps one fp32 state per chunk and head
        states = ceil_div(t, chunk) * hv * m.linear_key_head_dim * m.linear_value_head_dim * FP32
        out["gdn"] = t * (proj + conv + 2 * vd) * FP16 + states
    return out


def workspace_items(m: ModelShape, w: WorkspaceInputs, *, kinds: set[str], last: bool,
                    has_attention: bool) -> list[Item]:
    h = m.hidden_size
    t = w.tokens
    vocab = vocab_per_gpu(m, w.tp)
    vocab_full = vocab * w.tp
    items: list[Item] = []

    residual = 2 * t * h * FP16  # residual stream and hidden states
    layers = layer_activations(m, w.tp, t, w.gdn_chunk, kinds)
    peak_kind = max(layers, key=layers.__getitem__)
    items.append(Item("act.residual", f"activations: residual + hidden ({t} tok)", residual,
                      {"tokens": t, "hidden": h}))
    items.append(Item("act.layer", f"activations: layer peak ({peak_kind})", layers[peak_kind],
                      {"tokens": t, **{f"{k}_bytes": v for k, v in layers.items()}}))
    if w.int16_state and "linear" in kinds:
        items.append(int16_scratch_item(m, w))

    if last:
        rows = w.max_num_seqs * (1 + w.spec_tokens)
        copies = 2 + (1 if w.max_logprobs > 0 else 0)  # logits, probs, (logprobs)
        items.append(Item(
            "logits.sampler", f"sampler logits ({rows} rows x {vocab_full} fp32 x {copies})",
            rows * vocab * FP16 + rows * vocab_full * FP32 * copies,
            {"rows": rows, "vocab": vocab_full, "fp32_copies": copies}))
        if w.max_logprobs > 0 and w.prompt_logprobs_chunk > 0:
            c = w.prompt_logprobs_chunk
            items.append(Item(
                "logits.prompt", f"prompt-logprob chunk ({c} tok x {vocab_full} fp32 x 2)",
                c * vocab * FP16 + c * vocab_full * FP32 * 2,
                {"tokens": c, "vocab": vocab_full}))

    if w.int8_weights and t > INT8_GEMM_MAX_ROWS:
        # the largest quantized projection per GPU is gate_up_proj (2 x I/TP outputs); the
        # lm_head is larger but is sliced to the same cap
        biggest = 2 * (m.intermediate_size // w.tp) * h * FP16
        items.append(Item("gemm.dequant", "prefill GEMM: transient fp16 weight slice",
                          min(biggest, DEQUANT_SLICE_BYTES), {"cap": DEQUANT_SLICE_BYTES}))

    graph = 0
    for s in w.cudagraph_sizes:
        graph += 2 * s * h * FP16 + max(layer_activations(m, w.tp, s, w.gdn_chunk, kinds).values())
    items.append(Item("cudagraph", f"CUDA-graph pools (sizes {list(w.cudagraph_sizes)})", graph,
                      {"sizes": ",".join(map(str, w.cudagraph_sizes))}))

    if has_attention:
        rows = w.max_num_seqs * (1 + w.spec_tokens)
        heads = m.num_attention_heads // w.tp
        # per split and query row: the partial output normalised in fp16 (head_dim) plus its
        # fp32 running max and sum (paged_decode's split partials)
        split = w.decode_max_splits * rows * heads * (m.head_dim * FP16 + 2 * FP32)
        items.append(Item("decode.splitk", f"decode split-K ({w.decode_max_splits} splits)",
                          split, {"splits": w.decode_max_splits, "rows": rows}))

    comm = w.allreduce_buffer_bytes if w.tp > 1 else 0
    if w.pp > 1:
        comm += 2 * t * h * FP16  # stage send + receive of hidden states and residual
    if comm:
        items.append(Item("comm", "all-reduce / pipeline buffers", comm))
    items.append(Item("cuda_context", "CUDA context (SM70_CUDA_CONTEXT_RESERVE)",
                      w.cuda_context_reserve))
    items.append(Item("allocator", "allocator reserve (SM70_ALLOCATOR_RESERVE)",
                      w.allocator_reserve))
    return items


def int16_scratch_item(m: ModelShape, w: WorkspaceInputs) -> Item:
    """The float32 copy of a prefill step's state slots one GDN layer runs on with the int16
    pool (gdn_scratch.py), at the most slots a step can name."""
    slots = max_step_slots(w.max_num_seqs, w.tokens, w.spec_tokens)
    hv = m.linear_num_value_heads // w.tp
    conv_elems = (m.linear_conv_kernel_dim - 1 + w.spec_tokens) * (m.gdn_conv_dim // w.tp)
    entries = max_index_entries(w.max_num_seqs, w.spec_tokens)
    b = scratch_bytes(slots, hv, m.linear_value_head_dim, m.linear_key_head_dim, conv_elems,
                      entries)
    return Item("gdn.int16_scratch",
                f"GDN int16 pool: prefill step's float32 state scratch ({slots} slots, "
                "one layer at a time)", b,
                {"slots": slots, "value_heads": hv, "conv_elems_per_slot": conv_elems,
                 "index_entries": entries})
