"""One side of the GDN A/B in its own process: vLLM 0.22.1 on the tiny fp16 checkpoint, stock
or with our GDN decode layer (vllm_patch.gdn), in one mode (eager or graphs).

The engine settings, prompts and per-request records are tests/gpu/ab/ab_side.py's
(`engine_kwargs`, `prompts`, `run_phase`, `summarize_model`); both sides load the same fp16
checkpoint, so the only difference is the GDN layer. `--spec ngram` adds n-gram speculative
decoding (the tiny checkpoint has no MTP head): the verification rows then take the GDN
layer's MTP path, a state slot per draft position. The "ours" side is started by
device_gdn.py with VLLM_PLUGINS=sm70 and a plugin config that turns gdn.decode_layer on and
our int8 GEMV off (nothing else of ours runs). It counts our steps on the device
(`layer.count_on_device`), so CUDA-graph replays are counted; the JSON has those counts,
the Python-side route counts, and the class of every GDN layer the model built.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "ab"))

from ab_side import NEW_TOKENS, engine_kwargs, prompts, run_phase, summarize_model  # noqa: E402

SPEC_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2}


def gdn_layer_classes(model: Any) -> dict[str, int]:
    """How many modules of each GDN layer class the model holds."""
    counts: dict[str, int] = {}
    for _, mod in model.named_modules():
        name = type(mod).__name__
        if "GatedDeltaNet" in name:
            key = f"{type(mod).__module__}.{name}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["stock", "ours"], required=True)
    ap.add_argument("--mode", choices=["eager", "graphs"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", default="single,batch4,batch16")
    ap.add_argument("--util", type=float, default=0.05)
    ap.add_argument("--kv-gib", type=float, default=0.5)
    ap.add_argument("--spec", choices=["none", "ngram"], default="none",
                    help="ngram: speculative decoding with 3 n-gram drafts per step, so decode "
                    "steps carry verification rows (a state slot per position)")
    a = ap.parse_args()
    res: dict[str, Any] = {"side": a.side, "mode": a.mode, "model": a.model, "phases": {},
                           "phase_seconds": {}, "error": None}

    def flush() -> None:
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(a.out)

    t0 = time.time()
    layer = None
    try:
        from vllm import LLM, SamplingParams

        if a.side == "ours":
            from vllm_patch.gdn import layer

            layer.count_on_device(True)
        kw = engine_kwargs(a.model, a.mode, 512, max_len=4096, kv_gib=a.kv_gib, util=a.util)
        if a.spec == "ngram":
            kw["speculative_config"] = dict(SPEC_NGRAM)
        res["engine_kwargs"] = kw
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        res["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
        res["model_summary"] = llm.apply_model(summarize_model)[0]
        res["gdn_layer_classes"] = llm.apply_model(gdn_layer_classes)[0]
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        if res["plugin_imported"]:
            from vllm_patch.plugin import registered

            res["plugin"] = {k: str(v) for k, v in registered().items() if k != "config"}
        flush()
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=2, detokenize=False)
        ps = prompts()
        plan = {"single": [[p] for p in ps[:4]], "batch4": [ps[4:8]], "batch16": [ps]}
        for phase in a.phases.split(","):
            t = time.time()
            rows: list[dict[str, Any]] = []
            for batch in plan[phase]:
                rows += run_phase(llm, sp, batch)
            res["phases"][phase] = rows
            res["phase_seconds"][phase] = round(time.time() - t, 2)
            if layer is not None:
                res["gdn_calls"] = dict(layer.CALLS)
                res["gdn_device_calls"] = layer.device_counts()
                res["gdn_unsupported"] = dict(layer.REASONS)
            flush()
    except Exception as exc:  # the driver reports it; keep what ran
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-6000:]
    if layer is not None:
        try:
            res["gdn_calls"] = dict(layer.CALLS)
            res["gdn_device_calls"] = layer.device_counts()
            res["gdn_unsupported"] = dict(layer.REASONS)
        except Exception as exc:  # a dead CUDA context cannot read the counters back
            res["gdn_counts_error"] = f"{type(exc).__name__}: {exc}"
    res["total_s"] = round(time.time() - t0, 1)
    flush()
    return 0 if res["error"] is None else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
