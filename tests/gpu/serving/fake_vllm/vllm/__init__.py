"""A stand-in for vLLM's LLM with the surface spec_engine.py uses (CPU tests only).

Greedy "decoding" is a fixed function of the last three tokens, so equal prompts give equal
outputs; a prefix cache of whole blocks is kept as vLLM reports it (num_cached_tokens);
spec-decode and prefix-cache counters are kept like vLLM's Prometheus ones. FAKE_VLLM_BUG
plants the failures the proof must catch: `corrupt_cached` changes a token of every
speculative request served from the cache, `truncate` ends speculative generations one
short at block-size multiples. FAKE_VLLM_REFUSE=<method, or none> refuses that engine at
start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

BLOCK = 48
_COUNTERS: dict[str, Any] = {}


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    detokenize: bool = True


@dataclass
class _Lp:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, _Lp]] = field(default_factory=list)


@dataclass
class _Output:
    outputs: list[_Completion]
    num_cached_tokens: int


def _next(ctx: list[int]) -> int:
    return (ctx[-1] * 31 + ctx[-2] * 7 + ctx[-3] + 11) % 997 if len(ctx) >= 3 else 5


class LLM:
    def __init__(self, **kw: Any) -> None:
        method = (kw.get("speculative_config") or {}).get("method", "none")
        if os.environ.get("FAKE_VLLM_REFUSE") == method:
            raise ValueError("refused by the fake")
        self.kw = kw
        self.prefix = bool(kw.get("enable_prefix_caching"))
        self.spec = kw.get("speculative_config")
        self.seen: set[tuple[int, ...]] = set()
        cache = SimpleNamespace(block_size=BLOCK if self.prefix else 16,
                                mamba_block_size=BLOCK, enable_prefix_caching=self.prefix,
                                mamba_cache_mode=kw.get("mamba_cache_mode", "none"),
                                num_gpu_blocks=100)
        spec = None if self.spec is None else SimpleNamespace(**self.spec)
        cfg = SimpleNamespace(
            cache_config=cache, speculative_config=spec,
            compilation_config=SimpleNamespace(cudagraph_mode="FULL_AND_PIECEWISE",
                                               cudagraph_capture_sizes=[4, 8]),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=2048,
                                             async_scheduling=False),
            model_config=SimpleNamespace(quantization="sm70_gptq"))
        self.llm_engine = SimpleNamespace(vllm_config=cfg)

    def apply_model(self, fn: Any) -> list[Any]:
        return [{"methods": {}, "lm_head_method": "fake"}]

    def collective_rpc(self, fn: Any) -> list[Any]:
        return [None]

    def get_metrics(self) -> list[Any]:
        from vllm.v1.metrics.reader import Counter, Vector

        out: list[Any] = []
        for name, v in _COUNTERS.items():
            out.append(Vector(name, {}, list(v)) if isinstance(v, list)
                       else Counter(name, {}, v))
        return out

    def _cached(self, prompt: list[int]) -> int:
        whole = (len(prompt) - 1) // BLOCK
        hit = 0
        for b in range(1, whole + 1):
            if tuple(prompt[: b * BLOCK]) in self.seen:
                hit = b * BLOCK
        return hit if self.prefix else 0

    def generate(self, prompts: list[Any], sps: Any, use_tqdm: bool = False) -> list[_Output]:
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        bug = os.environ.get("FAKE_VLLM_BUG", "")
        outs = []
        for p, sp in zip(prompts, sps, strict=True):
            prompt = list(p["prompt_token_ids"])
            cached = self._cached(prompt)
            ctx = list(prompt)
            toks: list[int] = []
            n = sp.max_tokens
            if bug == "truncate" and self.spec and (len(prompt) + n) % BLOCK == 0:
                n -= 1
            for i in range(n):
                t = _next(ctx)
                if bug == "corrupt_cached" and self.spec and cached and i == 5:
                    t = (t + 1) % 997
                toks.append(t)
                ctx.append(t)
            lps = [{t: _Lp(-0.1), (t + 1) % 997: _Lp(-3.0)} for t in toks]
            for b in range(1, len(prompt) // BLOCK + 1):
                self.seen.add(tuple(prompt[: b * BLOCK]))
            _add("vllm:prefix_cache_queries", len(prompt))
            _add("vllm:prefix_cache_hits", cached)
            _add("vllm:generation_tokens", len(toks))
            if self.spec:
                steps = max(len(toks) - 1, 0)
                _add("vllm:spec_decode_num_drafts", steps)
                _add("vllm:spec_decode_num_draft_tokens", 3 * steps)
                _add("vllm:spec_decode_num_accepted_tokens", 0)
                pos = _COUNTERS.setdefault("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           [0, 0, 0])
                pos[0] += 0
            outs.append(_Output([_Completion(toks, lps)], cached))
        return outs


def _add(name: str, v: int) -> None:
    _COUNTERS[name] = _COUNTERS.get(name, 0) + v
