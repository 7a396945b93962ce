"""Runs in the serving venv with vLLM 0.22.1's Python tree first on the path (see
tests/vllm_cpu_tree.py): R7, the accepted-state fix (vllm_patch/spec_decode/
accepted_state.py), against vLLM's own code on the CPU. Driven by tests/test_spec_settle.py.

Request (JSON file argv[1]) -> result (JSON file argv[2]):
- "install": the fix's target check passes on vLLM 0.22.1's real `_prepare_inputs` (its
  parameters and the names its body uses), importing the runner module after the plugin
  armed the fix wraps it, and a second install is a no-op;
- "settle": a stand-in runner whose GDN layers hold CPU state tensors laid out as vLLM's
  (conv (blocks, kernel - 1 + k, dim), temporal (blocks, heads, k, v)), vLLM's real
  `MambaSpec` groups and the real copy-spec functions of Qwen3.5; per case (mode, accepted
  count, drafts this step) what the non-speculative path reads after `settle` (slot `base`,
  conv rows from 0) against what the speculative path would have read for the same state
  (slot `base + a - 1`, conv rows from `a - 1`) before it, and the accepted counts after.
- "front": a folder put first on sys.path (the test's mutated copy of vllm_patch).
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

KERNEL, K = 4, 3  # conv kernel and speculative tokens: conv rows = KERNEL - 1 + K
DIM, HEADS, DK, DV = 8, 2, 4, 4
BLOCKS = 40


class _Buf:
    """vLLM's CpuGpuBuffer as far as the fix uses it (np view + copy_to_gpu)."""

    def __init__(self, n: int) -> None:
        self.np = np.ones(n, dtype=np.int32)
        self.copied: list[int] = []

    def copy_to_gpu(self, n: int | None = None) -> None:
        self.copied.append(-1 if n is None else n)


def _runner(mode: str, reqs: list[tuple[str, list[int], int]], state_idx: dict[str, int]
            ) -> tuple[Any, list[torch.Tensor]]:
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    conv = torch.arange(BLOCKS * (KERNEL - 1 + K) * DIM, dtype=torch.float32).reshape(
        BLOCKS, KERNEL - 1 + K, DIM)
    temporal = torch.arange(BLOCKS * HEADS * DK * DV, dtype=torch.float32).reshape(
        BLOCKS, HEADS, DK, DV) + 1e6
    mamba = MambaSpec(block_size=16, shapes=((KERNEL - 1 + K, DIM), (HEADS, DK, DV)),
                      dtypes=(torch.float32, torch.float32), mamba_cache_mode=mode,
                      num_speculative_blocks=K)
    attn = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,
                             dtype=torch.float16)
    groups = [SimpleNamespace(kv_cache_spec=attn, layer_names=["attn0"]),
              SimpleNamespace(kv_cache_spec=mamba, layer_names=["gdn0"])]
    ctx = {"gdn0": SimpleNamespace(kv_cache=[conv, temporal])}
    n = len(reqs)
    batch = SimpleNamespace(num_reqs=n, req_ids=[r for r, _, _ in reqs] + [None],
                            num_accepted_tokens_cpu=np.array([a for _, _, a in reqs] + [1],
                                                             dtype=np.int32))
    requests = {r: SimpleNamespace(block_ids=([0], blocks)) for r, blocks, _ in reqs}
    model = SimpleNamespace(
        get_mamba_state_copy_func=Qwen3_5ForConditionalGeneration.get_mamba_state_copy_func)
    runner = SimpleNamespace(
        input_batch=batch, cache_config=SimpleNamespace(mamba_cache_mode=mode),
        mamba_state_idx=dict(state_idx), kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        compilation_config=SimpleNamespace(static_forward_context=ctx), model=model,
        requests=requests, num_accepted_tokens=_Buf(n + 1),
        speculative_config=SimpleNamespace(method="ngram"),
        model_config=SimpleNamespace(is_hybrid=True))
    runner.num_accepted_tokens.np[:n] = batch.num_accepted_tokens_cpu[:n]
    return runner, [conv, temporal]


def settle_case(case: dict[str, Any]) -> dict[str, Any]:
    from vllm_patch.spec_decode import accepted_state as st

    mode = case["mode"]
    reqs = [(r["id"], r["blocks"], r["accepted"]) for r in case["reqs"]]
    runner, (conv, temporal) = _runner(mode, reqs, case.get("state_idx", {}))
    base_of = {r: (0 if mode == "none" else case["state_idx"].get(r, 0)) for r, _, _ in reqs}
    # what the speculative path would read for each request's state, before the move
    spec_view = {r: {"temporal": temporal[b[base_of[r] + a - 1]].clone(),
                     "conv": conv[b[base_of[r]], a - 1:a - 1 + KERNEL - 1].clone()}
                 for r, b, a in reqs}
    before = {"conv": conv.clone(), "temporal": temporal.clone()}
    sched = SimpleNamespace(scheduled_spec_decode_tokens={
        r["id"]: [7] * r["drafts"] for r in case["reqs"] if r["drafts"]})
    moved = st.settle(runner, sched)
    out: dict[str, Any] = {"moved": moved, "rows": {}}
    for i, (r, b, _a) in enumerate(reqs):
        slot = b[base_of[r]]
        out["rows"][r] = {
            "accepted_after": int(runner.input_batch.num_accepted_tokens_cpu[i]),
            "gpu_buffer_after": int(runner.num_accepted_tokens.np[i]),
            # the non-speculative path reads slot `base`, conv rows from 0
            "temporal_matches_spec_view": bool(torch.equal(temporal[slot],
                                                           spec_view[r]["temporal"])),
            "conv_matches_spec_view": bool(torch.equal(conv[slot, :KERNEL - 1],
                                                       spec_view[r]["conv"])),
            "untouched": bool(torch.equal(temporal[slot], before["temporal"][slot])
                              and torch.equal(conv[slot], before["conv"][slot])),
        }
    others = [x for x in range(BLOCKS)
              if all(x != b[base_of[r]] for r, b, _ in reqs)]
    out["other_blocks_untouched"] = bool(
        torch.equal(conv[others], before["conv"][others])
        and torch.equal(temporal[others], before["temporal"][others]))
    out["counts"] = runner.__dict__.get(st.COUNTS_ATTR)
    return out


def install_case() -> dict[str, Any]:
    from vllm_patch.config import PluginConfig
    from vllm_patch.spec_decode import accepted_state as st

    got: dict[str, Any] = {}
    os.environ["SM70_PLUGIN_CONFIG"] = json.dumps(PluginConfig().to_dict())
    from vllm_patch import plugin

    got["register"] = plugin.register().get("settle_accepted_state")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner.__dict__["_prepare_inputs"]
    got["wrapped"] = bool(getattr(current, st.MARK, False))
    got["outcome"] = st.outcome()
    got["second"] = st.install()
    original = getattr(current, "__wrapped__", None)
    got["original_checks"] = None
    if original is not None:
        try:
            st.check_target(original, "0.22.1")
            got["original_checks"] = "ok"
        except st.SettlePatchError as exc:
            got["original_checks"] = str(exc)
    return got


def main() -> int:
    request = json.loads(Path(sys.argv[1]).read_text())
    if request.get("front"):
        sys.path.insert(0, request["front"])
    result: dict[str, Any] = {}
    if "install" in request:
        result["install"] = install_case()
    if "settle" in request:
        result["settle"] = [settle_case(c) for c in request["settle"]]
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
