"""The whole stack against stock vLLM 0.22.1 in one A/B: every vLLM-facing piece of ours on at
once, as `sm70ctl serve` will run them, on the tiny checkpoint, CUDA graphs
(FULL_AND_PIECEWISE).

Engines (one process each, in parallel; `ab_side.py` does the work):
- stock: vLLM as released on the fp16 copy: TRITON_ATTN, its GDN, no speculation, no prefix
  caching (the reference output);
- ours_core: our plugin on the int8 copy with our attention backend (CUSTOM), our GDN decode
  layer (plugin config gdn.decode_layer) and prefix caching (align mode);
- ours_full: ours_core plus MTP speculative decoding with 3 draft tokens (the drafter's linear
  layers int8 on our kernels, its attention on our backend).
Phases: single (batch 1), batch16 (8 short + 8 chunked long prompts) and prefix (shared
prefixes ending just before, on and after one and two attention blocks; served from the cache on
our sides). Greedy output must equal the reference within rounding noise (compare.py), the
largest |logprob difference| must stay under MAX_DLOGPROB (so a broken state cannot widen its
own noise bound), and each ours side must show that our pieces ran: its attention layers on
Sm70PagedBackend with our decode op counted on the device (graph replays included), our GDN op
counted, the int8 linear ops called, and for ours_full the drafter's linear layers on our
methods.

    python3 tests/gpu/ab/run_stack.py --out DIR --budget-s N   (after tests/gpu/round_call.py's
    preparation, or standalone with SM70_AB_TINY pointing at a made checkpoint)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import compare_sides  # noqa: E402
from run_ab import side_env  # noqa: E402

MAX_DLOGPROB = 0.1
OURS_BACKEND = "vllm_patch.attention.backend.Sm70PagedBackend"
# float32: the pool vLLM allocates itself (the int16 pool is CPU-proven only)
GDN_ON = json.dumps({"gdn": {"decode_layer": True, "kernel": "sm70", "state_dtype": "float32"}})
COMMON = ["--mode", "graphs", "--phases", "single,batch16,prefix", "--max-batched", "2048",
          "--kv-gib", "1"]
SIDES: dict[str, list[str]] = {
    "stock": ["--side", "stock"],
    "ours_core": ["--side", "ours", "--attention-backend", "CUSTOM", "--prefix-caching",
                  "--plugin-config", GDN_ON],
    "ours_full": ["--side", "ours", "--attention-backend", "CUSTOM", "--prefix-caching",
                  "--plugin-config", GDN_ON, "--spec", "mtp3"],
}


def evidence(side: dict[str, Any], spec: bool) -> dict[str, Any]:
    """What shows that our pieces ran on an ours side (pure; tested on the CPU)."""
    layers = side.get("attention_layers") or {}
    backends = {k.split(":")[0] for k in layers}
    gdn = side.get("gdn_device_calls") or {}
    ops = side.get("sm70_op_calls") or {}
    out = {
        "attention_on_ours": bool(layers) and backends == {OURS_BACKEND},
        "our_decode_ran": (side.get("attention_device_decodes") or 0) > 0,
        "our_gdn_ran": sum(gdn.values()) > 0 if isinstance(gdn, dict) else False,
        "int8_linear_ran": sum(ops.values()) > 0,
        "prefix_caching": bool((side.get("engine_kwargs") or {}).get("enable_prefix_caching")),
    }
    if spec:
        # "ModuleType:MethodType" keys; only the linear layers (not embeddings or the head)
        methods = [k for k in ((side.get("drafter") or {}).get("methods") or {})
                   if k.split(":")[0].endswith("Linear")]
        out["drafter_on_ours"] = bool(methods) and all("Unquantized" not in k for k in methods)
    return out


def verdict(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    res: dict[str, Any] = {"comparisons": {}, "evidence": {}, "errors": {}}
    for name, s in sides.items():
        if s.get("error"):
            res["errors"][name] = s["error"]
    stock = sides.get("stock") or {}
    ok = not stock.get("error") and bool(stock.get("phases"))
    for name in ("ours_core", "ours_full"):
        s = sides.get(name) or {}
        if not stock.get("phases") or not s.get("phases"):
            res["comparisons"][name] = {"passed": False, "why": "a side has no output"}
            ok = False
            continue
        c = compare_sides(stock, s)
        c.pop("phases", None)
        c["dlogprob_capped"] = (c.get("max_abs_dlogprob") or 0.0) <= MAX_DLOGPROB
        c["passed"] = bool(c["passed"] and c["dlogprob_capped"] and not s.get("error"))
        ev = evidence(s, spec=name == "ours_full")
        res["comparisons"][name] = c
        res["evidence"][name] = ev
        ok = ok and c["passed"] and all(ev.values())
    res["passed"] = ok
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=450)
    ap.add_argument("--util", type=float, default=0.04)
    a = ap.parse_args()
    t0 = time.time()
    deadline = t0 + a.budget_s - 10
    a.out.mkdir(parents=True, exist_ok=True)
    tiny = Path(os.environ.get("SM70_AB_TINY", "/tmp/ab/tiny"))
    procs: dict[str, subprocess.Popen] = {}
    for name, args in SIDES.items():
        model = tiny / ("fp16" if name == "stock" else "int8")
        cmd = [sys.executable, str(HERE / "ab_side.py"), *args, *COMMON, "--model", str(model),
               "--util", str(a.util), "--out", str(a.out / f"{name}.json")]
        env = side_env("stock" if name == "stock" else "ours",
                       {"VLLM_CACHE_ROOT": f"/tmp/vc_stack_{name}"})
        log = open(a.out / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       cwd="/tmp")

    def collect() -> dict[str, dict[str, Any]]:
        sides = {}
        for name in procs:
            f = a.out / f"{name}.json"
            try:
                sides[name] = json.loads(f.read_text())
            except (OSError, ValueError):
                sides[name] = {"error": "no output yet"}
        return sides

    def write(final: bool) -> dict[str, Any]:
        sides = collect()
        v = verdict(sides)
        v.update(elapsed_s=round(time.time() - t0, 1), final=final,
                 startup_s={n: s.get("startup_s") for n, s in sides.items()},
                 block_size={n: s.get("block_size") for n, s in sides.items()},
                 spec_metrics=(sides.get("ours_full") or {}).get("spec_metrics"),
                 drafter=(sides.get("ours_full") or {}).get("drafter"),
                 gdn_device_calls={n: s.get("gdn_device_calls") for n, s in sides.items()},
                 attention_device_decodes={n: s.get("attention_device_decodes")
                                           for n, s in sides.items()},
                 tracebacks={n: s["traceback"][-1500:] for n, s in sides.items()
                             if s.get("traceback")})
        (a.out / "summary.json").write_text(json.dumps(v, indent=1))
        return v

    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(5)
        write(final=False)
    for name, p in procs.items():
        if p.poll() is None:
            p.kill()
            p.wait()
            f = a.out / f"{name}.json"
            side = json.loads(f.read_text()) if f.exists() else {}
            side["error"] = side.get("error") or "killed at the budget"
            f.write_text(json.dumps(side))
    v = write(final=True)
    print(json.dumps({k: v[k] for k in ("passed", "errors", "evidence")}, indent=1))
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
