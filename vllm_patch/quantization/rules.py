"""What each linear layer of a GPTQ-int8 checkpoint gets, decided from its `quantization_config`.

Pure Python (no torch, no vLLM), so CI tests it anywhere. The vLLM-facing config
(`vllm_patch.quantization.sm70_gptq`) asks `scheme_for(prefix)` once per layer vLLM builds.

Why this exists: stock vLLM reads `dynamic` against its *runtime* names only (fused,
`language_model.model.layers.3.self_attn.qkv_proj`) and ignores `modules_to_not_convert`
(checkpoint names, unfused, `model.language_model.layers.0.mlp`). A checkpoint written with
either convention must give the same answer, so every rule is tried against all the names a
layer has: its vLLM name, and each checkpoint shard's name in both vLLM and HF spelling. A
fused layer is one tensor in our kernels, so its shards must agree; if they do not, serving
would read int8 codes as fp16 (or the reverse) and print garbage, so we refuse to start.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SERVED_BITS = 8
SERVED_GROUP_SIZE = 128

# vLLM fuses these checkpoint projections into one layer (Qwen3.5's packed_modules_mapping).
QWEN3_5_FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}

# Qwen3_5ForConditionalGeneration's hf_to_vllm_mapper (checkpoint prefix -> vLLM prefix).
QWEN3_5_PREFIXES: dict[str, str] = {
    "model.visual.": "visual.",
    "lm_head.": "language_model.lm_head.",
    "model.language_model.": "language_model.model.",
}

# Layers that stay fp16 whatever the config says: the vision tower (our kernels are for the
# decoder's GEMV shapes) and the GDN short convolution (a depthwise conv, not a GEMM).
ALWAYS_FP16 = (re.compile(r"^(visual|model\.visual)\."), re.compile(r"\.conv1d$"))


class QuantConfigError(ValueError):
    """A checkpoint config we cannot serve; the message names the setting and the rule."""


@dataclass(frozen=True)
class LayerScheme:
    """The decision for one vLLM layer: int8 (with its GPTQ parameters) or fp16, and why."""

    quantized: bool
    bits: int = SERVED_BITS
    group_size: int = SERVED_GROUP_SIZE
    sym: bool = False
    desc_act: bool = False
    reason: str = ""


@dataclass(frozen=True)
class GptqRules:
    """The parsed `quantization_config` of a GPTQ checkpoint."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    lm_head: bool = False
    checkpoint_format: str = "gptq"
    dynamic: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    modules_to_not_convert: tuple[str, ...] = ()
    prefixes: Mapping[str, str] = field(default_factory=lambda: dict(QWEN3_5_PREFIXES))
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(QWEN3_5_FUSED))

    @property
    def zero_offset(self) -> int:
        """Classic GPTQ ("gptq", v1) stores zero - 1; "gptq_v2" stores the zero itself."""
        return 0 if self.checkpoint_format == "gptq_v2" else 1

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GptqRules:
        """Parse a checkpoint's `quantization_config`; wrong types raise QuantConfigError."""
        if not isinstance(config, Mapping):
            raise QuantConfigError("quantization_config must be a JSON object")
        method = str(config.get("quant_method", "gptq")).lower()
        if method != "gptq":
            raise QuantConfigError(
                f"quantization_config.quant_method is {method!r}; sm70_gptq serves only 'gptq'"
            )
        bits = _int(config, "bits")
        group_size = _int(config, "group_size")
        sym = _bool(config, "sym", True)
        desc_act = _bool(config, "desc_act", False)
        lm_head = _bool(config, "lm_head", False)
        fmt = str(config.get("checkpoint_format") or "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantConfigError(
                f"quantization_config.checkpoint_format is {fmt!r}; must be 'gptq' or 'gptq_v2'"
            )
        dynamic = config.get("dynamic") or {}
        if not isinstance(dynamic, Mapping):
            raise QuantConfigError("quantization_config.dynamic must be an object of rules")
        rules: list[tuple[str, Mapping[str, Any]]] = []
        for key, override in dynamic.items():
            pattern = _pattern(key)
            try:
                re.compile(pattern)
            except re.error as exc:
                raise QuantConfigError(
                    f"quantization_config.dynamic rule {key!r} is not a regular expression "
                    f"({exc})"
                ) from None
            if override is None:
                override = {}
            if not isinstance(override, Mapping):
                raise QuantConfigError(
                    f"quantization_config.dynamic[{key!r}] must be an object of overrides"
                )
            rules.append((str(key), dict(override)))
        skip = config.get("modules_to_not_convert") or []
        if isinstance(skip, str) or not isinstance(skip, Sequence) or not all(
            isinstance(s, str) for s in skip
        ):
            raise QuantConfigError(
                "quantization_config.modules_to_not_convert must be a list of module names"
            )
        return cls(
            bits=bits,
            group_size=group_size,
            sym=sym,
            desc_act=desc_act,
            lm_head=lm_head,
            checkpoint_format=fmt,
            dynamic=tuple(rules),
            modules_to_not_convert=tuple(s.strip(".") for s in skip if s.strip(".")),
        )

    def with_mappings(
        self,
        prefixes: Mapping[str, str] | None = None,
        fused: Mapping[str, Sequence[str]] | None = None,
    ) -> GptqRules:
        """A copy that also knows the model's own prefix map and fused layers."""
        from dataclasses import replace

        p = dict(self.prefixes)
        if prefixes:
            p.update(prefixes)
        f = dict(self.fused)
        if fused:
            f.update({k: tuple(v) for k, v in fused.items()})
        return replace(self, prefixes=p, fused=f)

    # ------------------------------------------------------------------ names
    def to_hf(self, vllm_name: str) -> str:
        """The checkpoint spelling of a vLLM name (longest matching prefix wins)."""
        for hf, vl in sorted(self.prefixes.items(), key=lambda kv: -len(kv[1])):
            if vllm_name.startswith(vl):
                return hf + vllm_name[len(vl) :]
        return vllm_name

    def to_vllm(self, hf_name: str) -> str:
        """The vLLM spelling of a checkpoint name (longest matching prefix wins)."""
        for hf, vl in sorted(self.prefixes.items(), key=lambda kv: -len(kv[0])):
            if hf_name.startswith(hf):
                return vl + hf_name[len(hf) :]
        return hf_name

    def shards(self, vllm_prefix: str) -> list[str]:
        """The vLLM names of the checkpoint modules one vLLM layer is made of."""
        head, _, proj = vllm_prefix.rpartition(".")
        parts = self.fused.get(proj)
        if not parts:
            return [vllm_prefix]
        return [f"{head}.{p}" if head else p for p in parts]

    # ------------------------------------------------------------------ decisions
    def shard_scheme(self, fused_name: str, shard: str) -> LayerScheme:
        """The decision for one checkpoint module (vLLM spelling) inside layer `fused_name`."""
        names = _unique([fused_name, shard, self.to_hf(shard), self.to_hf(fused_name)])
        for rx in ALWAYS_FP16:
            if any(rx.search(n) for n in names):
                return LayerScheme(False, reason=f"{fused_name} always stays fp16")
        for entry in self.modules_to_not_convert:
            if any(_dotted_contains(n, entry) for n in names):
                return LayerScheme(False, reason=f"modules_to_not_convert entry {entry!r}")
        scheme = LayerScheme(
            True, self.bits, self.group_size, self.sym, self.desc_act, reason="global config"
        )
        # vLLM's order: the first dynamic rule matching wins (re.match, anchored at the start).
        for key, override in self.dynamic:
            if not any(re.match(_pattern(key), n) for n in names):
                continue
            if key.startswith("-:"):
                return LayerScheme(False, reason=f"dynamic rule {key!r}")
            return LayerScheme(
                True,
                bits=_int(override, "bits", scheme.bits, f"dynamic[{key!r}]"),
                group_size=_int(override, "group_size", scheme.group_size, f"dynamic[{key!r}]"),
                sym=_bool(override, "sym", scheme.sym, f"dynamic[{key!r}]"),
                desc_act=_bool(override, "desc_act", scheme.desc_act, f"dynamic[{key!r}]"),
                reason=f"dynamic rule {key!r}",
            )
        return scheme

    def scheme_for(self, vllm_prefix: str) -> LayerScheme:
        """The decision for one vLLM linear layer; refuses what our kernels cannot serve."""
        shards = self.shards(vllm_prefix)
        per_shard = [(s, self.shard_scheme(vllm_prefix, s)) for s in shards]
        first_name, first = per_shard[0]
        for name, other in per_shard[1:]:
            if _key(other) != _key(first):
                raise QuantConfigError(
                    f"layer {vllm_prefix}: its shards disagree ({_describe(first_name, first)}; "
                    f"{_describe(name, other)}); every shard of a fused layer must have the "
                    "same precision (such a checkpoint loads but produces garbage)"
                )
        if first.quantized:
            check_servable(vllm_prefix, first)
        return first

    def lm_head_scheme(self) -> LayerScheme:
        """The checkpoint's lm_head: GPTQ-quantized only when `lm_head: true` (we refuse that:
        our int8 lm_head is quantized per row at load time from an fp16 checkpoint head)."""
        if self.lm_head:
            raise QuantConfigError(
                "quantization_config.lm_head is true: sm70_gptq needs an fp16 lm_head in the "
                "checkpoint (it makes its own per-row int8 copy at load time)"
            )
        return LayerScheme(False, reason="lm_head is fp16 in the checkpoint")


def check_servable(layer: str, scheme: LayerScheme) -> None:
    """Refuse a quantized layer our int8 kernels cannot run, naming the layer and the rule."""
    if scheme.bits != SERVED_BITS:
        raise QuantConfigError(
            f"layer {layer}: bits={scheme.bits} ({scheme.reason}); sm70_gptq serves bits=8 only"
        )
    if scheme.group_size != SERVED_GROUP_SIZE:
        raise QuantConfigError(
            f"layer {layer}: group_size={scheme.group_size} ({scheme.reason}); sm70_gptq "
            f"serves group_size={SERVED_GROUP_SIZE} only"
        )
    if scheme.desc_act:
        raise QuantConfigError(
            f"layer {layer}: desc_act=true ({scheme.reason}); sm70_gptq serves desc_act=false "
            "only (no activation reordering)"
        )


def _pattern(key: str) -> str:
    return key[2:] if key.startswith("-:") else key.removeprefix("+:")


def _dotted_contains(name: str, entry: str) -> bool:
    """Does `entry`'s dotted path appear in `name` on component boundaries?

    `layers.1` matches `...layers.1.mlp` but not `...layers.10.mlp`; `mtp` matches
    `mtp.fc`; `lm_head` matches `language_model.lm_head`."""
    parts, want = name.split("."), entry.split(".")
    n = len(want)
    return any(parts[i : i + n] == want for i in range(len(parts) - n + 1))


def _unique(names: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


def _key(s: LayerScheme) -> tuple[Any, ...]:
    if not s.quantized:
        return (False,)
    return (True, s.bits, s.group_size, s.sym, s.desc_act)


def _describe(name: str, s: LayerScheme) -> str:
    what = f"int{s.bits} g{s.group_size}" if s.quantized else "fp16"
    return f"{name.rsplit('.', 1)[-1]} is {what} by {s.reason}"


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None, where: str = "") -> int:
    value = cfg.get(key, default)
    label = f"quantization_config.{where + '.' if where else ''}{key}"
    if value is None:
        raise QuantConfigError(f"{label} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuantConfigError(f"{label} must be an integer, got {value!r}")
    return value


def _bool(cfg: Mapping[str, Any], key: str, default: bool, where: str = "") -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        label = f"quantization_config.{where + '.' if where else ''}{key}"
        raise QuantConfigError(f"{label} must be true or false, got {value!r}")
    return value
