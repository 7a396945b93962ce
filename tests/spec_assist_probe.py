"""Runs in the serving venv with vLLM 0.22.1's Python tree first on the path (see
tests/vllm_cpu_tree.py): the n-gram assist hook (R-ASSIST) against vLLM's own classes on
the CPU. Driven by tests/test_spec_assist.py.

Request (JSON file argv[1]) -> result (JSON file argv[2]):
- "install": what the plugin's `register()` reports before vLLM's runner module is
  imported (deferred), that importing it wraps vLLM's real `propose_draft_token_ids` (the
  original kept, its parameters unchanged), a second install a no-op, and that runners
  other than MTP get vLLM's drafts back untouched;
- "simulate": requests in vLLM's real `InputBatch` (CPU) on a stand-in runner, stepped
  through the installed wrapper with a stand-in MTP drafter and an oracle verifier that
  knows each request's true continuation; between steps the batch is reordered with
  vLLM's `swap_states`, a request finishes (`remove_request` + `condense`), a new one takes
  its row, one is preempted and resumed, and one step leaves a request's drafts
  unscheduled. Beside it runs a pure-Python mirror built from the reference definitions
  (ngram.propose, chooser.observe / choose / counterfactual): every step, each row's
  returned drafts, the method chosen and both EWMAs are compared with the mirror's;
- "front": a folder put first on sys.path (the test's mutated copy of vllm_patch).
"""

from __future__ import annotations

import os

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

K = 3
VOCAB = 1000
MAX_REQS = 8
MAX_LEN = 2048
# MTP drafts that never match: ids the oracle's texts never use
WRONG = [VOCAB - 1, VOCAB - 2, VOCAB - 3]


def spec(method: str = "mtp", sample: str = "greedy") -> Any:
    return SimpleNamespace(method=method, num_speculative_tokens=K,
                           disable_padded_drafter_batch=False, draft_sample_method=sample)


def new_runner(method: str = "mtp") -> Any:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    ib = InputBatch(max_num_reqs=MAX_REQS, max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN,
                    device=torch.device("cpu"), pin_memory=False, vocab_size=VOCAB,
                    block_sizes=[16], kernel_block_sizes=[16])
    return SimpleNamespace(input_batch=ib, requests={}, speculative_config=spec(method),
                           discard_request_mask=SimpleNamespace(
                               gpu=torch.zeros(MAX_REQS, dtype=torch.bool)),
                           max_num_reqs=MAX_REQS, max_model_len=MAX_LEN,
                           device=torch.device("cpu"))


# --- the texts the oracle verifier knows ---------------------------------------------------

def texts(seed: int) -> dict[str, dict[str, Any]]:
    """Per request: its whole true sequence, the prompt length and how the stand-in MTP
    drafts. `copy_*` repeat a 12-token cycle (n-gram drafts are right), `rand_*` are
    random (n-gram drafts, when any, are mostly wrong)."""
    rng = random.Random(seed)

    def cycle(n: int) -> list[int]:
        pat = [rng.randrange(900) for _ in range(12)]
        return (pat * (n // 12 + 1))[:n]

    def rand(n: int) -> list[int]:
        return [rng.randrange(900) for _ in range(n)]

    return {
        "copy_mtp_bad": {"seq": cycle(400), "prompt": 60, "mtp": "wrong"},
        "rand_mtp_good": {"seq": rand(400), "prompt": 40, "mtp": "truth"},
        "copy_mtp_good": {"seq": cycle(400), "prompt": 30, "mtp": "truth"},  # a tie: MTP
        "rand_mtp_bad": {"seq": rand(400), "prompt": 50, "mtp": "wrong"},
        "late": {"seq": cycle(400), "prompt": 36, "mtp": "wrong"},
    }


def mtp_draft(t: dict[str, Any], pos: int) -> list[int]:
    """What the stand-in MTP proposes for a request that holds `pos` tokens."""
    if t["mtp"] == "truth":
        return list(t["seq"][pos:pos + K])
    return list(WRONG)


# --- the pure-Python mirror ------------------------------------------------------------------

class Mirror:
    def __init__(self, n_min: int, n_max: int) -> None:
        from vllm_patch.spec_decode.chooser import Acceptance

        self.n_min, self.n_max = n_min, n_max
        self.acc: dict[str, Any] = {}
        self.prev: dict[str, tuple[list[int], list[int], bool]] = {}
        self.new = Acceptance

    def step(self, rid: str, ctx_before: list[int], produced: list[int], verified: bool,
             mtp: list[int]) -> tuple[list[int], str]:
        from vllm_patch.spec_decode.chooser import choose, counterfactual, observe
        from vllm_patch.spec_decode.ngram import accepted_prefix, propose

        state = self.acc.setdefault(rid, self.new())
        prev = self.prev.get(rid)
        if prev is not None and verified and produced:
            pm, pn, used = prev
            accepted = len(produced) - 1
            other = pm if used else pn
            cf = counterfactual(accepted_prefix(other, produced), accepted, K) if other else None
            m_s = cf if used else accepted
            n_s = accepted if used else cf
            state = observe(state, mtp=m_s, ngram=n_s if pn else None)
        ctx = ctx_before + produced
        ng = propose(ctx, K, self.n_min, self.n_max)
        method = choose(state, ngram_has_draft=bool(ng))
        self.acc[rid] = state
        self.prev[rid] = (list(mtp), ng, method == "ngram")
        return (ng if method == "ngram" else list(mtp)), method

    def drop(self, rid: str) -> None:
        self.acc.pop(rid, None)
        self.prev.pop(rid, None)


# --- the simulation --------------------------------------------------------------------------

def add(runner: Any, rid: str, tokens: list[int], prompt: int) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    st = CachedRequestState(req_id=rid, prompt_token_ids=list(tokens[:prompt]), mm_features=[],
                            sampling_params=SamplingParams(max_tokens=400), generator=None,
                            block_ids=([],), num_computed_tokens=0,
                            output_token_ids=list(tokens[prompt:]))
    runner.requests[rid] = st
    runner.input_batch.add_request(st)
    runner.input_batch.refresh_metadata()


def remove(runner: Any, rid: str) -> None:
    runner.input_batch.remove_request(rid)
    runner.input_batch.condense()
    runner.input_batch.refresh_metadata()  # as vLLM's _update_states does after condensing
    runner.requests.pop(rid)


def simulate(steps: int, seed: int) -> dict[str, Any]:
    from vllm_patch.config import SpecConfig
    from vllm_patch.spec_decode import runner_hook

    cfg = SpecConfig()
    runner = new_runner()
    tx = texts(seed)
    # the tokens each request holds (prompt + accepted output), as vLLM's bookkeeping keeps
    held: dict[str, list[int]] = {}
    pending: dict[str, list[int]] = {}  # the drafts handed out last step, per request
    mirror = Mirror(cfg.ngram_min, cfg.ngram_max)
    calls: list[list[list[int]]] = []  # what the stub drafter was asked to return

    def stub(self: Any, scheduler_output: Any, sampled: Any, *args: Any, **kw: Any) -> Any:
        rows = [mtp_draft(tx[r], len(held[r])) for r in self.input_batch.req_ids]
        calls.append(rows)
        return torch.tensor(rows, dtype=torch.int64)

    wrapped = runner_hook.assist_method(stub, cfg)
    log: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    chose: dict[str, list[str]] = {}
    skip_step = {"copy_mtp_bad": 5}  # that step schedules no drafts for it
    for name in ("copy_mtp_bad", "rand_mtp_good", "copy_mtp_good", "rand_mtp_bad"):
        held[name] = list(tx[name]["seq"][: tx[name]["prompt"]])
        add(runner, name, held[name], tx[name]["prompt"])
    events: list[str] = []
    gone: set[str] = set()
    for step in range(steps):
        ib = runner.input_batch
        if step == 4:
            ib.swap_states(0, 2)
            events.append(f"{step}: swap_states(0, 2)")
        if step == 6:
            remove(runner, "rand_mtp_good")
            gone.add("rand_mtp_good")
            mirror.drop("rand_mtp_good")
            events.append(f"{step}: rand_mtp_good finished")
        if step == 7:
            held["late"] = list(tx["late"]["seq"][: tx["late"]["prompt"]])
            add(runner, "late", held["late"], tx["late"]["prompt"])
            events.append(f"{step}: late added")
        if step == 9:
            remove(runner, "copy_mtp_good")
            mirror.drop("copy_mtp_good")
            events.append(f"{step}: copy_mtp_good preempted")
        if step == 11:  # resumed with the tokens it had (vLLM re-adds it with its outputs)
            add(runner, "copy_mtp_good", held["copy_mtp_good"], tx["copy_mtp_good"]["prompt"])
            events.append(f"{step}: copy_mtp_good resumed")
        req_ids = list(ib.req_ids)
        width = 1 if step == 0 else K + 1
        sampled_rows, spec_tokens, produced_of = [], {}, {}
        for r in req_ids:
            seq, pos = tx[r]["seq"], len(held[r])
            drafts = pending.get(r)
            verified = drafts is not None and skip_step.get(r) != step
            if verified:
                spec_tokens[r] = [0] * K
                ok = 0
                for d, t in zip(drafts, seq[pos:pos + K], strict=False):
                    if d != t:
                        break
                    ok += 1
                produced = list(seq[pos:pos + ok + 1])
            else:
                produced = [seq[pos]]
            produced_of[r] = produced
            sampled_rows.append(produced + [-1] * (width - len(produced)))
        sampled = torch.tensor(sampled_rows, dtype=torch.int64)
        so = SimpleNamespace(scheduled_spec_decode_tokens=spec_tokens)
        want_rows, want_method = {}, {}
        for r in req_ids:
            ctx_before = list(held[r])
            mtp_next = mtp_draft(tx[r], len(held[r]) + len(produced_of[r]))
            want_rows[r], want_method[r] = mirror.step(r, ctx_before, produced_of[r],
                                                       r in spec_tokens, mtp_next)
        for r in req_ids:  # vLLM's bookkeeping before the drafter runs (outputs held)
            held[r] += produced_of[r]
        for r in req_ids:
            st = runner.requests[r]
            st.output_token_ids[:] = held[r][tx[r]["prompt"]:]
        out = wrapped(runner, so, sampled, None, None, None, None, None, None, None)
        state = runner.__dict__[runner_hook.STATE_ATTR]
        got = out.tolist()
        entry: dict[str, Any] = {"step": step, "rows": req_ids, "methods": {}}
        for i, r in enumerate(req_ids):
            method = "ngram" if got[i] != calls[-1][i] else "mtp"
            chose.setdefault(r, []).append(method)
            entry["methods"][r] = method
            ewma = state.acceptance(r)
            ref = mirror.acc[r]
            close = all((a is None and b is None) or (a is not None and b is not None
                                                        and abs(a - b) < 1e-6)
                        for a, b in zip(ewma, (ref.mtp, ref.ngram), strict=True))
            if got[i] != want_rows[r] or want_method[r] != method or not close:
                mismatches.append({"step": step, "request": r, "row": i, "got": got[i],
                                   "want": want_rows[r], "want_method": want_method[r],
                                   "ewma": ewma, "want_ewma": [ref.mtp, ref.ngram]})
            pending[r] = got[i]
        for r in list(pending):
            if r not in req_ids:
                pending.pop(r)
        log.append(entry)
    state = runner.__dict__[runner_hook.STATE_ATTR]
    return {"mismatches": mismatches[:20], "num_mismatches": len(mismatches),
            "chose": chose, "events": events, "stats": state.stats(),
            "gone_have_state": {r: state.acceptance(r) != (None, None) for r in gone},
            "slots_live": sorted(state.slot_of),
            "log": log[:3]}


def install_case() -> dict[str, Any]:
    out: dict[str, Any] = {}
    os.environ["SM70_PLUGIN_CONFIG"] = json.dumps({"spec": {"ngram_assist": True}})
    out["runner_imported_before"] = "vllm.v1.worker.gpu_model_runner" in sys.modules
    from vllm_patch import plugin

    out["register"] = plugin.register()["ngram_assist"]
    import vllm.v1.worker.gpu_model_runner as gmr

    from vllm_patch.config import SpecConfig
    from vllm_patch.spec_decode import runner_hook

    f = gmr.GPUModelRunner.__dict__["propose_draft_token_ids"]
    original = getattr(f, runner_hook.REPLACES, None)
    out["outcome"] = runner_hook.outcome()
    out["wrapped"] = bool(getattr(f, runner_hook.MARK, False))
    out["original_is_vllms"] = (original is not None
                                and original.__module__ == gmr.__name__
                                and original.__qualname__ ==
                                "GPUModelRunner.propose_draft_token_ids")
    out["original_params"] = list(__import__("inspect").signature(original).parameters) \
        if original else None
    out["second_install"] = runner_hook.install(SpecConfig())
    # runners the assist does not apply to get vLLM's tensor back, the same object
    drafts = torch.tensor([[5, 6, 7]])
    stub = runner_hook.assist_method(lambda *a, **k: drafts, SpecConfig())
    passthrough = {}
    for name, sp in (("ngram", spec("ngram")), ("eagle", spec("eagle")),
                     ("probabilistic", spec("mtp", "probabilistic")), ("none", None)):
        r = new_runner()
        r.speculative_config = sp
        got = stub(r, SimpleNamespace(scheduled_spec_decode_tokens={}),
                   torch.tensor([[1]]), None, None, None, None, None, None, None)
        passthrough[name] = {"same_object": got is drafts,
                             "stats": runner_hook.stats(r)}
    # a step that fails (here: a runner without vLLM's discard mask) hands vLLM's drafts
    # back and turns the assist off for that runner
    r = new_runner()
    del r.discard_request_mask
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    st = CachedRequestState(req_id="a", prompt_token_ids=[1, 2, 3], mm_features=[],
                            sampling_params=SamplingParams(), generator=None, block_ids=([],),
                            num_computed_tokens=0, output_token_ids=[])
    r.requests["a"] = st
    r.input_batch.add_request(st)
    got = stub(r, SimpleNamespace(scheduled_spec_decode_tokens={}), torch.tensor([[1]]),
               None, None, None, None, None, None, None)
    passthrough["failing_step"] = {"same_object": got is drafts, "stats": runner_hook.stats(r)}
    out["passthrough"] = passthrough
    out["refused_foreign"] = _refusals()
    return out


def _refusals() -> dict[str, str]:
    from vllm_patch.spec_decode import runner_hook as rh

    def other(self: Any, a: Any, b: Any) -> None:  # a foreign signature
        return None

    got = {}
    for name, (func, version) in {"version": (other, "0.23.0"),
                                  "params": (other, "0.22.1")}.items():
        try:
            rh.check_target(func, version)
            got[name] = "accepted"
        except rh.AssistPatchError as exc:
            got[name] = str(exc)
    return got


def main() -> int:
    request = json.loads(Path(sys.argv[1]).read_text())
    if request.get("front"):  # a mutated copy of vllm_patch, ahead of the repository's
        sys.path.insert(0, request["front"])
    result: dict[str, Any] = {}
    if "install" in request:
        result["install"] = install_case()
    if "simulate" in request:
        sim = request["simulate"]
        result["simulate"] = simulate(sim["steps"], sim["seed"])
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
