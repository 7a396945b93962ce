"""vLLM's Qwen3.5 GDN layer with its decode rows on torch.ops.sm70.gdn_* (issue 23).

`Sm70GatedDeltaNet` subclasses vLLM 0.22.1's `QwenGatedDeltaNetAttention` and is registered
with `register_oot` (PluggableLayer swaps the class at construction by name,
vllm/model_executor/custom_op.py), so the projections, the `qwen_gdn_attention_core`
splitting op, the metadata builder, the state pool and the weight loading all stay vLLM's.
It overrides only `_forward_core`: a step of decode rows alone (plain decodes or MTP
verification rows, `routing.route`) runs our causal conv1d update and recurrent update in
place on vLLM's pool; every other step (any prefill, the warm-up run, a layer our kernels do
not cover) goes to vLLM's own `_forward_core` unchanged, i.e. prefill stays on FLA.

The pool, as vLLM 0.22.1 lays it out and our ops read it without a copy: kv_cache[0] is the
conv state [slots, 3 + k, conv_dim] fp16 (SD layout), kv_cache[1] the recurrent state
[slots, HV, 128 (v), 128 (k)] float32; both are strided views into the hybrid pages (slot
stride = page size), which the ops take as given.

`Sm70GatedDeltaNetInt16` (opt-in, proven on the CPU only: int16_pool.py) declares a third
state tensor, so vLLM's pool holds kv_cache[1] as int16 codes and kv_cache[2] as their
float32 row scales [slots, HV, 128]; decode steps hand the scales to our op, steps with a
prefill run vLLM's FLA path on a float32 copy of their slots (int16_scratch.py), and a layer
our ops cannot run is an error (vLLM's kernels cannot read int16) raised while the model is
built, from what the layer declares, so the engine fails at start-up.

CALLS counts each route per Python call (a captured CUDA graph counts once, at capture);
with `count_on_device(True)` our path also bumps a device counter inside the step, so graph
replays are counted too (the A/B reads it to prove our op ran: a silent fallback reads 0).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from vllm_patch.gdn import int16_pool, int16_scratch, routing
from vllm_patch.ops import kernels
from vllm_patch.ops.loader import load_ops

CALLS: dict[str, int] = {}
REASONS: dict[str, str] = {}  # layer prefix -> why our ops do not run it
_DEVICE_SLOTS = (routing.OURS_DECODE, routing.OURS_SPEC)
_device_counts: dict[str, torch.Tensor] = {}
_count_on_device = False
_lock = threading.Lock()


def count_on_device(on: bool) -> None:
    """Also count our steps with a device-side add (seen by CUDA-graph replays)."""
    global _count_on_device
    _count_on_device = on


def device_counts() -> dict[str, int]:
    """Our steps as the device counted them, summed over devices (empty when off)."""
    total = dict.fromkeys(_DEVICE_SLOTS, 0)
    for counts in _device_counts.values():
        for kind, n in zip(_DEVICE_SLOTS, counts.tolist(), strict=True):
            total[kind] += int(n)
    return total if _device_counts else {}


def _counts_for(device: torch.device) -> torch.Tensor | None:
    """The device's counter, made on first use; never inside a graph capture (its zeroing
    would be captured and replayed), so the layer makes it at construction."""
    counts = _device_counts.get(str(device))
    if counts is None and not torch.cuda.is_current_stream_capturing():
        counts = _device_counts[str(device)] = torch.zeros(
            len(_DEVICE_SLOTS), dtype=torch.int64, device=device)
    return counts


def _bump_device(kind: str, device: torch.device) -> None:
    counts = _counts_for(device)
    if counts is not None:
        counts[_DEVICE_SLOTS.index(kind)].add_(1)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Sm70GatedDeltaNet(QwenGatedDeltaNetAttention):
    """QwenGatedDeltaNetAttention whose decode-only steps run on our kernels."""

    # Whether a layer our ops cannot run is refused while the model is built (the int16
    # pool: vLLM's kernels cannot read it) instead of left to vLLM's path.
    sm70_refuses_unsupported = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.sm70_refuses_unsupported:
            # at construction, so the engine fails at start-up, not at its first request
            reason = routing.unsupported_reason(self.sm70_declared_shape())
            if reason is not None:
                raise ValueError(int16_pool.layer_refusal(reason))
        # Load (or build) the ops now, in the worker, before any CUDA-graph capture.
        load_ops()
        if _count_on_device and torch.cuda.is_available():
            _counts_for(torch.device("cuda", torch.cuda.current_device()))
        self._sm70_reason: str | None = None
        self._sm70_checked = False

    def sm70_declared_shape(self) -> routing.LayerShape:
        """The layer as its construction fixes it: activations in the model dtype, the state
        dtypes this class declares (what vLLM allocates the pool with), the parameters'."""
        states = self.get_state_dtype()
        return self._sm70_shape(
            _dtype_name(self.model_config.dtype), _dtype_name(states[0]),
            _dtype_name(states[1]), _dtype_name(states[2]) if len(states) > 2 else None)

    def sm70_layer_shape(self, mixed_qkv: torch.Tensor) -> routing.LayerShape:
        """The layer as a forward sees it (the pool vLLM bound, this step's activations)."""
        conv_state, ssm_state = self.kv_cache[0], self.kv_cache[1]
        scale = self.kv_cache[2] if len(self.kv_cache) > 2 else None
        return self._sm70_shape(
            _dtype_name(mixed_qkv.dtype), _dtype_name(conv_state.dtype),
            _dtype_name(ssm_state.dtype), None if scale is None else _dtype_name(scale.dtype))

    def _sm70_shape(self, activation: str, conv_state: str, ssm_state: str,
                    ssm_scale: str | None) -> routing.LayerShape:
        return routing.LayerShape(
            activation_dtype=activation,
            ssm_state_dtype=ssm_state,
            conv_state_dtype=conv_state,
            a_log_dtype=_dtype_name(self.A_log.dtype),
            dt_bias_dtype=_dtype_name(self.dt_bias.dtype),
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            num_k_heads=self.num_k_heads // self.tp_size,
            num_v_heads=self.num_v_heads // self.tp_size,
            conv_kernel_size=self.conv_kernel_size,
            activation=self.activation,
            conv_state_dim_first=is_conv_state_dim_first(),
            num_spec=self.num_spec,
            ssm_scale_dtype=ssm_scale,
        )

    def _sm70_unsupported(self, mixed_qkv: torch.Tensor) -> str | None:
        if not self._sm70_checked:  # dtypes and shapes are fixed once the pool exists
            self._sm70_reason = routing.unsupported_reason(self.sm70_layer_shape(mixed_qkv))
            self._sm70_checked = True
            if self._sm70_reason is not None:
                REASONS[self.prefix] = self._sm70_reason
        return self._sm70_reason

    def _forward_core(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        core_attn_out: torch.Tensor,
    ) -> None:
        raw = get_forward_context().attn_metadata
        meta = None if raw is None else raw[self.prefix]
        unsupported = None if meta is None else self._sm70_unsupported(mixed_qkv)
        kind = routing.route(meta, unsupported)
        with _lock:
            CALLS[kind] = CALLS.get(kind, 0) + 1
        if kind not in _DEVICE_SLOTS:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        args = routing.decode_args(meta, kind)
        t = args.num_tokens
        conv_state, ssm_state = self.kv_cache[0], self.kv_cache[1]
        state_scale = self.kv_cache[2] if len(self.kv_cache) > 2 else None
        weight = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        qkv = kernels.gdn_conv1d_update(
            mixed_qkv[:t], conv_state, weight, self.conv1d.bias, args.query_start_loc,
            args.state_indices, args.num_accepted, silu=self.activation in routing.SILU_NAMES)
        out = kernels.gdn_recurrent_decode(
            qkv, a[:t], b[:t], self.A_log, self.dt_bias, ssm_state, args.query_start_loc,
            args.state_indices, args.num_accepted, self.num_k_heads // self.tp_size,
            self.head_k_dim**-0.5, state_scale)
        core_attn_out[:t] = out
        if _count_on_device:
            _bump_device(kind, core_attn_out.device)
        return None


class Sm70GatedDeltaNetInt16(Sm70GatedDeltaNet):
    """Sm70GatedDeltaNet on an int16 pool: codes plus float32 row scales (int16_pool.py)."""

    sm70_refuses_unsupported = True

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        conv, temporal = super().get_state_dtype()
        problem = int16_pool.base_dtype_problem(_dtype_name(temporal))
        if problem is not None:
            raise ValueError(problem)
        return conv, torch.int16, torch.float32

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        conv, temporal = super().get_state_shape()
        return int16_pool.state_shapes(conv, temporal)

    def _forward_core(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        core_attn_out: torch.Tensor,
    ) -> None:
        raw = get_forward_context().attn_metadata
        if raw is None:  # warm-up / profile run: vLLM's path touches no state
            return Sm70GatedDeltaNet._forward_core(self, mixed_qkv, b, a, core_attn_out)
        meta = raw[self.prefix]
        # construction refused what the layer declares; this sees the pool vLLM really bound
        unsupported = self._sm70_unsupported(mixed_qkv)
        if unsupported is not None:
            raise RuntimeError(int16_pool.layer_refusal(unsupported))
        kind = routing.route(meta)
        if kind in _DEVICE_SLOTS:
            return Sm70GatedDeltaNet._forward_core(self, mixed_qkv, b, a, core_attn_out)
        if kind == routing.STOCK_MIXED:
            raise RuntimeError(int16_pool.layer_refusal(
                "a step mixes plain decodes and MTP rows (vLLM's builder never makes one)"))
        with _lock:
            CALLS[kind] = CALLS.get(kind, 0) + 1
        if kind == routing.STOCK_EMPTY:
            return None  # no rows: no state to read or write
        pool = self.kv_cache

        def stock(conv: torch.Tensor, state: torch.Tensor, meta_s: Any) -> None:
            # vLLM's _forward_core reads its pool and metadata from these two places
            self.kv_cache, raw[self.prefix] = [conv, state], meta_s
            try:
                QwenGatedDeltaNetAttention._forward_core(self, mixed_qkv, b, a, core_attn_out)
            finally:
                self.kv_cache, raw[self.prefix] = pool, meta

        int16_scratch.run_on_scratch(pool[0], pool[1], pool[2], meta, stock)
        return None


_registered: list[str] = []


def register(int16_state: bool = False) -> str:
    """Install Sm70GatedDeltaNet in place of vLLM's class (once per process); for the int16
    pool, Sm70GatedDeltaNetInt16 and int16_model's class under the architecture's name."""
    cls = Sm70GatedDeltaNetInt16 if int16_state else Sm70GatedDeltaNet
    with _lock:
        if _registered:
            return _registered[0]
        name = QwenGatedDeltaNetAttention.__name__
        current = op_registry_oot.get(name)
        if current is not None and current is not cls:
            msg = f"absent (another out-of-tree {name} is registered: {current.__name__})"
        else:
            if current is None:
                QwenGatedDeltaNetAttention.register_oot(cls)
            msg = f"{name} -> {cls.__module__}.{cls.__name__}"
            if int16_state:
                # the model class sizes the page before any layer exists: both must agree
                from vllm import ModelRegistry

                from vllm_patch.gdn.int16_model import ARCHITECTURE, CLASS_PATH

                ModelRegistry.register_model(ARCHITECTURE, CLASS_PATH)
                msg += f"; int16 state: {ARCHITECTURE} -> {CLASS_PATH}"
        _registered.append(msg)
        return msg
