"""Bounded prompt logprobs (issue 24 item 5; vllm_patch/logprobs, runtime patch R5).

Pure parts here: which positions a step fills (`plan_step`), the slice bounds, and the
target check that makes `install` refuse a function it was not written against. Against
vLLM 0.22.1's own code (tests/prompt_logprobs_probe.py in the serving venv with the 0.22.1
tree, tests/vllm_cpu_tree.py): the sliced computation against vLLM's `Sampler` on all rows
at once, the installed method against vLLM's real `_get_prompt_logprobs_dict` through one
chunked schedule, and what `install` and the plugin report. Without the venv or the tree
those skip; under CI=true they fail.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_cpu_tree import require_tree, run_probe

from vllm_patch.logprobs import runner_patch as rp
from vllm_patch.logprobs.plan import PromptStep, plan_step, slice_bounds

PROBE = Path(__file__).resolve().parent / "prompt_logprobs_probe.py"
# CPU fp32 matmuls of different row counts may block differently: a last-ulp difference.
FP32_TOL = 1e-5

# --- pure -------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "computed", "scheduled", "want"), [
    (300, 0, 128, PromptStep(0, 128, False)),  # a middle chunk
    (300, 256, 44, PromptStep(256, 43, True)),  # the last chunk: one row more than left
    (129, 64, 64, PromptStep(64, 64, False)),  # ends exactly on the last prompt token
    (129, 128, 1, PromptStep(128, 0, True)),  # ... so the next step hands it back, empty
    (40, 0, 40, PromptStep(0, 39, True)),  # the whole prompt in one chunk
    (1, 0, 1, PromptStep(0, 0, True)),  # a one-token prompt has no prompt logprobs
])
def test_plan_step(prompt: int, computed: int, scheduled: int, want: PromptStep) -> None:
    assert plan_step(prompt, computed, scheduled) == want
    assert want.first_target == want.start + 1


def test_plan_step_refuses_negative() -> None:
    with pytest.raises(ValueError, match="num_scheduled -1"):
        plan_step(10, 0, -1)


@pytest.mark.parametrize(("rows", "per", "want"), [
    (0, 256, []),
    (5, 256, [(0, 5)]),
    (256, 256, [(0, 256)]),
    (257, 256, [(0, 256), (256, 257)]),
    (2047, 256, [(i, min(i + 256, 2047)) for i in range(0, 2047, 256)]),
    (3, 1, [(0, 1), (1, 2), (2, 3)]),
])
def test_slice_bounds(rows: int, per: int, want: list[tuple[int, int]]) -> None:
    got = slice_bounds(rows, per)
    assert got == want
    assert all(b - a <= per for a, b in got)


def test_slice_bounds_refuses_zero_rows_per_slice() -> None:
    with pytest.raises(ValueError, match=r"logprobs\.prompt_chunk is 0"):
        slice_bounds(10, 0)


def _like_vllm(self: Any, hidden_states: Any, num_scheduled_tokens: Any) -> Any:
    """Uses every name the check looks for (never called)."""
    r = self.requests[self.num_prompt_logprobs].prompt_token_ids
    r.in_progress_prompt_logprobs_cpu.empty_cpu(r.num_computed_tokens)
    self.input_batch.req_id_to_index(self.query_start_loc)
    self.model.compute_logits(self.sampler.compute_logprobs(self.sampler.gather_logprobs))
    return self._sync_device()


def _missing_gather(self: Any, hidden_states: Any, num_scheduled_tokens: Any) -> Any:
    r = self.requests[self.num_prompt_logprobs].prompt_token_ids
    r.in_progress_prompt_logprobs_cpu.empty_cpu(r.num_computed_tokens)
    self.input_batch.req_id_to_index(self.query_start_loc)
    self.model.compute_logits(self.sampler.compute_logprobs(None))
    return self._sync_device()


def _other_params(self: Any, hidden_states: Any, scheduler_output: Any) -> Any:
    return _like_vllm(self, hidden_states, scheduler_output)


def test_check_target_accepts_the_expected_shape() -> None:
    rp.check_target(_like_vllm, "0.22.1")
    rp.check_target(_like_vllm, "0.22.1+cu130")


@pytest.mark.parametrize(("func", "version", "says"), [
    (_like_vllm, "0.23.0", "vLLM is 0.23.0"),
    (_like_vllm, "0.22.10", "vLLM is 0.22.10"),
    (_other_params, "0.22.1", "scheduler_output"),
    (_missing_gather, "0.22.1", "['gather_logprobs']"),
    (None, "0.22.1", "NoneType, not a function"),
    (staticmethod(_like_vllm), "0.22.1", "staticmethod, not a function"),
])
def test_check_target_refuses(func: Any, version: str, says: str) -> None:
    with pytest.raises(rp.PromptLogprobsPatchError) as exc:
        rp.check_target(func, version)
    msg = str(exc.value)
    assert says in msg and rp.TARGET in msg and "\n" not in msg


def test_sliced_method_refuses_zero_rows() -> None:
    with pytest.raises(ValueError, match=r"logprobs\.prompt_chunk is 0"):
        rp.sliced_method(0)


# --- against vLLM 0.22.1 on the CPU --------------------------------------------------------

SLICE_CASES = [
    {"rows": 5, "k": 5, "per_slice": 64},  # fewer rows than a slice
    {"rows": 64, "k": 0, "per_slice": 64},  # exactly one slice, target only
    {"rows": 200, "k": 5, "per_slice": 64},  # not a multiple of the slice
    {"rows": 129, "k": 1, "per_slice": 64},  # a last slice of one row
    {"rows": 7, "k": 3, "per_slice": 1},  # one row at a time
]
# Prompt lengths (0: a prompt given as embeddings), top-k per request and the schedule:
# a: three chunks, the last one row short; b: a chunk ends exactly on its last prompt
# token, handed back empty one step later; c: not scheduled in step 1 (preempted), then
# whole; e: never has prompt tokens and stays pending, as in vLLM.
RUNNER = {
    "per_slice": 64,
    "prompt_lens": {"a": 300, "b": 129, "c": 40, "e": 0},
    "ks": {"a": 5, "b": 0, "c": 3, "e": 2},
    "schedule": [{"a": 128, "b": 64, "e": 10}, {"a": 128, "b": 64, "c": 40},
                 {"a": 44, "b": 1, "c": 1}, {"a": 1, "b": 1, "c": 1}],
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    tmp = tmp_path_factory.mktemp("prompt_logprobs")
    result, _log = run_probe(PROBE, {"slices": SLICE_CASES, "runner": RUNNER, "install": True},
                             tmp)
    return result


def _same(d: dict[str, Any], tol: float = 0.0) -> bool:
    return (d["shape_a"] == d["shape_b"] and d["dtype_a"] == d["dtype_b"]
            and d["max_abs"] is not None and d["max_abs"] <= tol)


def test_sliced_equals_all_rows_at_once(probe: dict[str, Any]) -> None:
    for case in probe["slices"]:
        assert case["slice_rows"] == [b - a for a, b in slice_bounds(case["rows"],
                                                                        case["per_slice"])]
        assert _same(case["ids"]) and _same(case["ranks"]), case
        assert _same(case["logprobs"], FP32_TOL), case
        assert case["target_column_is_target"], case
        assert case["ids"]["shape_a"] == [case["rows"], case["k"] + 1]


def test_installed_method_equals_vllms_through_a_chunked_schedule(
        probe: dict[str, Any]) -> None:
    steps = probe["runner"]["steps"]
    assert [s["keys_vllm"] for s in steps] == [[], ["c"], ["a", "b"], []]
    for s in steps:
        assert s["keys_ours"] == s["keys_vllm"]
        for r in s["keys_vllm"]:
            assert _same(s[r]["ids"]) and _same(s[r]["ranks"]), (r, s[r])
            assert _same(s[r]["logprobs"], FP32_TOL), (r, s[r])
    assert steps[2]["a"]["ids"]["shape_a"] == [299, 6]
    assert steps[2]["b"]["ids"]["shape_a"] == [128, 1]
    left = probe["runner"]["left"]
    assert left["ours"] == left["vllm"] == {"num_prompt_logprobs": ["e"], "in_progress": []}


def test_install_deferred_to_the_runner_import_and_refusals(probe: dict[str, Any]) -> None:
    got = probe["install"]
    assert got["version"] == "0.22.1" and not got["runner_loaded_before"]
    assert got["plugin"] == f"deferred (128 rows; installed when {rp.RUNNER_MODULE} is imported)"
    assert got["outcome_before_import"] is None
    assert got["outcome"] == "sliced (128 rows per slice)" and got["installed_rows"] == 128
    assert got["replaces_vllms"]
    assert got["again_same"] == "sliced (128 rows, already installed)"
    assert "already sliced at 128 rows, asked for 64" in got["again_other"]
    assert "parameters ('self', 'scheduler_output'" in got["refusals"]["execute_model"]
    assert "vLLM is 0.23.0" in got["refusals"]["original_on_0.23.0"]
    assert got["foreign"].startswith("refused (") and got["foreign_kept"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
