"""The speculation trace job (tests/gpu/serving/device_spec_trace.py) on the CPU: its plan
and engine settings against device_spec_diag's, the probe's wrappers on stand-in runner
objects, the pure comparison of two recorded traces on made-up steps, and the driver end to
end against the stand-in vLLM (tests/gpu/serving/fake_vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

SERVING = Path(__file__).resolve().parent / "gpu" / "serving"
sys.path.insert(0, str(SERVING))
sys.path.insert(0, str(SERVING.parent / "ab"))
import device_spec_diag as diag  # noqa: E402
import device_spec_trace as tr  # noqa: E402
import spec_cases as sc  # noqa: E402

from vllm_patch.spec_decode import accepted_state  # noqa: E402

# --- the cases --------------------------------------------------------------------------------


def test_engine_kwargs_are_the_diag_cells() -> None:
    tiny = Path("/tmp/ab/tiny")
    assert tr.engine_kwargs(tiny, 0.04) == diag.engine_kwargs(tiny, 0.04, {"O0", "ON"})


def test_plan_replays_the_target_fresh_alone_then_in_the_diag_order() -> None:
    base = sc.stage1_plan(528)
    plan = tr.trace_plan(528)
    names = list(plan["phases"])
    assert names[:2] == ["prefix_2b_minus1@fresh", "prefix_2b_minus1@alone"]
    assert names[2:] == list(base["phases"])
    target = base["phases"]["prefix_2b_minus1"]
    assert plan["phases"]["prefix_2b_minus1@fresh"] == target
    assert plan["phases"]["prefix_2b_minus1"] == target
    # request 2: the shared 1055 tokens plus one (the first alone, then the rest together)
    alone = plan["phases"]["prefix_2b_minus1@alone"]
    assert alone == [[target[1][1]]]
    assert len(alone[0][0]["prompt"]) == 2 * 528 and alone[0][0]["shared"] == 2 * 528 - 1
    assert tr.source_of("prefix_2b_minus1@alone", 0) == ("prefix_2b_minus1", 2)
    assert tr.source_of("prefix_2b_minus1@fresh", 2) == ("prefix_2b_minus1", 2)
    assert tr.source_of("trunc_cold", 1) == ("trunc_cold", 1)


def test_plan_without_the_target_phase_says_why() -> None:
    with pytest.raises(tr.TraceError, match="block_size=5000: stage 1 has no phase"):
        tr.trace_plan(5000)


# --- per-request steps ------------------------------------------------------------------------

def step(i: int, rows: list[dict[str, Any]], gdn: dict[str, Any] | None = None,
         r7: dict[str, Any] | None = None, cg: str = "PIECEWISE") -> dict[str, Any]:
    """A probe record; each row: rid, computed, prompt, sched, drafts (None: none), acc,
    out (the sampled row, -1 padded)."""
    return {"i": i, "rids": [r["rid"] for r in rows],
            "computed": [r["computed"] for r in rows], "prompt": [r["prompt"] for r in rows],
            "sched": [r["sched"] for r in rows], "draft_ids": [r.get("drafts") for r in rows],
            "acc": [r.get("acc", 1) for r in rows], "out": [r["out"] for r in rows],
            "gdn": [] if gdn is None else [gdn], "r7": r7, "cg": cg}


def row(rid: str, computed: int, sched: int, out: list[int], drafts: list[int] | None = None,
        prompt: int = 10, acc: int = 1) -> dict[str, Any]:
    return {"rid": rid, "computed": computed, "prompt": prompt, "sched": sched, "out": out,
            "drafts": drafts, "acc": acc}


# Request "7-abcd1234" (prompt 10) beside "8-ffff0000": a prefill in two chunks (the first
# emits nothing), a plain decode, a verification step with 3 drafts of which 2 are accepted
# (3 tokens out), then a step without drafts that R7 settles while "8" drafts.
STEPS = [
    step(0, [row("7-abcd1234", 0, 6, [99])], gdn={"p": 1, "d": 0, "s": 0, "ddt": None}),
    step(1, [row("7-abcd1234", 6, 4, [100])], gdn={"p": 1, "d": 0, "s": 0, "ddt": None}),
    step(2, [row("7-abcd1234", 10, 1, [101]), row("8-ffff0000", 10, 1, [500])],
         gdn={"p": 0, "d": 2, "s": 0, "ddt": None}),
    step(3, [row("7-abcd1234", 11, 4, [102, 103, 104, -1], drafts=[102, 103, 9]),
             row("8-ffff0000", 11, 1, [501, -1, -1, -1])],
         gdn={"p": 1, "d": 0, "s": 1, "ddt": [3, -1]}),
    step(4, [row("7-abcd1234", 14, 1, [105, -1, -1, -1], acc=1),
             row("8-ffff0000", 12, 4, [502, -1, -1, -1], drafts=[1, 2, 3])],
         gdn={"p": 1, "d": 0, "s": 1, "ddt": [-1, 3]},
         r7={"acc": [3, 1], "rows": ["7-abcd1234"]}),
]


def test_request_steps_follow_one_request() -> None:
    view = tr.request_steps(STEPS, "7")
    assert [v["step"] for v in view] == [0, 1, 2, 3, 4]
    assert [v["g0"] for v in view] == [None, 0, 1, 2, 5]
    assert [v["emitted"] for v in view] == [[], [100], [101], [102, 103, 104], [105]]
    assert [v["drafts"] for v in view] == [0, 0, 0, 3, 0]
    assert [v["accepted"] for v in view] == [0, 0, 0, 2, 0]
    assert [v["spec_row"] for v in view] == [False, False, False, True, False]
    assert view[4]["acc_in"] == 3 and view[4]["acc_used"] == 1 and view[4]["settled"]
    assert not view[3]["settled"] and view[3]["acc_in"] is None
    assert view[4]["batch"] == [2, 5] and view[4]["gdn"] == [1, 0, 1]
    other = tr.request_steps(STEPS, "8")
    assert [v["g0"] for v in other] == [1, 2, 3] and other[2]["spec_row"] is True
    assert not other[2]["settled"]
    # "7" must not take "71-...", nor an unknown id anything
    other_request = [step(0, [row("71-abcd1234", 10, 1, [5])])]
    assert tr.request_steps(other_request, "7") == []
    assert tr.request_steps(STEPS, "71") == [] and tr.request_steps(STEPS, None) == []


def test_locate_gives_the_step_and_the_position_in_it() -> None:
    view = tr.request_steps(STEPS, "7")
    assert tr.locate(view, 0) == (1, 0)
    assert tr.locate(view, 3) == (3, 1)
    assert tr.locate(view, 4) == (3, 2)
    assert tr.locate(view, 5) == (4, 0)
    assert tr.locate(view, 6) is None


# --- comparing two traces ---------------------------------------------------------------------

def traced(tokens: list[int], lps: list[float], second: float = -2.0) -> dict[str, Any]:
    """A row with top lists: the chosen token first, then token+1000 at `second`."""
    return {"tokens": tokens, "logprobs": lps, "request_id": "7",
            "top": [[[t, lp], [t + 1000, second]] for t, lp in zip(tokens, lps, strict=True)]}


REF_TOKENS = [100, 101, 102, 103, 104, 105]


def plain_view() -> list[dict[str, Any]]:
    steps = [step(0, [row("7-x", 0, 10, [100])], gdn={"p": 1, "d": 0, "s": 0, "ddt": None})]
    for k, t in enumerate(REF_TOKENS[1:]):
        steps.append(step(k + 1, [row("7-x", 10 + k, 1, [t])],
                          gdn={"p": 0, "d": 1, "s": 0, "ddt": None}, cg="FULL"))
    return tr.request_steps(steps, "7")


def test_compare_finds_the_onset_before_the_flip() -> None:
    ref = traced(REF_TOKENS, [-0.1] * 6)
    ref["top"][5] = [[105, -0.1], [777, -0.46], [5, -3.0]]  # a 0.36 margin at the flip
    # ON: same tokens up to 4, token 3 already 0.1 off, then 777 where O0 took 105
    sut = traced([100, 101, 102, 103, 104, 777], [-0.1, -0.11, -0.12, -0.2, -0.3, -0.2])
    sut["top"][5] = [[777, -0.2], [105, -0.3]]
    c = tr.compare_traces(ref, sut, plain_view(), tr.request_steps(STEPS, "7"))
    assert not c["equal"] and c["flip"] == 5 and c["onset"] == 3
    assert c["ref_margin"] == pytest.approx(0.36)
    assert c["per_token"][5]["sut_lp_of_ref"] == -0.3  # the reference token, from ON's top
    assert c["per_token"][3]["d"] == pytest.approx(-0.1)
    assert c["max_abs_d_before_flip"] == pytest.approx(0.2)
    assert c["at_onset"]["j"] == 1 and c["at_onset"]["step"]["step"] == 3
    assert c["at_onset"]["prev"]["step"] == 2 and c["at_onset"]["ref_step"]["step"] == 3
    assert c["at_flip"]["step"]["settled"] and c["at_flip"]["j"] == 0
    assert [s["step"] for s in c["window"]] == [0, 1, 2, 3, 4]


def test_compare_onset_is_the_flip_when_nothing_drifts_and_equal_runs_pass() -> None:
    ref = traced(REF_TOKENS, [-0.1] * 6)
    sut = traced([100, 101, 102, 103, 104, 106], [-0.1, -0.12, -0.1, -0.1, -0.1, -0.1])
    c = tr.compare_traces(ref, sut, plain_view(), tr.request_steps(STEPS, "7"))
    # the reference token is not in ON's top at the flip: no log-prob there, onset = flip
    assert c["flip"] == 5 and c["onset"] == 5 and c["per_token"][5]["d"] is None
    same = tr.compare_traces(ref, traced(REF_TOKENS, [-0.12] * 6), plain_view(),
                             tr.request_steps(STEPS, "7"))
    assert same["equal"] and same["flip"] is None and same["onset"] is None
    assert same["window"] == [] and "not reproduced" in tr.hypothesis(same)


def located(j: int, spec_row: bool | None, settled: bool, prev_emitted: int) -> dict[str, Any]:
    st = {"step": 9, "g0": 20, "emitted": [1, 2], "sched": 4, "drafts": 0 if not spec_row else 3,
          "acc_in": prev_emitted, "acc_used": 1 if settled else prev_emitted,
          "settled": settled, "spec_row": spec_row,
          "gdn": None if spec_row is None else [1, 0, 1], "cg": "PIECEWISE", "batch": [3, 6]}
    prev = dict(st, step=8, emitted=[0] * prev_emitted)
    return {"equal": False, "flip": 34, "onset": 20 + j, "ref_margin": 0.36,
            "at_onset": {"index": 20 + j, "j": j, "step": st, "prev": prev, "ref_step": None}}


@pytest.mark.parametrize(("j", "spec_row", "settled", "prev", "phrase"), [
    (0, False, False, 3, "R7 did not settle it"),
    (0, False, True, 3, "R7 settled the row, yet"),
    (0, True, False, 3, "speculative path's read of the state carried"),
    (2, True, False, 1, "draft position 2"),
    (0, False, False, 1, "no acceptance right before it"),
    (0, None, False, 3, "GDN path is unknown"),
])
def test_hypothesis_names_the_case(j: int, spec_row: bool | None, settled: bool, prev: int,
                                   phrase: str) -> None:
    h = tr.hypothesis(located(j, spec_row, settled, prev))
    assert phrase in h and "token 34 flips (ref margin 0.36)" in h and "\n" not in h
    # the batch drafts (1 spec row): a row off the speculative path ran as a prefill
    assert ("one-token prefill beside drafting rows" in h) == (spec_row is False)


def engines_for(sut_tokens: list[int]) -> dict[str, Any]:
    """O0 and ON results of the target phase (3 rows) and the alone variant."""
    def side(tokens: list[int], rid: str) -> dict[str, Any]:
        rows = [traced(REF_TOKENS, [-0.1] * 6) for _ in range(3)]
        rows[2] = dict(traced(tokens, [-0.1] * 6), request_id=rid)
        alone = [dict(traced(REF_TOKENS, [-0.1] * 6), request_id=rid)]
        return {"phases": {"prefix_2b_minus1": rows, "prefix_2b_minus1@alone": alone},
                "events": {"prefix_2b_minus1": STEPS, "prefix_2b_minus1@alone": STEPS}}
    return {"O0": side(REF_TOKENS, "7"), "ON": side(sut_tokens, "7")}


def test_analyse_picks_the_target_and_lists_unequal_requests() -> None:
    a = tr.analyse(engines_for([100, 101, 102, 103, 104, 777]))
    assert a["target_phase"] == "prefix_2b_minus1" and a["target"]["flip"] == 5
    assert a["requests"] == 4 and a["equal_requests"] == 3
    assert [(u["phase"], u["request"]) for u in a["unequal"]] == [("prefix_2b_minus1", 2)]
    assert a["variants"]["prefix_2b_minus1@alone"]["equal"]
    s = tr.summary_part(a)
    assert s["passed"] is True and s["reproduced"] is True
    assert s["hypothesis"].startswith("token 5 flips")
    assert s["variants"]["prefix_2b_minus1@alone"]["equal"] is True
    assert len(s["target"]["per_token"]) == 6
    # without events the target is not traced, whatever the tokens
    bare = engines_for(REF_TOKENS)
    for e in bare.values():
        e["events"] = {}
    s2 = tr.summary_part(tr.analyse(bare))
    assert s2["passed"] is False and s2["reproduced"] is False
    # only the fresh replay lost it: that one is the target
    fresh = engines_for(REF_TOKENS)
    for name, tokens in (("O0", REF_TOKENS), ("ON", [100, 101, 102, 103, 104, 777])):
        rows = [traced(REF_TOKENS, [-0.1] * 6) for _ in range(3)]
        rows[2] = dict(traced(tokens, [-0.1] * 6), request_id="7")
        fresh[name]["phases"]["prefix_2b_minus1@fresh"] = rows
        fresh[name]["events"]["prefix_2b_minus1@fresh"] = STEPS
    a3 = tr.analyse(fresh)
    assert a3["target_phase"] == "prefix_2b_minus1@fresh" and a3["target"]["flip"] == 5
    assert tr.summary_part(a3)["reproduced"] is True


# --- the probe on stand-in runner objects -----------------------------------------------------

class _FakeBuilder:
    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              num_accepted_tokens: Any = None, num_decode_draft_tokens_cpu: Any = None,
              fast_build: bool = False) -> Any:
        return SimpleNamespace(num_prefills=0, num_decodes=0, num_spec_decodes=2,
                               num_accepted_tokens=[3, 1])


class _FakeRunner:
    """The runner surface the probe reads, with a `_prepare_inputs` that acts like R7's
    wrapper (vLLM's sync, then settle -> accepted_state.rows_to_settle)."""

    def __init__(self) -> None:
        self.input_batch = SimpleNamespace(
            num_reqs=2, req_ids=["0-aaaa", "1-bbbb", None],
            num_computed_tokens_cpu=[20, 30, 0], num_prompt_tokens=[10, 10, 0],
            num_accepted_tokens_cpu=[3, 2, 1])
        self.cache_config = SimpleNamespace(mamba_cache_mode="none")
        self.calls: list[str] = []

    def _prepare_inputs(self, so: Any, num_scheduled: Any) -> str:
        self.calls.append("prepare")
        b = self.input_batch
        todo = accepted_state.rows_to_settle(b.req_ids[:2], b.num_accepted_tokens_cpu[:2],
                                             so.scheduled_spec_decode_tokens, "none", {})
        for s in todo:
            b.num_accepted_tokens_cpu[s.row] = 1
        _FakeBuilder().build(0, None, num_accepted_tokens=None,
                             num_decode_draft_tokens_cpu=[3, -1, -1])
        return "logits"

    def _determine_batch_execution_and_padding(self, **kw: Any) -> tuple[Any, ...]:
        return ("CUDAGraphMode.PIECEWISE", SimpleNamespace(num_tokens=5, num_reqs=2,
                                                           uniform=False), False, None, None)

    def _update_states_after_model_execute(self, output_token_ids: Any, so: Any) -> None:
        self.calls.append("post")


def test_probe_records_a_step_and_returns_what_vllm_returned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accepted_state, "rows_to_settle", accepted_state.rows_to_settle)
    monkeypatch.setattr(_FakeBuilder, "build", _FakeBuilder.build)
    probe = tr.StepProbe()
    runner = _FakeRunner()
    probe.install_runner(runner)
    probe.install_gdn(_FakeBuilder)
    probe.install_settle(accepted_state)
    # "0" drafts; "1" has none after 2 accepted: R7 settles "1"
    so = SimpleNamespace(scheduled_spec_decode_tokens={"0-aaaa": [5, 6, 7]},
                         num_scheduled_tokens={"0-aaaa": 4, "1-bbbb": 1})
    assert runner._prepare_inputs(so, [4, 1]) == "logits"
    assert runner._determine_batch_execution_and_padding(num_tokens=5)[0].endswith("PIECEWISE")
    assert runner._update_states_after_model_execute([[11, 12, -1, -1], [13, -1, -1, -1]],
                                                     so) is None
    assert runner.calls == ["prepare", "post"]
    assert probe.errors == [] and probe.count == 1 and probe.cur is None
    (rec,) = probe.steps
    assert rec["rids"] == ["0-aaaa", "1-bbbb"] and rec["sched"] == [4, 1]
    assert rec["draft_ids"] == [[5, 6, 7], None]
    assert rec["r7"] == {"acc": [3, 2], "rows": ["1-bbbb"]} and rec["acc"] == [3, 1]
    assert rec["gdn"] == [{"p": 0, "d": 0, "s": 2, "acc": [3, 1], "ddt": [3, -1, -1]}]
    assert rec["cg"] == "CUDAGraphMode.PIECEWISE" and rec["desc"]["num_tokens"] == 5
    view = tr.request_steps(probe.steps, "1")
    assert view[0]["g0"] == 21 and view[0]["emitted"] == [13] and view[0]["settled"]
    assert view[0]["acc_in"] == 2 and view[0]["spec_row"] is False
    first = tr.request_steps(probe.steps, "0")[0]
    assert first["spec_row"] is True and first["emitted"] == [11, 12] and first["drafts"] == 3


def test_probe_failure_never_reaches_the_engine() -> None:
    probe = tr.StepProbe()
    runner = _FakeRunner()
    runner.input_batch.num_prompt_tokens = None  # begin() cannot read it
    probe.install_runner(runner)
    so = SimpleNamespace(scheduled_spec_decode_tokens={}, num_scheduled_tokens={})
    assert runner._prepare_inputs(so, []) == "logits"
    assert probe.errors and probe.errors[0].startswith("begin: TypeError")


def test_top_n_ranks_the_logprobs() -> None:
    lp = SimpleNamespace
    out = SimpleNamespace(outputs=[SimpleNamespace(logprobs=[
        {5: lp(logprob=-2.0), 3: lp(logprob=-0.5), 9: lp(logprob=-1.0)}])])
    assert tr.top_n(out) == [[[3, -0.5], [9, -1.0], [5, -2.0]]]


# --- arguments and the driver end to end ------------------------------------------------------

def test_arguments() -> None:
    with pytest.raises(SystemExit):
        tr.parse_args(["--engine", "ON", "--kwargs", "k.json"])
    with pytest.raises(SystemExit):
        tr.parse_args(["--budget-s", "100"])
    with pytest.raises(SystemExit):
        tr.parse_args(["--out", "x", "--budget-s", "10"])
    a = tr.parse_args(["--out", "x", "--budget-s", "300"])
    assert a.out == Path("x") and a.engine is None
    e = tr.parse_args(["--engine", "O0", "--kwargs", "k", "--result", "r", "--plan-dir", "p",
                       "--deadline", "1.5"])
    assert e.engine == "O0" and e.deadline == 1.5


def test_driver_against_the_stand_in_vllm(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SERVING / "fake_vllm"), SM70_GPU_SHARE="0.08",
               SM70_AB_TINY=str(tmp_path / "none"))
    p = subprocess.run([sys.executable, str(SERVING / "device_spec_trace.py"), "--out",
                        str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                        "--budget-s", "90"], env=env, capture_output=True, text=True,
                       timeout=150, check=False)
    log = p.stdout + p.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    # the stand-in has no runner to probe and no request ids: rows, no events
    assert s["passed"] is False and p.returncode == 1, log
    assert s["reproduced"] is False and s["target_phase"] == "prefix_2b_minus1", log
    assert s["errors"] == {} and s["unequal"] == [], log
    assert s["plan_block_size"] == 528 and s["block_sizes"] == {"O0": 16, "ON": 16}, log
    plan = tr.trace_plan(528)
    want = sum(len(tr.flat_requests(subs)) for subs in plan["phases"].values()) + 4
    assert s["requests"] == want, log  # stage 1 as planned, then the 4 stage-2 phases
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert trace["O0"]["row"]["tokens"] == trace["ON"]["row"]["tokens"]
    assert len(trace["ON"]["row"]["top"]) == 64
    kw = json.loads((tmp_path / "work" / "ON_kwargs.json").read_text())
    assert kw["speculative_config"]["method"] == "ngram" and not kw["enable_prefix_caching"]


# --- the surface the probe wraps, on vLLM 0.22.1's own tree -----------------------------------

SURFACE_PROBE = '''
import inspect, json, os, sys
os.environ["TORCHDYNAMO_DISABLE"] = "1"
from vllm import SamplingParams
from vllm.outputs import RequestOutput
from vllm.v1.attention.backends import gdn_attn
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.worker import gpu_input_batch, gpu_model_runner
from vllm_patch.spec_decode import accepted_state

R = gpu_model_runner.GPUModelRunner
src = inspect.getsource(R)
params = {n: list(inspect.signature(getattr(R, n)).parameters) for n in (
    "_prepare_inputs", "_determine_batch_execution_and_padding",
    "_update_states_after_model_execute")}
sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2,
                    detokenize=False)
sp.logprobs = 5
batch_src = inspect.getsource(gpu_input_batch.InputBatch)
out = {
    "params": params,
    "mode_returns": str(inspect.signature(
        R._determine_batch_execution_and_padding).return_annotation),
    "calls": {c: src.count(c) for c in (
        "self._prepare_inputs(", "self._update_states_after_model_execute(",
        "sampler_output.sampled_token_ids, scheduler_output",
        "num_decode_draft_tokens_cpu=self.num_decode_draft_tokens.cpu")},
    "build": list(inspect.signature(gdn_attn.GDNAttentionMetadataBuilder.build).parameters),
    "meta": [f for f in ("num_prefills", "num_decodes", "num_spec_decodes",
                         "num_accepted_tokens")
             if f in gdn_attn.GDNAttentionMetadata.__dataclass_fields__],
    "batch": [a for a in ("self.num_computed_tokens_cpu =", "self.num_prompt_tokens =",
                          "self.num_accepted_tokens_cpu =", "def req_ids", "def num_reqs")
              if a in batch_src],
    "logprobs": sp.logprobs,
    "output_request_id": "request_id" in inspect.signature(RequestOutput).parameters,
    "internal_id": 'f"{request.external_req_id}-{' in inspect.getsource(
        InputProcessor.assign_request_id),
    "settle_looks_up": "rows_to_settle" in accepted_state.settle.__code__.co_names,
}
json.dump(out, open(sys.argv[2], "w"))
'''


def test_the_wrapped_surface_is_vllm_0_22_1s(tmp_path: Path) -> None:
    """What the probe wraps and reads exists in vLLM 0.22.1 as the probe calls it (a drift
    would leave the GPU run without events, found only after the call)."""
    from vllm_cpu_tree import require_tree, run_probe

    require_tree()
    script = tmp_path / "surface_probe.py"
    script.write_text(SURFACE_PROBE)
    got, log = run_probe(script, {}, tmp_path)
    assert got["params"] == {
        "_prepare_inputs": ["self", "scheduler_output", "num_scheduled_tokens"],
        "_determine_batch_execution_and_padding": got["params"][
            "_determine_batch_execution_and_padding"],
        "_update_states_after_model_execute": ["self", "output_token_ids",
                                               "scheduler_output"]}, log
    assert got["mode_returns"].startswith("tuple[vllm.config.compilation.CUDAGraphMode, "
                                          "vllm.forward_context.BatchDescriptor"), log
    assert all(n == 1 for n in got["calls"].values()), got["calls"]
    assert "num_decode_draft_tokens_cpu" in got["build"]
    assert len(got["meta"]) == 4 and len(got["batch"]) == 5
    assert got["logprobs"] == 5 and got["output_request_id"] and got["internal_id"]
    assert got["settle_looks_up"]
