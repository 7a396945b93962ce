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
