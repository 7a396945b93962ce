"""Which requests of one vLLM step are Clef's, and which batch rows the head reads (pure).

A request is Clef when its SamplingParams' `extra_args` carry `sm70_clef` (set by the
scoring route, `vllm_patch.clef.api`; vLLM carries `extra_args` with the SamplingParams
into the worker's `CachedRequestState`). A scoring request also carries `sm70_clef_score`:
{"key": str, "positions": [int], "roles": [int], "kinds": [int]}, the prompt positions the
head reads and their roles and kinds (`vllm_patch.clef.render`).

The runner lays a step out request by request in `input_batch.req_ids` order (after its
decode-first reorder): request i's rows are query_start_loc[i] .. query_start_loc[i + 1],
and row r of request i holds prompt position num_computed[i] + (r - query_start_loc[i])
(how `_prepare_inputs` builds `positions`). Every row of a Clef request is Clef, prefill
chunk or decode alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_patch.clef.errors import ClefError

CLEF_ARG = "sm70_clef"
SCORE_ARG = "sm70_clef_score"
SCORE_FIELDS = ("key", "positions", "roles", "kinds")


def is_clef(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request's extra_args mark it as Clef's (any true value of `sm70_clef`)."""
    return bool(extra_args) and bool(extra_args.get(CLEF_ARG))


def request_flags(req_ids: Sequence[str | None],
                  extra_args_of: Mapping[str, Mapping[str, Any] | None]) -> list[bool]:
    """One flag per request of the step, in the runner's order; a slot without a request
    (None, a hole the runner has not condensed) is chat."""
    return [rid is not None and is_clef(extra_args_of.get(rid)) for rid in req_ids]


@dataclass(frozen=True)
class ScoreSpec:
    key: str
    positions: tuple[int, ...]
    roles: tuple[int, ...]
    kinds: tuple[int, ...]


def score_spec(extra_args: Mapping[str, Any] | None) -> ScoreSpec | None:
    """The head's reading plan of a scoring request (None for any other request)."""
    if not is_clef(extra_args):
        return None
    raw = extra_args.get(SCORE_ARG) if extra_args else None
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or set(raw) != set(SCORE_FIELDS):
        raise ClefError(f"extra_args[{SCORE_ARG!r}] must have exactly the fields "
                        f"{list(SCORE_FIELDS)}")
    pos, roles, kinds = (tuple(int(v) for v in raw[k]) for k in SCORE_FIELDS[1:])
    if not pos or len(roles) != len(pos) or len(kinds) != len(pos):
        raise ClefError(f"extra_args[{SCORE_ARG!r}]: {len(pos)} positions, {len(roles)} "
                        f"roles, {len(kinds)} kinds (need as many of each, at least one)")
    return ScoreSpec(str(raw["key"]), pos, roles, kinds)


def rows_this_step(positions: Sequence[int], num_computed: int, row_lo: int,
                   row_hi: int) -> tuple[list[int], list[int]]:
    """Of a scoring request's prompt `positions`, those computed in this step: their
    indices in `positions` and the batch rows holding them (rows row_lo .. row_hi - 1 hold
    positions num_computed .. num_computed + row_hi - row_lo - 1)."""
    if row_hi < row_lo or num_computed < 0:
        raise ClefError(f"rows {row_lo}..{row_hi} with {num_computed} computed tokens")
    n = row_hi - row_lo
    idx, rows = [], []
    for j, p in enumerate(positions):
        off = p - num_computed
        if 0 <= off < n:
            idx.append(j)
            rows.append(row_lo + off)
    return idx, rows
