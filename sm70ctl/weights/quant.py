"""Checks a checkpoint's `quantization_config` before anyone serves it (pure).

A GPTQ int8 checkpoint of Qwen3.8-27B whose config is wrong in one of a few ways still
loads in vLLM and then produces garbage ("!!!!!!"): bits other than 8, a group size other
than 128, no `modules_to_not_convert`, or `dynamic` rules that do not keep the fused
`qkv_proj` (full attention) and `in_proj_ba` (Gated DeltaNet) in 16 bits. vLLM matches the
`dynamic` rules against its *runtime* module names, which are the fused ones
(`...self_attn.qkv_proj`, not `q_proj`), so a rule written for the checkpoint's unfused
names silently misses. This module replays vLLM's rule order on those runtime names.

`validate_quant_config(config)` takes the parsed `config.json` (or a bare
`quantization_config`) and returns one `Problem` per thing wrong; an empty list means
the checkpoint may be served. `weights verify` and `serve`'s pre-flight both call it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

REQUIRED_BITS = 8
REQUIRED_GROUP_SIZE = 128
REQUIRED_METHOD = "gptq"

# Defaults when the config does not say (FACTS.md: 64 layers, one full-attention layer
# every 4, the full-attention one last in each group of four).
_DEFAULT_LAYERS = 64
_DEFAULT_INTERVAL = 4


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a quantization config: where, what was found, the rule."""

    field: str  # dotted path in config.json, e.g. "quantization_config.bits"
    value: Any  # what the checkpoint has (None when absent)
    rule: str  # what it must be
    message: str  # one line for people

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def has_quant_config(config: Any) -> bool:
    """Does this config.json (any JSON value) carry a quantization_config, at the top level
    or under text_config?"""
    if not isinstance(config, Mapping):
        return False
    text = config.get("text_config")
    return "quantization_config" in config or (
        isinstance(text, Mapping) and "quantization_config" in text
    )


def _quant_section(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any] | None]:
    """Find the quantization config: top level, under text_config, or given bare."""
    if isinstance(config.get("quantization_config"), Mapping):
        return "quantization_config", config["quantization_config"]
    text = config.get("text_config")
    if isinstance(text, Mapping) and isinstance(text.get("quantization_config"), Mapping):
        return "text_config.quantization_config", text["quantization_config"]
    if "bits" in config or "quant_method" in config:
        return "quantization_config", config
    return "quantization_config", None


def _layer_types(config: Mapping[str, Any]) -> list[str]:
    """The decoder's layer kinds, from `layer_types` or the full-attention interval."""
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else config
    types = text.get("layer_types")
    if isinstance(types, Sequence) and not isinstance(types, str) and types:
        return [str(t) for t in types]
    n = text.get("num_hidden_layers", _DEFAULT_LAYERS)
    interval = text.get("full_attention_interval", _DEFAULT_INTERVAL)
    if not isinstance(n, int) or n <= 0:
        n = _DEFAULT_LAYERS
    if not isinstance(interval, int) or interval <= 0:
        interval = _DEFAULT_INTERVAL
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
    ]


def runtime_prefix(config: Mapping[str, Any]) -> str:
    """vLLM's module-name prefix of the decoder layers for this architecture."""
    archs = config.get("architectures") or []
    if any(str(a).endswith("ForConditionalGeneration") for a in archs) or (
        "text_config" in config and not archs
    ):
        # Qwen3_5ForConditionalGeneration maps model.language_model. -> language_model.model.
        return "language_model.model.layers"
    return "model.layers"


def fused_module_names(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """The runtime names that must stay 16-bit, grouped by fused projection."""
    prefix = runtime_prefix(config)
    names: dict[str, list[str]] = {"qkv_proj": [], "in_proj_ba": []}
    for i, kind in enumerate(_layer_types(config)):
        if kind == "full_attention":
            names["qkv_proj"].append(f"{prefix}.{i}.self_attn.qkv_proj")
        elif kind == "linear_attention":
            names["in_proj_ba"].append(f"{prefix}.{i}.linear_attn.in_proj_ba")
    return names


def dynamic_decision(dynamic: Mapping[str, Any], name: str) -> tuple[str, str | None]:
    """What vLLM's GPTQ `dynamic` rules decide for one module name.

    Rules are tried in order and the first match wins: a key starting with `-:` whose
    regex matches (re.match, anchored at the start) keeps the module unquantised
    ("skip"); any other matching key overrides its quantisation ("override"). Returns
    the decision ("skip", "override", "default") and the matching key.
    """
    for key in dynamic:
        if key.startswith("-:"):
            pattern, decision = key[2:], "skip"
        else:
            pattern, decision = key.removeprefix("+:"), "override"
        try:
            if re.match(pattern, name):
                return decision, key
        except re.error:
            continue  # reported separately by the caller
    return "default", None


def _check_int(
    qc: Mapping[str, Any], where: str, key: str, required: int, why: str
) -> list[Problem]:
    value = qc.get(key)
    if value is None:
        return [
            Problem(f"{where}.{key}", None, f"== {required}", f"{key} is missing: {why}")
        ]
    if isinstance(value, bool) or value != required:
        return [
            Problem(
                f"{where}.{key}",
                value,
                f"== {required}",
                f"{key} is {value!r}, must be {required}: {why}",
            )
        ]
    return []


def _check_dynamic(
    config: Mapping[str, Any], qc: Mapping[str, Any], where: str
) -> list[Problem]:
    problems: list[Problem] = []
    dynamic = qc.get("dynamic")
    field = f"{where}.dynamic"
    if not isinstance(dynamic, Mapping) or not dynamic:
        return [
            Problem(
                field,
                dynamic,
                "rules with '-:' keys that match the fused qkv_proj and in_proj_ba",
                "dynamic is missing or empty: the fused qkv_proj and in_proj_ba would be "
                "quantised, which loads but produces garbage",
            )
        ]
    for key, override in dynamic.items():
        try:
            re.compile(key[2:] if key.startswith("-:") else key.removeprefix("+:"))
        except re.error as exc:
            problems.append(
                Problem(field, key, "valid regular expressions", f"dynamic rule {key!r} "
                        f"is not a valid regular expression ({exc})")
            )
            continue
        # A positive rule that changes bits or group size would hand our int8 kernels
        # something else for those modules.
        if not key.startswith("-:") and isinstance(override, Mapping):
            for sub, required in (("bits", REQUIRED_BITS), ("group_size", REQUIRED_GROUP_SIZE)):
                if sub in override and override[sub] != required:
                    problems.append(
                        Problem(
                            f"{field}[{key!r}].{sub}",
                            override[sub],
                            f"== {required}",
                            f"dynamic rule {key!r} sets {sub}={override[sub]!r}, "
                            f"must be {required}",
                        )
                    )
    for proj, names in fused_module_names(config).items():
        missed = [n for n in names if dynamic_decision(dynamic, n)[0] != "skip"]
        if missed:
            problems.append(
                Problem(
                    field,
                    sorted(dynamic),
                    f"a '-:' rule matching every fused {proj} (vLLM name, e.g. {missed[0]})",
                    f"dynamic does not keep the fused {proj} 16-bit in {len(missed)} of "
                    f"{len(names)} layers (first: {missed[0]}); it loads but produces garbage",
                )
            )
    return problems


def validate_quant_config(config: Mapping[str, Any]) -> list[Problem]:
    """Every problem with the checkpoint's quantization config; [] when it may be served.

    `config` is the parsed config.json (with `quantization_config` at the top level or
    under `text_config`), or a bare quantization_config.
    """
    if not isinstance(config, Mapping):
        return [Problem("config.json", type(config).__name__, "a JSON object",
                        "config.json is not a JSON object")]
    where, qc = _quant_section(config)
    if qc is None:
        return [
            Problem(
                where,
                None,
                "present",
                "config.json has no quantization_config: this is not the int8 GPTQ checkpoint",
            )
        ]
    problems: list[Problem] = []
    method = qc.get("quant_method")
    if method != REQUIRED_METHOD:
        problems.append(
            Problem(
                f"{where}.quant_method",
                method,
                f"== {REQUIRED_METHOD!r}",
                f"quant_method is {method!r}, must be {REQUIRED_METHOD!r} (the classic GPTQ "
                "kernel is the one that builds for sm_70)",
            )
        )
    problems += _check_int(qc, where, "bits", REQUIRED_BITS,
                           "other widths load but produce garbage on this stack")
    problems += _check_int(qc, where, "group_size", REQUIRED_GROUP_SIZE,
                           "other group sizes load but produce garbage on this stack")
    mntc = qc.get("modules_to_not_convert")
    if not isinstance(mntc, list) or not mntc:
        problems.append(
            Problem(
                f"{where}.modules_to_not_convert",
                mntc,
                "a non-empty list",
                "modules_to_not_convert is missing or empty: the modules kept 16-bit "
                "would be read as int8 (garbage output)",
            )
        )
    problems += _check_dynamic(config, qc, where)
    return problems


__all__ = [
    "Problem",
    "dynamic_decision",
    "fused_module_names",
    "runtime_prefix",
    "validate_quant_config",
]
