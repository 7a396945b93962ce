"""The n-gram assist for a whole batch in torch, with fixed shapes and no host sync, so it can
run on the GPU between the MTP drafter and the verifier (docs/spec_decode.md).

`propose_batch` computes what `ngram.propose` defines for every row at once;
`choose_batch` and `observe_batch` are `chooser.choose` / `chooser.observe` on tensors (NaN
stands for "not measured"); `assist` puts n-gram drafts into the rows that take them. Only
static Python ints (k and the n-gram bounds) steer control flow: no `.item()`, no boolean
indexing, no data-dependent shapes. tests/test_ngram_batch.py runs these against the
reference on the CPU.

How `propose_batch` finds the match: rather than one scan per n, it counts for every
position e of a row how many tokens ending at e equal the row's last tokens (`run[e]`,
capped at n_max: n_max vectorised comparisons). A suffix occurrence of length n ends at e
exactly when run[e] >= n, and it has k tokens after it when e + k <= length - 1. So the
longest n is the largest run among those ends, and the latest occurrence of it the largest
such e whose run reaches it.
"""

from __future__ import annotations

import torch

from vllm_patch.spec_decode.ngram import check_bounds


def propose_batch(tokens: torch.Tensor, lengths: torch.Tensor, k: int, n_min: int,
                  n_max: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts for every row of `tokens` ([B, L] ids; row b holds its context in the first
    `lengths[b]` entries, the rest is ignored).

    Returns `drafts` [B, k] (rows without a match hold copies of their own tokens: read
    `has_draft`), `has_draft` [B] bool and `n` [B] (the matched length, 0 where none).
    """
    check_bounds(k, n_min, n_max)
    if tokens.dim() != 2 or lengths.shape != tokens.shape[:1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} and lengths {tuple(lengths.shape)}: "
                         "expected [B, L] and [B]")
    b, width = tokens.shape
    device = tokens.device
    pos = torch.arange(width, device=device).unsqueeze(0)  # [1, L]: an occurrence's end
    last = (lengths.to(torch.long) - 1).unsqueeze(1)  # [B, 1]: the row's last token
    run = torch.zeros((b, width), dtype=torch.int32, device=device)
    alive = torch.ones((b, width), dtype=torch.bool, device=device)
    for j in range(n_max):
        src = pos - j
        tail = last - j
        here = tokens.gather(1, src.clamp(min=0).expand(b, width))
        want = tokens.gather(1, tail.clamp(min=0))
        alive = alive & (src >= 0) & (tail >= 0) & (here == want)
        run = run + alive.to(torch.int32)
    room = pos + k <= last  # k tokens follow the occurrence inside the context
    run = torch.where(room, run, torch.zeros_like(run))
    n = run.amax(dim=1)  # [B]
    has_draft = n >= n_min
    ends = torch.where(room & (run >= n.unsqueeze(1)), pos.expand(b, width),
                       torch.full_like(run, -1, dtype=torch.long))
    end = ends.amax(dim=1)  # the latest occurrence of the longest suffix
    at = (end + 1).unsqueeze(1) + torch.arange(k, device=device).unsqueeze(0)
    drafts = tokens.gather(1, at.clamp(0, width - 1))
    n = torch.where(has_draft, n, torch.zeros_like(n))
    return drafts, has_draft, n


def choose_batch(ewma_mtp: torch.Tensor, ewma_ngram: torch.Tensor, has_draft: torch.Tensor,
                 margin: float) -> torch.Tensor:
    """True for rows that take n-gram drafts (`chooser.choose` per row; NaN = unmeasured)."""
    mtp_known = ~torch.isnan(ewma_mtp)
    ngram_known = ~torch.isnan(ewma_ngram)
    better = ewma_ngram > ewma_mtp + margin  # False wherever either is NaN
    return has_draft & ngram_known & (better | ~mtp_known)


def observe_batch(ewma: torch.Tensor, sample: torch.Tensor, measured: torch.Tensor,
                  alpha: float) -> torch.Tensor:
    """`chooser.observe` for one method: rows with `measured` take the sample (the first one
    as is), the others keep their value."""
    moved = torch.where(torch.isnan(ewma), sample, ewma + alpha * (sample - ewma))
    return torch.where(measured, moved, ewma)


def assist(mtp_drafts: torch.Tensor, ngram_drafts: torch.Tensor,
           use_ngram: torch.Tensor) -> torch.Tensor:
    """[B, k] drafts: the n-gram row where `use_ngram`, MTP's elsewhere; every row keeps k."""
    return torch.where(use_ngram.unsqueeze(1), ngram_drafts, mtp_drafts)


def valid_counts(sampled: torch.Tensor, discard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] tokens the verifier produced per row: the leading valid ids of `sampled` ([B, W],
    rejected positions hold -1), 0 for rows vLLM discards (a prefill chunk that is not the
    prompt's last samples nothing real)."""
    ok = (sampled >= 0) & (sampled < vocab_size)
    lead = torch.cumprod(ok.to(torch.int32), dim=1).sum(dim=1)
    return torch.where(discard, torch.zeros_like(lead), lead)


def draft_match(drafts: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """[B] leading draft tokens equal to what the verifier produced at the same positions
    (`ngram.accepted_prefix` per row; -1 in `sampled` never matches an id)."""
    k = drafts.shape[1]
    width = sampled.shape[1]
    if width < k:  # a step that verified no drafts: nothing to compare with
        pad = torch.full((sampled.shape[0], k - width), -1, dtype=sampled.dtype,
                         device=sampled.device)
        sampled = torch.cat([sampled, pad], dim=1)
    same = drafts.to(torch.long) == sampled[:, :k].to(torch.long)
    return torch.cumprod(same.to(torch.int32), dim=1).sum(dim=1)


def step_samples(valid: torch.Tensor, used_ngram: torch.Tensor, mtp_match: torch.Tensor,
                 ngram_match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted tokens per row for (MTP, n-gram) on a verified step: the chosen method's is
    the verifier's count (valid - 1), the other's its counterfactual (`chooser.counterfactual`:
    the common prefix with the produced tokens, which `draft_match` already caps at k and at
    valid since the positions past it hold -1)."""
    accepted = (valid - 1).clamp(min=0).to(torch.float32)
    mtp = torch.where(used_ngram, mtp_match.to(torch.float32), accepted)
    ngram = torch.where(used_ngram, accepted, ngram_match.to(torch.float32))
    return mtp, ngram
