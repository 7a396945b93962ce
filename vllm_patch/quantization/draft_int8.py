"""The MTP draft layer in int8 on our GEMV: SM70_DRAFT_HEAD_DTYPE (`spec.draft_head_dtype`).

The reference checkpoint keeps `mtp.*` 16-bit (its `quantization_config` excludes it), so
`Sm70GptqConfig.get_quant_method` would give the drafter's linear layers vLLM's fp16 method
and cuBLAS. With `spec.draft_head_dtype` int8 they get `DraftInt8LinearMethod` instead: it
creates and loads the fp16 weight exactly like vLLM's unquantized method (so vLLM's loaders
do the tensor-parallel split and fuse q/k/v and gate/up), then after loading quantizes each
layer round-to-nearest to asymmetric int8 with one (scale, zero) per 128 inputs, in the GEMV
layout sm70_gptq repacks GPTQ checkpoints to (qw [N, K] uint8, sz [N, K/128, 2] fp16), and
frees the fp16 copy. `apply` is sm70_gptq's `int8_linear`: the GEMV for 1-8 rows and, above,
the same choice sm70_gptq makes for its own layers on this architecture.

Which layers: vLLM 0.22.1 builds Qwen3.5's drafter (`Qwen3_5MTP`) under the prefix `mtp`
(`mtp.fc`, `mtp.layers.N.self_attn.{qkv,o}_proj`, `mtp.layers.N.mlp.{gate_up,down}_proj`);
only layers whose checkpoint rules leave them fp16 come here (a checkpoint that quantizes
the drafter with GPTQ keeps its own int8). Only a model served by sm70_gptq reaches this:
a 16-bit checkpoint has no quant config of ours and stays on vLLM's path.

int4 is a value of the setting (`sm70ctl plan --path target` counts it) that no code
serves: it is refused, by sm70ctl before vLLM starts and here for a hand-written config.

The decisions and the quantizer import no vLLM (the quantizer imports torch when called),
so CPU tests run them; only `method_for` builds vLLM's class.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm_patch.config import DRAFT_HEAD_DTYPES
from vllm_patch.quantization.rules import QuantConfigError

if TYPE_CHECKING:
    from torch import Tensor

SETTING = "SM70_DRAFT_HEAD_DTYPE"
FIELD = "spec.draft_head_dtype"
SERVED_DTYPES = DRAFT_HEAD_DTYPES
GROUP = 128
# Output rows quantized at once: the fp32 working copies of a slice stay small (the
# reference model's MTP gate_up_proj is 34,816 x 5,120 at TP=1, 0.7 GB in fp32 whole).
SLICE_ROWS = 4096
# Eager calls of the draft layers' apply (not counted while torch.compile traces, nor in
# CUDA-graph replays, which run no Python); the A/B reads them in-process.
CALLS: dict[str, int] = {"apply": 0, "rows": 0}

_lock = threading.Lock()
_configured: list[str] = []
_method_class: list[type] = []


# ---------------------------------------------------------------------- decisions (pure)
def is_draft_layer(prefix: str) -> bool:
    """Whether the vLLM layer `prefix` belongs to the MTP drafter (a dotted component `mtp`:
    vLLM names it `mtp.fc`, `mtp.layers.0.mlp.down_proj`; the target has none)."""
    return "mtp" in prefix.split(".")


def check_dtype(dtype: str) -> str:
    """`dtype` if the plugin serves it as the draft layer's width, else the refusal."""
    if dtype not in SERVED_DTYPES:
        raise QuantConfigError(
            f"{SETTING}={dtype} ({FIELD}): the plugin stores the MTP draft layer as int8 or "
            "float16 only (int4 is not implemented); set int8 or float16"
        )
    return dtype


def draft_int8(dtype: str, prefix: str) -> bool:
    """Whether the fp16 linear layer `prefix` gets the int8 draft method under `dtype`."""
    return check_dtype(dtype) == "int8" and is_draft_layer(prefix)


def check_layer(prefix: str, input_size: int, dtype_name: str) -> None:
    """Refuse a draft layer the int8 path cannot hold, naming the setting and the rule."""
    if dtype_name != "float16":
        raise QuantConfigError(
            f"layer {prefix}: dtype {dtype_name}; the int8 draft layer ({SETTING}=int8) is "
            f"made from float16 weights only (serve float16 or set {SETTING}=float16)"
        )
    if input_size % GROUP:
        raise QuantConfigError(
            f"layer {prefix}: {input_size} input features on this rank is not a multiple of "
            f"{GROUP} ({SETTING}=int8 quantizes whole groups of {GROUP}; set {SETTING}=float16)"
        )


def served_dtype() -> str:
    """The draft width of this process's plugin config (SM70_PLUGIN_CONFIG), read once."""
    with _lock:
        if not _configured:
            from vllm_patch.config import PluginConfig

            _configured.append(check_dtype(PluginConfig.from_env().spec.draft_head_dtype))
        return _configured[0]


# ---------------------------------------------------------------------- the quantizer
def quantize_int8_g128(weight: Tensor, group_size: int = GROUP) -> tuple[Tensor, Tensor]:
    """Round-to-nearest asymmetric int8 of W^T [N, K] with one (scale, zero) per group of
    `group_size` inputs: (qw [N, K] uint8, sz [N, K/G, 2] fp16), the GEMV layout, so
    `reference.dequant_repacked` gives scale * (q - zero).

    Each group's range is widened to include 0 (so 0 is a code: GPTQ's convention), the
    scale is range / 255 rounded to fp16 as stored, and the codes are computed against that
    stored scale, so what the kernel multiplies is what was rounded to. An all-zero group
    gets the smallest positive fp16 scale (codes all equal to the zero)."""
    import torch

    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    w = weight.to(torch.float32).reshape(n, k // group_size, group_size)
    lo = w.amin(dim=-1).clamp(max=0.0)
    hi = w.amax(dim=-1).clamp(min=0.0)
    scale16 = ((hi - lo) / 255.0).clamp(min=2.0**-24).to(torch.float16)
    scale = scale16.to(torch.float32)
    zero = torch.round(-lo / scale).clamp(0, 255)
    q = (torch.round(w / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, 255)
    qw = q.to(torch.uint8).reshape(n, k).contiguous()
    sz = torch.stack([scale16, zero.to(torch.float16)], dim=-1).contiguous()
    return qw, sz


def quantize_sliced(
    weight: Tensor, group_size: int = GROUP, rows: int = SLICE_ROWS
) -> tuple[Tensor, Tensor]:
    """`quantize_int8_g128` over slices of `rows` output rows (rows are independent)."""
    import torch

    n, k = weight.shape
    qw = torch.empty((n, k), dtype=torch.uint8, device=weight.device)
    sz = torch.empty((n, k // group_size, 2), dtype=torch.float16, device=weight.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        qw[r0:r1], sz[r0:r1] = quantize_int8_g128(weight[r0:r1], group_size)
    return qw, sz


def convert_layer(layer: Any) -> None:
    """Replace a loaded layer's fp16 `weight` [N, K] by our int8 tensors: `qweight` (the
    codes; sm70_gptq's name, which vLLM's device probes look for), `sm70_sz`, and
    `sm70_group_size`; the fp16 weight is dropped."""
    import torch

    if "weight" not in layer._parameters and hasattr(layer, "sm70_sz"):
        return  # converted already (a second post-load pass must not fail on it)
    qw, sz = quantize_sliced(layer.weight.data)
    delattr(layer, "weight")
    layer.register_parameter("qweight", torch.nn.Parameter(qw, requires_grad=False))
    layer.register_parameter("sm70_sz", torch.nn.Parameter(sz, requires_grad=False))
    layer.sm70_group_size = GROUP


# ---------------------------------------------------------------------- vLLM's side
def _build_class() -> type:
    import torch
    from vllm.model_executor.layers.linear import (
        UnquantizedLinearMethod,
        register_weight_loader_v2_supported_method,
    )

    from vllm_patch.quantization.sm70_gptq import int8_linear

    class DraftInt8LinearMethod(UnquantizedLinearMethod):
        """fp16 weights loaded as vLLM loads them, served as int8 g128 on our GEMV."""

        def __init__(self, prefix: str) -> None:
            super().__init__()
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
            check_layer(self.prefix, input_size_per_partition,
                        str(params_dtype).removeprefix("torch."))
            super().create_weights(layer, input_size_per_partition, output_partition_sizes,
                                   input_size, output_size, params_dtype, **extra_weight_attrs)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            convert_layer(layer)  # not the base's: on CPU it would repack the fp16 weight

        def apply(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            if not torch.compiler.is_compiling():
                CALLS["apply"] += 1
                CALLS["rows"] += x.numel() // x.shape[-1]
            return int8_linear(x, layer.qweight, layer.sm70_sz, layer.sm70_group_size, bias)

    return register_weight_loader_v2_supported_method(DraftInt8LinearMethod)


def method_for(prefix: str) -> Any:
    """Our int8 method for an fp16 draft layer when the plugin config says int8, else None
    (the caller keeps vLLM's fp16 method)."""
    if not draft_int8(served_dtype(), prefix):
        return None
    with _lock:
        if not _method_class:
            _method_class.append(_build_class())
    return _method_class[0](prefix)
