"""The pure parts of the prefix-caching + speculation proof (device_spec_prefix.py): which
engines, which prompts, and how their outputs are judged. No torch, no vLLM: the CPU tests
(tests/test_spec_prefix_cases.py) run all of it.

Why the prompts look the way they do:
- vLLM 0.22.1 caches a hybrid model's prefixes only in whole blocks, and in `align` mode it
  keeps the GDN state only at block ends, so the block size it chose (large: the attention
  page is padded to the GDN state's page) decides where a shared prefix can be reused. The
  prefix lengths are therefore derived from that block size at run time: half a block (no
  reuse possible), one short of a block, exactly one block, one past it, one and a half,
  one short of two, exactly two.
- Each group is submitted twice: its first request alone (it fills the cache), then the
  rest together (they hit it). One of the rest is the shared prefix itself, so a prompt of
  exactly m blocks meets its own cached blocks (vLLM must still compute the last token).
- The truncation regression of the reference (generations cut short exactly when prompt +
  output reached a block-size multiple, with speculation) needs max_tokens chosen so that
  prompt + max_tokens is such a multiple; the check is that every such request returns
  max_tokens tokens, and the same ones as without speculation.
- Random weights make MTP's acceptance meaningless and n-gram drafts rare. The n-gram
  cases are built from the reference engine's own greedy output (stage 2), so the context
  contains the continuation wherever the random model's greedy output repeats itself; the
  case whose reference continuation a simulated n-gram proposer would accept most is the
  "repetitive" one, a fresh random prompt the "non-repetitive" one.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ab"))
from ab_side import engine_kwargs  # the A/B's engine settings, reused

K = 3  # draft tokens per step (the launcher's SM70_SPEC_TOKENS default)
NGRAM_MIN, NGRAM_MAX = 2, 8  # the launcher's SM70_NGRAM_MIN / SM70_NGRAM_MAX defaults
NEW_TOKENS = 64
# The launcher's capture sizes: with k = 3 a decode row is 4 tokens, so 4..64 covers 1-16
# sequences (vLLM rounds sizes to multiples of 1 + k).
SPEC_CAPTURE_SIZES = [4, 8, 16, 32, 64]
MAX_BATCHED = 2048  # the launcher's SM70_MAX_NUM_BATCHED_TOKENS default
MAX_LEN = 8192
# Ids far below the tiny vocabulary's special tokens (vocab - 64 and up), as the A/B does.
VOCAB_CAP = 1024
SEED_PROMPT_LEN = 48
SEED_NEW_TOKENS = 512  # a random model's greedy output has time to fall into a loop
ENGINES = ("E0", "E1", "E2")


class CaseError(ValueError):
    """A plan that cannot be built from what the engines reported."""


def engine_configs(model: str, util: float, kv_bytes: int) -> dict[str, dict[str, Any]]:
    """vLLM keyword arguments of the three engines (all on our plugin, the int8 copy).

    E0: no speculation, prefix caching off (the reference). E1: MTP k = 3, prefix caching on
    with mamba_cache_mode `align` (what the launcher passes), FULL_AND_PIECEWISE graphs with
    the launcher's capture sizes. E2: vLLM's n-gram speculation k = 3, prefix caching on."""
    if not 0.0 < util < 1.0:
        raise CaseError(f"gpu_memory_utilization={util}: must be in (0, 1)")
    if kv_bytes <= 0:
        raise CaseError(f"kv_cache_memory_bytes={kv_bytes}: must be positive")
    out: dict[str, dict[str, Any]] = {}
    for name in ENGINES:
        kw = engine_kwargs(model, "graphs", MAX_BATCHED, MAX_LEN, 1, util)
        kw["kv_cache_memory_bytes"] = kv_bytes
        kw["disable_log_stats"] = False  # the spec-decode and prefix-cache counters
        kw["async_scheduling"] = False  # the launcher's default (it raised truncation)
        if name != "E0":
            kw["enable_prefix_caching"] = True
            kw["mamba_cache_mode"] = "align"
            kw["compilation_config"] = {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                        "cudagraph_capture_sizes": SPEC_CAPTURE_SIZES}
        if name == "E1":
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": K}
        if name == "E2":
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": K,
                                        "prompt_lookup_min": NGRAM_MIN,
                                        "prompt_lookup_max": NGRAM_MAX}
        out[name] = kw
    return out


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_CAP) for _ in range(n)]


def prefix_lengths(block: int) -> dict[str, int]:
    """Shared-prefix lengths by name: inside a block and exactly on block boundaries."""
    if block < 8:
        raise CaseError(f"block_size={block}: too small to place prefixes inside a block")
    return {"half": block // 2, "b_minus1": block - 1, "b": block, "b_plus1": block + 1,
            "b_and_half": block + block // 2, "2b_minus1": 2 * block - 1, "2b": 2 * block}


SUFFIXES = (7, 0, 1, 33)  # the first request's suffix, then the rest (0: the prefix itself)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    shared: int = 0  # tokens shared with an earlier request of the same group


def expected_cached(shared: int, prompt_len: int, block: int) -> int:
    """Tokens a cache hit can cover: whole blocks of the shared prefix, never the prompt's
    last token (vLLM computes it to sample the first output token)."""
    return min(shared // block, (prompt_len - 1) // block) * block


def stage1_plan(block: int, seed: int = 0, max_len: int = MAX_LEN) -> dict[str, Any]:
    """Phases in order; each phase is a list of submissions, each a list of requests.

    `seed`: one random prompt, 512 new tokens (stage 2 is built from its output).
    `prefix_<name>`: a group per prefix length (first request alone, then the rest).
    `together_2b`: a two-block group submitted in one go.
    `trunc_cold` / `trunc_warm`: prompt + max_tokens on block-size multiples, submitted
    together, then again (the second time their prefixes are cached)."""
    rng = random.Random(seed)
    phases: dict[str, list[list[Request]]] = {}
    skipped: list[str] = []
    phases["seed"] = [[Request(_ids(rng, SEED_PROMPT_LEN), SEED_NEW_TOKENS)]]
    for name, length in prefix_lengths(block).items():
        if length + max(SUFFIXES) + NEW_TOKENS + K + 1 > max_len:
            skipped.append(f"prefix_{name}")
            continue
        shared = _ids(rng, length)
        first, *rest = (shared + _ids(rng, s) for s in SUFFIXES)
        # The first request finds an empty cache; the rest share `length` tokens with it.
        phases[f"prefix_{name}"] = [[Request(first, NEW_TOKENS)],
                                    [Request(p, NEW_TOKENS, shared=length) for p in rest]]
    # The same group submitted all at once: vLLM 0.22.1 holds back a request whose cache
    # hit would use GDN state written by another request in the same step (MambaManager),
    # so the later ones are scheduled a step later and may hit; the output must not care.
    length = 2 * block
    if length + max(SUFFIXES) + NEW_TOKENS + K + 1 <= max_len:
        shared = _ids(rng, length)
        first, *rest = (shared + _ids(rng, s) for s in SUFFIXES)
        phases["together_2b"] = [[Request(first, NEW_TOKENS),
                                  *(Request(p, NEW_TOKENS, shared=length) for p in rest)]]
    else:
        skipped.append("together_2b")
    trunc = []
    for prompt_len, end in ((block - NEW_TOKENS, block), (block - K, block),
                            (block - 1, block), (block + 1, 2 * block),
                            (2 * block - NEW_TOKENS, 2 * block)):
        if prompt_len < 1 or end > max_len:
            continue
        trunc.append(Request(_ids(rng, prompt_len), end - prompt_len))
    if trunc:
        phases["trunc_cold"] = [trunc]
        phases["trunc_warm"] = [[Request(r.prompt, r.max_tokens, shared=len(r.prompt))
                                 for r in trunc]]
    return {"stage": 1, "block_size": block, "phases": _plain(phases), "skipped": skipped}


def repetitive_candidates(seed_prompt: Sequence[int], seed_output: Sequence[int],
                          seed: int = 1) -> dict[str, list[int]]:
    """Stage 2 prompts: `tail` is the seed prompt plus the first three quarters of the
    reference's own output (its greedy continuation is the rest of that output, which the
    context contains if the output repeats itself); `repeat2` is prompt + output twice;
    `cycle16` a 16-token random pattern repeated; `random` a fresh random prompt."""
    if len(seed_output) < 8:
        raise CaseError(f"seed output of {len(seed_output)} tokens: stage 2 needs at least 8")
    rng = random.Random(seed)
    cut = len(seed_output) * 3 // 4
    pattern = _ids(rng, 16)
    return {
        "tail": list(seed_prompt) + list(seed_output[:cut]),
        "repeat2": (list(seed_prompt) + list(seed_output)) * 2,
        "cycle16": pattern * 24,
        "random": _ids(rng, 384),
    }


def stage2_plan(seed_prompt: Sequence[int], seed_output: Sequence[int], source: str,
                seed: int = 1) -> dict[str, Any]:
    """Each candidate alone in its own phase, so the counters' deltas are its own."""
    cands = repetitive_candidates(seed_prompt, seed_output, seed)
    phases = {f"accept_{n}": [[Request(p, NEW_TOKENS)]] for n, p in cands.items()}
    return {"stage": 2, "seed_source": source, "phases": _plain(phases)}


def _plain(phases: Mapping[str, list[list[Request]]]) -> dict[str, list[list[dict]]]:
    return {ph: [[{"prompt": r.prompt, "max_tokens": r.max_tokens, "shared": r.shared}
                  for r in sub] for sub in subs] for ph, subs in phases.items()}


# --- n-gram simulation on the reference's tokens ------------------------------------------

def propose_upto_k_earliest(tokens: Sequence[int], k: int, n_min: int,
                            n_max: int) -> list[int]:
    """vLLM 0.22.1's n-gram rule read as a brute force: the longest suffix of length n_min..
    n_max that occurs earlier, its earliest occurrence, and up to k tokens after it."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(tokens[size - n:])
        for i in range(0, size - n):
            if list(tokens[i:i + n]) == suffix:
                return list(tokens[i + n:i + n + k])
    return []


def simulate_acceptance(prompt: Sequence[int], output: Sequence[int], k: int,
                        propose: Any) -> dict[str, Any]:
    """Step a proposer through a known greedy output: the first token comes from the
    prefill; each later step drafts from the context (no further than one short of the
    output's end: the verifier adds a token of its own), keeps the draft's common prefix
    with the true next tokens and adds one. The counters mirror vLLM's spec-decode
    metrics; 1 + steps + accepted is the output's length."""
    ctx = list(prompt) + list(output[:1])
    pos, steps, drafts, drafted, accepted = 1, 0, 0, 0, 0
    while pos < len(output):
        draft = propose(ctx, k)[: len(output) - pos - 1]
        ok = 0
        for d, t in zip(draft, output[pos:], strict=False):
            if d != t:
                break
            ok += 1
        steps += 1
        if draft:
            drafts += 1
            drafted += len(draft)
            accepted += ok
        ctx += list(output[pos:pos + ok + 1])
        pos += ok + 1
    return {"steps": steps, "num_drafts": drafts, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "tokens_per_step": None if steps == 0 else round((len(output) - 1) / steps, 3)}


# --- counters -------------------------------------------------------------------------------

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits", "vllm:generation_tokens", "vllm:prompt_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counter_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """after - before for every counter (a list elementwise); absent on either side: None."""
    out: dict[str, Any] = {}
    for name in (*COUNTERS, PER_POS):
        a, b = after.get(name), before.get(name)
        if a is None:
            out[name] = None
        elif isinstance(a, list):
            base = b if isinstance(b, list) and len(b) == len(a) else [0] * len(a)
            out[name] = [x - y for x, y in zip(a, base, strict=True)]
        else:
            out[name] = a - (b or 0)
    return out


def acceptance(delta: Mapping[str, Any], generated: int) -> dict[str, Any]:
    """Figures of one request's run from its counter deltas: drafted tokens accepted, mean
    tokens per step with a draft (1 + accepted / drafts), and tokens per decode step over
    all steps (the first token comes from the prefill; each decode step emits 1 + its
    accepted tokens, so steps = generated - 1 - accepted)."""
    drafts = delta.get("vllm:spec_decode_num_drafts")
    drafted = delta.get("vllm:spec_decode_num_draft_tokens")
    acc = delta.get("vllm:spec_decode_num_accepted_tokens")
    out: dict[str, Any] = {"num_drafts": drafts, "num_draft_tokens": drafted,
                           "num_accepted_tokens": acc,
                           "accepted_per_pos": delta.get(PER_POS)}
    if drafts is None or acc is None or drafted is None:
        return {**out, "acceptance_rate": None, "mean_acceptance_length": None,
                "tokens_per_step": None}
    steps = generated - 1 - acc
    out["acceptance_rate"] = None if not drafted else round(acc / drafted, 4)
    out["mean_acceptance_length"] = None if not drafts else round(1 + acc / drafts, 3)
    out["tokens_per_step"] = None if steps <= 0 else round((generated - 1) / steps, 3)
    return out


# --- verdicts -------------------------------------------------------------------------------

def truncation_check(rows: Sequence[Mapping[str, Any]], block: int) -> dict[str, Any]:
    """Every truncation request returned exactly max_tokens tokens, ending on a block-size
    multiple of total length."""
    bad = []
    for i, r in enumerate(rows):
        total = r["prompt_len"] + r["max_tokens"]
        if len(r["tokens"]) != r["max_tokens"] or total % block:
            bad.append({"request": i, "prompt_len": r["prompt_len"],
                        "max_tokens": r["max_tokens"], "got": len(r["tokens"]),
                        "total_on_block_multiple": total % block == 0})
    return {"requests": len(rows), "bad": bad, "passed": bool(rows) and not bad}


def whole_outputs(phases: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Every request of every phase returned max_tokens tokens (EOS is ignored, so a
    shorter output is a truncation wherever it happens; compare_sides alone could pass a
    short output whose cut falls on a near-tie of the reference)."""
    short = [{"phase": ph, "request": i, "prompt_len": r["prompt_len"],
              "max_tokens": r["max_tokens"], "got": len(r["tokens"])}
             for ph, rs in phases.items() for i, r in enumerate(rs)
             if len(r["tokens"]) != r["max_tokens"]]
    return {"requests": sum(len(rs) for rs in phases.values()), "short": short,
            "passed": not short}


def cache_hits(phases: Mapping[str, Sequence[Mapping[str, Any]]], block: int) -> dict[str, Any]:
    """Per prefix request: the tokens vLLM reported cached against what whole shared
    blocks allow. `exercised`: some request was served from the cache at all (without
    that the equality proves nothing about prefix caching)."""
    rows = []
    for ph, rs in phases.items():
        if not ph.startswith(("prefix_", "together_", "trunc_warm")):
            continue
        for i, r in enumerate(rs):
            want = expected_cached(r.get("shared", 0), r["prompt_len"], block)
            rows.append({"phase": ph, "request": i, "prompt_len": r["prompt_len"],
                         "shared": r.get("shared", 0), "cached": r.get("num_cached_tokens"),
                         "expected": want})
    return {"rows": rows,
            "exercised": any((r["cached"] or 0) > 0 for r in rows),
            "as_expected": sum(r["cached"] == r["expected"] for r in rows),
            "requests": len(rows)}


def pick_repetitive(predicted: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The stage-2 candidate (not `random`) whose reference continuation the simulated
    n-gram proposer accepts most; None when none accepts anything."""
    best, score = None, 0
    for name, p in predicted.items():
        if name == "random":
            continue
        if p["num_accepted_tokens"] > score:
            best, score = name, p["num_accepted_tokens"]
    return best


# compare_sides lets a divergence pass when the reference's top-1/top-2 margin is within
# twice the largest log-prob difference on agreeing steps; a corrupted GDN state that
# moves every log-prob would widen its own tolerance that way. fp16 and int8-KV rounding
# moves a chosen token's log-prob by hundredths of a nat, so a pair above this bound is a
# failure whatever its divergences.
MAX_DLOGPROB = 0.5


def verdict(comparisons: Mapping[str, Mapping[str, Any]], truncation: Mapping[str, Any],
            cache: Mapping[str, Any]) -> bool | None:
    """Passed: both speculative engines match the reference on every phase (a divergence
    only where the reference's top-1/top-2 margin is within the pair's rounding noise,
    and that noise itself bounded by MAX_DLOGPROB),
    every truncation request is whole, and MTP's engine really served from the cache.
    None when an engine produced nothing to compare."""
    needed = ("E1_vs_E0", "E2_vs_E0")
    if any(not comparisons.get(n, {}).get("requests") for n in needed):
        return None
    if any(not t.get("requests") for t in truncation.values()):
        return None
    return (all(comparisons[n]["passed"] for n in needed)
            and all((comparisons[n].get("max_abs_dlogprob") or 0.0) <= MAX_DLOGPROB
                    for n in needed)
            and all(t["passed"] for t in truncation.values())
            and bool(cache.get("E1", {}).get("exercised")))
