"""Clef's extra weights when SM70_CLEF is on (pure).

Clef differs from the base model only in decoder layers 40-63 by a rank-r change over 186
linears (a merged LoRA): in each full-attention layer q, k, v, o, gate, up, down (7), in each
Gated DeltaNet layer in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, gate, up, down
(8); 6 x 7 + 18 x 8 = 186. The factors are those of SM70_CLEF_DIR's format (docs/clef.md,
vllm_patch/clef): A [r, in] and B [out, r] in fp16, one pair per checkpoint module (a fused
layer carries one per slice). A column-parallel layer keeps A whole and splits B's rows
(in_proj_qkv part by part, as vLLM splits q, k and v: the same byte count as a plain
split), a row-parallel one splits A's columns and keeps B whole; in both cases one GPU holds
r x (rows + cols) values where rows x cols is that GPU's shard of the base weight.
The loader places a GPU's shards in one allocation, each at a 256-byte offset, the whole
rounded up to 2 MiB, so the caching allocator hands out exactly that; the plan counts it
with the loader's own rule (vllm_patch.clef.arena, pure). tests/test_clef_plan.py holds
this tensor table equal to the format's shard shapes.

The schema head (about 65-128M parameters) reads the final hidden states; we plan the upper
figure, 128,000,000 parameters in fp16, whole on the last pipeline stage's GPUs; the loader
refuses a head above it (vllm_patch.clef.head.MAX_HEAD_PARAMS).
"""

from __future__ import annotations

from sm70ctl.plan.model_config import FULL, ModelShape
from sm70ctl.plan.shapes import Tensor, _attention, _gdn, _mlp
from vllm_patch.clef.arena import arena_bytes

CLEF_LAYERS = 24  # the last 24 decoder layers (40-63 of 64)
CLEF_HEAD_PARAMS = 128_000_000
FP16 = 2
_LINEARS = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
}


def clef_layers(m: ModelShape) -> range:
    return range(max(0, m.num_layers - CLEF_LAYERS), m.num_layers)


def corrected_linears(m: ModelShape, tp: int, layers: range) -> list[Tensor]:
    out: list[Tensor] = []
    for i in layers:
        if i not in clef_layers(m):
            continue
        pfx = f"{m.prefix}layers.{i}."
        if m.layer_types[i] == FULL:
            ts = _attention(pfx, m, tp, "c", "c", "c", "ckpt", "ckpt")
        else:
            ts = _gdn(pfx, m, tp)
        ts += _mlp(pfx, m, tp, "c", "ckpt")
        out += [t for t in ts if t.linear and t.name.rsplit(".", 1)[-1] in _LINEARS]
    return out


def correction_bytes(linears: list[Tensor], rank: int) -> int:
    """One GPU's allocation for the A [r, cols] and B [rows, r] shards of `linears`."""
    return arena_bytes(rank * n * FP16 for t in linears for n in (t.cols, t.rows))


def clef_items(m: ModelShape, tp: int, layers: range, last: bool,
               rank: int) -> list[tuple[str, str, int, dict]]:
    linears = corrected_linears(m, tp, layers)
    correction = correction_bytes(linears, rank)
    items = [("clef.correction", f"Clef low-rank correction (r={rank}, fp16)", correction,
              {"linears": len(linears), "rank": rank,
               "tensor_bytes": sum(rank * (t.rows + t.cols) * FP16 for t in linears)})]
    if last:
        items.append(("clef.head", "Clef schema head (128M params, fp16)",
                      CLEF_HEAD_PARAMS * FP16, {"params": CLEF_HEAD_PARAMS}))
    return items
