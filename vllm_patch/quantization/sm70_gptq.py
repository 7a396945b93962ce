"""The `sm70_gptq` QuantizationConfig and linear method: GPTQ-int8 layers on our kernels.

Imports vLLM and torch; only `vllm_patch.plugin.register()` imports it (lazily), and only
`register()` below touches vLLM's registries. The per-layer decisions are `rules.GptqRules`.

Loading keeps vLLM's own GPTQ parameter classes (qweight / qzeros / scales / g_idx with
the packed and sharded dims AutoGPTQ declares), so vLLM's loaders shard them for TP=2 and
fuse the checkpoint's q/k/v, gate/up, in_proj_qkv/z and in_proj_b/a shards. After loading,
each layer is repacked once into the GEMV layout (qw [N, K] uint8, sz [N, K/G, 2] fp16).
The forward is one opaque custom op (`torch.ops.vllm.sm70_int8_linear`) with a fake impl, so
torch.compile traces through it and the row-count choice (GEMV for 1-8 rows, the int8 GEMM
above) happens at run time, per CUDA-graph capture size.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.parameter import (
    GroupQuantScaleParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)

from vllm_patch.quantization import clef_correction, draft_int8
from vllm_patch.quantization.rules import GptqRules, LayerScheme, QuantConfigError

logger = logging.getLogger("vllm_patch.quantization")

NAME = "sm70_gptq"
PACK = 4  # int8 codes per int32 word
OP = "sm70_int8_linear"
OP_BIAS = "sm70_int8_linear_bias"
# `--quantization` values under which a gptq checkpoint comes to us: none given, the generic
# "gptq" (what sm70ctl passes) or ours. An explicit auto_gptq / marlin choice stays vLLM's.
CLAIMED_USER_VALUES = (None, "gptq", NAME)

# Rows up to which the GEMV serves a call (the plugin config's gemm.gemv_max_rows, <= 8).
_settings: dict[str, Any] = {"gemv_max_rows": 8, "int8_lm_head": True}
# Eager calls per path; CUDA-graph replays do not run Python, so these count eager and
# capture-time calls only (the A/B harness reads them in-process).
CALLS: dict[str, int] = {"gemv": 0, "gemv_chunks": 0, "gemm": 0, "dequant_gemm": 0}

# Rows above gemv_max_rows, by instantiation (the GEMV reads the int8 weights once per call:
# 1 byte per weight; the dequantised path moves 5: read 1 and write 2 for a transient fp16 copy,
# read 2 in cuBLAS's GEMM):
# - Volta (a V100, or set_arch_path("sm70")): the int8 GEMM (int8_gemm_lowrank, m8n8k4) up to
#   INT8_GEMM_MAX_ROWS: it reads the weights once, and below about 256 rows a layer is bound by
#   that read; above, the GEMM is compute-bound and cuBLAS's tensor-core efficiency outweighs
#   the copy (at 125 TFLOP/s and 898 GB/s the copy costs about what the GEMM's own arithmetic
#   does at 256 rows, 14 % at 2,048; the crossover assumes our GEMM at about 40 % of peak,
#   projected, not measured on a V100).
# - sm_80 and newer: m8n8k4 is emulated there (the H200 slice A/B measured the int8 GEMM at
#   15.9x stock's time for an 8K prefill, bench/results/h200_vllm_decode.json), so GEMV slices
#   up to GEMV_CHUNKED_MAX_ROWS (slicing wins up to about 5 slices), cuBLAS on the copy above.
# The copy is transient (at most DEQUANT_SLICE_BYTES), so vLLM's profiling run sees it and the
# memory plan counts it.
GEMV_CHUNKED_MAX_ROWS = 32
INT8_GEMM_MAX_ROWS = 255
# The transient fp16 copy's cap: the largest projection of the model at TP=1 (gate_up_proj,
# 34,816 x 5,120) in fp16 is 356 MB and the lm_head 2.5 GB; 32 MiB slices (3,264 output
# columns at K = 5,120: a 2,048-token chunk still makes 68-GFLOP cuBLAS calls) keep the
# reference model on 2 x 16 GiB cards.
DEQUANT_SLICE_BYTES = 32 << 20
_volta_devices: dict[int, bool] = {}
_register_lock = threading.Lock()


def configure(gemv_max_rows: int, int8_lm_head: bool) -> None:
    if not 1 <= gemv_max_rows <= 8:
        raise QuantConfigError(f"gemm.gemv_max_rows is {gemv_max_rows}; the GEMV takes 1 to 8")
    _settings.update(gemv_max_rows=gemv_max_rows, int8_lm_head=int8_lm_head)


# ---------------------------------------------------------------------- the custom op
def _int8_linear(
    x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int, max_rows: int
) -> torch.Tensor:
    return _run(x, qw, sz, group_size, max_rows, None)


def _int8_linear_bias(
    x: torch.Tensor,
    qw: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    max_rows: int,
    bias: torch.Tensor,
) -> torch.Tensor:
    return _run(x, qw, sz, group_size, max_rows, bias)


def _run(
    x: torch.Tensor,
    qw: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    max_rows: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    from vllm_patch.ops import kernels

    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    # The kernels read rows with 16-byte loads: unit column stride, 8-element row stride.
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, qw.shape[0]))
    if m <= max_rows:
        CALLS["gemv"] += 1
        y = kernels.gptq_gemv(x2, qw, sz, group_size, bias)
    elif _volta_path(x2.device):
        if m <= INT8_GEMM_MAX_ROWS:
            CALLS["gemm"] += 1
            y = kernels.int8_gemm(x2, qw, sz, group_size, bias)
        else:
            CALLS["dequant_gemm"] += 1
            y = _dequant_gemm(x2, qw, sz, group_size, bias)
    elif m <= GEMV_CHUNKED_MAX_ROWS:
        CALLS["gemv_chunks"] += 1
        y = torch.cat([kernels.gptq_gemv(x2[i : i + max_rows], qw, sz, group_size, bias)
                       for i in range(0, m, max_rows)])
    else:
        CALLS["dequant_gemm"] += 1
        y = _dequant_gemm(x2, qw, sz, group_size, bias)
    return y.reshape(*lead, qw.shape[0])


def _volta_path(device: torch.device) -> bool:
    """Whether this device runs the Volta instantiations: compute capability 7.x, or any GPU
    when set_arch_path("sm70") forces them (tests)."""
    from vllm_patch.ops import kernels

    if kernels.arch_path() == "sm70":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _volta_devices:
        _volta_devices[index] = torch.cuda.get_device_capability(index)[0] == 7
    return _volta_devices[index]


def _dequant_gemm(
    x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x W^T (+ bias) through cuBLAS on fp16 copies of at most DEQUANT_SLICE_BYTES of W at a
    time (the lm_head is 2.5 GB in fp16 at TP=1: never whole)."""
    from vllm_patch.ops import kernels

    n, k = qw.shape
    rows = dequant_slice_rows(n, k)
    if rows == n:
        w = kernels.gptq_dequant(qw, sz, group_size, x.new_empty((n, k)))
        return torch.nn.functional.linear(x, w, bias)
    y = x.new_empty((x.shape[0], n))
    w = x.new_empty((rows, k))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        ws = kernels.gptq_dequant(qw[a:b], sz[a:b], group_size, w[: b - a])
        y[:, a:b] = torch.nn.functional.linear(x, ws, None if bias is None else bias[a:b])
    return y


def dequant_slice_rows(n: int, k: int) -> int:
    """Output rows of W dequantised at once: all of them when they fit DEQUANT_SLICE_BYTES,
    else the largest multiple of 64 that does (at least 64)."""
    if n * k * 2 <= DEQUANT_SLICE_BYTES:
        return n
    return max(64, DEQUANT_SLICE_BYTES // (k * 2) // 64 * 64)


def _int8_linear_fake(
    x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int, max_rows: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qw.shape[0]))


def _int8_linear_bias_fake(
    x: torch.Tensor,
    qw: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    max_rows: int,
    bias: torch.Tensor,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qw.shape[0]))


def _register_ops() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, OP):
        direct_register_custom_op(OP, _int8_linear, fake_impl=_int8_linear_fake)
    if not hasattr(torch.ops.vllm, OP_BIAS):
        direct_register_custom_op(OP_BIAS, _int8_linear_bias, fake_impl=_int8_linear_bias_fake)


def int8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias) with W in the GEMV layout, through the registered op."""
    rows = int(_settings["gemv_max_rows"])
    if bias is None:
        return torch.ops.vllm.sm70_int8_linear(x, qw, sz, group_size, rows)
    return torch.ops.vllm.sm70_int8_linear_bias(x, qw, sz, group_size, rows, bias)


# ---------------------------------------------------------------------- linear method
@register_weight_loader_v2_supported_method
class Sm70GptqLinearMethod(LinearMethodBase):
    """GPTQ-int8 g128 weights, loaded as vLLM's GPTQ parameters, run on our GEMV/GEMM."""

    def __init__(self, config: Sm70GptqConfig, scheme: LayerScheme, prefix: str) -> None:
        self.config = config
        self.scheme = scheme
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        g = self.scheme.group_size
        n = sum(output_partition_sizes)
        k = input_size_per_partition
        if params_dtype != torch.float16:
            raise QuantConfigError(
                f"layer {self.prefix}: dtype {params_dtype}; {NAME} serves float16 only"
            )
        if k % g:
            raise QuantConfigError(
                f"layer {self.prefix}: {k} input features on this rank is not a multiple of "
                f"group_size={g} (the tensor-parallel split must keep whole groups)"
            )
        if any(p % PACK for p in output_partition_sizes):
            raise QuantConfigError(
                f"layer {self.prefix}: output shards {output_partition_sizes} are not multiples "
                f"of {PACK} (GPTQ packs {PACK} zeros per int32)"
            )
        loader = extra_weight_attrs.get("weight_loader")
        qweight = PackedvLLMParameter(
            data=torch.empty(k // PACK, n, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=0,
            packed_factor=PACK,
            weight_loader=loader,
        )
        g_idx = RowvLLMParameter(
            data=torch.empty(k, dtype=torch.int32), input_dim=0, weight_loader=loader
        )
        qzeros = PackedvLLMParameter(
            data=torch.empty(k // g, n // PACK, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=1,
            packed_factor=PACK,
            weight_loader=loader,
        )
        scales = GroupQuantScaleParameter(
            data=torch.empty(k // g, n, dtype=params_dtype),
            input_dim=0,
            output_dim=1,
            weight_loader=loader,
        )
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("g_idx", g_idx)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        layer.sm70_group_size = g

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm_patch.quantization.repack import repack_gptq_sliced

        g = layer.sm70_group_size
        # In slices of output columns: the same bytes as reference.repack_gptq_int8 with a
        # bounded transient (the whole-layer version widens every code to int64 at once).
        qw, sz = repack_gptq_sliced(
            layer.qweight.data, layer.qzeros.data, layer.scales.data, g,
            self.config.rules.zero_offset,
        )
        # The GPTQ tensors are dropped; `qweight` stays the name of the int8 codes (LoRA and
        # vLLM's device probes look for it).
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        layer.register_parameter("qweight", torch.nn.Parameter(qw, requires_grad=False))
        layer.register_parameter("sm70_sz", torch.nn.Parameter(sz, requires_grad=False))
        # Clef's correction for this layer's slices (layers 40-63, only with SM70_CLEF on)
        clef_correction.attach(layer, self.prefix, qw.shape[0], qw.shape[1], qw.device)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if clef_correction.is_corrected(layer):
            rows = int(_settings["gemv_max_rows"])
            return clef_correction.int8_linear(layer, x, bias, rows)
        return int8_linear(x, layer.qweight, layer.sm70_sz, layer.sm70_group_size, bias)


# ---------------------------------------------------------------------- the config
class Sm70GptqConfig(QuantizationConfig):
    """GPTQ int8, group 128, asymmetric or symmetric, desc_act false, on sm_70 kernels."""

    def __init__(self, rules: GptqRules) -> None:
        super().__init__()
        self.rules = rules

    def __repr__(self) -> str:
        return (f"Sm70GptqConfig(bits={self.rules.bits}, group_size={self.rules.group_size}, "
                f"sym={self.rules.sym}, dynamic={len(self.rules.dynamic)} rules, "
                f"modules_to_not_convert={len(self.rules.modules_to_not_convert)})")

    @classmethod
    def get_name(cls) -> str:  # vLLM types this as its QuantizationMethods literal
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16]  # V100 has no bf16

    @classmethod
    def get_min_capability(cls) -> int:
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Sm70GptqConfig:
        rules = GptqRules.from_config(config)
        rules.lm_head_scheme()  # refuses a GPTQ-quantized lm_head before any weight loads
        return cls(rules)

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        """Claim gptq checkpoints (plugin configs are probed before vLLM's own)."""
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if method == "gptq" and user_quant in CLAIMED_USER_VALUES:
            return NAME
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        prefixes = getattr(hf_to_vllm_mapper, "orig_to_new_prefix", None) or {}
        self.rules = self.rules.with_mappings(
            prefixes={k: v for k, v in prefixes.items() if isinstance(v, str)}
        )

    def get_quant_method(
        self, layer: torch.nn.Module, prefix: str
    ) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        rules = self.rules.with_mappings(fused=self.packed_modules_mapping)
        scheme = rules.scheme_for(prefix)
        if not scheme.quantized:
            # the MTP drafter's fp16 layers in int8 on our GEMV (SM70_DRAFT_HEAD_DTYPE)
            draft = draft_int8.method_for(prefix)
            if draft is not None:
                return draft
            # qkv_proj and in_proj_ba stay fp16 but carry Clef's correction in layers 40-63
            if clef_correction.corrects(prefix):
                return clef_correction.unquantized_method(prefix, True)
            return UnquantizedLinearMethod()
        return Sm70GptqLinearMethod(self, scheme, prefix)


def register(gemv_max_rows: int = 8, int8_lm_head: bool = True) -> str:
    """Register sm70_gptq, our op and the int8 lm_head with vLLM (idempotent)."""
    configure(gemv_max_rows, int8_lm_head)
    with _register_lock:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        _register_ops()
        if NAME not in QUANTIZATION_METHODS:
            register_quantization_config(NAME)(Sm70GptqConfig)
        from vllm_patch.quantization import lm_head

        head = lm_head.register() if int8_lm_head else "fp16 (gemm.int8_lm_head off)"
    return f"{NAME} (GEMV up to {gemv_max_rows} rows), lm_head {head}"
