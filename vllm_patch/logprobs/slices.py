"""The prompt-logprobs computation a slice of rows at a time.

vLLM 0.22.1 turns a request's whole scheduled chunk into full-vocabulary logits at once,
then a float32 log-softmax of them, then the top-k, the target gather and the target's
rank. The two [rows, vocab] tensors are what grows with the chunk: at vocabulary 248,320
a row costs about 0.5 MB of fp16 logits plus 1 MB of fp32 log-probs (about 3 GB at 2048
rows). Here only `rows_per_slice` rows exist at any time; the per-row results
([rows, k + 1] ids and log-probs, [rows] ranks) are tiny and concatenated. Each row's
result depends on that row's hidden state only, so the output equals the unsliced one up
to the rounding of the logits GEMM at a different M.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_patch.logprobs.plan import slice_bounds

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
LogprobsFn = Callable[[torch.Tensor], torch.Tensor]
GatherFn = Callable[[torch.Tensor, int, torch.Tensor], Any]


def sliced_prompt_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    num_logprobs: int,
    rows_per_slice: int,
    compute_logits: LogitsFn,
    compute_logprobs: LogprobsFn,
    gather_logprobs: GatherFn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [n, k + 1] int32, log-probs [n, k + 1] fp32, target ranks [n]) for the
    `n` rows of `hidden` whose targets are `targets` (int64 [n]); the same three tensors
    `gather_logprobs(compute_logprobs(compute_logits(hidden)), k, targets)` returns, with
    at most `rows_per_slice` rows of logits alive at once."""
    n = hidden.shape[0]
    if targets.shape != (n,):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, hidden has {n} rows")
    if n <= rows_per_slice:  # one slice: exactly vLLM's own sequence of calls
        got = gather_logprobs(compute_logprobs(compute_logits(hidden)), num_logprobs, targets)
        return got[0], got[1], got[2]
    ids, lps, ranks = [], [], []
    for a, b in slice_bounds(n, rows_per_slice):
        logits = compute_logits(hidden[a:b])
        logprobs = compute_logprobs(logits)
        del logits  # before the gather's own [rows, vocab] temporaries
        got = gather_logprobs(logprobs, num_logprobs, targets[a:b])
        # Dropped now, not when the next slice rebinds the name: else two slices'
        # [rows, vocab] tensors would be alive at the next compute_logits.
        del logprobs
        ids.append(got[0])
        lps.append(got[1])
        ranks.append(got[2])
        del got
    return torch.cat(ids), torch.cat(lps), torch.cat(ranks)
