"""Peak GPU memory of a 32K-token prompt with prompt logprobs, before and after the sliced
prompt-logprobs rebinding (issue 24 item 5; vllm_patch/logprobs, runtime patch R5).

Driver (what tests/gpu/round_call.sh starts): `python3 THIS --out DIR --budget-s N`.
For each checkpoint of the real-shape slice ($SM70_AB_SLICE/{int8,fp16}; int8 first, fp16
only if the budget left allows), two engine processes at once through our plugin
(`side_env("ours")`): `before` with plugin config `logprobs.prompt_chunk` 0 (the rebinding
is not installed: vLLM's own path) and `after` with 256. Each engine process (this file
with `--side`):
  1. starts vLLM eager (engine in-process), max_model_len 33792, 2048-token chunks, an
     explicit small KV cache, gpu_memory_utilization = half of $SM70_GPU_SHARE;
  2. warm-up: a 2100-token prompt with and without prompt logprobs;
  3. `prompt_logprobs`: the 32K prompt, 1 new token, prompt_logprobs=5 (what
     /v1/completions with echo and logprobs asks): its peak, and the logprobs saved as
     flat arrays;
  4. `no_logprobs`: the same prompt without them: the prefill's own peak;
  5. `direct` (after only): the model's own compute_logits on 2047 random hidden rows, all
     at once and sliced: the peak of each and the rounding difference (the logits GEMM at
     another row count), which bounds what the engine comparison may show.
Peaks are torch.cuda.max_memory_allocated in the engine process, reset after start-up and
before each step; reserved bytes and device-wide used bytes (mem_get_info: includes other
processes on a shared GPU) beside them. Every step writes its JSON when it finishes and
records its own exception, so a failure (an OOM of `before` is a finding) keeps the rest.
The driver compares the pair's logprobs (bench/bench_prompt_logprobs.py) and writes
summary.json, the bench JSON and its table under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
PROMPT_LEN = 32768
WARM_LEN = 2100  # one full 2048-token chunk and a short one
MAX_LEN = 33792
MAX_BATCHED = 2048
TOP_K = 5
ROWS_PER_SLICE = 256
KV_GIB = 2.0
TOKEN_CAP = 1024  # prompt ids among the byte and filler tokens of the A/B tokenizer
DIRECT_ROWS = MAX_BATCHED - 1  # the rows a last 2048-token chunk scores
# Seconds a pair needs at least: cold start-up of two eager engines at once plus the
# requests (the A/B harness saw 110-145 s per start-up with four engines at once).
PAIR_MIN_S = 200.0
STOP_MARGIN_S = 20.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOKEN_CAP) for _ in range(n)]


def plugin_config(rows: int) -> str:
    """SM70_PLUGIN_CONFIG for a side: only the prompt-logprobs slice differs (0: off)."""
    return json.dumps({"logprobs": {"prompt_chunk": rows}})


def engine_share(share: float, engines_at_once: int) -> float:
    """gpu_memory_utilization per engine: our share split between the engines running at
    once (vLLM checks at start-up that this much is free)."""
    if not 0 < share <= 1:
        raise ValueError(f"SM70_GPU_SHARE is {share}: must be in (0, 1]")
    return round(share / engines_at_once, 4)


def should_start_pair(index: int, left_s: float, first_pair_s: float | None) -> str | None:
    """Why the pair `index` is skipped with `left_s` seconds left, or None to start it."""
    need = PAIR_MIN_S if first_pair_s is None else max(PAIR_MIN_S, 1.15 * first_pair_s)
    if index > 0 and left_s < need:
        return f"skipped: {left_s:.0f} s left, a pair needs about {need:.0f} s"
    if index == 0 and left_s < 60:
        return f"skipped: {left_s:.0f} s left"
    return None


# --- the engine process ------------------------------------------------------------------


def _mem(torch: Any) -> dict[str, int]:
    free, total = torch.cuda.mem_get_info()
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "memory_allocated": torch.cuda.memory_allocated(),
            "device_used": total - free, "device_total": total}


def _step(res: dict[str, Any], name: str, flush: Callable[[], None], torch: Any,
          fn: Callable[[], dict[str, Any]]) -> bool:
    """Run one measured step: peak stats reset first, figures and any error recorded."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    t = time.time()
    rec: dict[str, Any] = {"start_allocated": start}
    try:
        rec.update(fn())
        torch.cuda.synchronize()
        rec["error"] = None
    except Exception as exc:  # an OOM here is the measurement, not a crash
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
    rec["seconds"] = round(time.time() - t, 2)
    rec.update(_mem(torch))
    rec["peak_over_start"] = rec["max_memory_allocated"] - start
    res["steps"][name] = rec
    flush()
    log(f"{name}: error={rec['error']} peak_over_start={rec['peak_over_start']}")
    return rec["error"] is None


_DIRECT: dict[str, Any] = {}


def _direct_check(model: Any) -> dict[str, Any]:
    """compute_logits + log-softmax + gather on DIRECT_ROWS random rows with the model's
    own lm_head, all rows at once and in slices: each peak and the largest differences."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    from vllm_patch.logprobs.slices import sliced_prompt_logprobs

    rows, k = _DIRECT["rows"], _DIRECT["k"]
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, _DIRECT["hidden"], generator=g, device=dev, dtype=torch.float16)
    tgt = torch.randint(0, _DIRECT["vocab"], (rows,), generator=g, device=dev,
                        dtype=torch.int64)
    out: dict[str, Any] = {"rows": rows, "k": k, "rows_per_slice": _DIRECT["per_slice"]}
    got = {}
    for name, per in (("all_at_once", rows), ("sliced", _DIRECT["per_slice"])):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        t = time.time()
        with torch.inference_mode():  # as in the engine: no autograd state kept
            res = sliced_prompt_logprobs(h, tgt, k, per, model.compute_logits,
                                         Sampler.compute_logprobs, Sampler.gather_logprobs)
        torch.cuda.synchronize()
        out[name] = {"peak_over_start": torch.cuda.max_memory_allocated() - start,
                     "seconds": round(time.time() - t, 4)}
        got[name] = res
    a, b = got["all_at_once"], got["sliced"]
    out["max_abs_dlogprob"] = float((a[1] - b[1]).abs().max())
    out["logprob_bitwise_equal_fraction"] = float((a[1] == b[1]).float().mean())
    out["id_mismatches"] = int((a[0] != b[0]).sum())
    out["rank_mismatches"] = int((a[2] != b[2]).sum())
    return out


def run_side(a: argparse.Namespace) -> int:
    res: dict[str, Any] = {"side": a.side, "model": a.model, "prompt_chunk": a.rows,
                           "steps": {}, "error": None}

    def flush() -> None:  # atomic: the driver reads it while this process runs
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(a.json)

    t0 = time.time()
    try:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        sys.path.insert(0, str(ROOT / "tests" / "gpu" / "ab"))
        sys.path.insert(0, str(ROOT / "bench"))
        import bench_prompt_logprobs as bench
        from ab_side import engine_kwargs, summarize_model

        kw = engine_kwargs(a.model, "eager", MAX_BATCHED, MAX_LEN, KV_GIB, a.util)
        res["engine_kwargs"] = kw
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        res["startup_memory"] = _mem(torch)  # includes the profile run's peak
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        if res["plugin_imported"]:
            from vllm_patch.plugin import registered

            res["plugin"] = {k: str(v) for k, v in registered().items() if k != "config"}
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        method = GPUModelRunner.__dict__.get("_get_prompt_logprobs_dict")
        res["runner_method"] = getattr(method, "__module__", None)
        if "vllm_patch.logprobs.runner_patch" in sys.modules:
            from vllm_patch.logprobs.runner_patch import outcome

            res["rebinding_outcome"] = outcome()
        res["model_summary"] = llm.apply_model(summarize_model)[0]
        flush()
        log(f"started in {res['startup_s']} s; runner method from {res['runner_method']}")

        def gen(ids: list[int], plp: int | None) -> Any:
            sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                detokenize=False, prompt_logprobs=plp)
            return llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]

        warm = prompt_ids(WARM_LEN, 1)
        _step(res, "warmup", flush, torch,
              lambda: {"with": len(gen(warm, TOP_K).prompt_logprobs or []),
                       "without": len(gen(warm, None).outputs[0].token_ids)})
        ids = prompt_ids(PROMPT_LEN, 2)

        def with_logprobs() -> dict[str, Any]:
            out = gen(ids, TOP_K)
            arrays = bench.arrays_from_prompt_logprobs(ids, out.prompt_logprobs, TOP_K)
            bench.save_arrays(arrays, TOP_K, a.arrays)
            return {"positions": len(arrays["target_lp"]),
                    "first_target_logprobs": arrays["target_lp"][:4],
                    "sampled": list(out.outputs[0].token_ids)}

        # The measurement first (a budget that runs out keeps it), then its baseline.
        _step(res, "prompt_logprobs", flush, torch, with_logprobs)
        _step(res, "no_logprobs", flush, torch,
              lambda: {"new_tokens": len(gen(ids, None).outputs[0].token_ids)})
        if a.direct:
            mc = llm.llm_engine.vllm_config.model_config
            _DIRECT.update(rows=DIRECT_ROWS, k=TOP_K, per_slice=ROWS_PER_SLICE,
                           hidden=mc.get_hidden_size(), vocab=mc.get_vocab_size())
            _step(res, "direct", flush, torch, lambda: llm.apply_model(_direct_check)[0])
    except Exception as exc:  # start-up failed: the driver reports it
        res["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        res["traceback"] = traceback.format_exc()[-6000:]
    res["total_s"] = round(time.time() - t0, 1)
    flush()
    return 0 if res["error"] is None else 1


# --- the driver --------------------------------------------------------------------------


def run_pair(ckpt: str, model: Path, out: Path, util: float, deadline: float,
             side_env: Callable[..., dict[str, str]]) -> dict[str, Any]:
    """Start `before` and `after` on `model` at once; wait for both or the deadline."""
    procs: dict[str, subprocess.Popen] = {}
    for side, rows in (("before", 0), ("after", ROWS_PER_SLICE)):
        name = f"{ckpt}_{side}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side,
               "--model", str(model), "--rows", str(rows), "--util", str(util),
               "--json", str(out / "sides" / f"{name}.json"),
               "--arrays", str(out / "arrays" / name)]
        if side == "after":
            cmd.append("--direct")
        env = side_env("ours", {"VLLM_CACHE_ROOT": f"/tmp/vc_logprobs_{name}",
                                "SM70_PLUGIN_CONFIG": plugin_config(rows)})
        fh = open(out / "logs" / f"{name}.log", "w")  # noqa: SIM115 (closed by the child's exit)
        procs[side] = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                       cwd=str(ROOT))
        log(f"{name}: started (pid {procs[side].pid})")
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(3)
    rcs: dict[str, Any] = {}
    for side, p in procs.items():
        if p.poll() is None:
            p.kill()
            p.wait()
            rcs[side] = "killed at the budget"
        else:
            rcs[side] = p.returncode
    return rcs


def drive(a: argparse.Namespace) -> int:
    t0 = time.time()
    deadline = t0 + a.budget_s - STOP_MARGIN_S
    out: Path = a.out
    for sub in ("sides", "arrays", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"passed": None, "started": time.strftime("%H:%M:%S"),
                               "budget_s": a.budget_s, "prompt_len": PROMPT_LEN,
                               "max_model_len": MAX_LEN, "max_num_batched_tokens": MAX_BATCHED,
                               "prompt_logprobs": TOP_K, "rows_per_slice": ROWS_PER_SLICE,
                               "pairs": {}, "runs": {}}

    def flush() -> None:
        summary["elapsed_s"] = round(time.time() - t0, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    flush()
    try:
        sys.path.insert(0, str(ROOT / "tests" / "gpu" / "ab"))
        sys.path.insert(0, str(ROOT / "bench"))
        import bench_prompt_logprobs as bench
        from run_ab import side_env

        share = float(os.environ.get("SM70_GPU_SHARE", "0.2"))
        util = engine_share(share, 2)
        summary.update(gpu_share=share, util_per_engine=util)
        slice_dir = Path(os.environ.get("SM70_AB_SLICE", "/tmp/ab/slice"))
        first_s: float | None = None
        for i, ckpt in enumerate(("int8", "fp16")):
            model = slice_dir / ckpt
            if not (model / "config.json").is_file():
                summary["runs"][ckpt] = f"skipped: {model} has no config.json"
                flush()
                continue
            why = should_start_pair(i, deadline - time.time(), first_s)
            if why:
                summary["runs"][ckpt] = why
                flush()
                continue
            t = time.time()
            summary["runs"][ckpt] = run_pair(ckpt, model, out, util, deadline, side_env)
            if first_s is None:
                first_s = time.time() - t
            pair = bench.pair_from_dir(out, ckpt)
            if pair is not None:
                summary["pairs"][ckpt] = pair
            flush()
        if summary["pairs"]:
            summary["table"] = bench.write(out, summary["pairs"])
        summary["headline"] = bench.headline(summary["pairs"])
        summary["passed"] = bench.verdict(summary["pairs"])
    except Exception as exc:  # the driver's own failure: keep what the sides wrote
        summary["error"] = f"{type(exc).__name__}: {exc}"
        summary["traceback"] = traceback.format_exc()[-4000:]
    flush()
    log(f"passed={summary['passed']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="driver: where everything is written")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--side", choices=["before", "after"], help="run one engine process")
    ap.add_argument("--model")
    ap.add_argument("--rows", type=int, default=ROWS_PER_SLICE)
    ap.add_argument("--util", type=float, default=0.1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--arrays", type=Path)
    ap.add_argument("--direct", action="store_true")
    a = ap.parse_args(argv)
    if a.side:
        if not (a.model and a.json and a.arrays):
            ap.error("--side needs --model, --json and --arrays")
        return run_side(a)
    if a.out is None:
        ap.error("--out is required")
    return drive(a)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
