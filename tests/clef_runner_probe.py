"""Runs in the serving venv with vLLM 0.22.1's Python tree first on the path (see
tests/vllm_cpu_tree.py): the Clef runner hook (R6) against vLLM's own classes on the CPU.

Request (JSON file argv[1]) -> result (JSON file argv[2]):
- "install": what `runner_hook.install` does to vLLM's real `GPUModelRunner` (both methods
  wrapped, a second call a no-op, vLLM's parameters kept);
- "cases": for each case, requests (prompt length, computed tokens, scheduled tokens, Clef
  or not, in the order they were added) go into vLLM's real `InputBatch`, which vLLM's own
  `reorder_batch_to_split_decodes_and_prefills` reorders decode-first; query_start_loc is
  built as `_prepare_inputs` builds it; the installed `_preprocess` runs on a stand-in
  runner holding that batch. Reported: the row mask it wrote, the mask expected from the
  reordered layout, whether the reorder moved anything, and the masks two plausible bugs
  would write (insertion order instead of the reordered one; prefill rows only);
- "scoring": a scoring request prefilled in two chunks beside a chat request: the hidden
  rows the installed `_model_forward` hands the store (a stand-in head returns the rows'
  first feature, which the stand-in model sets to the row's prompt position), taken once.
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


class Stop(Exception):
    """Raised by the stand-in scheduler output once vLLM's own `_preprocess` body starts."""


class StopOutput:
    def __getattr__(self, name: str) -> Any:
        raise Stop(name)


def new_batch() -> Any:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch(max_num_reqs=16, max_model_len=4096, max_num_batched_tokens=4096,
                      device=torch.device("cpu"), pin_memory=False, vocab_size=1000,
                      block_sizes=[16], kernel_block_sizes=[16])


def add(ib: Any, requests: dict[str, Any], rid: str, prompt: int, computed: int,
        clef: bool, score: dict[str, Any] | None = None) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    extra: dict[str, Any] | None = None
    if clef:
        extra = {"sm70_clef": 1}
        if score is not None:
            extra["sm70_clef_score"] = score
    sp = SamplingParams(max_tokens=4, extra_args=extra)
    out = list(range(max(0, computed - prompt + 1))) if computed >= prompt else []
    st = CachedRequestState(req_id=rid, prompt_token_ids=list(range(prompt)), mm_features=[],
                            sampling_params=sp, generator=None, block_ids=([],),
                            num_computed_tokens=computed, output_token_ids=out)
    requests[rid] = st
    ib.add_request(st)


def layout(ib: Any, sched: dict[str, int]) -> np.ndarray:
    n = ib.num_reqs
    counts = np.array([sched[r] for r in ib.req_ids[:n]], dtype=np.int32)
    qsl = np.zeros(16 + 1, dtype=np.int32)
    qsl[1: n + 1] = np.cumsum(counts)
    qsl[n + 1:] = qsl[n]
    return qsl


def run_preprocess(runner: Any, padded: int) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    try:
        GPUModelRunner._preprocess(runner, StopOutput(), padded, None)
    except Stop:
        return
    raise AssertionError("vLLM's _preprocess body did not run after the hook")


def mask_of(order: list[str], sched: dict[str, int], flags: dict[str, bool],
            padded: int, prefill_only: dict[str, bool] | None = None) -> list[int]:
    out: list[int] = []
    for r in order:
        on = flags[r] and (prefill_only is None or prefill_only[r])
        out += [1 if on else 0] * sched[r]
    return out + [0] * (padded - len(out))


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills

    from vllm_patch.quantization.clef_correction import ROWS

    ib, requests = new_batch(), {}
    sched: dict[str, int] = {}
    flags: dict[str, bool] = {}
    prefill: dict[str, bool] = {}
    for r in case["requests"]:
        add(ib, requests, r["id"], r["prompt"], r["computed"], r["clef"])
        sched[r["id"]], flags[r["id"]] = r["scheduled"], r["clef"]
        prefill[r["id"]] = r["computed"] < r["prompt"]
    inserted = list(ib.req_ids[: ib.num_reqs])
    so = SimpleNamespace(num_scheduled_tokens=sched, scheduled_spec_decode_tokens={})
    reorder_batch_to_split_decodes_and_prefills(ib, so, decode_threshold=1)
    order = list(ib.req_ids[: ib.num_reqs])
    qsl = layout(ib, sched)
    padded = int(qsl[ib.num_reqs]) + case.get("pad", 0)
    runner = SimpleNamespace(input_batch=ib, requests=requests,
                             query_start_loc=SimpleNamespace(np=qsl),
                             device=torch.device("cpu"))
    run_preprocess(runner, padded)
    got = [int(v) for v in ROWS.mask[:padded]]
    return {"name": case["name"], "inserted": inserted, "order": order,
            "reordered": inserted != order, "padded": padded, "got": got,
            "any_clef": ROWS.any_clef,
            "expected": mask_of(order, sched, flags, padded),
            "bug_insertion_order": mask_of(inserted, sched, flags, padded),
            "bug_prefill_only": mask_of(order, sched, flags, padded, prefill)}


def run_scoring() -> dict[str, Any]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_patch.clef import runner_hook

    positions = [2, 5, 9, 12, 15]
    score = {"key": "k1", "positions": positions, "roles": [0, 1, 1, 0, 1],
             "kinds": [0, 0, 0, 2, 2]}
    runner_hook.SCORES.head = lambda buf, pos, roles, kinds, starts: buf[:, 0].float()
    ib, requests = new_batch(), {}
    add(ib, requests, "chat", 8, 8, False)
    add(ib, requests, "score", 16, 0, True, score)
    steps = []
    for computed, scheduled in ((0, 10), (10, 6)):
        i = ib.req_id_to_index["score"]
        ib.num_computed_tokens_cpu[i] = computed
        sched = {"chat": 1, "score": scheduled}
        qsl = layout(ib, sched)
        n_rows = int(qsl[ib.num_reqs])

        def model(input_ids: Any = None, positions: Any = None, **_kw: Any) -> torch.Tensor:
            return positions.float().view(-1, 1).repeat(1, 4)

        runner = SimpleNamespace(input_batch=ib, requests=requests,
                                 query_start_loc=SimpleNamespace(np=qsl),
                                 device=torch.device("cpu"), model=model)
        run_preprocess(runner, n_rows + 2)
        pending = runner.__dict__.get(runner_hook.PENDING)
        # positions as _prepare_inputs builds them: computed + offset per request's row
        pos = []
        for j, r in enumerate(ib.req_ids[: ib.num_reqs]):
            c = int(ib.num_computed_tokens_cpu[j])
            pos += list(range(c, c + sched[r]))
        pos += [0, 0]
        GPUModelRunner._model_forward(runner, input_ids=None,
                                      positions=torch.tensor(pos), intermediate_tensors=None,
                                      inputs_embeds=None)
        steps.append({"pending_rows": [rows for _s, _i, rows in pending or []],
                      "left_pending": runner_hook.PENDING in runner.__dict__,
                      "partial": list(runner_hook.SCORES.partial)})
    taken = runner_hook.SCORES.take("k1")
    again = runner_hook.SCORES.take("k1")
    return {"steps": steps, "positions": positions, "taken": taken, "again": again}


def run_install() -> dict[str, Any]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_patch.clef import runner_hook

    first = runner_hook.install()
    second = runner_hook.install()
    import inspect

    return {"first": first, "second": second,
            "installed": list(runner_hook.installed_names(GPUModelRunner)),
            "params": list(inspect.signature(
                GPUModelRunner._preprocess.__wrapped__).parameters)}


def main() -> int:
    req = json.loads(Path(sys.argv[1]).read_text())
    res: dict[str, Any] = {"install": run_install()}
    res["cases"] = [run_case(c) for c in req["cases"]]
    res["scoring"] = run_scoring()
    Path(sys.argv[2]).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
