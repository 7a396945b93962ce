"""Runs in the serving venv with vLLM 0.22.1's Python tree first on the path (see
tests/vllm_cpu_tree.py): the sliced prompt logprobs against vLLM's own code on the CPU.

Request (JSON file argv[1]) -> result (JSON file argv[2]):
- "slices": for each case {rows, k, per_slice}, random hidden states and an lm_head weight
  through vLLM's `Sampler.compute_logprobs` / `gather_logprobs`, all rows at once and
  through `sliced_prompt_logprobs`: the largest differences;
- "runner": vLLM's real `GPUModelRunner._get_prompt_logprobs_dict` and the installed
  replacement, each driven on its own fake runner through the same chunked schedule: the
  largest differences of every tensor handed back, and the bookkeeping left behind;
- "install" (first, in a process that has not imported vLLM's runner module): what the
  plugin's `register` reports (deferred), that importing the runner module installs the
  replacement, what `install` says then, and the refusals of foreign targets.
torch.compile is disabled (vLLM compiles its rank count; eager gives the same counts and
the probe runs in seconds on two cores).
"""

from __future__ import annotations

import os

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

VOCAB = 3001  # odd: no slice lines up with a power of two
HIDDEN = 48


def _weights(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=g) * 0.5


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    same_shape = tuple(a.shape) == tuple(b.shape)
    out: dict[str, Any] = {"shape_a": list(a.shape), "shape_b": list(b.shape),
                           "dtype_a": str(a.dtype), "dtype_b": str(b.dtype)}
    if same_shape and a.numel():
        d = (a.double() - b.double()).abs()
        out["max_abs"] = float(d.max())
        out["mismatches"] = int((d > 0).sum())
    else:
        out["max_abs"] = 0.0 if same_shape else None
        out["mismatches"] = 0 if same_shape else None
    return out


def run_slices(cases: list[dict[str, int]]) -> list[dict[str, Any]]:
    from vllm.v1.sample.sampler import Sampler

    from vllm_patch.logprobs.slices import sliced_prompt_logprobs

    w = _weights(1)
    calls: list[int] = []  # rows of each compute_logits call

    def logits_fn(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ w.t()

    results = []
    for i, case in enumerate(cases):
        g = torch.Generator().manual_seed(100 + i)
        n, k, s = case["rows"], case["k"], case["per_slice"]
        hidden = torch.randn(n, HIDDEN, generator=g)
        targets = torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int64)
        ref = Sampler.gather_logprobs(Sampler.compute_logprobs(logits_fn(hidden)), k, targets)
        calls.clear()
        got = sliced_prompt_logprobs(hidden, targets, k, s, logits_fn, Sampler.compute_logprobs,
                                     Sampler.gather_logprobs)
        results.append({**case, "slice_rows": list(calls),
                        "ids": _diff(ref[0], got[0]), "logprobs": _diff(ref[1], got[1]),
                        "ranks": _diff(ref[2], got[2]),
                        "target_column_is_target": bool(
                            (got[0][:, 0].long() == targets).all()) if n else True})
    return results


def _fake_runner(sampler: Any, w: torch.Tensor, prompts: dict[str, list[int] | None],
                 ks: dict[str, int]) -> Any:
    reqs = {r: SimpleNamespace(prompt_token_ids=p, in_progress_prompt_logprobs_cpu=None,
                               num_computed_tokens=0) for r, p in prompts.items()}
    return SimpleNamespace(
        num_prompt_logprobs=dict(ks), requests=reqs, device=torch.device("cpu"),
        input_batch=SimpleNamespace(req_id_to_index={}),
        query_start_loc=SimpleNamespace(np=np.zeros(len(prompts) + 1, dtype=np.int32)),
        model=SimpleNamespace(compute_logits=lambda h: h @ w.t()), sampler=sampler,
        _sync_device=lambda: None)


def run_runner(req: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_patch.logprobs.runner_patch import REPLACES, sliced_method

    current = GPUModelRunner.__dict__["_get_prompt_logprobs_dict"]
    original = getattr(current, REPLACES, current)  # vLLM's own, installed or not
    replacement = sliced_method(req["per_slice"])
    w = _weights(2)
    g = torch.Generator().manual_seed(7)
    lens: dict[str, int] = req["prompt_lens"]  # a length of 0: a prompt given as embeddings
    prompts = {r: (torch.randint(0, VOCAB, (n,), generator=g).tolist() if n else None)
               for r, n in lens.items()}
    hidden = {r: torch.randn(max(n, 1) + 8, HIDDEN, generator=g) for r, n in lens.items()}
    ks: dict[str, int] = req["ks"]
    sides = {"vllm": _fake_runner(Sampler, w, prompts, ks),
             "ours": _fake_runner(Sampler, w, prompts, ks)}
    steps: list[dict[str, int]] = req["schedule"]  # per step: request -> tokens scheduled
    report: list[dict[str, Any]] = []
    for step in steps:
        outs = {}
        for name, rn in sides.items():
            rows, starts, rn.input_batch.req_id_to_index = [], [0], {}
            for j, (r, n) in enumerate(step.items()):
                rn.input_batch.req_id_to_index[r] = j
                c = rn.requests[r].num_computed_tokens
                rows.append(hidden[r][c:c + n])
                starts.append(starts[-1] + n)
            rn.query_start_loc.np[: len(starts)] = starts
            hs = torch.cat(rows) if rows else torch.empty(0, HIDDEN)
            fn = original if name == "vllm" else replacement
            outs[name] = fn(rn, hs, dict(step))
            for r, n in step.items():
                rn.requests[r].num_computed_tokens += n
        row: dict[str, Any] = {"keys_vllm": sorted(outs["vllm"]), "keys_ours": sorted(outs["ours"])}
        for r in sorted(set(outs["vllm"]) & set(outs["ours"])):
            a, b = outs["vllm"][r], outs["ours"][r]
            row[r] = {"ids": _diff(a.logprob_token_ids, b.logprob_token_ids),
                      "logprobs": _diff(a.logprobs, b.logprobs),
                      "ranks": _diff(a.selected_token_ranks, b.selected_token_ranks)}
        report.append(row)
    left = {name: {"num_prompt_logprobs": sorted(rn.num_prompt_logprobs),
                   "in_progress": sorted(r for r, q in rn.requests.items()
                                         if q.in_progress_prompt_logprobs_cpu is not None)}
            for name, rn in sides.items()}
    return {"steps": report, "left": left}


def run_install() -> dict[str, Any]:
    """First in the probe, before anything imports vLLM's runner module: the plugin defers
    the rebinding until that import."""
    import vllm

    from vllm_patch.logprobs import runner_patch as rp

    out: dict[str, Any] = {"version": vllm.__version__,
                           "runner_loaded_before": rp.RUNNER_MODULE in sys.modules}
    os.environ["SM70_PLUGIN_CONFIG"] = json.dumps({"logprobs": {"prompt_chunk": 128}})
    from vllm_patch.plugin import register

    out["plugin"] = register().get("prompt_logprobs")
    out["outcome_before_import"] = rp.outcome()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    now = GPUModelRunner.__dict__["_get_prompt_logprobs_dict"]
    out["outcome"] = rp.outcome()
    out["installed_rows"] = getattr(now, rp.MARK, None)
    original = getattr(now, rp.REPLACES)
    out["replaces_vllms"] = original.__module__ == rp.RUNNER_MODULE
    out["again_same"] = rp.install(128)
    try:
        rp.install(64)
        out["again_other"] = None
    except rp.PromptLogprobsPatchError as exc:
        out["again_other"] = str(exc)
    refusals = {}
    for name, func, version in (
        ("execute_model", GPUModelRunner.execute_model, vllm.__version__),
        ("original_on_0.23.0", original, "0.23.0"),
        ("sample_tokens", GPUModelRunner.__dict__.get("sample_tokens"), vllm.__version__),
    ):
        try:
            rp.check_target(func, version)
            refusals[name] = None
        except rp.PromptLogprobsPatchError as exc:
            refusals[name] = str(exc)
    out["refusals"] = refusals

    # A foreign function in the target's place is refused, and stays in place.
    def foreign(self: Any, hidden_states: Any, num_scheduled_tokens: Any) -> dict:
        return {}

    GPUModelRunner._get_prompt_logprobs_dict = foreign
    out["foreign"] = rp.install_or_refuse(128)
    out["foreign_kept"] = GPUModelRunner.__dict__["_get_prompt_logprobs_dict"] is foreign
    GPUModelRunner._get_prompt_logprobs_dict = now
    return out


def main() -> int:
    req = json.loads(Path(sys.argv[1]).read_text())
    result: dict[str, Any] = {}
    if req.get("install"):  # first: nothing has imported vLLM's runner module yet
        result["install"] = run_install()
    if "slices" in req:
        result["slices"] = run_slices(req["slices"])
    if "runner" in req:
        result["runner"] = run_runner(req["runner"])
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
