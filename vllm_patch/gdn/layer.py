"""vLLM's Qwen3.5 GDN layer with its decode rows on torch.ops.sm70.gdn_* (issue 23).

`Sm70GatedDeltaNet` subclasses vLLM 0.22.1's `QwenGatedDeltaNetAttention` and is registered
with `register_oot` (PluggableLayer swaps the class at construction by name,
vllm/model_executor/custom_op.py), so the projections, the `qwen_gdn_attention_core`
splitting op, the metadata builder, the state pool and the weight loading all stay vLLM's.
It overrides only `_forward_core`: a step of decode rows alone (plain decodes or MTP
verification rows, `routing.route`) runs our causal conv1d update and recurrent update in
place on vLLM's pool. A step with a prefill row goes to vLLM's own `_forward_core` (FLA)
unless the prefill is ours (`set_prefill("sm70")`: the plugin's gdn.prefill,
SM70_GDN_KERNEL=sm70_chunk); then its prefill rows run our conv1d prefill and chunked
prefill and its decode rows our decode ops (`routing.prefill_plan` says how the step is
split), on the same pool slots vLLM's path reads and writes (the slot per sequence its
builder picked, prefix caching's `align` block included; has_initial_state per row). The
warm-up run and a layer our kernels do not cover stay vLLM's.

The pool, as vLLM 0.22.1 lays it out and our ops read it without a copy: kv_cache[0] is the
conv state [slots, 3 + k, conv_dim] fp16 (SD layout), kv_cache[1] the recurrent state
[slots, HV, 128 (v), 128 (k)] float32; both are strided views into the hybrid pages (slot
stride = page size), which the ops take as given.

`Sm70GatedDeltaNetInt16` (int16_pool.py; run against stock on the H200) declares a third
state tensor, so vLLM's pool holds kv_cache[1] as int16 codes and kv_cache[2] as their
float32 row scales [slots, HV, 128]; decode steps hand the scales to our op, steps with a
prefill run vLLM's FLA path (or, with our prefill on, our prefill ops) on a float32 copy of
their slots (int16_scratch.py), and a layer
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

from vllm_patch.config import GDN_PREFILLS
from vllm_patch.gdn import int16_pool, int16_scratch, routing
from vllm_patch.ops import kernels
from vllm_patch.ops.loader import load_ops

CALLS: dict[str, int] = {}
# per prefill step on our ops: which chunk op ran, and the decode / MTP rows it carried
PREFILL_OPS: dict[str, int] = {}
REASONS: dict[str, str] = {}  # layer prefix -> why our ops do not run it
# prefill steps run eagerly (vLLM captures only decode batches), so CALLS counts each one;
# the device slots are for the decode kinds a CUDA graph replays without Python
_DEVICE_SLOTS = (routing.OURS_DECODE, routing.OURS_SPEC, routing.OURS_PREFILL,
                 routing.OURS_PREFILL_SPEC)
_OURS = _DEVICE_SLOTS
_prefill = "fla"  # the plugin's gdn.prefill (set_prefill)
_device_counts: dict[str, torch.Tensor] = {}
_count_on_device = False
_lock = threading.Lock()


def count_on_device(on: bool) -> None:
    """Also count our steps with a device-side add (seen by CUDA-graph replays)."""
    global _count_on_device
    _count_on_device = on


def _count(table: dict[str, int], key: str, n: int = 1) -> None:
    with _lock:
        table[key] = table.get(key, 0) + n


def set_prefill(prefill: str) -> None:
    """Where steps with a prefill row go: "fla" (vLLM's path) or "sm70" (our ops)."""
    global _prefill
    if prefill not in GDN_PREFILLS:
        raise ValueError(f"gdn.prefill is {prefill!r}; choose one of {GDN_PREFILLS}")
    _prefill = prefill


def prefill_mode() -> str:
    return _prefill


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
    """QwenGatedDeltaNetAttention whose decode steps (and, with gdn.prefill "sm70", prefill
    steps) run on our kernels."""

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
        kind = routing.route(meta, unsupported, _prefill)
        with _lock:
            CALLS[kind] = CALLS.get(kind, 0) + 1
        if kind not in _OURS:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        conv_state, ssm_state = self.kv_cache[0], self.kv_cache[1]
        state_scale = self.kv_cache[2] if len(self.kv_cache) > 2 else None
        if kind in (routing.OURS_DECODE, routing.OURS_SPEC):
            args = routing.decode_args(meta, kind)
            t = args.num_tokens
            core_attn_out[:t] = self._sm70_decode(
                mixed_qkv[:t], a[:t], b[:t], conv_state, ssm_state, state_scale,
                args.query_start_loc, args.state_indices, args.num_accepted)
        else:
            self._sm70_prefill_step(meta, kind, mixed_qkv, b, a, core_attn_out, conv_state,
                                    ssm_state, state_scale)
        if _count_on_device:
            _bump_device(kind, core_attn_out.device)
        return None

    def _sm70_conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))

    def _sm70_decode(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor,
                     state_scale: torch.Tensor | None, query_start_loc: torch.Tensor,
                     state_indices: torch.Tensor, num_accepted: torch.Tensor | None
                     ) -> torch.Tensor:
        """Our conv1d update + recurrent decode of decode rows x [T, D]: out [T, HV, 128]."""
        qkv = kernels.gdn_conv1d_update(
            x, conv_state, self._sm70_conv_weight(), self.conv1d.bias, query_start_loc,
            state_indices, num_accepted, silu=self.activation in routing.SILU_NAMES)
        return kernels.gdn_recurrent_decode(
            qkv, a, b, self.A_log, self.dt_bias, ssm_state, query_start_loc, state_indices,
            num_accepted, self.num_k_heads // self.tp_size, self.head_k_dim**-0.5, state_scale)

    def _sm70_prefill_step(self, meta: Any, kind: str, mixed_qkv: torch.Tensor,
                           b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
                           conv_state: torch.Tensor, ssm_state: torch.Tensor,
                           state_scale: torch.Tensor | None) -> None:
        """A step with prefill rows on our ops (routing.prefill_plan), in place on the pool
        views given (vLLM's, or the int16 layer's float32 scratch)."""
        if state_scale is not None:  # checked before any state is touched
            raise RuntimeError("our chunked prefill takes a float32 state; the int16 layer "
                               "hands it a float32 scratch")
        plan = routing.prefill_plan(meta, kind, getattr(self, "gdn_prefill_backend", "triton"))
        if plan.gathered:
            # MTP rows in the step: vLLM's index tensors say whose tokens. The gates a, b are
            # gathered too (vLLM's own path hands its MTP kernel the step's first tokens'
            # gates, right only while every MTP row precedes every non-spec row)
            spec_tok = meta.spec_token_indx.long()
            ns_tok = meta.non_spec_token_indx.long()
            if plan.num_spec:
                n = plan.num_spec
                out_spec = self._sm70_decode(
                    mixed_qkv.index_select(0, spec_tok), a.index_select(0, spec_tok),
                    b.index_select(0, spec_tok), conv_state, ssm_state, state_scale,
                    meta.spec_query_start_loc[: n + 1], meta.spec_state_indices_tensor[:n],
                    meta.num_accepted_tokens[:n])
                core_attn_out.index_copy_(0, spec_tok, out_spec.to(core_attn_out.dtype))
            x_ns, a_ns, b_ns = (t.index_select(0, ns_tok) for t in (mixed_qkv, a, b))
        else:
            x_ns, a_ns, b_ns = mixed_qkv, a, b
        d = plan.num_decodes
        _count(PREFILL_OPS, "chunk_two_pass" if plan.two_pass else "chunk_one_pass")
        _count(PREFILL_OPS, "decode_rows", d)
        _count(PREFILL_OPS, "mtp_rows", plan.num_spec)
        qsl = meta.non_spec_query_start_loc
        idx = meta.non_spec_state_indices_tensor
        if d:
            core_attn_out[:d] = self._sm70_decode(
                x_ns[:d], a_ns[:d], b_ns[:d], conv_state, ssm_state, state_scale, qsl[: d + 1],
                idx[:d], None)
        p, lo = plan.num_prefills, plan.first_prefill_token
        hi = lo + plan.prefill_tokens
        # the prefill rows' own numbering: sequences from 0, tokens from 0
        qsl_p = (qsl[d: d + p + 1] - lo).to(torch.int32).contiguous()
        idx_p = idx[d: d + p]
        init_p = meta.has_initial_state[d: d + p].contiguous()
        qkv = kernels.gdn_conv1d_prefill(
            x_ns[lo:hi], conv_state, self._sm70_conv_weight(), self.conv1d.bias, qsl_p, idx_p,
            init_p, silu=self.activation in routing.SILU_NAMES)
        h, scale = self.num_k_heads // self.tp_size, self.head_k_dim**-0.5
        if plan.two_pass:
            # the decode rows' chunks (one each) dropped, the sequences renumbered past them
            table = meta.chunk_indices[plan.chunk_rows_skipped:].to(torch.int32, copy=True)
            if d:
                table[:, 0] -= d
            out = kernels.gdn_chunk_prefill_two_pass(
                qkv, a_ns[lo:hi], b_ns[lo:hi], self.A_log, self.dt_bias, ssm_state, qsl_p,
                idx_p, init_p, h, scale, table.contiguous())
        else:
            out = kernels.gdn_chunk_prefill(
                qkv, a_ns[lo:hi], b_ns[lo:hi], self.A_log, self.dt_bias, ssm_state, qsl_p,
                idx_p, init_p, h, scale)
        if plan.gathered:
            core_attn_out.index_copy_(0, ns_tok[lo:hi], out.to(core_attn_out.dtype))
        else:
            core_attn_out[lo:hi] = out


class Sm70GatedDeltaNetInt16(Sm70GatedDeltaNet):
    """Sm70GatedDeltaNet on an int16 pool: codes plus float32 row scales (int16_pool.py)."""

    sm70_refuses_unsupported = True
    _sm70_float32_view = False  # set while vLLM's prefill warm-up runs (below)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        conv, temporal = super().get_state_dtype()
        problem = int16_pool.base_dtype_problem(_dtype_name(temporal))
        if problem is not None:
            raise ValueError(problem)
        if self._sm70_float32_view:
            return conv, torch.float32
        return conv, torch.int16, torch.float32

    def _warmup_prefill_kernels(self, qkv_or_qkvz: torch.Tensor, v_dim: int) -> None:
        # vLLM's warm-up (the profile run, no metadata) unpacks (conv, temporal) from
        # get_state_dtype to make a dummy state for the FLA chunk kernel; every prefill of
        # this layer runs on a float32 scratch of the int16 pool, so float32 is the dtype
        # that warms the kernels the layer will use (the H200 start-up failed on the triple)
        self._sm70_float32_view = True
        try:
            super()._warmup_prefill_kernels(qkv_or_qkvz, v_dim)
        finally:
            self._sm70_float32_view = False

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
        kind = routing.route(meta, None, _prefill)
        if kind in (routing.OURS_DECODE, routing.OURS_SPEC):
            return Sm70GatedDeltaNet._forward_core(self, mixed_qkv, b, a, core_attn_out)
        if kind == routing.STOCK_MIXED:
            raise RuntimeError(int16_pool.layer_refusal(
                "a step mixes plain decodes and MTP rows (vLLM's builder never makes one)"))
        with _lock:
            CALLS[kind] = CALLS.get(kind, 0) + 1
        if kind == routing.STOCK_EMPTY:
            return None  # no rows: no state to read or write
        pool = self.kv_cache
        if kind in (routing.OURS_PREFILL, routing.OURS_PREFILL_SPEC):
            def ours(conv: torch.Tensor, state: torch.Tensor, meta_s: Any) -> None:
                self._sm70_prefill_step(meta_s, kind, mixed_qkv, b, a, core_attn_out, conv,
                                        state, None)

            int16_scratch.run_on_scratch(pool[0], pool[1], pool[2], meta, ours)
            return None

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


def register(int16_state: bool = False, prefill: str = "fla") -> str:
    """Install Sm70GatedDeltaNet in place of vLLM's class (once per process); for the int16
    pool, Sm70GatedDeltaNetInt16 and int16_model's class under the architecture's name;
    `prefill` is the plugin's gdn.prefill (set_prefill)."""
    cls = Sm70GatedDeltaNetInt16 if int16_state else Sm70GatedDeltaNet
    set_prefill(prefill)
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
            msg = f"{name} -> {cls.__module__}.{cls.__name__}; prefill on {prefill}"
            if int16_state:
                # the model class sizes the page before any layer exists: both must agree
                from vllm import ModelRegistry

                from vllm_patch.gdn.int16_model import ARCHITECTURE, CLASS_PATH

                ModelRegistry.register_model(ARCHITECTURE, CLASS_PATH)
                msg += f"; int16 state: {ARCHITECTURE} -> {CLASS_PATH}"
        _registered.append(msg)
        return msg
