"""The plan's figure for the int16 GDN pool's prefill scratch (sm70ctl/plan/gdn_scratch.py)
against what vllm_patch/gdn/int16_scratch.py really allocates, and the plan counting it
only when the int16 pool is on.

The measurement (tests/plan_gdn_scratch_probe.py) runs `run_on_scratch` on CPU tensors in
the serving venv, which has torch; without that venv the measured tests skip (under CI=true
they fail).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sm70ctl.errors import Sm70Error
from sm70ctl.plan.gdn_scratch import max_index_entries, max_step_slots, scratch_bytes
from sm70ctl.plan.model_config import ModelShape, builtin_config_path, load_config
from sm70ctl.plan.plan import Gpu, Plan, PlanInputs, compute_plan

REPO = Path(__file__).resolve().parents[1]
SERVE_PYTHON = REPO / ".serve-venv" / "bin" / "python"
PROBE = REPO / "tests" / "plan_gdn_scratch_probe.py"
V100 = 34_089_730_048
KEY = "gdn.int16_scratch"

# Small heads, the model's head sizes: (value heads per GPU, V, K, conv channels, conv columns)
SHAPE = (2, 128, 128, 96, 6)
POOL_SLOTS = 40
# Step layouts: (non-spec indices or None, spec indices [rows][1 + k] or None); -1 is
# vLLM's PAD_SLOT_ID, 0 its null block (a padded row's block-table entry)
LAYOUTS: dict[str, tuple[list[int] | None, list[list[int]] | None]] = {
    # one prefill and two plain decodes, a padded row
    "plain": ([7, 3, 12, -1], None),
    # a prefill with MTP rows (k = 3) beside it, a zero-length padded row on the null block
    "mtp": ([5, 0], [[9, 10, 11, 13], [20, 21, 22, 23]]),
    # a slot named twice (two columns of a row on one block) and the null block in a row
    "shared": ([30], [[31, 31, 0, 32]]),
    # the bound: max_num_seqs = 4, k = 3, every sequence but the prefill an MTP row
    "bound": ([1], [[2, 3, 4, 6], [14, 15, 16, 17], [24, 25, 26, 27]]),
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not SERVE_PYTHON.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must have the serving venv: {SERVE_PYTHON} is missing")
        pytest.skip(f"{SERVE_PYTHON} is missing (run .ci/setup.d/20-serve-env.sh)")
    tmp = tmp_path_factory.mktemp("scratch")
    req, res = tmp / "request.json", tmp / "result.json"
    req.write_text(json.dumps({"shape": SHAPE, "pool_slots": POOL_SLOTS, "layouts": LAYOUTS}))
    proc = subprocess.run([str(SERVE_PYTHON), str(PROBE), str(req), str(res)], cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(res.read_text())


def _figure(slots: int, entries: int) -> int:
    hv, dv, dk, channels, cols = SHAPE
    return scratch_bytes(slots, hv, dv, dk, channels * cols, entries)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_figure_is_the_peak_run_on_scratch_allocates(measured: dict[str, Any],
                                                     name: str) -> None:
    got = measured[name]
    plain, spec = LAYOUTS[name]
    named = {s for s in (plain or []) + [s for row in spec or [] for s in row] if s >= 0}
    # the distinct slots named plus the null block, which is always the scratch's row 0
    assert got["slots"] == len(named | {0})
    assert got["peak"] == _figure(got["slots"], got["entries"])
    assert got["left"] == 0  # all freed when the layer returns: one layer's scratch at a time


def test_the_bound_layout_reaches_max_step_slots(measured: dict[str, Any]) -> None:
    _plain, spec = LAYOUTS["bound"]
    seqs, k = 1 + len(spec), len(spec[0]) - 1
    assert measured["bound"]["slots"] == max_step_slots(seqs, 2048, k)
    assert measured["bound"]["entries"] <= max_index_entries(seqs, k)
    assert measured["bound"]["peak"] == _figure(max_step_slots(seqs, 2048, k),
                                                measured["bound"]["entries"])


def test_max_step_slots_by_hand() -> None:
    # 16 sequences, k = 3: one prefill slot, 15 MTP rows of 4 slots, the null block
    assert max_step_slots(16, 2048, 3) == 1 + 1 + 15 * 4 == 62
    # no speculation: one slot a sequence and the null block
    assert max_step_slots(16, 2048, 0) == 17
    # a step of 4 tokens carries at most 4 sequences
    assert max_step_slots(16, 4, 3) == 1 + 1 + 3 * 4
    assert max_index_entries(16, 3) == 64
    with pytest.raises(Sm70Error, match="SM70_MAX_NUM_SEQS=0"):
        max_step_slots(0, 2048, 3)


@pytest.fixture(scope="module")
def model() -> ModelShape:
    return load_config(builtin_config_path())


def _plan(model: ModelShape, **kw: Any) -> Plan:
    gpus = [Gpu(0, "a", V100), Gpu(1, "b", V100)]
    return compute_plan(model, PlanInputs(**{"kv_cache_bytes": 0, **kw}), gpus)


def _items(plan: Plan) -> dict[str, int]:
    return {i.key: i.bytes for i in plan.gpus[0].items}


def test_plan_counts_the_scratch_by_hand_with_the_int16_pool(model: ModelShape) -> None:
    on = _plan(model, gdn_kernel="sm70", gdn_state_dtype="int16")
    # TP=2: 24 value heads x 128 x 128; conv 5120 channels x 6 columns (k = 3) in fp16.
    # Per slot: conv 61,440 + 393,216 values x 12 B + 3,072 rows x 8 B + 8 B of slot list
    per_slot = 5120 * 6 * 2 + 24 * 128 * 128 * 12 + 24 * 128 * 8 + 8
    assert _items(on)[KEY] == 62 * per_slot + 64 * 4 == 297_886_448
    chunk = _plan(model, gdn_kernel="sm70_chunk", gdn_state_dtype="int16")
    assert _items(chunk)[KEY] == _items(on)[KEY]
    # the pool takes what the budget leaves: the scratch comes out of the KV, byte for byte
    off = _plan(model, gdn_kernel="sm70", gdn_state_dtype="float32")
    assert KEY not in _items(off)
    page_on, page_off = on.gdn_page.total, off.gdn_page.total
    assert page_on < page_off  # the int16 page; the other items are the same
    fixed = {k: v for k, v in _items(on).items() if not k.startswith("pool.")}
    fixed_off = {k: v for k, v in _items(off).items() if not k.startswith("pool.")}
    assert fixed == {**fixed_off, KEY: _items(on)[KEY]}


def test_plan_leaves_it_out_without_the_int16_pool(model: ModelShape) -> None:
    # FLA's prefill on vLLM's float32 pool: no scratch (the served default)
    assert KEY not in _items(_plan(model, gdn_kernel="triton", gdn_state_dtype="int16"))
    assert KEY not in _items(_plan(model, gdn_kernel="sm70", gdn_state_dtype="float32"))
    # the target design's int16 state takes it; its float32 state does not
    assert KEY in _items(_plan(model, path="target", gdn_state_dtype="int16"))
    assert KEY not in _items(_plan(model, path="target", gdn_state_dtype="float32"))


def test_plan_scratch_follows_the_step_settings(model: ModelShape) -> None:
    base = _items(_plan(model, gdn_kernel="sm70", gdn_state_dtype="int16"))[KEY]
    fewer = _items(_plan(model, gdn_kernel="sm70", gdn_state_dtype="int16",
                         max_num_seqs=4))[KEY]
    no_mtp = _items(_plan(model, gdn_kernel="sm70", gdn_state_dtype="int16",
                          spec_method="none"))[KEY]
    assert fewer < base and no_mtp < base
    # 4 sequences, k = 3: 14 slots, 16 index entries
    per_slot = 5120 * 6 * 2 + 24 * 128 * 128 * 12 + 24 * 128 * 8 + 8
    assert fewer == 14 * per_slot + 16 * 4
    # no speculation: 17 slots of a 3-column conv state, 16 entries
    per_slot0 = 5120 * 3 * 2 + 24 * 128 * 128 * 12 + 24 * 128 * 8 + 8
    assert no_mtp == 17 * per_slot0 + 16 * 4

