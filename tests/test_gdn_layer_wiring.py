"""Sm70GatedDeltaNet inside vLLM 0.22.1's Python tree on the CPU: a decode step and an MTP
step (metadata graph-padded as vLLM's builder pads it) reach our two ops with the real rows,
the strided pool views are updated in place at exactly the named slots, the outputs land in
core_attn_out, and a prefill step goes to vLLM's own _forward_core
(tests/gpu/gdn/layer_wiring_probe.py; our ops replaced by their references there).
Needs the serving venv and the 0.22.1 tree (tests/vllm_cpu_tree.py): skips without them,
fails under CI=true."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from vllm_cpu_tree import REPO, SERVE_PYTHON, SITE_HOOK, VLLM_DEPS, VLLM_TREE, require_tree

PROBE = REPO / "tests" / "gpu" / "gdn" / "layer_wiring_probe.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_tree()
    out = tmp_path_factory.mktemp("gdn_wiring") / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM70_", "VLLM_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (VLLM_TREE, VLLM_DEPS, SITE_HOOK, REPO))
    proc = subprocess.run([str(SERVE_PYTHON), str(PROBE), str(out)], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(Path(out).read_text())
    assert "error" not in res, res.get("traceback")
    return res


@pytest.mark.parametrize("kind", ["decode", "spec"])
def test_decode_steps_run_our_ops_on_the_real_rows(result: dict, kind: str) -> None:
    r = result[kind]
    assert r["out_equal"], "core_attn_out differs from the references on the real rows"
    assert r["conv_state_equal"], "the conv state pool was not updated as the reference does"
    assert r["ssm_state_equal"], "the recurrent state pool was not updated in place"
    assert r["states_changed"]  # the comparison above is not vacuous
    assert r["other_slots_untouched"]


def test_each_decode_step_is_one_conv_and_one_recurrent_call(result: dict) -> None:
    assert result["ops"] == ["conv", "recurrent", "conv", "recurrent"]
    assert result["spec"]["calls"]["sm70:decode"] == 1
    assert result["spec"]["calls"]["sm70:spec"] == 1


def test_a_prefill_step_goes_to_vllm(result: dict) -> None:
    assert result["prefill"]["stock_called"]
    assert result["ops_in_prefill_step"] == 0
    assert result["prefill"]["calls"]["stock:prefill"] == 1


PREFILL_STEPS = ["prefill_only", "mixed", "mixed_one_pass", "mixed_spec", "mixed_int16"]


@pytest.mark.parametrize("step", PREFILL_STEPS)
def test_prefill_steps_with_our_prefill_on_match_each_request_alone(result: dict,
                                                                    step: str) -> None:
    r = result[step]
    assert r["out_close"], f"outputs off by {r['out_max_err']}: a row shifted or a state lost"
    assert r["conv_state_close"], "the conv state pool differs from each request alone"
    assert r["ssm_state_close"], "the recurrent state pool differs: wrong slot or no init"
    assert r["states_changed"]  # the comparison above is not vacuous
    assert r["other_slots_untouched"]


def test_each_prefill_step_runs_the_ops_the_routing_names(result: dict) -> None:
    # plain decodes of a mixed step on our decode ops, its prefill rows on the prefill ops:
    # two-pass with vLLM's chunk table (rebased past the decodes), one-pass without one
    assert result["prefill_only"]["ops"] == ["conv_prefill", "chunk_two_pass"]
    assert result["mixed"]["ops"] == ["conv", "recurrent", "conv_prefill", "chunk_two_pass"]
    assert result["mixed_one_pass"]["ops"] == ["conv", "recurrent", "conv_prefill",
                                               "chunk_one_pass"]
    assert result["mixed_spec"]["ops"] == ["conv", "recurrent", "conv_prefill",
                                           "chunk_two_pass"]
    assert result["mixed_int16"]["ops"] == result["mixed"]["ops"]  # on the float32 scratch
    for step in ("prefill_only", "mixed", "mixed_spec"):
        assert result[step]["tables_ok"] == [True], step
    assert result["mixed"]["calls"] == {"sm70:prefill": 1}
    assert result["mixed_spec"]["calls"] == {"sm70:prefill+spec": 1}


def test_the_int16_layer_survives_vllms_prefill_warm_up(result: dict) -> None:
    # vLLM 0.22.1's profile run unpacks (conv, temporal) from get_state_dtype: the int16
    # layer's triple killed the H200 start-up; during the warm-up it shows the float32 of
    # its prefill scratch, and afterwards its pool's triple again
    w = result["int16_warmup"]
    assert w.get("state_dtype") == "torch.float32", w
    assert w["after"][1:] == ["torch.int16", "torch.float32"], w
