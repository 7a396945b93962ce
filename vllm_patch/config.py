"""The plugin's typed, frozen configuration, read from the SM70_PLUGIN_CONFIG env var.

`sm70ctl` (sm70ctl/runtime/plugin_config.py) builds it from the SM70_* settings and passes
it to every vLLM process as JSON; the plugin reads it with `PluginConfig.from_env()`. This
module imports only the standard library: it runs inside vLLM workers before torch is
touched.

The defaults here equal what the settings defaults produce (a test in the sm70ctl suite
compares them), so a plugin started without SM70_PLUGIN_CONFIG behaves like the reference.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

ENV_VAR = "SM70_PLUGIN_CONFIG"
VERSION = 1


@dataclass(frozen=True)
class MemoryConfig:
    state_block_multiplier: int = 8
    split_pools: bool = True


@dataclass(frozen=True)
class AttentionConfig:
    prefill_kernel: str = "triton"  # SM70_PREFILL_ATTENTION; cutlass_fmha is opt-in
    decode_tensor_cores: bool = True
    uniform_decode: bool = True
    decode_max_splits: int = 64
    paged_prefill: bool = True


@dataclass(frozen=True)
class SparsePrefillConfig:
    enabled: bool = True
    percent: float = 10.0
    mass: float = 0.85
    block: int = 64
    min_len: int = 2048
    decode_top_fraction: float = 0.0


@dataclass(frozen=True)
class GemmConfig:
    int8_gemv: bool = True
    attn_weights_12bit: bool = False
    int8_lm_head: bool = True
    tuning: str = "cached"
    gemv_max_rows: int = 8


@dataclass(frozen=True)
class AllreduceConfig:
    mode: str = "auto"  # as set (auto | fp16 | int12) or resolved by topology (fp16 | int12 | nccl)
    buffer_bytes: int = 16 * 1024**2


GDN_PREFILLS = ("fla", "sm70")  # gdn.prefill: vLLM's path or ours (vllm_patch.gdn.routing)
# SM70_GDN_KERNEL -> (gdn.kernel, gdn.decode_layer, gdn.prefill): sm70 is our layer with
# vLLM's FLA prefill, sm70_chunk the same layer with its prefill rows on our ops too
GDN_KERNEL_SETTING = {"triton": ("triton", False, "fla"), "sm70": ("sm70", True, "fla"),
                      "sm70_chunk": ("sm70", True, "sm70")}


@dataclass(frozen=True)
class GdnConfig:
    kernel: str = "triton"
    chunk_size: int = 64
    # int16 (the setting's default) with decode_layer on puts int16 codes + row scales in
    # vLLM's pool (vllm_patch/gdn/int16_pool.py); both it and float32 ran on a GPU.
    # Without decode_layer vLLM's float32 pool stays whatever this says.
    state_dtype: str = "int16"
    # Our decode rows inside vLLM's GDN layer (vllm_patch.gdn): SM70_GDN_KERNEL=sm70 or
    # sm70_chunk sets it (sm70ctl/runtime/plugin_config.py); off by default like the setting.
    decode_layer: bool = False
    # Steps with a prefill row in that layer: "fla" (vLLM's path) or "sm70" (our conv1d
    # prefill + chunked prefill; SM70_GDN_KERNEL=sm70_chunk). Read only with decode_layer.
    prefill: str = "fla"

    def __post_init__(self) -> None:
        if self.prefill not in GDN_PREFILLS:
            raise ValueError(f"{ENV_VAR}: gdn.prefill is {self.prefill!r}; choose one of "
                             f"{GDN_PREFILLS} (SM70_GDN_KERNEL=sm70_chunk sets sm70)")


# The MTP draft layer's widths the plugin serves (vllm_patch.quantization.draft_int8); the
# setting also names int4, which `sm70ctl plan --path target` counts but nothing serves.
DRAFT_HEAD_DTYPES = ("int8", "float16")


@dataclass(frozen=True)
class SpecConfig:
    draft_head_dtype: str = "int8"
    draft_cudagraph: bool = True
    ngram_assist: bool = True
    # R7 (spec_decode/accepted_state.py): vLLM 0.22.1 reads a stale GDN state on a decode
    # step without drafts after accepted drafts; false only to reproduce that bug
    settle_accepted_state: bool = True
    # R8 (spec_decode/prefix_state.py): vLLM 0.22.1 reports MTP prefix hits on hybrid models
    # that full attention does not cover; false only to reproduce that bug
    exact_prefix_hits: bool = True
    # R10 (gdn/spec_gates.py): vLLM 0.22.1 hands the speculative rows of a mixed GDN step
    # the gates of the batch's first tokens; false only to reproduce that bug
    gather_spec_gates: bool = True
    ngram_min: int = 2
    ngram_max: int = 8

    def __post_init__(self) -> None:
        if self.draft_head_dtype not in DRAFT_HEAD_DTYPES:
            raise ValueError(
                f"{ENV_VAR}: spec.draft_head_dtype is {self.draft_head_dtype!r} "
                "(SM70_DRAFT_HEAD_DTYPE); the plugin stores the MTP draft layer as int8 or "
                "float16 only (int4 is not implemented)"
            )


@dataclass(frozen=True)
class ClefConfig:
    enabled: bool = False
    dir: str = "~/.cache/sm70ctl/models/clef-correction"
    rank: int = 256
    max_model_len: int = 16384
    max_questions: int = 64


@dataclass(frozen=True)
class LogprobsConfig:
    prompt_chunk: int = 256


@dataclass(frozen=True)
class PluginConfig:
    version: int = VERSION
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    sparse_prefill: SparsePrefillConfig = field(default_factory=SparsePrefillConfig)
    gemm: GemmConfig = field(default_factory=GemmConfig)
    allreduce: AllreduceConfig = field(default_factory=AllreduceConfig)
    gdn: GdnConfig = field(default_factory=GdnConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    clef: ClefConfig = field(default_factory=ClefConfig)
    logprobs: LogprobsConfig = field(default_factory=LogprobsConfig)

    # --- (de)serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PluginConfig:
        """Strict: unknown keys and wrong types raise ValueError naming the field."""
        return _build(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> PluginConfig:
        data = _parse_bounded(text)
        if not isinstance(data, dict):
            raise ValueError(f"{ENV_VAR} must be a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginConfig:
        """The configuration sm70ctl passed; the reference defaults when none was passed."""
        env = os.environ if environ is None else environ
        text = env.get(ENV_VAR)
        return cls() if not text else cls.from_json(text)

    def get(self, dotted: str) -> Any:
        """A field by dotted path, e.g. `gdn.state_dtype`."""
        value: Any = self
        for part in dotted.split("."):
            value = getattr(value, part)
        return value


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}

# The config sm70ctl writes is a few hundred bytes, two levels deep. The bounds keep a
# damaged or hostile value from overflowing the parser's recursion or memory; the plugin
# may not import sm70ctl, so this is its own small copy of the bounded-reader rule.
MAX_JSON_BYTES = 64 * 1024
MAX_JSON_DEPTH = 8


def _parse_bounded(text: str) -> Any:
    if len(text) > MAX_JSON_BYTES:
        raise ValueError(f"{ENV_VAR} is {len(text)} characters long (limit {MAX_JSON_BYTES})")
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                raise ValueError(f"{ENV_VAR} is nested more than {MAX_JSON_DEPTH} levels deep")
        elif ch in "]}":
            depth -= 1

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(text, parse_constant=no_constant)
    except ValueError as exc:  # JSONDecodeError, NaN, a number with thousands of digits
        raise ValueError(f"{ENV_VAR} is not valid JSON: {exc}") from None


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown field(s) {[prefix + u for u in unknown]}")
    kwargs: dict[str, Any] = {}
    for name in known & set(data):
        want = hints[name]
        value = data[name]
        path = prefix + name
        if is_dataclass(want):
            if not isinstance(value, Mapping):
                raise ValueError(f"{ENV_VAR}: {path} must be an object")
            kwargs[name] = _build(want, value, path + ".")
            continue
        ok = (
            isinstance(value, bool)
            if want is bool
            else isinstance(value, (int, float)) and not isinstance(value, bool)
            if want is float
            else isinstance(value, want) and not isinstance(value, bool)
        )
        if not ok:
            raise ValueError(f"{ENV_VAR}: {path} must be {want.__name__}, got {value!r}")
        if want is float and not math.isfinite(value):  # 1e999 parses as inf
            raise ValueError(f"{ENV_VAR}: {path} must be a finite number, got {value!r}")
        kwargs[name] = float(value) if want is float else value
    obj = cls(**kwargs)
    if getattr(obj, "version", VERSION) != VERSION:
        raise ValueError(f"{ENV_VAR}: version {obj.version} is not {VERSION}; rebuild sm70ctl")
    return obj


__all__ = [
    "ENV_VAR",
    "AllreduceConfig",
    "AttentionConfig",
    "ClefConfig",
    "GdnConfig",
    "GemmConfig",
    "LogprobsConfig",
    "MemoryConfig",
    "PluginConfig",
    "SparsePrefillConfig",
    "SpecConfig",
]
