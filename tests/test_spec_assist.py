"""The n-gram assist inside vLLM 0.22.1's model runner (issue 24 item 4; runtime patch
R-ASSIST: vllm_patch/spec_decode/runner_hook.py, assist.py).

tests/spec_assist_probe.py runs in the serving venv with the 0.22.1 tree (tests/vllm_cpu_tree.py):
- the plugin arms the hook, importing vLLM's runner module wraps its real
  `propose_draft_token_ids`, runners that are not MTP with greedy padded drafts get vLLM's
  tensor back untouched, foreign targets are refused;
- a simulation through the wrapper on vLLM's real `InputBatch` (reordered with
  `swap_states`, a request finished with `remove_request` + `condense`, one added, one
  preempted and resumed, one step without drafts for a request) against a pure-Python
  mirror of the reference definitions: every row's drafts, the method and both EWMAs
  must equal the mirror's on every step.
Each plausible bug in MUTANTS, applied to a copy of the package in the child, must make
the simulation disagree with the mirror. Without the venv or the tree these skip; under
CI=true they fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_cpu_tree import mutated_plugin, require_tree, run_probe

from vllm_patch.config import PluginConfig, SpecConfig

PROBE = Path(__file__).resolve().parent / "spec_assist_probe.py"
SIM = {"steps": 16, "seed": 3}

# (name, file under vllm_patch/spec_decode, text, replacement)
MUTANTS: tuple[tuple[str, str, str, str], ...] = (
    ("state-by-row-not-request", "assist.py",
     "torch.tensor([self.slot_of[r] for r in req_ids]",
     "torch.tensor([i for i, _ in enumerate(req_ids)]"),
    ("finished-keep-state", "assist.py",
     "for rid in [r for r in self.slot_of if r not in present]:", "for rid in []:"),
    ("new-slot-keeps-old-ewma", "assist.py",
     '            self.ewma_ngram[slot] = float("nan")\n', ""),
    ("chosen-gets-counterfactual", "batch.py",
     "mtp = torch.where(used_ngram, mtp_match.to(torch.float32), accepted)",
     "mtp = torch.where(used_ngram, accepted, mtp_match.to(torch.float32))"),
    ("measures-unverified-steps", "assist.py",
     "measured = self.pending[slots] & ver & (valid > 0)",
     "measured = self.pending[slots] & (valid > 0)"),
    ("ngram-measured-without-draft", "assist.py",
     "measured & self.prev_has[slots], p.alpha)", "measured, p.alpha)"),
    ("replaces-every-row-with-a-draft", "assist.py",
     "use = batch.choose_batch(self.ewma_mtp[slots], self.ewma_ngram[slots], has, p.margin)",
     "use = has"),
    ("history-stops-growing", "assist.py", "        self.length[slots] = length\n", ""),
)


def _probe(request: dict[str, Any], tmp: Path) -> dict[str, Any]:
    require_tree()
    result, _log = run_probe(PROBE, request, tmp)
    return result


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _probe({"install": True, "simulate": SIM}, tmp_path_factory.mktemp("assist"))


def test_plugin_arms_and_import_wraps_vllms_method(probed: dict[str, Any]) -> None:
    got = probed["install"]
    assert got["runner_imported_before"] is False
    assert got["register"].startswith("deferred")
    assert got["outcome"].startswith("wrapped")
    assert got["wrapped"] and got["original_is_vllms"]
    assert got["original_params"][:3] == ["self", "scheduler_output", "sampled_token_ids"]
    assert got["second_install"] == "wrapped (already installed)"


def test_other_runners_get_vllms_drafts_untouched(probed: dict[str, Any]) -> None:
    got = probed["install"]["passthrough"]
    assert set(got) == {"ngram", "eagle", "probabilistic", "none", "failing_step"}
    for name, p in got.items():
        assert p["same_object"], name
        assert p["stats"]["active"] is False and p["stats"]["why"].startswith("off: "), name
    assert got["failing_step"]["stats"]["why"].startswith("off: failed (AttributeError")


def test_foreign_targets_refused(probed: dict[str, Any]) -> None:
    got = probed["install"]["refused_foreign"]
    assert "vLLM is 0.23.0" in got["version"]
    assert "parameters ('self', 'a', 'b')" in got["params"]


def test_every_row_matches_the_reference_mirror(probed: dict[str, Any]) -> None:
    sim = probed["simulate"]
    assert sim["num_mismatches"] == 0, sim["mismatches"]
    assert len(sim["events"]) == 5  # the reorder, finish, add, preempt, resume happened


def test_choice_follows_measured_acceptance(probed: dict[str, Any]) -> None:
    chose = probed["simulate"]["chose"]
    # a copying request with useless MTP drafts: n-gram from its first measured step on
    assert chose["copy_mtp_bad"][0] == "mtp" and set(chose["copy_mtp_bad"][1:]) == {"ngram"}
    assert chose["late"][0] == "mtp" and set(chose["late"][1:]) == {"ngram"}
    # MTP exact: a tie on copied text and a win on random text both keep MTP
    assert set(chose["copy_mtp_good"]) == {"mtp"}
    assert set(chose["rand_mtp_good"]) == {"mtp"}
    assert set(chose["rand_mtp_bad"]) == {"mtp"}  # n-gram rarely drafts and is wrong


def test_finished_and_preempted_requests_drop_state(probed: dict[str, Any]) -> None:
    sim = probed["simulate"]
    assert sim["gone_have_state"] == {"rand_mtp_good": False}
    assert sim["slots_live"] == ["copy_mtp_bad", "copy_mtp_good", "late", "rand_mtp_bad"]
    assert sim["stats"]["live_requests"] == 4
    assert 0 < sim["stats"]["rows_chose_ngram"] <= sim["stats"]["rows_with_ngram_draft"]


@pytest.mark.parametrize(("name", "file", "old", "new"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutant_is_caught(name: str, file: str, old: str, new: str, tmp_path: Path) -> None:
    front = mutated_plugin(tmp_path / "mut", f"spec_decode/{file}", old, new)
    result = _probe({"simulate": SIM, "front": str(front)}, tmp_path)
    sim = result["simulate"]
    chose = sim["chose"]
    caught = (sim["num_mismatches"] > 0 or sim["gone_have_state"] != {"rand_mtp_good": False}
              or set(chose["copy_mtp_good"]) != {"mtp"})
    assert caught, f"{name} survived"


def test_plugin_leaves_the_runner_alone_when_assist_is_off() -> None:
    from vllm_patch.plugin import _install_ngram_assist

    cfg = PluginConfig(spec=SpecConfig(ngram_assist=False))
    assert _install_ngram_assist(cfg) == "off (spec.ngram_assist is false)"
