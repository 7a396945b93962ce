"""The base model's shapes that decide Clef's tensor shapes, read from its `config.json`.

`vllm_patch` cannot use sm70ctl's config parser, so this is the small subset Clef needs: the
widths of every corrected linear. A `qwen3_5` config nests the decoder under `text_config`;
a flat text config (tests' tiny models) is read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_patch.clef.errors import ClefError

FULL = "full_attention"
LINEAR = "linear_attention"
# configs of real models are far below this; it keeps a hostile config from asking the
# validator for terabyte-sized expectations
MAX_DIM = 1 << 20


@dataclass(frozen=True)
class ModelDims:
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

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def _int(cfg: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ClefError(f"model config: `{where}{key}` is missing (Clef's shapes need it)")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
        raise ClefError(f"model config: `{where}{key}` = {value!r} is not an integer "
                        f"from 1 to {MAX_DIM:,}")
    return value


def model_dims(config: Mapping[str, Any]) -> ModelDims:
    """The shapes Clef needs from a parsed `config.json`; ClefError naming the field."""
    if not isinstance(config, Mapping):
        raise ClefError("model config: not a JSON object")
    text = config.get("text_config", config)
    if not isinstance(text, Mapping):
        raise ClefError("model config: `text_config` is not a JSON object")
    where = "text_config." if "text_config" in config else ""
    n = _int(text, "num_hidden_layers", where)
    types = text.get("layer_types")
    if types is None:
        interval = _int(text, "full_attention_interval", where)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if (not isinstance(types, list) or len(types) != n
            or any(t not in (FULL, LINEAR) for t in types)):
        raise ClefError(f"model config: `{where}layer_types` must list {n} entries, each "
                        f"{FULL!r} or {LINEAR!r}")
    heads = _int(text, "num_attention_heads", where)
    gate = text.get("attn_output_gate", True)
    if not isinstance(gate, bool):
        raise ClefError(f"model config: `{where}attn_output_gate` = {gate!r} is not "
                        "true or false")
    return ModelDims(
        hidden_size=_int(text, "hidden_size", where),
        intermediate_size=_int(text, "intermediate_size", where),
        layer_types=tuple(types),
        num_attention_heads=heads,
        num_key_value_heads=_int(text, "num_key_value_heads", where, heads),
        head_dim=_int(text, "head_dim", where),
        attn_output_gate=gate,
        linear_num_key_heads=_int(text, "linear_num_key_heads", where),
        linear_num_value_heads=_int(text, "linear_num_value_heads", where),
        linear_key_head_dim=_int(text, "linear_key_head_dim", where),
        linear_value_head_dim=_int(text, "linear_value_head_dim", where),
    )
