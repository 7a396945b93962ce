"""Every weight tensor one GPU holds, with its per-GPU shape (pure).

Tensor parallelism follows vLLM's layers: column-parallel linears (q/k/v, gate/up, the GDN
input projections, the MTP `fc`) split their output features over the TP ranks; row-parallel
ones (o_proj, down_proj, GDN out_proj) split their input features; KV heads are replicated
when there are fewer KV heads than ranks; the embedding and lm_head split the vocabulary
(padded to a multiple of 64, vLLM's VocabParallelEmbedding); norms and small per-layer
vectors are whole on every rank (the GDN ones per head are split). Pipeline parallelism
splits the decoder layers like vLLM's `get_pp_indices`; the embedding and vision tower sit
on the first stage, the final norm, lm_head and MTP layer on the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from sm70ctl.plan.model_config import FULL, ModelShape

VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Tensor:
    """One weight tensor (or one linear layer with its companions) on one GPU.

    For a linear: `rows` x `cols` = output features x input features on this GPU.
    For a plain tensor: `rows` x `cols` elements of `elem_bytes` each.
    `store` picks the storage rule: "ckpt" (whatever the quant config says; 16-bit if it
    names the module), "fp16", "lm_head", "draft" (SM70_DRAFT_HEAD_DTYPE), "attn16" (a
    16-bit attention weight that SM70_ATTN_WEIGHTS_12BIT may pack into 12 bits).
    """

    name: str  # checkpoint name (what `modules_to_not_convert` and `dynamic` see)
    cls: str  # the tensor class the plan reports
    rows: int
    cols: int
    linear: bool = True
    bias: bool = False
    fused: str | None = None  # vLLM's fused module name, also matched against `dynamic`
    store: str = "ckpt"
    elem_bytes: int = 2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Decoder layers per pipeline stage: equal shares; the remainder goes one layer each
    to the stages just before the last, walking backwards (vLLM's rule: the last stage also
    holds the lm_head, so it gets no extra layer)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append(range(start, start + n))
        start += n
    return out


def kv_heads_per_gpu(m: ModelShape, tp: int) -> int:
    return max(1, m.num_key_value_heads // tp)


def vocab_per_gpu(m: ModelShape, tp: int) -> int:
    padded = ceil_div(m.vocab_size, VOCAB_PAD) * VOCAB_PAD
    return ceil_div(padded, tp)


def _attention(pfx: str, m: ModelShape, tp: int, cls_qkv: str, cls_o: str, cls_n: str,
               store_qkv: str, store_o: str) -> list[Tensor]:
    h, hd = m.hidden_size, m.head_dim
    q_out = m.num_attention_heads * hd * (2 if m.attn_output_gate else 1) // tp
    kv_out = kv_heads_per_gpu(m, tp) * hd
    fused = f"{pfx}self_attn.qkv_proj"
    return [
        Tensor(f"{pfx}self_attn.q_proj", cls_qkv, q_out, h, fused=fused, store=store_qkv),
        Tensor(f"{pfx}self_attn.k_proj", cls_qkv, kv_out, h, fused=fused, store=store_qkv),
        Tensor(f"{pfx}self_attn.v_proj", cls_qkv, kv_out, h, fused=fused, store=store_qkv),
        Tensor(f"{pfx}self_attn.o_proj", cls_o, h, m.num_attention_heads * hd // tp,
               store=store_o),
        Tensor(f"{pfx}self_attn.q_norm", cls_n, 1, hd, linear=False),
        Tensor(f"{pfx}self_attn.k_norm", cls_n, 1, hd, linear=False),
    ]


def _mlp(pfx: str, m: ModelShape, tp: int, cls: str, store: str) -> list[Tensor]:
    h, inter = m.hidden_size, m.intermediate_size // tp
    fused = f"{pfx}mlp.gate_up_proj"
    return [
        Tensor(f"{pfx}mlp.gate_proj", cls, inter, h, fused=fused, store=store),
        Tensor(f"{pfx}mlp.up_proj", cls, inter, h, fused=fused, store=store),
        Tensor(f"{pfx}mlp.down_proj", cls, h, inter, store=store),
    ]


def _gdn(pfx: str, m: ModelShape, tp: int) -> list[Tensor]:
    h = m.hidden_size
    kd, vd, hv = m.gdn_key_dim, m.gdn_value_dim, m.linear_num_value_heads
    a = f"{pfx}linear_attn."
    return [
        Tensor(a + "in_proj_qkv", "gdn.in_proj", (2 * kd + vd) // tp, h, fused=a + "in_proj_qkvz"),
        Tensor(a + "in_proj_z", "gdn.in_proj", vd // tp, h, fused=a + "in_proj_qkvz"),
        Tensor(a + "in_proj_b", "gdn.in_proj_ba", hv // tp, h, fused=a + "in_proj_ba"),
        Tensor(a + "in_proj_a", "gdn.in_proj_ba", hv // tp, h, fused=a + "in_proj_ba"),
        Tensor(a + "out_proj", "gdn.out_proj", h, vd // tp),
        # depthwise causal conv over q, k and v channels: (channels, 1, kernel)
        Tensor(a + "conv1d", "gdn.small", (2 * kd + vd) // tp, m.linear_conv_kernel_dim,
               linear=False),
        # float32 in vLLM's GDN layer whatever the model dtype
        Tensor(a + "A_log", "gdn.small", 1, hv // tp, linear=False, elem_bytes=4),
        Tensor(a + "dt_bias", "gdn.small", 1, hv // tp, linear=False),
        Tensor(a + "norm", "gdn.small", 1, m.linear_value_head_dim, linear=False),
    ]


def _vision(m: ModelShape) -> list[Tensor]:
    v = m.vision
    assert v is not None
    d, p = v.hidden_size, "model.visual."
    merged = d * v.spatial_merge_size**2
    out = [
        Tensor(p + "patch_embed.proj", "vision", d,
               v.in_channels * v.temporal_patch_size * v.patch_size**2, bias=True),
        Tensor(p + "pos_embed", "vision", v.num_position_embeddings, d, linear=False),
    ]
    for i in range(v.depth):
        b = f"{p}blocks.{i}."
        out += [
            Tensor(b + "norm1", "vision", 2, d, linear=False),  # LayerNorm weight + bias
            Tensor(b + "norm2", "vision", 2, d, linear=False),
            Tensor(b + "attn.qkv", "vision", 3 * d, d, bias=True),
            Tensor(b + "attn.proj", "vision", d, d, bias=True),
            Tensor(b + "mlp.linear_fc1", "vision", v.intermediate_size, d, bias=True),
            Tensor(b + "mlp.linear_fc2", "vision", d, v.intermediate_size, bias=True),
        ]
    mergers = [("merger.", d)] + [
        (f"deepstack_merger_list.{j}.", merged) for j in range(len(v.deepstack_visual_indexes))
    ]
    for name, norm_dim in mergers:
        out += [
            Tensor(p + name + "norm", "vision", 2, norm_dim, linear=False),
            Tensor(p + name + "linear_fc1", "vision", merged, merged, bias=True),
            Tensor(p + name + "linear_fc2", "vision", v.out_hidden_size, merged, bias=True),
        ]
    return [Tensor(t.name, t.cls, t.rows, t.cols, t.linear, t.bias, None, "fp16") for t in out]


def _mtp(m: ModelShape, tp: int) -> list[Tensor]:
    h = m.hidden_size
    out: list[Tensor] = [
        Tensor("mtp.fc", "mtp", h // tp, 2 * h, store="draft"),
        Tensor("mtp.pre_fc_norm_hidden", "mtp", 1, h, linear=False),
        Tensor("mtp.pre_fc_norm_embedding", "mtp", 1, h, linear=False),
        Tensor("mtp.norm", "mtp", 1, h, linear=False),
    ]
    for j in range(m.mtp_num_hidden_layers):
        pfx = f"mtp.layers.{j}."
        out += _attention(pfx, m, tp, "mtp", "mtp", "mtp", "draft", "draft")
        out += _mlp(pfx, m, tp, "mtp", "draft")
        out += [
            Tensor(pfx + "input_layernorm", "mtp", 1, h, linear=False),
            Tensor(pfx + "post_attention_layernorm", "mtp", 1, h, linear=False),
        ]
    return out


def stage_tensors(m: ModelShape, tp: int, pp: int, stage: int, *, mtp: bool,
                  int8_lm_head: bool, vision: bool = True) -> list[Tensor]:
    """All weight tensors one GPU of pipeline stage `stage` holds."""
    h = m.hidden_size
    layers = pp_layer_ranges(m.num_layers, pp)[stage]
    first, last = stage == 0, stage == pp - 1
    vocab = vocab_per_gpu(m, tp)
    out: list[Tensor] = []
    if first:
        out.append(Tensor(m.prefix + "embed_tokens", "embed", vocab, h, linear=False))
        if m.vision is not None and vision:
            out += _vision(m)
    for i in layers:
        pfx = f"{m.prefix}layers.{i}."
        if m.layer_types[i] == FULL:
            out += _attention(pfx, m, tp, "attn.qkv", "attn.o_proj", "norms", "attn16", "ckpt")
        else:
            out += _gdn(pfx, m, tp)
        out += _mlp(pfx, m, tp, "mlp", "ckpt")
        out += [
            Tensor(pfx + "input_layernorm", "norms", 1, h, linear=False),
            Tensor(pfx + "post_attention_layernorm", "norms", 1, h, linear=False),
        ]
    if last:
        out.append(Tensor(m.prefix + "norm", "norms", 1, h, linear=False))
        if not m.tie_word_embeddings or int8_lm_head or not first:
            # tied embeddings share the fp16 table on the same GPU; an int8 head, or a
            # head on another pipeline stage, is a separate copy
            out.append(Tensor("lm_head", "lm_head", vocab, h, store="lm_head"))
        if mtp and m.mtp_num_hidden_layers:
            # vLLM's MTP drafter shares the target's embedding and lm_head
            out += _mtp(m, tp)
    return out
