"""`sm70ctl plan`'s Clef figures against the format of SM70_CLEF_DIR (vllm_patch.clef).

The plan counts from its own tensor table (sm70ctl/plan/shapes.py); the format defines the
A/B shapes and the TP rule the loader will apply. Per linear and per GPU, at TP=1/2, with
pipeline stages and every allowed rank, both must give the same bytes: a plan that shards
A of a column-parallel layer, forgets a slice or counts a layer outside 40-63 fails here.
"""

from __future__ import annotations

import json

import pytest
from clef_fixture import REAL_CONFIG

from sm70ctl.plan import clef as plan_clef
from sm70ctl.plan.model_config import builtin_config_path, load_config
from sm70ctl.plan.plan import Gpu, PlanInputs, compute_plan
from sm70ctl.plan.shapes import pp_layer_ranges
from vllm_patch.clef.arena import arena_bytes, shard_sizes
from vllm_patch.clef.head import MAX_HEAD_PARAMS, REFERENCE_HEAD, head_params, parse_head_config
from vllm_patch.clef.layout import corrections
from vllm_patch.clef.model_dims import model_dims
from vllm_patch.clef.sharding import shard_bytes

V100 = 34_089_730_048
MODEL = load_config(builtin_config_path())
FORMAT = {c.stem: c for c in corrections(model_dims(json.loads(REAL_CONFIG.read_text())))}


def test_same_config_file() -> None:
    assert builtin_config_path().resolve() == REAL_CONFIG.resolve()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("rank", [64, 128, 256])
def test_each_linear_matches_the_format(tp: int, rank: int) -> None:
    linears = plan_clef.corrected_linears(MODEL, tp, range(MODEL.num_layers))
    plan = {t.name.removeprefix(MODEL.prefix): rank * (t.rows + t.cols) * 2 for t in linears}
    assert set(plan) == set(FORMAT)
    for stem, c in FORMAT.items():
        assert plan[stem] == shard_bytes(c, rank, tp), stem


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_per_gpu_totals_match_the_format(tp: int, pp: int) -> None:
    gpus = [Gpu(i, str(i), V100) for i in range(tp * pp)]
    plan = compute_plan(MODEL, PlanInputs(path="target", clef=True, tensor_parallel_size=tp,
                                          pipeline_parallel_size=pp), gpus)
    for stage, layers in enumerate(pp_layer_ranges(MODEL.num_layers, pp)):
        want = sum(shard_bytes(c, 256, tp) for c in FORMAT.values() if c.layer in layers)
        count = sum(1 for c in FORMAT.values() if c.layer in layers)
        for g in plan.gpus[stage * tp:(stage + 1) * tp]:
            items = {i.key: i for i in g.items if i.section == "clef"}
            assert items["clef.correction"].detail["tensor_bytes"] == want
            assert items["clef.correction"].detail["linears"] == count
            head = items.get("clef.head")
            if stage == pp - 1:
                assert head is not None and head.bytes == 2 * MAX_HEAD_PARAMS
            else:
                assert head is None


def test_head_bound_is_the_one_the_format_enforces() -> None:
    # the loader refuses a head above MAX_HEAD_PARAMS, so the plan's figure is an upper bound
    assert plan_clef.CLEF_HEAD_PARAMS == MAX_HEAD_PARAMS
    assert head_params(parse_head_config(REFERENCE_HEAD, MODEL.hidden_size)) <= MAX_HEAD_PARAMS


def test_clef_off_adds_nothing() -> None:
    plan = compute_plan(MODEL, PlanInputs(path="target"), [Gpu(0, "a", V100),
                                                           Gpu(1, "b", V100)])
    assert not [i for g in plan.gpus for i in g.items if i.section == "clef"]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("rank", [64, 200, 256])
def test_per_gpu_correction_is_the_loaders_one_allocation(tp: int, pp: int, rank: int) -> None:
    # the loader places a GPU's shards in one allocation (vllm_patch.clef.arena); the plan
    # must count that allocation, alignment and rounding included (rank 200 makes shards
    # that are not multiples of the alignment)
    dims = model_dims(json.loads(REAL_CONFIG.read_text()))
    gpus = [Gpu(i, str(i), V100) for i in range(tp * pp)]
    plan = compute_plan(MODEL, PlanInputs(path="target", clef=True, tensor_parallel_size=tp,
                                          pipeline_parallel_size=pp, clef_rank=rank), gpus)
    for stage, layers in enumerate(pp_layer_ranges(MODEL.num_layers, pp)):
        want = arena_bytes(shard_sizes(dims, rank, tp, layers))
        for g in plan.gpus[stage * tp:(stage + 1) * tp]:
            items = {i.key: i for i in g.items if i.section == "clef"}
            assert items["clef.correction"].bytes == want, (stage, g.gpu.index)
