#!/usr/bin/env python3
"""Clef's correction and head on the GPU, at the layer level (issue 25 items 1, 4, 5).

Run by the lead's round call as `python3 tests/gpu/clef/device_clef.py --out DIR
--budget-s N` from the repo root, vLLM 0.22.1 and our ops built (SM70_KERNELS_BUILD_DIR).
No engine is started: each layer is built the way vLLM builds it, by calling the linear
method's create_weights / process_weights_after_loading / apply (sm70_gptq for int8
layers, clef_correction's subclass of vLLM's fp16 method for qkv_proj and in_proj_ba), at
Qwen3.8-27B's shapes on one rank of TP=2, random weights, rank-256 corrections attached by
clef_correction.attach_from. vLLM's parameter classes ask the TP group for their rank; with
no engine there is none, so they are told rank 0 of 1 (the base weights are generated at
the per-rank shapes directly; the corrections are sharded by our TP=2 rule).

Steps, each written to DIR/<step>.json as soon as it ends (an exception is recorded and
the next step runs), and DIR/summary.json after each:
- layers: for M = 1, 4, 16, 300 rows in a batch laid out as vLLM lays it (requests one after
  another, some Clef), each arch path of the int8 ops: Clef rows against the merged-weights
  reference, chat rows bit-identical to the same rows of the same batch with no Clef request;
- graphs: a CUDA graph captured on a chat-only batch, replayed after the mask is rewritten
  for a mixed batch (the mask is a device buffer; a replay runs no Python);
- row_parallel: down_proj's two TP=2 ranks on one GPU, partial outputs summed (what the
  all-reduce does) against the unsharded layer;
- loader: a small SM70_CLEF_DIR (tests/clef_fixture.py) checked, its shards attached and
  its head loaded on the GPU;
- head: the scoring head (the reference 111M-parameter config) against the head written
  out in plain PyTorch (head_reference.py, float64) on the same hidden states;
- memory: torch.cuda.memory_allocated before/after attaching all 186 linears' shards at
  TP=2 and TP=1 (one allocation per rank, vllm_patch/clef/arena.py), and after loading
  the head, against `sm70ctl plan`'s figures; the extra peak of one corrected prefill call;
- compile: the layer under torch.compile(fullgraph): the path still chosen at run time.

Tolerance of a Clef row (stated, over the batch's Clef rows):
|y - y64| <= 2 max(max|y16 - y64|, max|y0 - x W^T|) + 2^-10 max|y64|, y64 = x (W + B A)^T in
float64 with W the dequantized int8 weights, y16 the same product with the merged weights
rounded to fp16 (cuBLAS), y0 the layer's own output without the correction: no worse than
twice the larger of the fp16 merged-weights product's error and the kernel's own, plus one
fp16 rounding of the output. A correction not added errs by its own size (~100x more).
Chat rows: equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
for p in (ROOT, ROOT / "tests", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# `sm70ctl plan`'s figures (tests/test_clef_device_figures.py holds them equal to the plan):
# the correction's one allocation per GPU at rank 256 (TP=2, TP=1) and the head's bound.
PLAN_CORRECTION = {2: 945_815_552, 1: 1_400_897_536}
PLAN_HEAD_BYTES = 256_000_000
RANK = 256
DEV = "cuda"  # a CPU dry run of the script's logic sets "cpu" (with reference kernels)
MS = (1, 4, 16, 300)
# "added": the default (the layer's own kernel, then the correction on Clef's rows);
# "fused": the int8 GEMM with the correction in its launch (clef_correction.configure)
MODES = ("added", "fused")
PREFIX = "language_model.model.layers"
# each case: (name, vLLM prefix, int8?, K on the rank, slice output sizes on the rank)
CASES = (
    ("gate_up_proj", f"{PREFIX}.40.mlp.gate_up_proj", True, 5120, (8704, 8704)),
    ("in_proj_qkvz", f"{PREFIX}.40.linear_attn.in_proj_qkvz", True, 5120, (5120, 3072)),
    ("out_proj", f"{PREFIX}.40.linear_attn.out_proj", True, 3072, (5120,)),
    ("qkv_proj_fp16", f"{PREFIX}.43.self_attn.qkv_proj", False, 5120, (6144, 512, 512)),
    ("in_proj_ba_fp16", f"{PREFIX}.40.linear_attn.in_proj_ba", False, 5120, (24, 24)),
)


def batch_layout(m: int) -> tuple[list[int], list[bool]]:
    """query_start_loc and Clef flags of an M-row batch: 1 row, all Clef; else requests of
    M/4 rows (1 each at M=4) alternating chat, Clef, ...; M=300: 100 chat, 50 Clef, 150 chat."""
    if m == 1:
        return [0, 1], [True]
    if m == 300:
        return [0, 100, 150, 300], [False, True, False]
    step = m // 4
    return [0, step, 2 * step, 3 * step, m], [False, True, False, True]


def clef_tolerance(err16: float, err_kernel: float, scale: float) -> float:
    """The bound on a Clef row's error: twice the larger of the fp16 merged-weights
    product's error and the layer kernel's own error without the correction (the M = 1
    GEMV's packed-half partials err more than cuBLAS), plus one fp16 rounding of the
    output (the correction's t = x A^T and its sum are rounded to fp16 once each)."""
    return 2.0 * max(err16, err_kernel) + 2.0**-10 * scale


class Run:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.steps: dict[str, Any] = {}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self, name: str, res: dict[str, Any]) -> None:
        self.steps[name] = res
        (self.out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        self.summary()

    def summary(self) -> None:
        flags = [s.get("passed") for s in self.steps.values()]
        passed = None if any(f is None for f in flags) or not flags else all(flags)
        figures = {n: s.get("figures") for n, s in self.steps.items() if s.get("figures")}
        body = {"passed": passed, "steps": {n: s.get("passed") for n, s in self.steps.items()},
                "figures": figures}
        (self.out / "summary.json").write_text(json.dumps(body, indent=1, default=str))


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ building layers
def setup() -> dict[str, Any]:
    import torch
    import vllm
    import vllm.model_executor.parameter as vparam

    # no engine, so no TP group: the parameter classes see rank 0 of 1
    vparam.get_tensor_model_parallel_rank = lambda: 0
    vparam.get_tensor_model_parallel_world_size = lambda: 1
    from vllm_patch.ops.loader import load_ops
    from vllm_patch.quantization import sm70_gptq

    share = os.environ.get("SM70_GPU_SHARE")
    if share and DEV == "cuda":  # several scripts share the GPU: stay within ours
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(share)))
    load_ops()
    sm70_gptq.configure(8, True)
    sm70_gptq._register_ops()
    return {"torch": torch.__version__, "vllm": vllm.__version__,
            "device": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0))}


def dims() -> Any:
    from clef_fixture import REAL_CONFIG

    from vllm_patch.clef.model_dims import model_dims

    return model_dims(json.loads(REAL_CONFIG.read_text()))


class Factors:
    """Random whole (unsharded) A and B per correction name, made on first use (CPU fp16),
    or uninitialised ones for the memory count."""

    def __init__(self, seed: int, random: bool = True) -> None:
        import torch

        from vllm_patch.clef.layout import corrections

        self.shapes = {}
        for c in corrections(dims()):
            self.shapes[c.a_name] = c.a_shape(RANK)
            self.shapes[c.b_name] = c.b_shape(RANK)
        self.gen = torch.Generator().manual_seed(seed)
        self.random = random
        self.cache: dict[str, Any] = {}

    def __call__(self, name: str) -> Any:
        import torch

        if name not in self.cache:
            shape = self.shapes[name]
            if self.random:
                t = (torch.randn(*shape, generator=self.gen) * 0.02).half()
            else:
                t = torch.empty(*shape, dtype=torch.float16)
            if not self.random:
                return t
            self.cache[name] = t
        return self.cache[name]


# the decoder layers of CASES and the row-parallel step: a source's one allocation is sized
# for these (the memory step's for every Clef layer)
CASE_LAYERS = (40, 41, 43)


def source(tp: int, rank: int, fetch: Callable[[str], Any],
           layers: tuple[int, ...] | None = CASE_LAYERS) -> Any:
    from vllm_patch.quantization.clef_correction import ClefSource

    return ClefSource(dims(), tp, rank, fetch, RANK, layers)


def int8_layer(prefix: str, k: int, sizes: tuple[int, ...], gen: Any,
               codes: Any = None) -> tuple[Any, Any, Any]:
    """(method, layer, W^T float32 [N, K] as the kernels dequantize it)."""
    import torch

    from vllm_patch.ops import reference as ref
    from vllm_patch.quantization import sm70_gptq
    from vllm_patch.quantization.rules import LayerScheme

    cfg = sm70_gptq.Sm70GptqConfig.from_config(
        {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False,
         "desc_act": False})
    method = sm70_gptq.Sm70GptqLinearMethod(cfg, LayerScheme(True, 8, 128, False), prefix)
    layer = torch.nn.Module()
    n = sum(sizes)
    method.create_weights(layer, k, list(sizes), k, n, torch.float16,
                          weight_loader=lambda *a, **kw: None)
    dev = torch.device(DEV)
    if codes is None:
        codes = torch.randint(0, 256, (k, n), generator=gen)
    zeros = torch.randint(118, 138, (k // 128, n), generator=gen)
    scales = torch.rand(k // 128, n, generator=gen) * 0.002 + 0.0005
    qweight, qzeros, sc = ref.pack_gptq_int8(codes, zeros, scales, cfg.rules.zero_offset)
    layer.qweight.data = qweight.to(dev)
    layer.qzeros.data = qzeros.to(dev)
    layer.scales.data = sc.to(dev)
    layer.g_idx.data = (torch.arange(k) // 128).to(torch.int32).to(dev)
    method.process_weights_after_loading(layer)
    w_t = ref.dequant_repacked(layer.qweight, layer.sm70_sz, 128)
    return method, layer, w_t


def fp16_layer(prefix: str, k: int, sizes: tuple[int, ...], gen: Any) -> tuple[Any, Any, Any]:
    import torch

    from vllm_patch.quantization import clef_correction

    method = clef_correction.unquantized_method(prefix, True)
    layer = torch.nn.Module()
    n = sum(sizes)
    method.create_weights(layer, k, list(sizes), k, n, torch.float16,
                          weight_loader=lambda *a, **kw: None)
    layer.weight.data = (torch.randn(n, k, generator=gen) * 0.02).half().to(DEV)
    w_t = layer.weight.detach().float().clone()
    method.process_weights_after_loading(layer)
    return method, layer, w_t


def merged_weights(layer: Any, w_t: Any) -> Any:
    from vllm_patch.quantization.clef_correction import factors

    a, b, bounds = factors(layer)
    w = w_t.double().clone()
    for i in range(len(a)):
        w[bounds[2 * i]:bounds[2 * i + 1]] += b[i].double() @ a[i].double()
    return w


def bits_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def forward(method: Any, layer: Any, x: Any, qsl: list[int], flags: list[bool]) -> Any:

    from vllm_patch.quantization.clef_correction import ROWS

    ROWS.set_batch(qsl, flags, x.shape[0], x.device)
    y = method.apply(layer, x)
    sync()
    return y


def check_batch(method: Any, layer: Any, w_t: Any, wm: Any, m: int, gen: Any) -> dict[str, Any]:
    import torch

    qsl, flags = batch_layout(m)
    k = w_t.shape[1]
    x = torch.randn(m, k, generator=gen).half().to(DEV)
    mixed = forward(method, layer, x, qsl, flags)
    chat_only = forward(method, layer, x, qsl, [False] * len(flags))
    clef = torch.zeros(m, dtype=torch.bool, device=x.device)
    for i, f in enumerate(flags):
        if f:
            clef[qsl[i]:qsl[i + 1]] = True
    y64 = x.double() @ wm.t()
    y16 = x @ wm.half().t()
    res: dict[str, Any] = {"m": m, "clef_rows": int(clef.sum()), "finite": bool(
        torch.isfinite(mixed).all())}
    if clef.any():
        scale = y64[clef].abs().max().item()
        err = (mixed[clef].double() - y64[clef]).abs().max().item()
        err16 = (y16[clef].double() - y64[clef]).abs().max().item()
        base = x.double() @ w_t.double().t()
        err_kernel = (chat_only.double() - base).abs().max().item()
        res |= {"clef_err": err, "merged_fp16_err": err16, "kernel_err": err_kernel,
                "scale": scale, "tolerance": clef_tolerance(err16, err_kernel, scale),
                "correction_size": (y64[clef] - base[clef]).abs().max().item()}
        res["clef_ok"] = err <= res["tolerance"]
        # a correction that was never added errs by its own size, far above the tolerance
        res["uncorrected_err"] = (chat_only[clef].double() - y64[clef]).abs().max().item()
    chat = ~clef
    res["chat_rows"] = int(chat.sum())
    res["chat_bit_identical"] = bits_equal(mixed[chat], chat_only[chat]) if chat.any() else None
    res["passed"] = res["finite"] and res.get("clef_ok", True) and res[
        "chat_bit_identical"] is not False
    return res


# ------------------------------------------------------------------ steps
def step_layers(run: Run) -> dict[str, Any]:
    import torch

    from vllm_patch.ops import kernels
    from vllm_patch.quantization import clef_correction

    gen = torch.Generator().manual_seed(1)
    fetch = Factors(2)
    src = source(2, 0, fetch)
    out: dict[str, Any] = {"cases": [], "tolerance_rule": "|y - y64| <= 2 max(max|y16 - y64|, "
                           "max|y0 - x W^T|) + 2^-10 max|y64| on Clef rows; chat rows "
                           "bit-identical"}
    paths = ["native", "sm70"] if torch.cuda.get_device_capability(0)[0] >= 8 else ["native"]
    for name, prefix, int8, k, sizes in CASES:
        if run.left() < 60:
            out["cases"].append({"case": name, "skipped": "budget"})
            continue
        try:
            build = int8_layer if int8 else fp16_layer
            method, layer, w_t = build(prefix, k, sizes, gen)
            ok = clef_correction.attach_from(src, layer, prefix, sum(sizes), k,
                                             torch.device(DEV))
            wm = merged_weights(layer, w_t)
            for mode in (MODES if int8 else ("added",)):
                clef_correction.configure(fused=mode == "fused")
                for arch in (paths if int8 else ["native"]):
                    kernels.set_arch_path(arch)
                    for m in MS if mode == "added" else [m for m in MS if m > 8]:
                        r = check_batch(method, layer, w_t, wm, m, gen)
                        out["cases"].append({"case": name, "mode": mode, "arch": arch,
                                             "attached": ok, **r})
            clef_correction.configure(fused=False)
            kernels.set_arch_path("native")
            if int8:
                out.setdefault("diagnostics", []).append(slicing_diagnostic(name, layer, gen))
            del method, layer, w_t, wm
            torch.cuda.empty_cache()
        except Exception:
            out["cases"].append({"case": name, "passed": False,
                                 "error": traceback.format_exc()[-3000:]})
    done = [c for c in out["cases"] if "skipped" not in c]
    out["passed"] = bool(done) and all(c.get("passed") for c in done) and len(done) == len(
        out["cases"])
    out["figures"] = {
        "worst_clef_err_over_tolerance": max((c["clef_err"] / c["tolerance"] for c in done
                                              if "clef_err" in c), default=None),
        "chat_rows_bit_identical": all(c.get("chat_bit_identical") is not False for c in done),
    }
    return out


def slicing_diagnostic(name: str, layer: Any, gen: Any) -> dict[str, Any]:
    """Where a chat row's bits could change on the fused path (300 rows): the GEMM split
    by slices vs whole, and a zero-masked correction's extra K steps vs none."""
    import torch

    from vllm_patch.ops import kernels
    from vllm_patch.quantization.clef_correction import factors

    a, b, bounds = factors(layer)
    qw, sz = layer.qweight, layer.sm70_sz
    x = torch.randn(300, qw.shape[1], generator=gen).half().to(DEV)
    whole = kernels.int8_gemm(x, qw, sz, 128)
    parts = [kernels.int8_gemm(x, qw[bounds[2 * i]:bounds[2 * i + 1]],
                               sz[bounds[2 * i]:bounds[2 * i + 1]], 128) for i in range(len(a))]
    zero = torch.zeros(300, dtype=torch.uint8, device=x.device)
    masked = [kernels.int8_gemm(x, qw[bounds[2 * i]:bounds[2 * i + 1]],
                                sz[bounds[2 * i]:bounds[2 * i + 1]], 128, None, a[i], b[i], zero)
              for i in range(len(a))]
    return {"case": name,
            "slices_equal_whole": bits_equal(torch.cat(parts, 1), whole),
            "zero_mask_equal_no_correction": all(bits_equal(p, q) for p, q in zip(
                parts, masked, strict=True))}


def step_graphs(run: Run) -> dict[str, Any]:
    import torch

    from vllm_patch.quantization import clef_correction
    from vllm_patch.quantization.clef_correction import ROWS

    gen = torch.Generator().manual_seed(3)
    src = source(2, 0, Factors(4))
    out: dict[str, Any] = {"cases": []}
    for name, prefix, int8, k, sizes in (CASES[0], CASES[3]):
        build = int8_layer if int8 else fp16_layer
        method, layer, w_t = build(prefix, k, sizes, gen)
        clef_correction.attach_from(src, layer, prefix, sum(sizes), k, torch.device(DEV))
        for mode, m in [(md, m) for md in (MODES if int8 else ("added",)) for m in (4, 16, 300)
                        if md == "added" or m > 8]:
            clef_correction.configure(fused=mode == "fused")
            if run.left() < 30:
                out["cases"].append({"case": name, "mode": mode, "m": m, "skipped": "budget"})
                continue
            try:
                qsl, flags = batch_layout(m)
                x = torch.randn(m, k, generator=gen).half().to(DEV)
                eager_mixed = forward(method, layer, x, qsl, flags)
                eager_chat = forward(method, layer, x, qsl, [False] * len(flags))
                # warm the corrected path on a side stream (torch's capture recipe), then
                # capture with the mask saying chat-only
                ROWS.set_batch(qsl, flags, m, x.device)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    method.apply(layer, x)
                torch.cuda.current_stream().wait_stream(s)
                ROWS.set_batch(qsl, [False] * len(flags), m, x.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):  # captured on a chat-only batch
                    y = method.apply(layer, x)
                ROWS.set_batch(qsl, flags, m, x.device)
                g.replay()
                sync()
                replay_mixed = y.clone()
                ROWS.set_batch(qsl, [False] * len(flags), m, x.device)
                g.replay()
                sync()
                r = {"case": name, "mode": mode, "m": m,
                     "replay_mixed_equals_eager_mixed": bits_equal(replay_mixed, eager_mixed),
                     "replay_chat_equals_eager_chat": bits_equal(y, eager_chat)}
                r["passed"] = r["replay_mixed_equals_eager_mixed"] and r[
                    "replay_chat_equals_eager_chat"]
                out["cases"].append(r)
                del g
            except Exception:
                out["cases"].append({"case": name, "mode": mode, "m": m, "passed": False,
                                     "error": traceback.format_exc()[-3000:]})
        clef_correction.configure(fused=False)
        del method, layer, w_t
    done = [c for c in out["cases"] if "skipped" not in c]
    out["passed"] = bool(done) and all(c.get("passed") for c in done) and len(done) == len(
        out["cases"])
    return out


def step_row_parallel(run: Run) -> dict[str, Any]:
    import torch

    from vllm_patch.quantization import clef_correction

    gen = torch.Generator().manual_seed(5)
    fetch = Factors(6)
    prefix, k_full, n = f"{PREFIX}.41.mlp.down_proj", 17408, 5120
    codes = torch.randint(0, 256, (k_full, n), generator=gen)
    half = k_full // 2
    ranks = []
    for r in range(2):
        method, layer, w_t = int8_layer(prefix, half, (n,), gen, codes[r * half:(r + 1) * half])
        clef_correction.attach_from(source(2, r, fetch), layer, prefix, n, half,
                                    torch.device(DEV))
        ranks.append((method, layer, w_t))
    a_full = fetch("layers.41.mlp.down_proj.lora_A").double().to(DEV)
    b_full = fetch("layers.41.mlp.down_proj.lora_B").double().to(DEV)
    w_full = torch.cat([w for _, _, w in ranks], dim=1).double()  # [N, K]
    wm = w_full + b_full @ a_full
    cases = []
    for m in MS:
        qsl, flags = batch_layout(m)
        x = torch.randn(m, k_full, generator=gen).half().to(DEV)
        parts, chat_parts = [], []
        for r, (method, layer, _) in enumerate(ranks):
            xr = x[:, r * half:(r + 1) * half].contiguous()
            parts.append(forward(method, layer, xr, qsl, flags))
            chat_parts.append(forward(method, layer, xr, qsl, [False] * len(flags)))
        summed = (parts[0].float() + parts[1].float()).half()  # the all-reduce's sum
        clef = torch.zeros(m, dtype=torch.bool, device=x.device)
        for i, f in enumerate(flags):
            if f:
                clef[qsl[i]:qsl[i + 1]] = True
        y64 = x.double() @ wm.t()
        y16 = x @ wm.half().t()
        scale = y64[clef].abs().max().item()
        err = (summed[clef].double() - y64[clef]).abs().max().item()
        err16 = (y16[clef].double() - y64[clef]).abs().max().item()
        chat_sum = (chat_parts[0].float() + chat_parts[1].float()).half()
        err_kernel = (chat_sum.double() - x.double() @ w_full.t()).abs().max().item()
        tol = clef_tolerance(err16, err_kernel, scale)
        chat = ~clef
        same = all(bits_equal(p[chat], q[chat]) for p, q in zip(parts, chat_parts, strict=True)
                   ) if chat.any() else None
        cases.append({"m": m, "clef_err": err, "merged_fp16_err": err16, "tolerance": tol,
                      "chat_partials_bit_identical": same,
                      "passed": err <= tol and same is not False})
    return {"cases": cases, "passed": all(c["passed"] for c in cases)}


def step_loader(run: Run) -> dict[str, Any]:
    import shutil

    import torch
    from clef_fixture import TINY_CONFIG, write_clef_dir

    from vllm_patch.clef.errors import ClefError
    from vllm_patch.quantization import clef_correction

    folder = write_clef_dir(run.out / "tmp_clef_dir")
    try:
        res: dict[str, Any] = {}
        for tp in (1, 2):
            for r in range(tp):
                src = clef_correction.source_from_folder(folder, TINY_CONFIG, 8, tp, r)
                layer = torch.nn.Module()
                n = 48 if tp == 2 else 96
                ok = clef_correction.attach_from(src, layer, "model.layers.40.mlp.gate_up_proj",
                                                 n, 32, torch.device(DEV))
                a, b, bounds = clef_correction.factors(layer)
                full_b = src.fetch("layers.40.mlp.up_proj.lora_B")
                want = full_b[r * 24:(r + 1) * 24] if tp == 2 else full_b  # 48 rows whole
                res[f"tp{tp}_rank{r}"] = {
                    "attached": ok, "bounds": bounds, "device": str(a[0].device),
                    "up_proj_B_shard_equal": bool(torch.equal(b[1].cpu(), want))}
        from vllm_patch.clef.head_forward import head_from_folder

        head = head_from_folder(folder, TINY_CONFIG, 8, torch.device(DEV))
        logits = head(torch.randn(16, 32).half().to(DEV), torch.tensor([1, 3, 4]).to(DEV),
                      torch.tensor([0, 1, 1]).to(DEV), torch.tensor([0, 0, 0]).to(DEV),
                      [0, 3])
        res["head_from_folder"] = {"logits": logits.tolist(),
                                   "finite": bool(torch.isfinite(logits).all())}
        try:
            clef_correction.source_from_folder(folder, TINY_CONFIG, 256, 2, 0)
            res["refusal"] = None
        except ClefError as exc:
            res["refusal"] = str(exc)
        res["passed"] = all(v["attached"] and v["up_proj_B_shard_equal"] for k, v in res.items()
                            if k.startswith("tp")) and bool(res["refusal"]) and res[
                                "head_from_folder"]["finite"]
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def head_request(gen: Any, start: int, questions: list[tuple[int, int]]
                 ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Positions, roles, kinds and option-position groups of one rendered schema: per
    question its text's last token, then each option's, a few tokens apart."""
    import torch

    pos, roles, kinds, groups = [], [], [], []
    t = start
    for kind, n_opt in questions:
        t += int(torch.randint(3, 12, (1,), generator=gen))
        pos.append(t)
        roles.append(0)
        kinds.append(kind)
        group = []
        for _ in range(n_opt):
            t += int(torch.randint(1, 5, (1,), generator=gen))
            group.append(len(pos))
            pos.append(t)
            roles.append(1)
            kinds.append(kind)
        groups.append(group)
    return pos, roles, kinds, groups


def step_head(run: Run) -> dict[str, Any]:
    import torch
    from head_reference import reference_logits

    from vllm_patch.clef.head import REFERENCE_HEAD, head_params, head_tensors, parse_head_config
    from vllm_patch.clef.head_forward import ClefHead

    gen = torch.Generator().manual_seed(7)
    cfg = parse_head_config(REFERENCE_HEAD, 5120)
    ts = {}
    for name, shape in head_tensors(cfg).items():
        if "norm" in name:
            ts[name] = (1.0 + 0.1 * torch.randn(*shape, generator=gen)).half()
        elif len(shape) == 2 and "embed" not in name:
            ts[name] = (torch.randn(*shape, generator=gen) / math.sqrt(shape[1])).half()
        else:
            ts[name] = (0.1 * torch.randn(*shape, generator=gen)).half()
    sync()
    before = torch.cuda.memory_allocated()
    head = ClefHead(cfg, ts, torch.device(DEV))
    sync()
    loaded = torch.cuda.memory_allocated() - before
    hidden = torch.randn(3000, 5120, generator=gen).half().to(DEV)
    requests = [[(0, 3), (1, 5), (2, 2)], [(0, 8), (2, 4)] * 3, [(1, 11)] + [(0, 2)] * 10]
    pos, roles, kinds, groups, starts = [], [], [], [], [0]
    for i, qs in enumerate(requests):
        p, r, k, g = head_request(gen, 1000 * i, qs)
        off = len(pos)
        pos += p
        roles += r
        kinds += k
        groups += [([off + j for j in grp], qs[n][0]) for n, grp in enumerate(g)]
        starts.append(len(pos))
    got = head(hidden, torch.tensor(pos).to(DEV), torch.tensor(roles).to(DEV),
               torch.tensor(kinds).to(DEV), starts).cpu().double()
    want = torch.tensor(reference_logits(ts, cfg.blocks, cfg.attention_heads, hidden, pos,
                                         roles, kinds, starts), dtype=torch.float64)
    opt = torch.tensor([j for grp, _ in groups for j in grp])
    logit_err = (got[opt] - want[opt]).abs().max().item()
    logit_scale = want[opt].abs().max().item()
    score_err = 0.0
    for grp, kind in groups:
        idx = torch.tensor(grp)
        if cfg.kinds[kind] == "likelihood":
            s1, s2 = torch.sigmoid(got[idx]), torch.sigmoid(want[idx])
        else:
            s1, s2 = torch.softmax(got[idx], 0), torch.softmax(want[idx], 0)
        score_err = max(score_err, (s1 - s2).abs().max().item())
    params = head_params(cfg)
    res = {"positions": len(pos), "requests": len(requests), "option_logit_err": logit_err,
           "option_logit_scale": logit_scale, "score_err": score_err,
           "tolerance": {"score_err": 5e-3, "logit_err": "2e-2 * max(1, scale)"},
           "memory": {"measured_bytes": loaded, "tensor_bytes": 2 * params,
                      "plan_bound_bytes": PLAN_HEAD_BYTES}}
    res["passed"] = (score_err <= 5e-3 and logit_err <= 2e-2 * max(1.0, logit_scale)
                     and 2 * params <= loaded <= PLAN_HEAD_BYTES)
    res["figures"] = {"head_bytes_measured": loaded, "head_plan_bytes": PLAN_HEAD_BYTES,
                      "score_err": score_err}
    return res


def plan_figures() -> dict[str, Any]:
    """`sm70ctl plan`'s Clef figures computed here when sm70ctl imports on this machine."""
    try:
        from sm70ctl.plan import clef as plan_clef
        from sm70ctl.plan.model_config import builtin_config_path, load_config

        model = load_config(builtin_config_path())
        return {tp: plan_clef.clef_items(model, tp, range(model.num_layers), True, RANK)[0][2]
                for tp in (1, 2)}
    except Exception as exc:  # sm70ctl's dependencies may be absent on the device image
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def step_memory(run: Run) -> dict[str, Any]:
    import torch

    from vllm_patch.clef.arena import shard_sizes
    from vllm_patch.clef.layout import corrections, fused_slices
    from vllm_patch.clef.rows import layer_plan
    from vllm_patch.quantization import clef_correction

    d = dims()
    res: dict[str, Any] = {"plan_here": plan_figures(), "plan_constants": PLAN_CORRECTION}
    for tp in (2, 1):
        src = source(tp, 0, Factors(0, random=False), layers=None)
        mods = []
        sync()
        before = torch.cuda.memory_allocated()
        tensors = 0
        for (layer_i, fused), _group in fused_slices(corrections(d)).items():
            prefix = f"{PREFIX}.{layer_i}.{fused}"
            plans = layer_plan(d, prefix, tp, 0)
            k = sum(hi - lo for lo, hi in plans[0].a_cols)
            mod = torch.nn.Module()
            clef_correction.attach_from(src, mod, prefix, plans[-1].out_hi, k,
                                        torch.device(DEV))
            tensors += 2 * len(plans)
            mods.append(mod)
        sync()
        delta = torch.cuda.memory_allocated() - before
        bufs = [b for mod in mods for b in mod.buffers()]
        held = sum(b.numel() * b.element_size() for b in bufs)
        storages = {b.untyped_storage().data_ptr() for b in bufs}
        want_held = sum(shard_sizes(d, RANK, tp))
        # one allocation per rank, a multiple of 2 MiB: the allocator hands out exactly it
        res[f"tp{tp}"] = {"measured_bytes": delta, "attached_tensor_bytes": held,
                          "format_tensor_bytes": want_held,
                          "plan_bytes": PLAN_CORRECTION[tp], "storages": len(storages),
                          "vllm_layers": len(src.attached), "tensors": tensors,
                          "agree": held == want_held and len(storages) == 1
                          and delta == PLAN_CORRECTION[tp]}
        # `mod` too: the loop variable would keep the last layer, so this rank's whole
        # allocation, alive into the next rank's count
        del mods, bufs, src, mod
        torch.cuda.empty_cache()
    res["transient"] = transient_peak()
    plan_ok = all(res["plan_here"].get(tp, PLAN_CORRECTION[tp]) == PLAN_CORRECTION[tp]
                  for tp in (1, 2))
    res["passed"] = res["tp2"]["agree"] and res["tp1"]["agree"] and plan_ok
    res["figures"] = {"correction_bytes_tp2_measured": res["tp2"]["measured_bytes"],
                      "correction_bytes_tp2_plan": PLAN_CORRECTION[2],
                      "corrected_call_extra_peak_bytes": res["transient"].get("extra_peak_bytes")}
    return res


def transient_peak() -> dict[str, Any]:
    """Extra peak memory of one corrected gate_up_proj call at 2048 rows (the served
    max_num_batched_tokens) over the plain call: per-slice outputs before the cat, x A^T."""
    import torch

    from vllm_patch.quantization import clef_correction

    try:
        gen = torch.Generator().manual_seed(9)
        name, prefix, _, k, sizes = CASES[0]
        method, layer, _ = int8_layer(prefix, k, sizes, gen)
        clef_correction.attach_from(source(2, 0, Factors(10)), layer, prefix, sum(sizes), k,
                                    torch.device(DEV))
        x = torch.randn(2048, k, generator=gen).half().to(DEV)
        peaks = {}
        for label, flags in (("plain", [False, False]), ("added", [False, True]),
                             ("fused", [False, True])):
            clef_correction.configure(fused=label == "fused")
            forward(method, layer, x, [0, 1024, 2048], flags)  # warm
            sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = forward(method, layer, x, [0, 1024, 2048], flags)
            peaks[label] = torch.cuda.max_memory_allocated() - base
            del y
        clef_correction.configure(fused=False)
        return {"rows": 2048, "case": name, "peak_bytes": peaks,
                "extra_peak_bytes": peaks["added"] - peaks["plain"],
                "fused_extra_peak_bytes": peaks["fused"] - peaks["plain"]}
    except Exception:
        return {"error": traceback.format_exc()[-2000:]}


def step_compile(run: Run) -> dict[str, Any]:
    """The layer under torch.compile (fullgraph, as vLLM compiles the model): the ops' fake
    impls trace, the path is still chosen at run time (the mask flips between calls of one
    compiled graph), and chat rows of a mixed batch equal a chat-only batch's bit for bit."""
    import torch

    from vllm_patch.quantization import clef_correction
    from vllm_patch.quantization.clef_correction import ROWS

    gen = torch.Generator().manual_seed(11)
    src = source(2, 0, Factors(12))
    cases = []
    for name, prefix, int8, k, sizes in (CASES[0], CASES[3]):
        try:
            build = int8_layer if int8 else fp16_layer
            method, layer, _ = build(prefix, k, sizes, gen)
            clef_correction.attach_from(src, layer, prefix, sum(sizes), k, torch.device(DEV))

            class Wrap(torch.nn.Module):
                def __init__(self, inner: Any, how: Any) -> None:
                    super().__init__()
                    self.inner, self.how = inner, how

                def forward(self, x: Any) -> Any:
                    return self.how.apply(self.inner, x)

            comp = torch.compile(Wrap(layer, method), fullgraph=True, dynamic=False)
            m = 16
            qsl, flags = batch_layout(m)
            x = torch.randn(m, k, generator=gen).half().to(DEV)
            eager_mixed = forward(method, layer, x, qsl, flags)
            eager_chat = forward(method, layer, x, qsl, [False] * len(flags))
            ROWS.set_batch(qsl, flags, m, x.device)
            y_mixed = comp(x).clone()
            ROWS.set_batch(qsl, [False] * len(flags), m, x.device)
            y_chat = comp(x).clone()
            sync()
            chat = torch.ones(m, dtype=torch.bool, device=x.device)
            for i, f in enumerate(flags):
                if f:
                    chat[qsl[i]:qsl[i + 1]] = False
            scale = eager_mixed.abs().max().item()
            r = {"case": name, "m": m,
                 "mixed_vs_eager": (y_mixed - eager_mixed).abs().max().item(),
                 "chat_vs_eager": (y_chat - eager_chat).abs().max().item(),
                 "clef_rows_vs_chat_only": (y_mixed[~chat] - y_chat[~chat]).abs().max().item(),
                 "chat_rows_bit_identical": bits_equal(y_mixed[chat], y_chat[chat]),
                 "tolerance": 2.0**-10 * scale}
            r["passed"] = (r["mixed_vs_eager"] <= r["tolerance"]
                           and r["chat_vs_eager"] <= r["tolerance"]
                           and r["clef_rows_vs_chat_only"] > 10 * r["tolerance"]
                           and r["chat_rows_bit_identical"])
            cases.append(r)
        except Exception:
            cases.append({"case": name, "passed": False, "error": traceback.format_exc()[-3000:]})
    return {"cases": cases, "passed": all(c["passed"] for c in cases)}


STEPS: tuple[tuple[str, Callable[[Run], dict[str, Any]], float], ...] = (
    # capture and compilation last: a capture that fails can leave the device unusable
    ("layers", step_layers, 120.0),
    ("row_parallel", step_row_parallel, 60.0),
    ("loader", step_loader, 20.0),
    ("head", step_head, 60.0),
    ("memory", step_memory, 60.0),
    ("graphs", step_graphs, 60.0),
    ("compile", step_compile, 120.0),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--steps", default=",".join(s[0] for s in STEPS),
                    help="comma-separated subset of the steps")
    args = ap.parse_args(argv)
    run = Run(args.out, args.budget_s - 15.0)
    # caches that torch.compile and vLLM would write elsewhere go under --out, removed at exit
    scratch = args.out / "scratch"
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                     ("VLLM_CACHE_ROOT", "vllm")):
        os.environ.setdefault(var, str(scratch / sub))
    try:
        return _run_steps(run, args)
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


def _run_steps(run: Run, args: argparse.Namespace) -> int:
    try:
        run.write("env", {"passed": True, **setup(),
                          "env": {k: os.environ.get(k) for k in (
                              "SM70_KERNELS_BUILD_DIR", "TORCH_CUDA_ARCH_LIST",
                              "SM70_GPU_SHARE")}})
    except Exception:
        run.write("env", {"passed": False, "error": traceback.format_exc()[-3000:]})
        return 1
    wanted = set(args.steps.split(","))
    for name, fn, need in STEPS:
        if name not in wanted:
            continue
        if run.left() < need:
            run.write(name, {"passed": None, "skipped": f"budget: {run.left():.0f} s left, "
                             f"the step needs about {need:.0f} s"})
            continue
        t0 = time.monotonic()
        try:
            res = fn(run)
        except Exception:
            res = {"passed": False, "error": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.monotonic() - t0, 1)
        run.write(name, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
