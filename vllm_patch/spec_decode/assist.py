"""The n-gram assist's per-request state inside the model runner (torch, no vLLM).

`AssistState.step` runs once per decode step, after MTP has proposed its [B, k] drafts and
before they leave for the verifier: it measures the previous step's drafts of both methods
against what the verifier produced, appends the produced tokens to each request's history,
proposes n-gram drafts from that history, chooses per row and returns the drafts to verify.
Everything stays on the drafts' device (`batch.py`'s fixed-shape forms); the only host
data are the row -> slot map, a per-row "verified k drafts" flag and new requests' known
tokens (copied once, when the request first shows up).

State is keyed by request id, not by batch row: vLLM moves requests between rows
(`InputBatch.condense`, `swap_states`, the attention reorder), so each call maps the rows'
request ids to slots of its own. A request absent from a call (finished, preempted, or
not scheduled this step) loses its slot; if it comes back it starts cold, like a new
request. That also drops drafts no verifier will see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_patch.spec_decode import batch
from vllm_patch.spec_decode.chooser import DEFAULT_ALPHA, DEFAULT_MARGIN, check_weights
from vllm_patch.spec_decode.ngram import check_bounds

# Indices of `AssistState.counts`.
ROWS, NGRAM_DRAFTS, CHOSE_NGRAM, MEASURED = range(4)


@dataclass(frozen=True)
class AssistParams:
    k: int
    n_min: int
    n_max: int
    alpha: float = DEFAULT_ALPHA
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        check_bounds(self.k, self.n_min, self.n_max)
        check_weights(self.alpha, self.margin)


class AssistState:
    """Slots for up to `max_reqs` requests of at most `max_len` tokens each."""

    def __init__(self, params: AssistParams, max_reqs: int, max_len: int,
                 device: torch.device | str) -> None:
        if max_reqs < 1 or max_len < 1:
            raise ValueError(f"max_reqs={max_reqs}, max_len={max_len}: both must be >= 1")
        self.params = params
        self.max_len = max_len
        k = params.k
        dev = torch.device(device)
        self.device = dev
        self.tokens = torch.zeros((max_reqs, max_len), dtype=torch.int32, device=dev)
        self.length = torch.zeros(max_reqs, dtype=torch.long, device=dev)
        nan = float("nan")
        self.ewma_mtp = torch.full((max_reqs,), nan, dtype=torch.float32, device=dev)
        self.ewma_ngram = torch.full((max_reqs,), nan, dtype=torch.float32, device=dev)
        self.prev_mtp = torch.zeros((max_reqs, k), dtype=torch.long, device=dev)
        self.prev_ngram = torch.zeros((max_reqs, k), dtype=torch.long, device=dev)
        self.prev_has = torch.zeros(max_reqs, dtype=torch.bool, device=dev)
        self.prev_used = torch.zeros(max_reqs, dtype=torch.bool, device=dev)
        self.pending = torch.zeros(max_reqs, dtype=torch.bool, device=dev)
        # rows seen, rows with an n-gram draft, rows that carried it, rows measured
        self.counts = torch.zeros(4, dtype=torch.long, device=dev)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(max_reqs - 1, -1, -1))
        self.calls = 0
        self.skipped = 0  # calls left alone by the runner hook (a batch of another shape)

    # --- slots (host) -------------------------------------------------------------------
    def _assign(self, req_ids: Sequence[str],
                known: Callable[[int], Sequence[int]]) -> torch.Tensor:
        present = set(req_ids)
        if len(present) != len(req_ids):
            raise ValueError(f"request ids repeat within one batch: {list(req_ids)}")
        for rid in [r for r in self.slot_of if r not in present]:
            self._free.append(self.slot_of.pop(rid))
        for row, rid in enumerate(req_ids):
            if rid in self.slot_of:
                continue
            if not self._free:
                raise ValueError(f"{len(req_ids)} requests in one batch: more than the "
                                 f"{self.tokens.shape[0]} slots (max_num_seqs)")
            slot = self._free.pop()
            self.slot_of[rid] = slot
            ctx = list(known(row))[: self.max_len]
            if ctx:
                self.tokens[slot, : len(ctx)] = torch.tensor(ctx, dtype=torch.int32).to(
                    self.device, non_blocking=True)
            self.length[slot] = len(ctx)
            self.ewma_mtp[slot] = float("nan")
            self.ewma_ngram[slot] = float("nan")
            self.pending[slot] = False
        return torch.tensor([self.slot_of[r] for r in req_ids], dtype=torch.long).to(
            self.device, non_blocking=True)

    def acceptance(self, req_id: str) -> tuple[float | None, float | None]:
        """(MTP, n-gram) EWMA of one request; None where unmeasured or unknown (syncs)."""
        slot = self.slot_of.get(req_id)
        if slot is None:
            return None, None
        vals = [float(self.ewma_mtp[slot]), float(self.ewma_ngram[slot])]
        return tuple(None if v != v else v for v in vals)  # type: ignore[return-value]

    def stats(self) -> dict[str, int]:
        """The counters since start (syncs: call it off the hot path)."""
        c = [int(x) for x in self.counts.tolist()]
        return {"calls": self.calls, "skipped": self.skipped, "rows": c[ROWS],
                "rows_with_ngram_draft": c[NGRAM_DRAFTS],
                "rows_chose_ngram": c[CHOSE_NGRAM], "rows_measured": c[MEASURED],
                "live_requests": len(self.slot_of)}

    # --- one step (device) ----------------------------------------------------------------
    def step(self, req_ids: Sequence[str], mtp_drafts: torch.Tensor, sampled: torch.Tensor,
             discard: torch.Tensor, verified: Sequence[bool], vocab_size: int,
             known: Callable[[int], Sequence[int]], upper: int) -> torch.Tensor:
        """The drafts to verify next step ([B, k], `mtp_drafts`' dtype and device).

        `sampled` [B, W]: this step's verifier output (-1 past the accepted tokens);
        `discard` [B]: rows whose sample vLLM throws away; `verified[b]`: row b's step
        verified k drafts (the ones this method returned last time for that request);
        `known(b)`: the tokens vLLM already holds for row b (asked for new requests only);
        `upper`: a bound on any row's length after this step (the width scanned).
        """
        p = self.params
        b = len(req_ids)
        if mtp_drafts.dim() != 2 or mtp_drafts.shape[1] != p.k or mtp_drafts.shape[0] != b:
            raise ValueError(f"MTP drafts {tuple(mtp_drafts.shape)} for {b} requests: "
                             f"expected [{b}, {p.k}]")
        if sampled.shape[0] != b or len(verified) != b:
            raise ValueError(f"sampled {tuple(sampled.shape)}, {len(verified)} flags for "
                             f"{b} requests")
        self.calls += 1
        slots = self._assign(req_ids, known)
        dev = self.device
        sampled = sampled.to(dev)
        valid = batch.valid_counts(sampled, discard.to(dev), vocab_size)

        # 1. Last step's drafts against what the verifier produced (both methods).
        ver = torch.tensor(list(verified), dtype=torch.bool).to(dev, non_blocking=True)
        measured = self.pending[slots] & ver & (valid > 0)
        used = self.prev_used[slots]
        mtp_s, ngram_s = batch.step_samples(
            valid, used, batch.draft_match(self.prev_mtp[slots], sampled),
            batch.draft_match(self.prev_ngram[slots], sampled))
        self.ewma_mtp[slots] = batch.observe_batch(self.ewma_mtp[slots], mtp_s, measured,
                                                   p.alpha)
        self.ewma_ngram[slots] = batch.observe_batch(
            self.ewma_ngram[slots], ngram_s, measured & self.prev_has[slots], p.alpha)

        # 2. The produced tokens join each request's history.
        width = sampled.shape[1]
        offs = torch.arange(width, device=dev).unsqueeze(0)
        base = self.length[slots]
        pos = (base.unsqueeze(1) + offs).clamp(max=self.max_len - 1)
        rows = slots.unsqueeze(1).expand(b, width)
        keep = offs < valid.unsqueeze(1)
        self.tokens[rows, pos] = torch.where(keep, sampled.to(torch.int32),
                                             self.tokens[rows, pos])
        length = (base + valid).clamp(max=self.max_len)
        self.length[slots] = length

        # 3. N-gram drafts from the history, the choice, the drafts to verify.
        scan = max(1, min(int(upper), self.max_len))
        ng, has, _ = batch.propose_batch(self.tokens[slots, :scan], length.clamp(max=scan),
                                         p.k, p.n_min, p.n_max)
        use = batch.choose_batch(self.ewma_mtp[slots], self.ewma_ngram[slots], has, p.margin)
        out = batch.assist(mtp_drafts, ng.to(dtype=mtp_drafts.dtype, device=mtp_drafts.device),
                           use.to(mtp_drafts.device))

        # 4. What the next step measures.
        self.prev_mtp[slots] = mtp_drafts.to(device=dev, dtype=torch.long)
        self.prev_ngram[slots] = ng.to(torch.long)
        self.prev_has[slots] = has
        self.prev_used[slots] = use
        self.pending[slots] = True
        self.counts += torch.stack([
            torch.tensor(b, device=dev), has.sum(), use.sum(), measured.sum()]).to(torch.long)
        return out
