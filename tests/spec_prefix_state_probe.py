"""Runs in the serving venv with vLLM 0.22.1's Python tree first on the path (see
tests/vllm_cpu_tree.py): R8, the prefix-hit fix (vllm_patch/spec_decode/prefix_state.py),
against vLLM's own KV cache manager, coordinator and scheduler chunking on the CPU. Driven
by tests/test_spec_prefix_state.py.

Request (JSON file argv[1]) -> result (JSON file argv[2]):
- "config": the plugin configuration (SM70_PLUGIN_CONFIG) `register()` runs with;
- "front": a folder put first on sys.path (the test's mutated copy of vllm_patch);
- "replay": also replay the H200 matrix's first stage (below).
Result: what `register()` reported, whether the coordinator's method is wrapped, and per
scenario (a producer prompt prefilled in the chunks vLLM's align-mode scheduler picks,
then a consumer prompt sharing a prefix with it) the consumer's hit length and the length
of each KV cache group's hit list, before the plugin is registered ("stock") and after.
The replay runs the stage-1 plan of tests/gpu/serving/device_spec_diag.py (the same prompt
token ids, block 528) through the manager with a stand-in of the scheduler's loop (token
budget, FCFS admission that stops at the first request it cannot place, MTP steps of 1 + k
tokens with every draft rejected as on the random-weight model) and records per request
its hit and hit-list lengths: with MTP and n-gram before `register()`, with MTP after.
"""

from __future__ import annotations

import os

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BLOCK = 16
SPEC_BLOCKS = 3  # MTP k=3: vLLM's num_speculative_blocks for the GDN group
LOOKAHEAD = 3
_HASH_READY = False

# name: (producer length, shared length, consumer suffix length, drafter)
SCENARIOS: dict[str, tuple[int, int, int, bool]] = {
    "one_block": (BLOCK, BLOCK, 1, True),  # prefix_b request 2 of the H200 run
    "three_blocks": (3 * BLOCK, 3 * BLOCK, 1, True),
    "two_blocks_inside": (2 * BLOCK + 7, 2 * BLOCK, 1, True),
    "one_block_ngram": (BLOCK, BLOCK, 1, False),
}


def _manager(use_eagle: bool) -> Any:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                             dtype=torch.float16)
    gdn = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,),
                    mamba_cache_mode="align", num_speculative_blocks=SPEC_BLOCKS)
    # the tiny checkpoint's layout: full attention + the MTP layer, three GDN layers
    cfg = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn", "mtp"], attn),
        KVCacheGroupSpec(["gdn0", "gdn1", "gdn2"], gdn)])
    return KVCacheManager(cfg, max_model_len=4096, hash_block_size=BLOCK,
                          enable_caching=True, use_eagle=use_eagle)


def _request(rid: str, tokens: list[int], block: int = BLOCK) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _HASH_READY
    if not _HASH_READY:  # once: the seed of every block hash chain is random per call
        init_none_hash(sha256)
        _HASH_READY = True
    return Request(rid, tokens, SamplingParams(max_tokens=8), None,
                   block_hasher=get_request_block_hasher(block, sha256))


def _prefill(manager: Any, req: Any, use_eagle: bool) -> tuple[int, list[int]]:
    """Schedule `req`'s prompt step by step as vLLM's scheduler would (its own align-mode
    chunking); returns the hit length and each group's hit-list length."""
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK),
                            use_eagle=use_eagle)
    manager.new_step_starts()
    blocks, hit = manager.get_computed_blocks(req)
    lists = [len(g) for g in blocks.blocks]
    n = Scheduler._mamba_block_aligned_split(sched, req, req.num_tokens - hit, hit)
    assert manager.allocate_slots(req, n, hit, blocks, num_lookahead_tokens=LOOKAHEAD)
    req.num_computed_tokens = hit + n
    while req.num_computed_tokens < req.num_tokens:
        manager.new_step_starts()
        n = Scheduler._mamba_block_aligned_split(
            sched, req, req.num_tokens - req.num_computed_tokens)
        assert manager.allocate_slots(req, n, num_lookahead_tokens=LOOKAHEAD)
        req.num_computed_tokens += n
    return hit, lists


H200 = {"block": 528, "kv_blocks": 1955, "budget": 2048, "max_seqs": 16}


def _sampled(manager: Any, req: Any, running: list[Any], tokens: Any) -> None:
    """After a step: a request whose prompt is done gets a token; the last one ends it."""
    if req.num_computed_tokens < req.num_tokens:
        return
    req.append_output_token_ids(next(tokens))
    req.sm70_left -= 1
    if req.sm70_left <= 0:
        manager.free(req)
        running.remove(req)


def replay(use_eagle: bool) -> dict[str, list[list[int]]]:
    from vllm.v1.core.sched.scheduler import Scheduler

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu" / "serving"))
    import spec_cases
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    block, budget_per_step = H200["block"], H200["budget"]
    attn = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8,
                             dtype=torch.float16)
    gdn = MambaSpec(block_size=block, shapes=((4, 8),), dtypes=(torch.float32,),
                    mamba_cache_mode="align", num_speculative_blocks=SPEC_BLOCKS)
    cfg = KVCacheConfig(num_blocks=H200["kv_blocks"], kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn", "mtp"], attn), KVCacheGroupSpec(["gdn0", "gdn1", "gdn2"], gdn)])
    manager = KVCacheManager(cfg, max_model_len=8192, hash_block_size=block,
                             enable_caching=True, use_eagle=use_eagle)
    sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=block), use_eagle=use_eagle)
    drafts = LOOKAHEAD if use_eagle else 0
    split = Scheduler._mamba_block_aligned_split
    next_token = iter(range(100_000, 10**9))
    out: dict[str, list[list[int]]] = {}
    n_req = 0
    for phase, subs in spec_cases.stage1_plan(block)["phases"].items():
        rows: list[list[int]] = []
        for sub in subs:
            waiting = []
            for r in sub:
                req = _request(f"replay-{n_req}", r["prompt"], block)
                req.sm70_left, req.sm70_row = r["max_tokens"], len(rows)
                rows.append([])
                n_req += 1
                waiting.append(req)
            running: list[Any] = []
            while waiting or running:
                manager.new_step_starts()
                budget = budget_per_step
                for req in list(running):
                    if req.num_computed_tokens < req.num_tokens:  # a prompt's next chunk
                        n = split(sched, req, min(req.num_tokens - req.num_computed_tokens,
                                                  budget))
                        if n == 0:
                            continue
                        assert manager.allocate_slots(req, n, num_lookahead_tokens=drafts)
                        req.num_computed_tokens += n
                        budget -= n
                    else:  # 1 + k tokens verified, the drafts rejected: one token on
                        assert manager.allocate_slots(req, 1 + drafts,
                                                      num_lookahead_tokens=drafts)
                        req.num_computed_tokens += 1
                        budget -= 1 + drafts
                    _sampled(manager, req, running, next_token)
                while waiting and len(running) < H200["max_seqs"] and budget > 0:
                    req = waiting[0]
                    blocks, hit = manager.get_computed_blocks(req)
                    n = split(sched, req, min(req.num_tokens - hit, budget), hit)
                    if n == 0 or manager.allocate_slots(
                            req, n, hit, blocks, num_lookahead_tokens=drafts) is None:
                        break  # vLLM's FCFS admission stops here for this step
                    waiting.pop(0)
                    rows[req.sm70_row] = [hit, *(len(g) for g in blocks.blocks)]
                    req.num_computed_tokens = hit + n
                    budget -= n
                    running.append(req)
                    _sampled(manager, req, running, next_token)
        out[phase] = rows
    return out


def scenario(name: str, preset: bool = False) -> dict[str, Any]:
    produced, shared, suffix, eagle = SCENARIOS[name]
    manager = _manager(eagle)
    if preset:
        # the guard alone: a coordinator the fix acts in, its look-ahead left in place
        from vllm_patch.spec_decode import prefix_state as ps

        manager.coordinator.__dict__[ps.STATE_ATTR] = {
            "applies": True, "removed": [], "hits": 0, "refused": 0}
    prompt = list(range(1000, 1000 + produced))
    _prefill(manager, _request(f"{name}-a", prompt), eagle)
    hit, lists = _prefill(manager, _request(f"{name}-b", prompt[:shared] + [7] * suffix),
                          eagle)
    return {"hit": hit, "lists": lists,
            "record": manager.coordinator.__dict__.get("_sm70_prefix_state")}


def main() -> int:
    request = json.loads(Path(sys.argv[1]).read_text())
    if request.get("front"):
        sys.path.insert(0, request["front"])
    out: dict[str, Any] = {"stock": {n: scenario(n) for n in SCENARIOS}}
    if request.get("replay"):
        out["replay"] = {"stock_mtp": replay(True), "stock_ngram": replay(False)}
    os.environ["SM70_PLUGIN_CONFIG"] = json.dumps(request["config"])
    from vllm_patch import plugin
    from vllm_patch.spec_decode import prefix_state as ps

    out["module"] = ps.__file__
    out["register"] = plugin.register().get("exact_prefix_hits")
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    current = HybridKVCacheCoordinator.__dict__["find_longest_cache_hit"]
    out["wrapped"] = bool(getattr(current, ps.MARK, False))
    out["second"] = ps.install() if out["wrapped"] else None
    out["after"] = {n: scenario(n) for n in SCENARIOS}
    out["guard"] = scenario("one_block", preset=True) if out["wrapped"] else None
    if request.get("replay"):
        out["replay"]["fixed_mtp"] = replay(True)
    Path(sys.argv[2]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
