"""Bytes of every weight tensor on one GPU, by storage format (pure).

GPTQ layout, as the checkpoint stores it and vLLM's `gptq` method allocates it, for a
linear with `k` input and `n` output features on this GPU, `b` bits, groups of `g` inputs:
- qweight: int32 [ceil(k*b/32), n]: b-bit values packed along the input, 32/b per word;
- qzeros:  int32 [groups, ceil(n*b/32)]: one b-bit zero point per group and output, packed
  along the output (8-bit: four per int32), stored even when `sym` is true;
- scales:  fp16  [groups, n];
- g_idx:   int32 [k]: read from the checkpoint, but vLLM replaces it by an empty tensor after
  loading when `desc_act` is false, so it is counted only for desc_act checkpoints.
groups = k/g (rounded up; 1 for g = -1); for a row-parallel layer k is already the shard.

Formats our plugin quantises at load time (the int8 lm_head, int8/int4 draft heads, 12-bit
attention weights): values of `bits` bits packed densely plus one fp16 scale per group of
128 inputs and output row (symmetric, no zero points).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sm70ctl.plan.model_config import QuantConfig, Scheme
from sm70ctl.plan.shapes import Tensor, ceil_div

RUNTIME_GROUP = 128  # inputs per fp16 scale for formats the plugin quantises at load
FP16 = 2

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


@dataclass(frozen=True)
class TensorBytes:
    name: str
    cls: str
    fmt: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class ClassBytes:
    cls: str
    label: str
    total: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)  # bytes per storage format
    tensors: int = 0


def gptq_parts(k: int, n: int, s: Scheme) -> dict[str, int]:
    groups = ceil_div(k, s.group_size) if s.group_size > 0 else 1
    return {
        "qweight": ceil_div(k * s.bits, 32) * n * 4,
        "qzeros": groups * ceil_div(n * s.bits, 32) * 4,
        "scales": groups * n * FP16,
        "g_idx": k * 4 if s.desc_act else 0,
    }


def runtime_parts(k: int, n: int, bits: int) -> dict[str, int]:
    return {
        "qweight": ceil_div(k * n * bits, 8),
        "scales": ceil_div(k, RUNTIME_GROUP) * n * FP16,
    }


def _scheme(t: Tensor, quant: QuantConfig | None, warnings: list[str]) -> Scheme | None:
    if quant is None:
        return None
    s = quant.scheme_for(t.name)
    if t.fused is not None:
        fused = quant.scheme_for(t.fused)
        if fused != s:
            warnings.append(
                f"quantisation config: `{t.name}` is {_fmt_scheme(s)} but vLLM's fused "
                f"`{t.fused}` matches {_fmt_scheme(fused)}; vLLM decides by the fused name "
                "(a mismatch loads but produces garbage)"
            )
    return s


def _fmt_scheme(s: Scheme | None) -> str:
    if s is None:
        return "16-bit"
    return f"gptq-int{s.bits} g{s.group_size}{'' if s.sym else ' asym'}"


def tensor_bytes(t: Tensor, quant: QuantConfig | None, opts: WeightOptions,
                 warnings: list[str]) -> TensorBytes:
    k, n = t.cols, t.rows
    if not t.linear:
        return TensorBytes(t.name, t.cls, "fp16", {"weight": k * n * t.elem_bytes})
    bias = {"bias": n * FP16} if t.bias else {}
    if t.store == "lm_head":
        if opts.int8_lm_head:
            return TensorBytes(t.name, t.cls, "int8 g128 (plugin)", runtime_parts(k, n, 8))
        s = _scheme(t, quant, warnings) if quant is not None and quant.lm_head else None
    elif t.store == "fp16":
        s = None
    else:
        s = _scheme(t, quant, warnings)
    if s is not None:
        return TensorBytes(t.name, t.cls, _fmt_scheme(s), {**gptq_parts(k, n, s), **bias})
    if t.store == "draft" and opts.draft_head_dtype in ("int8", "int4"):
        bits = 8 if opts.draft_head_dtype == "int8" else 4
        return TensorBytes(t.name, t.cls, f"int{bits} g128 (plugin)",
                           {**runtime_parts(k, n, bits), **bias})
    if t.store == "attn16" and opts.attn_weights_12bit:
        return TensorBytes(t.name, t.cls, "int12 g128 (plugin)",
                           {**runtime_parts(k, n, 12), **bias})
    return TensorBytes(t.name, t.cls, "fp16", {"weight": k * n * FP16, **bias})


def by_class(tensors: Iterable[Tensor], quant: QuantConfig | None, opts: WeightOptions,
             warnings: list[str]) -> list[ClassBytes]:
    """Bytes per tensor class, in CLASS_LABELS order; classes with no tensors left out."""
    classes = {c: ClassBytes(c, label) for c, label in CLASS_LABELS.items()}
    for t in tensors:
        tb = tensor_bytes(t, quant, opts, warnings)
        c = classes[tb.cls]
        c.total += tb.total
        c.tensors += 1
        c.formats[tb.fmt] = c.formats.get(tb.fmt, 0) + tb.total
        for part, b in tb.parts.items():
            if b:
                c.parts[part] = c.parts.get(part, 0) + b
    return [c for c in classes.values() if c.tensors]
