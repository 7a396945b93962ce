"""Parse a Hugging Face `config.json` (the `qwen3_5` layout) into the shapes the plan needs.

Only what changes memory is read: layer counts and kinds, head counts and sizes, the
vocabulary, the vision tower's shapes, the MTP layer count, and the quantisation config
(`bits`, `group_size`, `sym`, `desc_act`, `modules_to_not_convert`, `dynamic`). A flat text
config (no `text_config`, as `Qwen3NextForCausalLM` or `qwen3_5_text` checkpoints have) is
accepted too, so tiny test models work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.plan.model_checks import FIELD_MAX, MAX_LAYERS, check_model

FULL = "full_attention"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Scheme:
    """How one linear is stored: GPTQ with these parameters."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool


@dataclass(frozen=True)
class QuantConfig:
    """A GPTQ quantisation config; `scheme_for(name)` says how a module is stored."""

    method: str
    default: Scheme
    lm_head: bool = False  # GPTQ's `lm_head` flag: the checkpoint's lm_head is quantised
    modules_to_not_convert: tuple[str, ...] = ()
    # (regex, None for "-:" (kept 16-bit) or the overriding Scheme), in file order
    dynamic: tuple[tuple[str, Scheme | None], ...] = ()
    # the checkpoint's quantization_config as read: the plan decides each layer's storage
    # with the plugin's own rules from it (sm70ctl.plan.weights, vllm_patch.quantization)
    source: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def scheme_for(self, name: str) -> Scheme | None:
        """The GPTQ scheme of module `name`, or None when it stays 16-bit.

        `modules_to_not_convert` entries match on dotted-name boundaries (so `layers.1`
        never matches `layers.10`); `dynamic` keys are regexes matched from the start of
        the name, as vLLM's GPTQ config does: `-:` keeps the module 16-bit, `+:` or no
        prefix overrides bits/group_size/sym/desc_act.
        """
        dotted = f".{name}."
        if any(f".{m.strip('.')}." in dotted for m in self.modules_to_not_convert):
            return None
        for pattern, override in self.dynamic:
            if re.match(pattern, name):
                return override
        return self.default


@dataclass(frozen=True)
class ModelShape:
    """Everything about the model that decides its memory footprint."""

    source: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attn_output_gate: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    max_position_embeddings: int
    # checkpoint name prefix of the decoder (model.language_model. for qwen3_5, model. flat)
    prefix: str
    vision: VisionShape | None
    quant: QuantConfig | None
    warnings: tuple[str, ...] = field(default=())
    # the GDN recurrent state dtype the config asks for (Qwen3.5: float32); None: model dtype
    mamba_ssm_dtype: str | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the GDN causal conv (q, k and v of the fused projection)."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim


def _brief(value: Any, limit: int = 60) -> str:
    """A config value for a message: its repr, cut short (a config may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({type(value).__name__})"


MAX_QUANT_RULES = 4096
MAX_RULE_CHARS = 512

_HINT = "give a Hugging Face config.json of a Qwen3.5/Qwen3.8 (qwen3_5) model"


def _need(cfg: dict[str, Any], key: str, where: str, default: int | None = None,
          minimum: int = 0) -> int:
    """The integer `cfg[key]` (at least `minimum`, at most the key's FIELD_MAX); `default`
    when absent or null, or a named error when there is no default."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise Sm70Error(f"model config: `{where}{key}` is missing", hint=_HINT)
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise Sm70Error(f"model config: `{where}{key}` = {_brief(value)} is not {rule}",
                        hint=_HINT)
    limit = FIELD_MAX.get(key)
    if limit is not None and value > limit:
        raise Sm70Error(
            f"model config: `{where}{key}` = {value:,} is above {limit:,}, the most sm70ctl "
            "plans (no real model comes near it)", hint=_HINT)
    return value


def _layer_types(text: dict[str, Any], where: str, model_type: Any) -> tuple[str, ...]:
    n = _need(text, "num_hidden_layers", where, minimum=1)
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise Sm70Error(
                f"model config: `{where}layer_types` and `{where}full_attention_interval` "
                f"are both missing (model_type {_brief(model_type)})",
                hint=f"{_HINT}: a hybrid of linear_attention and full_attention layers",
            )
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise Sm70Error(f"model config: `{where}layer_types` = {_brief(types)} is not a list "
                        "of names", hint=f"allowed names: {FULL!r}, {LINEAR!r}")
    types = tuple(types)
    if len(types) != n:
        raise Sm70Error(
            f"model config: `{where}layer_types` has {len(types)} entries, "
            f"num_hidden_layers is {n}"
        )
    bad = sorted({t for t in types if t not in (FULL, LINEAR)})
    if bad:
        raise Sm70Error(
            f"model config: `{where}layer_types` has unknown kinds {_brief(bad)}",
            hint=f"allowed: {FULL!r}, {LINEAR!r}",
        )
    return types


def _scheme(q: dict[str, Any], base: Scheme | None, where: str) -> Scheme:
    bits = q.get("bits", base.bits if base else None)
    group = q.get("group_size", base.group_size if base else None)
    if isinstance(bits, bool) or bits not in (2, 3, 4, 8) or not isinstance(bits, int):
        raise Sm70Error(f"quantization config: `{where}bits` = {_brief(bits)}; allowed 2, 3, 4, 8")
    if not isinstance(group, int) or isinstance(group, bool) or (group <= 0 and group != -1):
        raise Sm70Error(
            f"quantization config: `{where}group_size` = {_brief(group)}; "
            "must be a positive integer or -1"
        )
    return Scheme(
        bits=bits,
        group_size=group,
        sym=bool(q.get("sym", base.sym if base else True)),
        desc_act=bool(q.get("desc_act", base.desc_act if base else False)),
    )


def parse_quant(q: dict[str, Any] | None) -> QuantConfig | None:
    """The GPTQ config, or None for a 16-bit checkpoint."""
    if not q:
        return None
    if not isinstance(q, dict):
        raise Sm70Error(f"model config: `quantization_config` = {_brief(q)} is not a JSON object")
    method = str(q.get("quant_method", "gptq")).lower()
    if method != "gptq":
        raise Sm70Error(
            f"quantization config: quant_method {_brief(method)} is not planned",
            hint="sm70ctl plans GPTQ (int8 group-128) or 16-bit checkpoints",
        )
    default = _scheme(q, None, "quantization_config.")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise Sm70Error("quantization config: `modules_to_not_convert` must be a list of names")
    dynamic: list[tuple[str, Scheme | None]] = []
    dyn = q.get("dynamic") or {}
    if not isinstance(dyn, dict):
        raise Sm70Error("quantization config: `dynamic` must be a JSON object of "
                        "regex -> overrides")
    # every tensor name is matched against each rule: a few thousand rules of a few hundred
    # characters cover any real checkpoint and keep the matching quick
    for what, rules in (("modules_to_not_convert", skip), ("dynamic", list(dyn))):
        if len(rules) > MAX_QUANT_RULES:
            raise Sm70Error(f"quantization config: `{what}` has {len(rules):,} entries, more "
                            f"than the {MAX_QUANT_RULES:,} sm70ctl plans")
        long = next((r for r in rules if len(r) > MAX_RULE_CHARS), None)
        if long is not None:
            raise Sm70Error(f"quantization config: `{what}` entry {_brief(long)} is longer "
                            f"than {MAX_RULE_CHARS} characters")
    for key, override in dyn.items():
        if override is not None and not isinstance(override, dict):
            raise Sm70Error(f"quantization config: dynamic[{_brief(key)}] = "
                            f"{_brief(override)} is not a JSON object")
        if key.startswith("-:"):
            dynamic.append((key[2:], None))
        else:
            pattern = key[2:] if key.startswith("+:") else key
            dynamic.append((pattern, _scheme(override or {}, default, f"dynamic[{key!r}].")))
        try:
            re.compile(dynamic[-1][0])
        except re.error as exc:
            raise Sm70Error(
                f"quantization config: dynamic key {_brief(key)} is not a regex: {exc}"
            ) from exc
    return QuantConfig(
        method, default, bool(q.get("lm_head", False)), tuple(skip), tuple(dynamic), source=q
    )


def parse_vision(v: Any) -> VisionShape | None:
    if not v:
        return None
    if not isinstance(v, dict):
        raise Sm70Error(f"model config: `vision_config` = {_brief(v)} is not a JSON object")
    w = "vision_config."
    deepstack = v.get("deepstack_visual_indexes") or []
    if not isinstance(deepstack, list) or len(deepstack) > MAX_LAYERS or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS
            for i in deepstack):
        raise Sm70Error(f"model config: `{w}deepstack_visual_indexes` = {_brief(deepstack)} "
                        f"is not a list of layer indexes (integers 0..{MAX_LAYERS - 1})")
    return VisionShape(
        depth=_need(v, "depth", w),
        hidden_size=_need(v, "hidden_size", w, minimum=1),
        intermediate_size=_need(v, "intermediate_size", w, minimum=1),
        num_heads=_need(v, "num_heads", w, minimum=1),
        in_channels=_need(v, "in_channels", w, 3, minimum=1),
        patch_size=_need(v, "patch_size", w, minimum=1),
        temporal_patch_size=_need(v, "temporal_patch_size", w, 2, minimum=1),
        spatial_merge_size=_need(v, "spatial_merge_size", w, 2, minimum=1),
        out_hidden_size=_need(v, "out_hidden_size", w, minimum=1),
        num_position_embeddings=_need(v, "num_position_embeddings", w, 0),
        deepstack_visual_indexes=tuple(deepstack),
    )


def parse_config(cfg: dict[str, Any], source: str = "<dict>") -> ModelShape:
    """A `ModelShape` from a parsed config.json; Sm70Error naming the field when unusable."""
    if not isinstance(cfg, dict):
        raise Sm70Error(f"model config {source}: not a JSON object")
    text_cfg = cfg.get("text_config")
    if text_cfg is not None and not isinstance(text_cfg, dict):
        raise Sm70Error(f"model config {source}: `text_config` is not a JSON object")
    nested = text_cfg is not None
    text = text_cfg if nested else cfg
    where = "text_config." if nested else ""
    model_type = text.get("model_type", cfg.get("model_type"))
    types = _layer_types(text, where, model_type)
    heads = _need(text, "num_attention_heads", where, minimum=1)
    hidden = _need(text, "hidden_size", where, minimum=1)
    head_dim = _need(text, "head_dim", where, 0) or hidden // heads
    if head_dim < 1:
        raise Sm70Error(f"model config: `{where}head_dim` is missing and hidden_size {hidden} "
                        f"/ num_attention_heads {heads} is 0")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise Sm70Error(f"model config: `tie_word_embeddings` = {_brief(tie)} is not true or false")
    quant = parse_quant(cfg.get("quantization_config") or text.get("quantization_config"))
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else "?"
    shape = ModelShape(
        source=source,
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=_need(text, "intermediate_size", where, minimum=1),
        layer_types=types,
        num_attention_heads=heads,
        num_key_value_heads=_need(text, "num_key_value_heads", where, heads, minimum=1),
        head_dim=head_dim,
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        linear_num_key_heads=_need(text, "linear_num_key_heads", where, 0),
        linear_num_value_heads=_need(text, "linear_num_value_heads", where, 0),
        linear_key_head_dim=_need(text, "linear_key_head_dim", where, 0),
        linear_value_head_dim=_need(text, "linear_value_head_dim", where, 0),
        linear_conv_kernel_dim=_need(text, "linear_conv_kernel_dim", where, 4, minimum=1),
        vocab_size=_need(text, "vocab_size", where, minimum=1),
        tie_word_embeddings=tie,
        mtp_num_hidden_layers=_need(text, "mtp_num_hidden_layers", where, 0),
        max_position_embeddings=_need(text, "max_position_embeddings", where, 0),
        prefix="model.language_model." if nested else "model.",
        vision=parse_vision(cfg.get("vision_config")),
        quant=quant,
        mamba_ssm_dtype=_ssm_dtype(text, where),
    )
    if shape.linear_layers and not (
        shape.linear_num_key_heads and shape.linear_num_value_heads
        and shape.linear_key_head_dim and shape.linear_value_head_dim
    ):
        raise Sm70Error(
            f"model config: `{where}layer_types` has linear_attention layers but the "
            f"`{where}linear_*` head counts/dims are missing or zero"
        )
    check_model(shape, where)
    return shape


# A config.json is a few KiB; reading stops past this, so pointing --config at a weights
# file (gigabytes) fails at once instead of loading it all into memory.
CONFIG_MAX_BYTES = 16 << 20


def load_config(path: Path) -> ModelShape:
    """Read and parse a config.json (the file edge): the bounded reader refuses a file too
    large, too deeply nested, binary or not JSON in one line."""
    from sm70ctl.readers import read_json

    raw = read_json(path, what="model config", max_bytes=CONFIG_MAX_BYTES)
    return parse_config(raw, str(path))


def _ssm_dtype(text: dict[str, Any], where: str) -> str | None:
    value = text.get("mamba_ssm_dtype")
    if value is None:
        return None
    if value not in ("float32", "float16", "bfloat16"):
        raise Sm70Error(f"model config: `{where}mamba_ssm_dtype` = {_brief(value)} is not "
                        "float32, float16 or bfloat16")
    return str(value)


def builtin_config_path() -> Path:
    """The packaged reference description of Qwen3.8-27B GPTQ int8."""
    return Path(__file__).resolve().parent.parent / "data" / "qwen3.8-27b" / "config.json"
