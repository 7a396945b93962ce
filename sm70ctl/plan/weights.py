"""Bytes of every weight tensor on one GPU, as the sm70 plugin allocates them (pure).

Which linear layers are int8 is decided by the plugin's own rules
(`vllm_patch.quantization.rules.GptqRules`, pure Python) from the checkpoint's
`quantization_config` (`dynamic`, `modules_to_not_convert`, fused shards that must agree),
asked with the layer's vLLM name, so the plan and the served model cannot disagree on a
layer; a config the plugin refuses is refused here with its message.

Resident layout of an int8 layer with `k` input and `n` output features on this GPU
(sm70_gptq repacks the GPTQ tensors after loading and frees them, g_idx included):
- qw: uint8 [n, k], one code per weight;
- sz: fp16 [n, k/128, 2], the (scale, zero) pair of each group of 128 inputs,
so 1 + 4/128 bytes per weight. The int8 lm_head (SM70_INT8_LM_HEAD, made by the plugin at
load from the fp16 head, only when the checkpoint is served by sm70_gptq) is the same
layout with one group per row: n*k + 4n bytes. The GPTQ tensors and the fp16 head live
only while loading (one layer at a time, converted in slices), so they are not counted.
The MTP draft layer's linear layers, 16-bit in the checkpoint, are quantized at load into
the same int8 layout with groups of 128 when SM70_DRAFT_HEAD_DTYPE is int8
(vllm_patch.quantization.draft_int8, again only in a model served by sm70_gptq).

On the plan path `target` the formats the plugin is designed to make but does not yet
(int4 draft heads; 12-bit attention weights, issue 21) are counted too: values of `bits`
bits packed densely plus one fp16 scale per group of 128 inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sm70ctl.errors import Sm70Error
from sm70ctl.plan.model_config import QuantConfig
from sm70ctl.plan.shapes import Tensor, ceil_div
from vllm_patch.quantization.rules import GptqRules, LayerScheme, QuantConfigError

RUNTIME_GROUP = 128  # inputs per fp16 scale for formats the plugin quantises at load
FP16 = 2
SZ_BYTES = 2 * FP16  # one fp16 (scale, zero) pair per group and output row
# The dtype each part is stored in (a plain tensor's "weight" is its own element size).
PART_DTYPES = {"qw": "uint8", "sz": "float16", "bias": "float16", "scales": "float16",
               "qweight": "uint8"}

# The order and labels the plan reports classes in.
CLASS_LABELS = {
    "embed": "embed_tokens (vocab-parallel)",
    "lm_head": "lm_head (vocab-parallel)",
    "attn.qkv": "attention q/k/v",
    "attn.o_proj": "attention o_proj",
    "gdn.in_proj": "GDN in_proj qkv+z",
    "gdn.in_proj_ba": "GDN in_proj b+a",
    "gdn.out_proj": "GDN out_proj",
    "gdn.small": "GDN conv1d, A_log, dt_bias, norm",
    "mlp": "MLP gate/up/down",
    "norms": "norms (layer, q/k, final)",
    "vision": "vision tower (replicated)",
    "mtp": "MTP draft layer",
}


@dataclass(frozen=True)
class WeightOptions:
    int8_lm_head: bool = True
    attn_weights_12bit: bool = False
    draft_head_dtype: str = "int8"  # fp16 | int8 | int4
    # plan path `served`: only what the plugin does today (no int4 draft or 12-bit formats)
    served: bool = True


@dataclass(frozen=True)
class TensorBytes:
    name: str
    cls: str
    fmt: str
    parts: dict[str, int]

    elem_bytes: int = FP16

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def by_dtype(self) -> dict[str, int]:
        """Bytes per torch dtype, as `model.parameters()` of the served model reports them."""
        plain = {2: "float16", 4: "float32", 1: "uint8"}.get(self.elem_bytes, "other")
        out: dict[str, int] = {}
        for part, b in self.parts.items():
            dtype = PART_DTYPES.get(part, plain)
            out[dtype] = out.get(dtype, 0) + b
        return out


@dataclass
class ClassBytes:
    cls: str
    label: str
    total: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)  # bytes per storage format
    tensors: int = 0


def int8_parts(k: int, n: int, group_size: int) -> dict[str, int]:
    """A repacked int8 layer: qw uint8 [n, k] and sz fp16 [n, k/group, 2]."""
    return {"qw": n * k, "sz": n * ceil_div(k, group_size) * SZ_BYTES}


def int8_lm_head_parts(k: int, n: int) -> dict[str, int]:
    """The plugin's per-row int8 lm_head: qw uint8 [n, k] and one (scale, zero) per row."""
    return {"qw": n * k, "sz": n * SZ_BYTES}


def runtime_parts(k: int, n: int, bits: int) -> dict[str, int]:
    return {
        "qweight": ceil_div(k * n * bits, 8),
        "scales": ceil_div(k, RUNTIME_GROUP) * n * FP16,
    }


def plugin_rules(quant: QuantConfig | None) -> GptqRules | None:
    """The plugin's rules for this checkpoint (None: a 16-bit checkpoint)."""
    if quant is None:
        return None
    if quant.source is None:  # only parse_quant builds these, and it keeps the source
        raise Sm70Error("quantization config: the plan was given no quantization_config")
    try:
        rules = GptqRules.from_config(quant.source)
        rules.lm_head_scheme()
    except QuantConfigError as exc:
        raise Sm70Error(f"quantization config: {exc}",
                        hint="the sm70 plugin refuses this checkpoint at load too") from None
    return rules


def layer_scheme(t: Tensor, rules: GptqRules) -> LayerScheme:
    """The plugin's decision for the vLLM layer `t` belongs to (fused layers as one)."""
    prefix = rules.to_vllm(t.fused or t.name)
    try:
        return rules.scheme_for(prefix)
    except QuantConfigError as exc:
        raise Sm70Error(f"quantization config: {exc}",
                        hint="the sm70 plugin refuses this checkpoint at load too") from None


def tensor_bytes(t: Tensor, rules: GptqRules | None, opts: WeightOptions) -> TensorBytes:
    k, n = t.cols, t.rows
    if not t.linear:
        return TensorBytes(t.name, t.cls, f"fp{8 * t.elem_bytes}",
                           {"weight": k * n * t.elem_bytes}, t.elem_bytes)
    bias = {"bias": n * FP16} if t.bias else {}
    if t.store == "lm_head":
        # Sm70ParallelLMHead quantises the head only in a model served by sm70_gptq.
        if opts.int8_lm_head and rules is not None:
            return TensorBytes(t.name, t.cls, "int8 per row (plugin)",
                               {**int8_lm_head_parts(k, n), **bias})
        return TensorBytes(t.name, t.cls, "fp16", {"weight": k * n * FP16, **bias})
    if t.store != "fp16" and rules is not None:
        s = layer_scheme(t, rules)
        if s.quantized:
            if k % s.group_size:
                raise Sm70Error(
                    f"layer {t.fused or t.name}: {k} input features on this GPU is not a "
                    f"multiple of group_size={s.group_size} (the plugin refuses it at load)",
                    hint="choose a tensor-parallel size that keeps whole groups")
            return TensorBytes(t.name, t.cls, f"int8 g{s.group_size} (plugin)",
                               {**int8_parts(k, n, s.group_size), **bias})
    if t.store == "draft" and opts.draft_head_dtype == "int8" and (
            rules is not None or not opts.served):
        if k % RUNTIME_GROUP:
            raise Sm70Error(
                f"layer {t.fused or t.name}: {k} input features on this GPU is not a multiple "
                f"of {RUNTIME_GROUP} (SM70_DRAFT_HEAD_DTYPE=int8 quantizes whole groups; the "
                "plugin refuses it at load)", hint="set SM70_DRAFT_HEAD_DTYPE=float16")
        return TensorBytes(t.name, t.cls, f"int8 g{RUNTIME_GROUP} (plugin, at load)",
                           {**int8_parts(k, n, RUNTIME_GROUP), **bias})
    if not opts.served:
        if t.store == "draft" and opts.draft_head_dtype == "int4":
            return TensorBytes(t.name, t.cls, "int4 g128 (plugin, target)",
                               {**runtime_parts(k, n, 4), **bias})
        if t.store == "attn16" and opts.attn_weights_12bit:
            return TensorBytes(t.name, t.cls, "int12 g128 (plugin, target)",
                               {**runtime_parts(k, n, 12), **bias})
    return TensorBytes(t.name, t.cls, "fp16", {"weight": k * n * FP16, **bias})


def by_class(tensors: Iterable[Tensor], quant: QuantConfig | None, opts: WeightOptions,
             warnings: list[str]) -> list[ClassBytes]:
    """Bytes per tensor class, in CLASS_LABELS order; classes with no tensors left out.

    `warnings` is kept for the callers; a config the plugin cannot serve is an error now.
    """
    rules = plugin_rules(quant)
    classes = {c: ClassBytes(c, label) for c, label in CLASS_LABELS.items()}
    for t in tensors:
        tb = tensor_bytes(t, rules, opts)
        c = classes[tb.cls]
        c.total += tb.total
        c.tensors += 1
        c.formats[tb.fmt] = c.formats.get(tb.fmt, 0) + tb.total
        for part, b in tb.parts.items():
            if b:
                c.parts[part] = c.parts.get(part, 0) + b
    return [c for c in classes.values() if c.tensors]
