"""Runs in the serving venv with vLLM 0.22.1's Python tree first on the path (see
tests/vllm_cpu_tree.py): R8, the prefix-hit fix (vllm_patch/spec_decode/prefix_state.py),
against vLLM's own KV cache manager, coordinator and scheduler chunking on the CPU. Driven
by tests/test_spec_prefix_state.py.

Request (JSON file argv[1]) -> result (JSON file argv[2]):
- "config": the plugin configuration (SM70_PLUGIN_CONFIG) `register()` runs with;
- "front": a folder put first on sys.path (the test's mutated copy of vllm_patch).
Result: what `register()` reported, whether the coordinator's method is wrapped, and per
scenario (a producer prompt prefilled in the chunks vLLM's align-mode scheduler picks,
then a consumer prompt sharing a prefix with it) the consumer's hit length and the length
of each KV cache group's hit list, before the plugin is registered ("stock") and after.
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


def _request(rid: str, tokens: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _HASH_READY
    if not _HASH_READY:  # once: the seed of every block hash chain is random per call
        init_none_hash(sha256)
        _HASH_READY = True
    return Request(rid, tokens, SamplingParams(max_tokens=8), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


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
    Path(sys.argv[2]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
