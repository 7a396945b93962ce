"""The token n-gram speculation still loses, traced step by step inside the engine (a probe).

After R7 and R8 one loss remains (tests/gpu/results/h200_spec_diag_fixed.json, and the same
token in stock vLLM 0.22.1 with and without prefix caching, h200_spec_diag.json): phase
`prefix_2b_minus1`, request 2, generated token 34, a 0.36-nat reference margin. This job
replays that phase exactly as device_spec_diag.py built it (spec_cases.stage1_plan at the
diag runs' block size, the diag's O0 / ON engine keyword arguments) on two engines, each
in its own process (GPU machine, lead's round call):

    python3 tests/gpu/serving/device_spec_trace.py --out $OUT_DIR --budget-s N

  O0  ours, int8, plain decoding, no prefix caching (the reference)
  ON  ours, int8, vLLM's n-gram speculation k=3, no prefix caching (R7 on)

Each engine records the top-5 log-probs of every generated token and, through a probe
installed from this script into its own model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0, so
the runner lives in the engine's process), every step's facts per request: the draft tokens
the scheduler gave it, the accepted count vLLM synchronised before R7 and the one the step
uses after it, whether R7 settled the row, whether the GDN metadata put the row on the
speculative path (and the batch's num_prefills / num_decodes / num_spec_decodes), the CUDA
graph mode, and the tokens the step emitted. The probe is test instrumentation only: it
wraps the runner instance's methods and vLLM's GDN metadata builder in that process, and
changes nothing they compute.

Plan per engine, in order: the target phase on a fresh engine (`<phase>@fresh`), request 2
of it alone (`<phase>@alone`), then every stage-1 phase in the diag's order (the target
again under its own name, after the same history as in the diag run), then stage 2 (from
O0's seed output). The two engines' traces are compared per request (pure functions below,
tests/test_spec_trace.py): the first token that differs, the first earlier token whose
log-prob differs by more than DEV_DLOGPROB (the divergence usually starts before the flip),
the step and position in it that produced each, and the speculation events around them.

Written to $OUT_DIR: summary.json (`passed`: the target request was traced on both engines
with the probe's events, whatever its tokens; `reproduced`: ON lost the token again; the
events around the first deviation; a one-line `hypothesis`; every other unequal request
with its own), trace.json (the target request's per-token trace with both top-5 lists and
both engines' step events), engines.json (every row and event) and logs.txt. To keep:
summary.json as tests/gpu/results/h200_spec_trace.json, trace.json as
h200_spec_trace_request.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "ab"))
sys.path.insert(0, str(HERE))
import spec_cases as sc  # noqa: E402
import spec_rules as rules  # noqa: E402
from device_io import (  # noqa: E402
    atomic_write,
    engine_share,
    fresh_plan_dir,
    launch,
    log,
    read_engines,
    snapshot,
    stop,
    summary_writer,
    utc_stamp,
    watch,
)
from run_ab import side_env, start  # noqa: E402

KV_BYTES = 1 << 30  # the diag's KV bytes: the same block count, the same block assignment
MARGIN_S = 25
DEFAULT_SHARE = "0.08"
TARGET_PHASE = "prefix_2b_minus1"
TARGET_REQUEST = 2
FRESH = "@fresh"
ALONE = "@alone"
TOP_N = 5
# fp16 / int8 rounding between a 1-row and a 4-row step moves a matched token's log-prob by
# a few hundredths of a nat; a larger gap marks where a real divergence starts.
DEV_DLOGPROB = 0.05
TRACE_TOKENS = 40  # tokens of the target request shown per index in the summary
WINDOW_BEFORE = 3  # steps of events shown before the onset's step
ENGINES = ("O0", "ON")
# The block size both diag runs planned with (h200_spec_diag*.json `block_size`; vLLM gives
# this model 528 with and without prefix caching or speculation, h200_spec_prefix.json):
# the plan is built from it, not from this run's report, so the prompts are the diag's.
DIAG_BLOCK = 528
SNAPSHOT_S = 30
REFERENCE, SPECULATIVE = ENGINES


class TraceError(ValueError):
    """A plan that cannot be built from what the engines reported."""


# --- the cases (pure) -----------------------------------------------------------------------

def engine_kwargs(tiny: Path, util: float) -> dict[str, dict[str, Any]]:
    """device_spec_diag's O0 and ON cells: spec_cases' E0 (plain) and E2 (n-gram k=3) on the
    int8 copy with prefix caching off (no mamba cache mode without it)."""
    base = sc.engine_configs(str(tiny / "int8"), util, KV_BYTES)
    out: dict[str, dict[str, Any]] = {}
    for name, src in ((REFERENCE, "E0"), (SPECULATIVE, "E2")):
        kw = dict(base[src])
        kw["enable_prefix_caching"] = False
        kw.pop("mamba_cache_mode", None)
        out[name] = kw
    return out


def flat_requests(subs: Sequence[Sequence[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    """A phase's requests in the order of its rows (submission by submission)."""
    return [r for sub in subs for r in sub]


def trace_plan(block: int) -> dict[str, Any]:
    """Stage 1 of this job: the target phase on a fresh engine, its request alone, then the
    diag's stage-1 phases in the diag's order (spec_cases.stage1_plan, the same seed)."""
    base = sc.stage1_plan(block)
    phases = base["phases"]
    if TARGET_PHASE not in phases:
        raise TraceError(f"block_size={block}: stage 1 has no phase {TARGET_PHASE} "
                         f"(skipped: {base['skipped']})")
    target = phases[TARGET_PHASE]
    reqs = flat_requests(target)
    if len(reqs) <= TARGET_REQUEST:
        raise TraceError(f"{TARGET_PHASE}: {len(reqs)} requests, no request {TARGET_REQUEST}")
    ordered = {TARGET_PHASE + FRESH: target, TARGET_PHASE + ALONE: [[reqs[TARGET_REQUEST]]]}
    ordered.update(phases)
    return {**base, "phases": ordered}


def source_of(phase: str, request: int) -> tuple[str, int]:
    """(diag phase, request index there) of a row of this job's plan."""
    if phase == TARGET_PHASE + ALONE:
        return TARGET_PHASE, TARGET_REQUEST
    return phase.split("@", 1)[0], request


# --- the probe's step records, per request (pure) -------------------------------------------

def owns(rid: str, request_id: str | None) -> bool:
    """vLLM 0.22.1 runs a request as `<the LLM's request id>-<8 random characters>`."""
    return request_id is not None and (rid == request_id or rid.startswith(request_id + "-"))


def request_steps(steps: Sequence[Mapping[str, Any]], request_id: str | None
                  ) -> list[dict[str, Any]]:
    """The probe's steps as one request saw them, in order.

    `g0`: the index of the first generated token the step emits (None: a prefill chunk that
    emits nothing); `emitted`: its tokens; `drafts`: draft tokens scheduled; `acc_in` /
    `accepted`: drafts accepted (the step emits those and one more); `acc_in` /
    `acc_used`: the accepted count (tokens the previous step emitted) as vLLM synchronised
    it and as the step used it after R7; `settled`: R7 moved the row's state; `spec_row`:
    the GDN metadata put the row on the speculative path."""
    out: list[dict[str, Any]] = []
    for st in steps:
        rids = st.get("rids") or []
        row = next((i for i, r in enumerate(rids) if owns(r, request_id)), None)
        if row is None:
            continue
        computed, prompt, sched = st["computed"][row], st["prompt"][row], st["sched"][row]
        if computed + sched < prompt:
            g0 = None
        elif computed < prompt:
            g0 = 0
        else:
            g0 = computed - prompt + 1
        out_rows = st.get("out")
        emitted = ([t for t in out_rows[row] if t != -1] if out_rows and g0 is not None
                   else [])
        drafts = (st.get("draft_ids") or [None] * len(rids))[row]
        r7 = st.get("r7")
        gdn = (st.get("gdn") or [None])[0]
        spec_row = None
        if gdn is not None:
            ddt = gdn.get("ddt")
            spec_row = bool(gdn["s"]) and ddt is not None and row < len(ddt) and ddt[row] >= 0
        out.append({
            "step": st["i"], "g0": g0, "emitted": emitted, "sched": sched,
            "drafts": 0 if drafts is None else len(drafts), "draft_ids": drafts,
            "accepted": len(emitted) - 1 if drafts and emitted else 0,
            "acc_in": None if not r7 else r7["acc"][row],
            "acc_used": (st.get("acc") or [None] * len(rids))[row],
            "settled": bool(r7) and rids[row] in r7["rows"],
            "spec_row": spec_row, "gdn": None if gdn is None else [gdn["p"], gdn["d"], gdn["s"]],
            "cg": st.get("cg"), "batch": [len(rids), sum(st["sched"])],
        })
    return out


def locate(view: Sequence[Mapping[str, Any]], index: int) -> tuple[int, int] | None:
    """(position in `view`, position in that step) of the step that emitted generated
    token `index`."""
    for k, st in enumerate(view):
        g0 = st["g0"]
        if g0 is not None and g0 <= index < g0 + len(st["emitted"]):
            return k, index - g0
    return None


def _lp_of(token: int, top: Sequence[Sequence[Any]] | None) -> float | None:
    for t, lp in top or ():
        if t == token:
            return lp
    return None


def compare_traces(ref: Mapping[str, Any], sut: Mapping[str, Any],
                   ref_view: Sequence[Mapping[str, Any]],
                   sut_view: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One request on both engines: per generated token up to the first flip, the
    reference token's log-prob on both (the speculative engine's from its top-n when it
    chose another), the step that emitted it; `flip`: the first differing token; `onset`:
    the first token (flip included) whose reference log-prob differs by more than
    DEV_DLOGPROB; the speculative engine's steps around them."""
    rt, st = list(ref["tokens"]), list(sut["tokens"])
    n = min(len(rt), len(st))
    flip = next((i for i in range(n) if rt[i] != st[i]), None)
    if flip is None and len(rt) != len(st):
        flip = n
    last = n - 1 if flip is None else min(flip, n - 1)
    ref_top, sut_top = ref.get("top") or [], sut.get("top") or []
    per: list[dict[str, Any]] = []
    onset = None
    for i in range(last + 1):
        tok = rt[i]
        lr = ref["logprobs"][i]
        ls = sut["logprobs"][i] if st[i] == tok else _lp_of(tok, sut_top[i]
                                                           if i < len(sut_top) else None)
        d = None if lr is None or ls is None else ls - lr
        where = locate(sut_view, i)
        rwhere = locate(ref_view, i)
        per.append({"i": i, "ref_tok": tok, "sut_tok": st[i], "ref_lp": lr, "sut_lp_of_ref": ls,
                    "d": d, "sut_step": None if where is None else sut_view[where[0]]["step"],
                    "sut_j": None if where is None else where[1],
                    "ref_step": None if rwhere is None else ref_view[rwhere[0]]["step"],
                    "ref_top": ref_top[i] if i < len(ref_top) else None,
                    "sut_top": sut_top[i] if i < len(sut_top) else None})
        off = (d is None and i == flip) or (d is not None and abs(d) > DEV_DLOGPROB)
        if onset is None and off:
            onset = i
    margin = None
    if flip is not None and flip < len(ref_top) and len(ref_top[flip]) > 1:
        margin = ref_top[flip][0][1] - ref_top[flip][1][1]
    agreed = [abs(p["d"]) for p in per if p["d"] is not None and (flip is None or p["i"] < flip)]
    out: dict[str, Any] = {
        "equal": flip is None, "flip": flip, "onset": onset, "ref_margin": margin,
        "max_abs_d_before_flip": max(agreed, default=None), "per_token": per,
        "at_onset": _where(onset, sut_view, ref_view), "at_flip": _where(flip, sut_view,
                                                                         ref_view),
        "window": _window(onset, flip, sut_view),
        "sut_steps": len(sut_view), "ref_steps": len(ref_view),
    }
    return out


def _where(index: int | None, sut_view: Sequence[Mapping[str, Any]],
           ref_view: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The step that emitted token `index` on each engine, with the speculative one's
    previous step (where the state it started from was written)."""
    if index is None:
        return None
    got = locate(sut_view, index)
    rgot = locate(ref_view, index)
    return {"index": index,
            "j": None if got is None else got[1],
            "step": None if got is None else dict(sut_view[got[0]]),
            "prev": None if got is None or got[0] == 0 else dict(sut_view[got[0] - 1]),
            "ref_step": None if rgot is None else dict(ref_view[rgot[0]])}


def _window(onset: int | None, flip: int | None,
            view: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The speculative engine's steps from WINDOW_BEFORE steps before the onset's step to
    the step after the flip's."""
    first = onset if onset is not None else flip
    if first is None:
        return []
    a = locate(view, first)
    b = locate(view, flip if flip is not None else first)
    if a is None:
        return []
    end = (b[0] if b is not None else a[0]) + 1
    return [dict(s) for s in view[max(0, a[0] - WINDOW_BEFORE):end + 1]]


def _path(st: Mapping[str, Any] | None) -> str:
    if st is None:
        return "no probe record"
    gdn = st.get("gdn")
    kind = ("spec" if st.get("spec_row") else "non-spec") if gdn is not None else "GDN unknown"
    batch = "" if gdn is None else f", batch prefills/decodes/spec {gdn[0]}/{gdn[1]}/{gdn[2]}"
    return (f"step {st['step']} ({kind} GDN path{batch}, {st['drafts']} drafts, "
            f"{st['batch'][0]} requests, graph {st.get('cg')})")


def hypothesis(c: Mapping[str, Any] | None) -> str:
    """One line from the target's comparison: where the divergence starts and which of the
    speculative path's cases it falls in."""
    if c is None:
        return "not traced: the target request has rows on one engine only (see errors)"
    if c["equal"]:
        return ("not reproduced: ON's tokens equal O0's on this request in this run; "
                "compare the @fresh / in-order phases and the diag run's engine history")
    k = c["onset"] if c["onset"] is not None else c["flip"]
    m = c["ref_margin"]
    head = (f"token {c['flip']} flips (ref margin {'?' if m is None else f'{m:.2f}'}), "
            f"deviation starts at token {k}")
    loc = c["at_onset"]
    if loc is None or loc["step"] is None:
        return head + ": no probe event emitted it (probe missing or request id unmatched)"
    st, j, prev = loc["step"], loc["j"], loc["prev"]
    prev_n = None if prev is None else len(prev["emitted"])
    facts = (f"{head}, emitted at position {j} of {_path(st)}; the step before emitted "
             f"{prev_n} tokens (acc synced {st['acc_in']}, used {st['acc_used']}, "
             f"R7 settled: {st['settled']}); O0: {_path(loc['ref_step'])}")
    if st["spec_row"] is None and not j:
        cause = ("the step's GDN path is unknown (the metadata probe recorded nothing); "
                 "read acc_in / acc_used / settled")
    elif j:
        cause = (f"the verifier's logits at draft position {j} deviate, so the in-step "
                 "state or multi-token attention of the speculative path is off, not the "
                 "state carried in")
    elif prev_n is not None and prev_n > 1:
        if st["spec_row"] is False and not st["settled"]:
            cause = ("stale carried state: after an acceptance the row read slot 0 on the "
                     "non-speculative path and R7 did not settle it")
        elif st["spec_row"] is False:
            cause = ("R7 settled the row, yet the carried state deviates: the settle's copy "
                     "(temporal slot or conv shift) is not what the speculative path reads")
        else:
            cause = ("the speculative path's read of the state carried after an acceptance "
                     "(slot acc-1, conv offset acc-1) deviates in this batch")
    else:
        cause = ("no acceptance right before it: the state comes from a one-token step; a "
                 "kernel-path / batch-composition difference (see the window's paths)")
    gdn = st.get("gdn")
    if st["spec_row"] is False and gdn is not None and gdn[2] > 0:
        # gdn_attn.py: with any row drafting, vLLM runs the non-drafting decodes through
        # the prefill kernels as one-token prefills
        cause += "; the row ran as a one-token prefill beside drafting rows"
    return f"{facts}: {cause}"


def compact(c: Mapping[str, Any]) -> dict[str, Any]:
    """A comparison without its per-token rows."""
    return {k: v for k, v in c.items() if k != "per_token"}


def analyse(engines: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Every request both engines ran, compared; the target's detail and hypothesis."""
    ref, sut = engines.get(REFERENCE) or {}, engines.get(SPECULATIVE) or {}
    out: dict[str, Any] = {"target": None, "target_phase": None, "variants": {},
                           "unequal": [], "requests": 0, "equal_requests": 0}
    variants: dict[str, dict[str, Any]] = {}
    for phase, rrows in (ref.get("phases") or {}).items():
        srows = (sut.get("phases") or {}).get(phase)
        if not srows or len(srows) != len(rrows):
            continue
        rev = (ref.get("events") or {}).get(phase, [])
        sev = (sut.get("events") or {}).get(phase, [])
        for i, (r, s) in enumerate(zip(rrows, srows, strict=True)):
            c = compare_traces(r, s, request_steps(rev, r.get("request_id")),
                               request_steps(sev, s.get("request_id")))
            out["requests"] += 1
            out["equal_requests"] += c["equal"]
            src = source_of(phase, i)
            if src == (TARGET_PHASE, TARGET_REQUEST):
                variants[phase] = c
            if not c["equal"]:
                out["unequal"].append({"phase": phase, "request": i, "flip": c["flip"],
                                       "onset": c["onset"], "ref_margin": c["ref_margin"],
                                       "at_onset": c["at_onset"], "hypothesis": hypothesis(c)})
    # The diag's own replay (after the same history) unless only the fresh one lost the
    # token; either when the other did not run.
    order = [p for p in (TARGET_PHASE, TARGET_PHASE + FRESH) if p in variants]
    lost = [p for p in order if not variants[p]["equal"]]
    if order:
        pick = (lost or order)[0]
        out["target"], out["target_phase"] = variants[pick], pick
    out["variants"] = {k: compact(v) for k, v in variants.items()}
    return out


def summary_part(a: Mapping[str, Any]) -> dict[str, Any]:
    """What summary.json says of an analysis; `passed`: the target was traced with events."""
    c = a["target"]
    traced = c is not None and c["sut_steps"] > 0 and c["ref_steps"] > 0
    part: dict[str, Any] = {
        "passed": traced, "reproduced": None if c is None else not c["equal"],
        "target_phase": a["target_phase"],
        "hypothesis": hypothesis(c),
        "requests": a["requests"], "equal_requests": a["equal_requests"],
        "unequal": a["unequal"],
        "variants": {k: {x: v.get(x) for x in ("equal", "flip", "onset", "ref_margin")}
                     for k, v in a["variants"].items()},
    }
    if c is not None:
        part["target"] = compact(c) | {"per_token": [
            {k: p[k] for k in ("i", "ref_tok", "sut_tok", "ref_lp", "sut_lp_of_ref", "d",
                               "sut_step", "sut_j")}
            for p in c["per_token"][:max(TRACE_TOKENS, (c["flip"] or 0) + 1)]]}
    return part


# --- the probe (engine process only) --------------------------------------------------------

def _as_list(x: Any) -> list[Any]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


class StepProbe:
    """Test instrumentation, not product code: records each model-runner step of the engine
    it is installed in. Wraps, on the runner instance, `_prepare_inputs` (the batch, the
    scheduled drafts, the accepted counts after R7), `_determine_batch_execution_and_padding`
    (the CUDA graph mode) and `_update_states_after_model_execute` (the emitted tokens; it
    closes the step); on vLLM's GDN metadata builder class, `build` (the batch's split);
    in R7's module, `rows_to_settle` (the counts vLLM synchronised and the rows R7 moves).
    Every wrapper returns what the wrapped function returned."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.cur: dict[str, Any] | None = None
        self.count = 0
        self.errors: list[str] = []
        self.runner: Any = None

    # one step's record
    def begin(self, runner: Any, so: Any) -> None:
        if self.cur is not None:  # a step that sampled nothing
            self.cur["unsampled"] = True
            self.steps.append(self.cur)
        batch = runner.input_batch
        n = int(batch.num_reqs)
        rids = [str(r) for r in list(batch.req_ids)[:n]]
        spec = so.scheduled_spec_decode_tokens
        self.cur = {"i": self.count, "rids": rids,
                    "computed": [int(x) for x in _as_list(batch.num_computed_tokens_cpu)[:n]],
                    "prompt": [int(x) for x in _as_list(batch.num_prompt_tokens)[:n]],
                    "sched": [int(so.num_scheduled_tokens.get(r, 0)) for r in rids],
                    "draft_ids": [None if r not in spec else [int(t) for t in spec[r]]
                                  for r in rids],
                    "r7": None, "gdn": [], "cg": None, "out": None}
        self.count += 1

    def after_prepare(self, runner: Any) -> None:
        if self.cur is not None:
            n = len(self.cur["rids"])
            self.cur["acc"] = [int(x) for x in _as_list(
                runner.input_batch.num_accepted_tokens_cpu)[:n]]

    def on_settle_rows(self, req_ids: Sequence[Any], accepted: Any, rows: Sequence[Any]) -> None:
        if self.cur is not None:
            self.cur["r7"] = {"acc": [int(x) for x in _as_list(accepted)[:len(req_ids)]],
                              "rows": [str(s.req_id) for s in rows]}

    def on_batch_mode(self, result: Any) -> None:
        if self.cur is not None:
            mode, desc = result[0], result[1]
            self.cur["cg"] = str(mode)
            self.cur["desc"] = {k: getattr(desc, k, None)
                                for k in ("num_tokens", "num_reqs", "uniform")}

    def on_gdn(self, meta: Any, num_decode_draft_tokens_cpu: Any) -> None:
        if self.cur is None:
            return
        acc = getattr(meta, "num_accepted_tokens", None)
        rec = {"p": int(meta.num_prefills), "d": int(meta.num_decodes),
               "s": int(meta.num_spec_decodes),
               "acc": None if acc is None else [int(x) for x in _as_list(acc)],
               "ddt": None if num_decode_draft_tokens_cpu is None else
               [int(x) for x in _as_list(num_decode_draft_tokens_cpu)]}
        if rec not in self.cur["gdn"]:
            self.cur["gdn"].append(rec)

    def end(self, output_token_ids: Any) -> None:
        if self.cur is not None:
            self.cur["out"] = [[int(t) for t in row] for row in _as_list(output_token_ids)]
            self.steps.append(self.cur)
            self.cur = None

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        """A probe failure is recorded, never raised into the engine's step."""
        try:
            fn()
        except Exception as exc:
            if len(self.errors) < 20:
                self.errors.append(f"{what}: {type(exc).__name__}: {exc}")

    # installation
    def install_runner(self, runner: Any) -> None:
        prep = runner._prepare_inputs
        mode = runner._determine_batch_execution_and_padding
        post = runner._update_states_after_model_execute

        def _prepare_inputs(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._guard("begin", lambda: self.begin(runner, scheduler_output))
            out = prep(scheduler_output, *args, **kwargs)
            self._guard("after_prepare", lambda: self.after_prepare(runner))
            return out

        def _determine(*args: Any, **kwargs: Any) -> Any:
            out = mode(*args, **kwargs)
            self._guard("batch_mode", lambda: self.on_batch_mode(out))
            return out

        def _post(output_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
            self._guard("end", lambda: self.end(output_token_ids))
            return post(output_token_ids, *args, **kwargs)

        runner._prepare_inputs = _prepare_inputs
        runner._determine_batch_execution_and_padding = _determine
        runner._update_states_after_model_execute = _post

    def install_gdn(self, builder_cls: Any) -> None:
        build = builder_cls.build

        def wrapped(builder: Any, *args: Any, **kwargs: Any) -> Any:
            meta = build(builder, *args, **kwargs)
            self._guard("gdn", lambda: self.on_gdn(
                meta, kwargs.get("num_decode_draft_tokens_cpu")))
            return meta

        builder_cls.build = wrapped

    def install_settle(self, module: Any) -> None:
        rows_to_settle = module.rows_to_settle

        def wrapped(req_ids: Any, accepted: Any, *args: Any, **kwargs: Any) -> Any:
            before = _as_list(accepted)  # R7 resets these counts right after
            rows = rows_to_settle(req_ids, accepted, *args, **kwargs)
            self._guard("settle", lambda: self.on_settle_rows(list(req_ids), before, rows))
            return rows

        module.rows_to_settle = wrapped

    def install_on_worker(self, worker: Any) -> dict[str, Any]:
        """Through collective_rpc (the worker object itself in this process)."""
        runner = worker.model_runner
        info: dict[str, Any] = {"runner": type(runner).__name__,
                                "mamba_cache_mode": getattr(runner.cache_config,
                                                            "mamba_cache_mode", None)}
        self.install_runner(runner)
        self.runner = runner
        try:
            from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

            self.install_gdn(GDNAttentionMetadataBuilder)
            info["gdn"] = "wrapped"
        except Exception as exc:
            info["gdn"] = f"{type(exc).__name__}: {exc}"
        try:
            from vllm_patch.spec_decode import accepted_state

            self.install_settle(accepted_state)
            info["r7"] = accepted_state.outcome()
        except Exception as exc:
            info["r7"] = f"{type(exc).__name__}: {exc}"
        return info

    def settled_counts(self) -> Any:
        return None if self.runner is None else self.runner.__dict__.get("_sm70_settled")


def top_n(output: Any) -> list[list[list[Any]]]:
    """Per generated token of a RequestOutput, its log-probs ranked: [[token, logprob]...]
    (vLLM's top-n plus the sampled token when it is not among them)."""
    c = output.outputs[0]
    return [[[int(t), float(lp.logprob)] for t, lp in sorted(step.items(),
                                                             key=lambda kv: -kv[1].logprob)]
            for step in (c.logprobs or [])]


def engine_main(a: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from ab_side import run_phase
    from spec_engine import _KeepOutputs, engine_facts, greedy, run_engine, run_stages

    res: dict[str, Any] = {"name": a.engine, "error": None, "phases": {}, "events": {},
                           "phase_errors": {}, "phase_seconds": {}}
    probe = StepProbe()

    def body(llm: Any, flush: Callable[[], None]) -> None:
        res["engine"] = engine_facts(llm)
        try:
            res["probe"] = llm.collective_rpc(probe.install_on_worker)[0]
        except Exception as exc:
            res["probe"] = f"{type(exc).__name__}: {exc}"
        flush()

        def one_phase(phase: str, subs: list[list[dict[str, Any]]]) -> None:
            rows: list[dict[str, Any]] = []
            events: list[dict[str, Any]] = []
            for k, sub in enumerate(subs):
                sps = []
                for r in sub:
                    sp = greedy(r["max_tokens"])
                    sp.logprobs = TOP_N  # the diag's sampling with more log-probs
                    sps.append(sp)
                keep = _KeepOutputs(llm)
                first = len(probe.steps)
                got = run_phase(keep, sps, [r["prompt"] for r in sub])
                for r, row, o in zip(sub, got, keep.outputs, strict=True):
                    row.update(max_tokens=r["max_tokens"], shared=r["shared"],
                               request_id=getattr(o, "request_id", None), top=top_n(o))
                rows += got
                events += [dict(s, sub=k) for s in probe.steps[first:]]
                res["phases"][phase] = rows
                res["events"][phase] = events
                res["probe_steps"] = probe.count
                res["probe_errors"] = probe.errors
                flush()

        run_stages(a.plan_dir, a.deadline, res, flush, one_phase)
        res["settled"] = probe.settled_counts()

    return run_engine(res, a.kwargs, a.result, body)


# --- the driver -----------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, help="the job's output folder (driver)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--work", type=Path, default=Path("/tmp/spec_trace"))
    eng = ap.add_argument_group("one engine process (started by the driver)")
    eng.add_argument("--engine", choices=ENGINES)
    eng.add_argument("--kwargs", type=Path)
    eng.add_argument("--result", type=Path)
    eng.add_argument("--plan-dir", type=Path)
    eng.add_argument("--deadline", type=float, help="epoch seconds")
    a = ap.parse_args(argv)
    if a.engine:
        missing = [f"--{k.replace('_', '-')}" for k in ("kwargs", "result", "plan_dir",
                                                        "deadline") if getattr(a, k) is None]
        if missing:
            ap.error(f"--engine {a.engine}: also needs {' '.join(missing)}")
    elif a.out is None:
        ap.error("--out is required (the job's output folder)")
    elif a.budget_s <= MARGIN_S:
        ap.error(f"--budget-s {a.budget_s}: must exceed the {MARGIN_S} s kept for writing")
    return a


def target_trace(engines: Mapping[str, Mapping[str, Any]], a: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """trace.json: the target request's comparison, rows and both engines' steps."""
    phase = a["target_phase"]
    req = TARGET_REQUEST if phase != TARGET_PHASE + ALONE else 0
    out: dict[str, Any] = {"phase": phase, "request": req, "comparison": a["target"]}
    for name in ENGINES:
        e = engines.get(name) or {}
        rows = ((e.get("phases") or {}).get(phase) or []) if phase else []
        row = rows[req] if len(rows) > req else None
        out[name] = {"row": row, "steps": None if row is None else request_steps(
            (e.get("events") or {}).get(phase, []), row.get("request_id"))}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.engine:
        return engine_main(a)
    t0 = time.time()
    deadline = t0 + a.budget_s - MARGIN_S
    out, work = a.out, a.work
    out.mkdir(parents=True, exist_ok=True)
    plan_dir = fresh_plan_dir(work)
    tiny, _share, util = engine_share(len(ENGINES), DEFAULT_SHARE)
    configs = engine_kwargs(tiny, util)
    summary: dict[str, Any] = {"passed": None, "started": utc_stamp(),
                               "target_request": [TARGET_PHASE, TARGET_REQUEST],
                               "dev_dlogprob": DEV_DLOGPROB, "engine_kwargs": configs}
    flush = summary_writer(out / "summary.json", summary, t0)
    stage1 = trace_plan(DIAG_BLOCK)
    atomic_write(plan_dir / "stage1.json", stage1)
    summary["plan_block_size"] = DIAG_BLOCK
    flush()
    procs, files = launch(
        configs, work,
        lambda name, kw_path, result: [
            sys.executable, str(Path(__file__).resolve()), "--engine", name, "--kwargs",
            str(kw_path), "--result", str(result), "--plan-dir", str(plan_dir),
            "--deadline", str(deadline)],
        lambda name: side_env("ours", {"VLLM_CACHE_ROOT": f"/tmp/vc_trace_{name}"}),
        start)
    engines: dict[str, dict[str, Any]] = {}
    stage2: dict[str, Any] | None = None
    last_snapshot = 0.0

    def judge() -> None:
        try:
            a_ = analyse(engines)
            summary.update(summary_part(a_))
            atomic_write(out / "trace.json", target_trace(engines, a_))
        except Exception as exc:  # the rows stay in engines.json; the judge can be redone
            summary["judge_error"] = f"{type(exc).__name__}: {exc}"

    def tick() -> None:
        nonlocal stage2, last_snapshot
        if time.time() - last_snapshot > SNAPSHOT_S:  # engines.json is megabytes
            snapshot(out, work, files, engines)
            last_snapshot = time.time()
        else:
            read_engines(files, engines)
        if stage2 is None:
            seed = rules.seed_source(engines, (REFERENCE,))
            if seed:
                try:
                    stage2 = sc.stage2_plan(stage1["phases"]["seed"][0][0]["prompt"], seed[1],
                                            seed[0])
                except sc.CaseError as exc:
                    stage2 = {"error": str(exc)}
                    summary["plan_error"] = str(exc)
                else:
                    atomic_write(plan_dir / "stage2.json", stage2)
        summary["block_sizes"] = {n: ((engines.get(n) or {}).get("engine") or {}).get(
            "block_size") for n in ENGINES}
        summary["progress"] = rules.progress(engines, ENGINES, count_key="phases")
        summary["probe"] = {n: {k: (engines.get(n) or {}).get(k)
                                for k in ("probe", "probe_steps", "probe_errors", "settled")}
                            for n in ENGINES}
        judge()
        flush()

    watch(procs, deadline, tick)
    stop(procs)
    snapshot(out, work, files, engines)
    summary["errors"] = {k: e.get("error") for k, e in engines.items() if e.get("error")}
    judge()
    if summary.get("passed") is None:
        summary["passed"] = False
    flush()
    log(f"passed={summary['passed']} reproduced={summary.get('reproduced')}")
    log(f"hypothesis: {summary.get('hypothesis')}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
