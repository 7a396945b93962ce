"""CPU probe of R10 (vllm_patch/gdn/spec_gates.py) on vLLM 0.22.1's own GDN layer code, run by
tests/test_spec_gates_vllm.py in the serving venv with the 0.22.1 tree first on the path.

The layer is vLLM's stock QwenGatedDeltaNetAttention (not our subclass) running its own
_forward_core; the step's GDNAttentionMetadata comes from vLLM's GDNAttentionMetadataBuilder
.build on a CommonAttentionMetadata laid out as the model runner lays it out, and sits in a
real ForwardContext. Only the GPU kernels are replaced, by float64 torch references
(vllm_patch.ops.reference_gdn): the conv kernels, fused_post_conv_prep and the chunked prefill
at the layer module's names, and for the speculative recurrence the Triton kernel inside
vLLM's host function fused_sigmoid_gating_delta_rule_update, so that host function (the one
R10 wraps in production) runs for real and reads each token's gates at its row, as the
kernel does.

A mixed n-gram step (a draft-less request, reclassified as a 1-token prefill, beside a
request with 3 drafts, in either order, and one with the drafting request between plain
ones) is compared request by request with each request run alone (a plain decode step; a
speculative step of that request only): outputs and the states it leaves. Stock first, then
with R10 installed by spec_gates.install(), then two mutants of R10.

    python spec_gates_probe.py REQUEST.json RESULT.json   (the request is unused: {})
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

H, HV, D = 2, 4, 32  # key heads, value heads, head dim (one GPU's share; sizes are free)
CONV_DIM = 2 * H * D + HV * D
WIDTH = 4
NUM_SPEC = 3
ROWS = WIDTH - 1 + NUM_SPEC  # conv state rows with 3 drafts
SLOTS = 24
PREFIX = "model.layers.0.linear_attn"

# The step's requests: a draft-less decode (1 token, one slot) and a request with 3 drafts
# (4 tokens, slots of columns 0..3, 2 tokens accepted last step: its state is column 1).
PLAIN = {"kind": "plain", "n": 1, "slots": [7, 0, 0, 0], "seq": 20}
SPEC = {"kind": "spec", "n": 4, "slots": [11, 12, 13, 14], "seq": 33, "acc": 2}
PLAIN2 = {"kind": "plain", "n": 1, "slots": [3, 0, 0, 0], "seq": 9}
PLAIN3 = {"kind": "plain", "n": 1, "slots": [5, 0, 0, 0], "seq": 41}
PLAIN4 = {"kind": "plain", "n": 1, "slots": [9, 0, 0, 0], "seq": 15}
STEPS = {
    "plain_first": [PLAIN, SPEC],  # the spec request's gates shift under stock vLLM
    "spec_first": [SPEC, PLAIN],  # its gates line up by luck of the order
    "spec_between": [PLAIN, PLAIN2, SPEC, PLAIN3, PLAIN4],  # as many plain tokens as spec
}


def next_power_of_2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


class RecurrentKernel:
    """Stands in for fused_sigmoid_gating_delta_rule_update_kernel[grid](...): what the
    Triton kernel computes, on the host function's own arguments (gates read at the row of
    the token, as its pointers do)."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self.calls: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self.launch

    def launch(self, **kw: Any) -> None:
        q, k, v, o = kw["q"], kw["k"], kw["v"], kw["o"]
        assert kw["USE_QK_L2NORM_IN_KERNEL"] and kw["INPLACE_FINAL_STATE"]
        assert kw["ht"] is kw["h0"] and not kw["IS_KDA"]
        t = q.shape[1]
        hv = kw["HV"]
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
        a = kw["a"].reshape(-1, hv)
        b = kw["b"].reshape(-1, hv)
        if a.shape[0] < t or b.shape[0] < t:
            raise IndexError(f"the kernel reads gates of {t} tokens, handed {a.shape[0]}")
        self.calls.append({"tokens": t, "gate_rows": int(a.shape[0]),
                           "spec": kw["num_accepted_tokens"] is not None})
        out = self.ref.gdn_recurrent_reference(
            qkv, a, b, kw["A_log"], kw["dt_bias"], kw["h0"], kw["cu_seqlens"],
            kw["ssm_state_indices"], kw["num_accepted_tokens"], kw["H"], kw["scale"])
        o[0] = out.to(o.dtype)


def install_references(layer_mod: Any, fsg_mod: Any, ref: Any) -> RecurrentKernel:
    """vLLM's GPU kernels replaced by the references (the conv state is handed over as
    (dim, width) views of the SD pool, so the references get it back as (width, dim))."""

    def conv_update(x: Any, conv_state: Any, weight: Any, bias: Any = None,
                    activation: Any = None, conv_state_indices: Any = None,
                    num_accepted_tokens: Any = None, query_start_loc: Any = None,
                    **_: Any) -> Any:
        qsl = (query_start_loc if query_start_loc is not None
               else torch.arange(x.shape[0] + 1, dtype=torch.int32))
        return ref.conv1d_update_reference(x, conv_state.transpose(-1, -2), weight, bias, qsl,
                                           conv_state_indices, num_accepted_tokens,
                                           activation == "silu").to(x.dtype)

    def conv_fn(x: Any, weight: Any, bias: Any, conv_states: Any, query_start_loc: Any,
                cache_indices: Any = None, has_initial_state: Any = None,
                activation: Any = "silu", **_: Any) -> Any:
        out = ref.conv1d_prefill_reference(x.transpose(0, 1), conv_states.transpose(-1, -2),
                                           weight, bias, query_start_loc, cache_indices,
                                           has_initial_state, activation == "silu")
        return out.to(x.dtype).transpose(0, 1)

    def post_conv_prep(conv_output: Any, a: Any, b: Any, A_log: Any, dt_bias: Any,
                       num_k_heads: int, head_k_dim: int, head_v_dim: int,
                       apply_l2norm: bool = True, output_g_exp: bool = False) -> Any:
        assert apply_l2norm and not output_g_exp
        hv = A_log.shape[0]
        q, k, v = ref.split_qkv(conv_output, num_k_heads, hv, head_k_dim, head_v_dim)
        g, beta = ref.gdn_gating(a, b, A_log, dt_bias)
        dt = conv_output.dtype
        return (ref.l2norm(q).to(dt), ref.l2norm(k).to(dt), v.contiguous(), g.float(),
                beta.float())

    layer_mod.causal_conv1d_update = conv_update
    layer_mod.causal_conv1d_fn = conv_fn
    layer_mod.fused_post_conv_prep = post_conv_prep
    layer_mod.is_conv_state_dim_first = lambda: False  # the SD pool the references read
    fsg_mod.triton.next_power_of_2 = next_power_of_2  # the CPU placeholder lacks it
    kernel = RecurrentKernel(ref)
    fsg_mod.fused_sigmoid_gating_delta_rule_update_kernel = kernel
    return kernel


def chunk_reference(ref: Any) -> Callable[..., Any]:
    """The layer's chunk_gated_delta_rule (q, k already normalised, g in log space) token by
    token in float64."""

    def chunk(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any,
              output_final_state: bool, cu_seqlens: Any, chunk_indices: Any = None,
              chunk_offsets: Any = None, use_qk_l2norm_in_kernel: bool = True) -> Any:
        assert output_final_state and not use_qk_l2norm_in_kernel
        group = v.shape[2] // q.shape[2]
        scale = q.shape[-1] ** -0.5
        out = torch.zeros(v.shape[1:], dtype=torch.float64)
        final = torch.empty_like(initial_state)
        starts = cu_seqlens.tolist()
        for n in range(len(starts) - 1):
            h = initial_state[n].double()
            for t in range(starts[n], starts[n + 1]):
                qn = q[0, t].double().repeat_interleave(group, 0) * scale
                kn = k[0, t].double().repeat_interleave(group, 0)
                h, out[t] = ref._delta_step(h, qn, kn, v[0, t], g[0, t].double(),
                                            beta[0, t].double())
            final[n] = h.to(final.dtype)
        return out.to(q.dtype).unsqueeze(0), final

    return chunk


def make_layer(layer_mod: Any, ref: Any, gen: torch.Generator) -> Any:
    cls = layer_mod.QwenGatedDeltaNetAttention
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.prefix = PREFIX
    layer.tp_size = 1
    layer.num_k_heads, layer.num_v_heads = H, HV
    layer.head_k_dim = layer.head_v_dim = D
    layer.key_dim, layer.value_dim = H * D, HV * D
    layer.activation = "silu"
    layer.enable_packed_recurrent_decode = False  # the general path, the one R10 is about
    layer.conv1d = SimpleNamespace(
        weight=(torch.randn(CONV_DIM, 1, WIDTH, generator=gen) * 0.5).half(), bias=None)
    layer.A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1).float()
    layer.dt_bias = (torch.randn(HV, generator=gen) * 0.5).half()
    layer.chunk_gated_delta_rule = chunk_reference(ref)
    conv = torch.randn(SLOTS, ROWS, CONV_DIM, generator=gen).half()
    ssm = torch.randn(SLOTS, HV, D, D, generator=gen) * 0.1
    layer.kv_cache = (conv, ssm)
    return layer


def step_metadata(gdn_attn: Any, backend: Any, reqs: list[dict[str, Any]]) -> Any:
    """vLLM's builder on the step as the model runner hands it over: decodes in batch order,
    block table rows of 1 + num_spec slots (mamba cache mode "none"), -1 draft tokens for a
    request without drafts."""
    lens = [r["n"] for r in reqs]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    m = backend.CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([r["seq"] for r in reqs], dtype=torch.int32),
        num_reqs=len(reqs), num_actual_tokens=sum(lens), max_query_len=max(lens),
        max_seq_len=max(r["seq"] for r in reqs),
        block_table_tensor=torch.tensor([r["slots"] for r in reqs], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(lens), dtype=torch.int64))
    builder = gdn_attn.GDNAttentionMetadataBuilder.__new__(
        gdn_attn.GDNAttentionMetadataBuilder)
    # what __init__ derives from a VllmConfig with 3 speculative tokens, eager (no full
    # CUDA graphs), the Triton prefill backend and mamba cache mode "none"
    builder.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    builder.kv_cache_spec = None
    builder.gdn_prefill_backend = "triton"
    builder.num_spec = NUM_SPEC
    builder.use_spec_decode = True
    builder.use_full_cuda_graph = False
    builder.decode_cudagraph_max_bs = 64
    drafts = torch.tensor([NUM_SPEC if r["kind"] == "spec" else -1 for r in reqs],
                          dtype=torch.int32)
    accepted = torch.tensor([r.get("acc", 1) for r in reqs], dtype=torch.int32)
    return builder.build(0, m, num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=drafts)


def run_step(mods: SimpleNamespace, reqs: list[dict[str, Any]], seed: int
             ) -> tuple[torch.Tensor, Any, Any]:
    """vLLM's _forward_core on this step from the seed's weights and pools: (core_attn_out,
    the layer, the step's metadata). The inputs of request i depend on the seed and the
    request only, so a request has the same q/k/v/gates alone and in any batch."""
    layer = make_layer(mods.layer, mods.ref, torch.Generator().manual_seed(seed))
    rows = []
    for r in reqs:
        g = torch.Generator().manual_seed(seed * 1000 + r["slots"][0])
        rows.append((torch.randn(r["n"], CONV_DIM, generator=g).half(),
                     torch.randn(r["n"], HV, generator=g).half(),
                     (torch.randn(r["n"], HV, generator=g) * 2).half()))
    mixed_qkv = torch.cat([x for x, _, _ in rows])
    b = torch.cat([y for _, y, _ in rows])
    a = torch.cat([z for _, _, z in rows])
    md = step_metadata(mods.gdn_attn, mods.backend, reqs)
    ctx = mods.fc.ForwardContext(no_compile_layers={}, attn_metadata={PREFIX: md},
                                 slot_mapping={})
    core = torch.zeros(mixed_qkv.shape[0], HV, D, dtype=torch.float16)
    with mods.fc.override_forward_context(ctx):
        layer._forward_core(mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core)
    return core, layer, md


def request_view(reqs: list[dict[str, Any]], which: dict[str, Any], core: torch.Tensor,
                 layer: Any) -> dict[str, torch.Tensor]:
    """One request's output rows and the pool slots it owns."""
    pos = 0
    for r in reqs:
        if r is which:
            break
        pos += r["n"]
    slots = [s for s in which["slots"] if s > 0]
    conv, ssm = layer.kv_cache
    return {"out": core[pos:pos + which["n"]].float(), "ssm": ssm[slots].clone(),
            "conv": conv[slots[0]].float()}


def compare(mods: SimpleNamespace, name: str, seed: int) -> dict[str, Any]:
    """Each request of the mixed step against itself alone."""
    reqs = STEPS[name]
    kernel_calls0 = len(mods.kernel.calls)
    core, layer, md = run_step(mods, reqs, seed)
    mixed_calls = mods.kernel.calls[kernel_calls0:]
    res: dict[str, Any] = {
        "meta": {"num_prefills": md.num_prefills, "num_decodes": md.num_decodes,
                 "num_spec_decodes": md.num_spec_decodes,
                 "spec_token_indx": md.spec_token_indx.tolist(),
                 "non_spec_token_indx": md.non_spec_token_indx.tolist()},
        "recurrent_calls": mixed_calls,
    }
    fresh = make_layer(mods.layer, mods.ref, torch.Generator().manual_seed(seed))
    owned = {s for r in reqs for s in r["slots"] if s > 0}
    others = [s for s in range(1, SLOTS) if s not in owned]
    res["other_slots_untouched"] = bool(
        torch.equal(layer.kv_cache[1][others], fresh.kv_cache[1][others])
        and torch.equal(layer.kv_cache[0][others], fresh.kv_cache[0][others]))
    for i, r in enumerate(reqs):
        got = request_view(reqs, r, core, layer)
        alone_core, alone_layer, alone_md = run_step(mods, [r], seed)
        want = request_view([r], r, alone_core, alone_layer)
        path = ("spec" if alone_md.num_spec_decodes else
                "decode" if alone_md.num_decodes else "prefill")
        err = {k: float((got[k].float() - want[k].float()).abs().max()) for k in got}
        key = f"{i}:{r['kind']}"
        res[key] = {
            "alone_path": path,
            "err": err,
            "equal": all(torch.equal(got[k], want[k]) for k in got),
            # a plain request runs as a 1-token prefill in the mixed step and as a decode
            # alone: fp16 rounding of the prefill's normalised q/k is all that may differ
            "close": bool(torch.allclose(got["out"], want["out"], atol=2e-3, rtol=1e-2)
                          and torch.allclose(got["ssm"], want["ssm"], atol=1e-3, rtol=1e-3)
                          and torch.allclose(got["conv"], want["conv"])),
            "state_changed": bool(not torch.equal(
                got["ssm"], fresh.kv_cache[1][[s for s in r["slots"] if s > 0]])),
        }
    return res


def all_steps(mods: SimpleNamespace) -> dict[str, Any]:
    out = {}
    for seed, name in enumerate(STEPS, start=1):
        try:
            out[name] = compare(mods, name, seed)
        except Exception as exc:  # a mutant may hand the kernel too few gates
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def refusal(layer_mod: Any, spec_gates: Any) -> dict[str, Any]:
    """install_or_refuse against a caller that no longer gathers by spec_token_indx."""
    cls = layer_mod.QwenGatedDeltaNetAttention
    saved = cls.__dict__["_forward_core"]
    before = layer_mod.fused_sigmoid_gating_delta_rule_update

    def _forward_core(self: Any, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> Any:
        md = layer_mod.get_forward_context().attn_metadata[self.prefix]
        x = mixed_qkv.index_select(0, md.non_spec_token_indx)
        return layer_mod.fused_sigmoid_gating_delta_rule_update(a=a, b=b, q=x, k=x, v=x)

    cls._forward_core = _forward_core
    try:
        said = spec_gates.install_or_refuse()
    finally:
        cls._forward_core = saved
    return {"said": said,
            "left_alone": layer_mod.fused_sigmoid_gating_delta_rule_update is before}


def main() -> int:
    result: dict[str, Any] = {}
    try:
        import vllm
        import vllm.forward_context as fc
        import vllm.model_executor.layers.fla.ops.fused_sigmoid_gating as fsg_mod
        import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as layer_mod
        import vllm.v1.attention.backend as backend
        import vllm.v1.attention.backends.gdn_attn as gdn_attn

        from vllm_patch.gdn import spec_gates
        from vllm_patch.ops import reference_gdn as ref

        result["vllm"] = vllm.__version__
        stock = layer_mod.fused_sigmoid_gating_delta_rule_update
        kernel = install_references(layer_mod, fsg_mod, ref)
        mods = SimpleNamespace(layer=layer_mod, ref=ref, gdn_attn=gdn_attn, backend=backend,
                               fc=fc, kernel=kernel)
        result["stock"] = all_steps(mods)
        result["refusal"] = refusal(layer_mod, spec_gates)
        result["install"] = spec_gates.install()
        wrapper = layer_mod.fused_sigmoid_gating_delta_rule_update
        result["wraps_vllm"] = getattr(wrapper, "__wrapped__", None) is stock
        counts0 = dict(spec_gates.COUNTS)
        result["r10"] = all_steps(mods)
        result["r10_counts"] = {k: v - counts0[k] for k, v in spec_gates.COUNTS.items()}
        result["install_again"] = spec_gates.install()

        # mutant 1: the speculative call's gates gathered with non_spec_token_indx
        find = spec_gates.find_index
        spec_gates.find_index = lambda md, which, rows: find(
            md, "non_spec" if which == "spec" else "spec", rows)
        try:
            result["mutant_non_spec_index"] = all_steps(mods)
        finally:
            spec_gates.find_index = find

        # mutant 2: a gathered, b left in batch order
        def no_b(**kw: Any) -> Any:
            b_all = kw["b"]
            return spec_gates.wrap(lambda **k2: stock(**{**k2, "b": b_all}))(**kw)

        layer_mod.fused_sigmoid_gating_delta_rule_update = no_b
        try:
            result["mutant_b_ungathered"] = all_steps(mods)
        finally:
            layer_mod.fused_sigmoid_gating_delta_rule_update = wrapper
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(sys.argv[2], "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
