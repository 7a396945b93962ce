"""Which linears carry Clef's correction, and the full (unsharded) shape of each A and B.

Clef differs from the base model in decoder layers 40-63 of the 64 only. Per layer the
corrected linears are the checkpoint's unfused modules: a full-attention layer has q_proj,
k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (7); a Gated DeltaNet layer has
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, gate_proj, up_proj, down_proj (8).
For Qwen3.8-27B's 6 full-attention and 18 GDN layers there that is 186.

One correction per checkpoint module, so a layer vLLM fuses carries one per slice:
qkv_proj 3 (q, k, v), gate_up_proj 2, in_proj_qkvz 2 (in_proj_qkv, in_proj_z), in_proj_ba 2.
Each correction is `y += (x A^T) B^T` with A [rank, K] and B [N, rank] in fp16, K x N the
module's input x output features (the layout of PEFT's lora_A / lora_B and of the op's
`a_t` / `b_t`), alpha / rank already folded into B.

`blocks` says how vLLM splits the module's output features over tensor-parallel ranks:
each block is a run of heads (or of single features) that is split on its own, so the
column-parallel shard of B is taken block by block (`sharding.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.model_dims import FULL, ModelDims

CLEF_LAYERS = range(40, 64)
MODEL_LAYERS = 64
COLUMN = "column"
ROW = "row"


@dataclass(frozen=True)
class Block:
    """`units` heads of `unit` features each, split over the ranks as whole heads;
    `replicate`: fewer heads than ranks copies heads (vLLM's KV-head rule) instead of
    refusing."""

    units: int
    unit: int = 1
    replicate: bool = False

    @property
    def features(self) -> int:
        return self.units * self.unit


@dataclass(frozen=True)
class Correction:
    """One corrected linear: its name stem, where vLLM keeps it, and its A/B shapes."""

    layer: int
    module: str  # e.g. "self_attn.q_proj", "linear_attn.in_proj_qkv", "mlp.down_proj"
    fused: str  # the vLLM layer it lives in ("self_attn.qkv_proj"); == module when unfused
    slice_index: int  # its slice in the fused layer (0 when unfused)
    parallel: str  # COLUMN (output features split) or ROW (input features split)
    in_features: int  # K
    out_features: int  # N
    k_blocks: tuple[Block, ...]  # how K splits (row-parallel only)
    n_blocks: tuple[Block, ...]  # how N splits (column-parallel only)

    @property
    def stem(self) -> str:
        return f"layers.{self.layer}.{self.module}"

    @property
    def a_name(self) -> str:
        return f"{self.stem}.lora_A"

    @property
    def b_name(self) -> str:
        return f"{self.stem}.lora_B"

    def a_shape(self, rank: int) -> tuple[int, int]:
        return (rank, self.in_features)

    def b_shape(self, rank: int) -> tuple[int, int]:
        return (self.out_features, rank)


def _col(layer: int, module: str, fused: str, index: int, k: int,
         blocks: tuple[Block, ...]) -> Correction:
    n = sum(b.features for b in blocks)
    return Correction(layer, module, fused, index, COLUMN, k, n, (Block(k),), blocks)


def _row(layer: int, module: str, blocks: tuple[Block, ...], n: int) -> Correction:
    k = sum(b.features for b in blocks)
    return Correction(layer, module, module, 0, ROW, k, n, blocks, (Block(n),))


def layer_corrections(d: ModelDims, layer: int) -> list[Correction]:
    """The corrected linears of one decoder layer, in checkpoint order."""
    h = d.hidden_size
    out: list[Correction] = []
    if d.layer_types[layer] == FULL:
        q_rows = d.head_dim * (2 if d.attn_output_gate else 1)
        kv = Block(d.num_key_value_heads, d.head_dim, replicate=True)
        qkv = "self_attn.qkv_proj"
        out += [
            # with the output gate each head's query and gate rows sit together (vLLM
            # splits q_proj's rows per head as [query, gate]), so a head is 2 x head_dim rows
            _col(layer, "self_attn.q_proj", qkv, 0, h, (Block(d.num_attention_heads, q_rows),)),
            _col(layer, "self_attn.k_proj", qkv, 1, h, (kv,)),
            _col(layer, "self_attn.v_proj", qkv, 2, h, (kv,)),
            _row(layer, "self_attn.o_proj", (Block(d.num_attention_heads, d.head_dim),), h),
        ]
    else:
        kh = Block(d.linear_num_key_heads, d.linear_key_head_dim)
        vh = Block(d.linear_num_value_heads, d.linear_value_head_dim)
        hv = Block(d.linear_num_value_heads)
        qkvz, ba = "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"
        out += [
            # vLLM's in_proj_qkvz has output sizes [key, key, value, value], each split on
            # its own: rank r keeps the r-th part of q, of k, of v (and of z)
            _col(layer, "linear_attn.in_proj_qkv", qkvz, 0, h, (kh, kh, vh)),
            _col(layer, "linear_attn.in_proj_z", qkvz, 1, h, (vh,)),
            _col(layer, "linear_attn.in_proj_b", ba, 0, h, (hv,)),
            _col(layer, "linear_attn.in_proj_a", ba, 1, h, (hv,)),
            _row(layer, "linear_attn.out_proj", (vh,), h),
        ]
    gate_up = "mlp.gate_up_proj"
    inter = Block(d.intermediate_size)
    out += [
        _col(layer, "mlp.gate_proj", gate_up, 0, h, (inter,)),
        _col(layer, "mlp.up_proj", gate_up, 1, h, (inter,)),
        _row(layer, "mlp.down_proj", (inter,), h),
    ]
    return out


def corrections(d: ModelDims) -> list[Correction]:
    """Every corrected linear of layers 40-63, in layer then checkpoint order."""
    if d.num_layers != MODEL_LAYERS:
        raise ClefError(f"model config: {d.num_layers} decoder layers; Clef corrects layers "
                        f"{CLEF_LAYERS.start}-{CLEF_LAYERS.stop - 1} of a "
                        f"{MODEL_LAYERS}-layer Qwen3.8-27B")
    return [c for i in CLEF_LAYERS for c in layer_corrections(d, i)]


def fused_slices(cs: list[Correction]) -> dict[tuple[int, str], list[Correction]]:
    """Corrections grouped by the vLLM layer that applies them, slices in order."""
    out: dict[tuple[int, str], list[Correction]] = {}
    for c in cs:
        out.setdefault((c.layer, c.fused), []).append(c)
    for group in out.values():
        group.sort(key=lambda c: c.slice_index)
    return out
