"""Clef's correction as our linear method applies it, on CPU tensors (torch in a child:
this interpreter or .serve-venv, tests/serve_venv.py).

- the masked add: Clef rows get (x A^T) B^T of their slice, chat rows keep the layer's own
  output bit for bit (also when x A^T overflows, and a -0 stays -0: chosen, not added);
- the fused GEMM's slicing: one op call per slice on that slice's rows of W, checked in
  float64 against x (W + blockdiag(B_i A_i))^T with the pure-torch op reference;
- the loader's shards from a real SM70_CLEF_DIR (tests/clef_fixture.py, tiny widths) at
  TP=2: column-parallel ranks' outputs are the full output's columns in vLLM's per-rank
  order, row-parallel ranks' partial products sum to the full correction (what the
  all-reduce adds);
- one allocation per rank: every corrected layer of the folder attached from one source
  lands in one storage, at aligned offsets, filling it as vllm_patch.clef.arena counts;
  a layer attached twice, or outside the worker's pipeline stage, is refused by name;
- refusals: a folder for another rank names SM70_CLEF_DIR, the file and the rule; a layer
  whose input width differs from the shard names the layer; the batch mask refuses a
  layout that is not vLLM's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serve_venv import run_json

CHILD = r'''
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, "tests")
from clef_fixture import TINY_CONFIG, write_clef_dir
from vllm_patch.clef.errors import ClefError
from vllm_patch.ops import reference as ref
from vllm_patch.quantization import clef_correction as cc

req = json.loads(sys.stdin.read())
folder = Path(req["dir"])
out = {}
g = torch.Generator().manual_seed(0)

def rnd(*shape, s=1.0):
    return (torch.randn(*shape, generator=g) * s).half()

# --- the masked add
x = rnd(6, 32)
y0 = rnd(6, 10)
a = [rnd(8, 32, s=0.2), rnd(8, 32, s=0.2)]
b = [rnd(6, 8, s=0.2), rnd(4, 8, s=0.2)]
mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.uint8)
x[1] = 60000.0  # a chat row whose x A^T overflows fp16
y0[3, 2] = -0.0  # -0 + 0 would come back +0
y = y0.clone()
cc.add_correction(y, x, a, b, [0, 6, 6, 10], mask)
chat = mask == 0
out["add_chat_equal"] = bool(torch.equal(y[chat].view(torch.int16),
                                         y0[chat].view(torch.int16)))
want = y0.double().clone()
for i, (lo, hi) in enumerate([(0, 6), (6, 10)]):
    want[:, lo:hi] += (x.double() @ a[i].double().t()) @ b[i].double().t()
keep = mask.bool()
err = (y[keep].double() - want[keep]).abs().max().item()
out["add_clef_err"] = err / want[keep].abs().max().item()

# --- the fused GEMM's slices against the merged weights
k, n_slices, gs = 256, [96, 32, 32], 128
n = sum(n_slices)
codes = torch.randint(0, 256, (k, n), generator=g)
zeros = torch.randint(100, 156, (k // gs, n), generator=g)
scales = (torch.rand(k // gs, n, generator=g) * 0.01 + 0.001)
qweight, qzeros, sc = ref.pack_gptq_int8(codes, zeros, scales, 1)
qw, sz = ref.repack_gptq_int8(qweight, qzeros, sc, gs, 1)
w_t = ref.dequant_repacked(qw, sz, gs).double()  # [N, K]
bias = rnd(n)
xs = rnd(20, k)
a_ts = [rnd(8, k, s=0.1) for _ in n_slices]
b_ts = [rnd(m_, 8, s=0.1) for m_ in n_slices]
bounds, lo = [], 0
for m_ in n_slices:
    bounds += [lo, lo + m_]
    lo += m_
rmask = (torch.arange(20) % 3 == 0).to(torch.uint8)
calls = []

def gemm(x_, qw_, sz_, g_, bias_, a_t, b_t, mask_):
    calls.append(qw_.shape[0])
    return ref.lowrank_reference(x_, ref.dequant_repacked(qw_, sz_, g_), bias_, a_t.t(),
                                 b_t.t(), mask_)

got = cc.fused_gemm(xs, qw, sz, gs, bias, a_ts, b_ts, bounds, rmask, gemm)
merged = w_t.clone()
for i in range(len(n_slices)):
    lo_, hi_ = bounds[2 * i], bounds[2 * i + 1]
    merged[lo_:hi_] += b_ts[i].double() @ a_ts[i].double()
want_clef = xs.double() @ merged.t() + bias.double()
want_chat = xs.double() @ w_t.t() + bias.double()
want = torch.where(rmask.bool().view(-1, 1), want_clef, want_chat)
out["fused_calls"] = calls
out["fused_err"] = (got - want).abs().max().item()

# --- shards from a folder at TP=2
tp = 2
full = cc.source_from_folder(folder, TINY_CONFIG, 8, 1, 0)
xk = rnd(5, 32).double()
xd = rnd(5, 48).double()

def corr(src, prefix, n_out, k_in, xin):
    layer = torch.nn.Module()
    assert cc.attach_from(src, layer, prefix, n_out, k_in, torch.device("cpu"))
    a_, b_, bd = cc.factors(layer)
    o = torch.zeros(xin.shape[0], n_out, dtype=torch.float64)
    for i in range(len(a_)):
        o[:, bd[2 * i]:bd[2 * i + 1]] += (xin @ a_[i].double().t()) @ b_[i].double().t()
    return o

P = "model.layers"
qkvz_full = corr(full, f"{P}.40.linear_attn.in_proj_qkvz", 96, 32, xk)
qkv_full = corr(full, f"{P}.43.self_attn.qkv_proj", 96, 32, xk)
down_full = corr(full, f"{P}.40.mlp.down_proj", 32, 48, xd)
cols = {0: [list(range(0, 8)) + list(range(16, 24)) + list(range(32, 48))
            + list(range(64, 80)), list(range(0, 32)) + list(range(64, 80))
            + list(range(80, 96))],
        1: [list(range(8, 16)) + list(range(24, 32)) + list(range(48, 64))
            + list(range(80, 96)), list(range(32, 64)) + list(range(64, 80))
            + list(range(80, 96))]}
col_err, down_sum = 0.0, torch.zeros_like(down_full)
for r in range(tp):
    src = cc.source_from_folder(folder, TINY_CONFIG, 8, tp, r)
    col_err = max(col_err, (corr(src, f"{P}.40.linear_attn.in_proj_qkvz", 48, 32, xk)
                            - qkvz_full[:, cols[r][0]]).abs().max().item())
    col_err = max(col_err, (corr(src, f"{P}.43.self_attn.qkv_proj", 64, 32, xk)
                            - qkv_full[:, cols[r][1]]).abs().max().item())
    half = slice(24 * r, 24 * (r + 1))
    down_sum += corr(src, f"{P}.40.mlp.down_proj", 32, 24, xd[:, half])
out["column_err"] = col_err
out["row_sum_err"] = (down_sum - down_full).abs().max().item()
out["uncorrected"] = cc.attach_from(full, torch.nn.Module(), f"{P}.39.mlp.down_proj", 32,
                                    48, torch.device("cpu"))

def refusal(fn):
    try:
        fn()
    except ClefError as exc:
        return str(exc)
    return None

out["wrong_rank"] = refusal(lambda: cc.source_from_folder(folder, TINY_CONFIG, 16, 1, 0))
out["wrong_width"] = refusal(lambda: cc.attach_from(full, torch.nn.Module(),
                                                    f"{P}.40.mlp.down_proj", 32, 40,
                                                    torch.device("cpu")))
out["no_folder"] = refusal(lambda: cc.source_from_folder(folder / "nope", TINY_CONFIG, 8, 1, 0))

# --- one allocation per rank: every corrected layer of the folder, from one source
from vllm_patch.clef.arena import aligned, arena_bytes, shard_sizes
from vllm_patch.clef.layout import corrections, fused_slices
from vllm_patch.clef.model_dims import model_dims
from vllm_patch.clef.rows import layer_plan

dims_ = model_dims(TINY_CONFIG)
for tp_ in (1, 2):
    src = cc.source_from_folder(folder, TINY_CONFIG, 8, tp_, tp_ - 1)
    bufs = []
    for (li, fused), _g in fused_slices(corrections(dims_)).items():
        pre = f"{P}.{li}.{fused}"
        plans = layer_plan(dims_, pre, tp_, tp_ - 1)
        m_ = torch.nn.Module()
        cc.attach_from(src, m_, pre, plans[-1].out_hi,
                       sum(hi - lo for lo, hi in plans[0].a_cols), torch.device("cpu"))
        bufs += list(m_.buffers())
    base = src.arena.buf.data_ptr()
    sizes = shard_sizes(dims_, 8, tp_)
    out[f"arena_tp{tp_}"] = {
        "storages": len({b.untyped_storage().data_ptr() for b in bufs}),
        "offsets_aligned": all((b.data_ptr() - base) % 256 == 0 for b in bufs),
        "nbytes": src.arena.nbytes, "rule": arena_bytes(sizes),
        "used": src.arena.used, "placed": sum(aligned(n) for n in sizes),
        "tensors": len(bufs), "counted": len(sizes)}
    out[f"twice_tp{tp_}"] = refusal(lambda: cc.attach_from(
        src, torch.nn.Module(), f"{P}.40.mlp.down_proj", 32, 48 // tp_, torch.device("cpu")))
stage = cc.source_from_folder(folder, TINY_CONFIG, 8, 1, 0, layers=range(0, 42))
out["other_stage"] = refusal(lambda: cc.attach_from(
    stage, torch.nn.Module(), f"{P}.43.self_attn.qkv_proj", 96, 32, torch.device("cpu")))
out["stage_nbytes"] = stage.arena.nbytes
out["stage_rule"] = arena_bytes(shard_sizes(dims_, 8, 1, range(0, 42)))
out["stage_counted"] = len(shard_sizes(dims_, 8, 1, range(0, 42)))
out["stage_corrections"] = 2 * sum(1 for c in corrections(dims_) if c.layer in (40, 41))
out["all_counted"] = len(shard_sizes(dims_, 8, 1))

# --- the batch mask
rows = cc.ClefRows()
rows.set_batch([0, 2, 5, 6], [False, True, False], 8, torch.device("cpu"))
out["mask"] = rows.mask_for(8, torch.device("cpu")).tolist()
out["any"] = rows.any_clef
rows.set_batch([0, 2, 5, 6], [False, False, False], 8)
out["mask_after_chat"] = rows.mask_for(8, torch.device("cpu")).tolist()
out["any_after_chat"] = rows.any_clef
out["bad_layout"] = refusal(lambda: rows.set_batch([0, 9], [True], 8))
# a shorter chat batch after a Clef one clears the Clef rows beyond it too (a graph padded
# to 8 rows reads them); chat after chat copies nothing (a marker byte survives)
rows.set_batch([0, 8], [True], 8)
rows.set_batch([0, 4], [False], 4)
out["mask_shorter_chat"] = rows.mask[:8].tolist()
rows.mask[6] = 7
rows.set_batch([0, 3], [False], 3)
out["marker_after_chat_chat"] = int(rows.mask[6])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, request: Any) -> dict[str, Any]:
    from clef_fixture import write_clef_dir

    folder = write_clef_dir(Path(tmp_path_factory.mktemp("clef")) / "clef")
    return run_json(["-c", CHILD], {"dir": str(folder)}, timeout=300)


def test_chat_rows_keep_their_values_and_clef_rows_get_the_correction(result: dict) -> None:
    assert result["add_chat_equal"] is True
    assert result["add_clef_err"] < 2e-3  # fp16 rounding of t, t B^T and the sum


def test_the_fused_gemm_runs_one_launch_per_slice_on_the_merged_weights(result: dict) -> None:
    assert result["fused_calls"] == [96, 32, 32]
    assert result["fused_err"] < 1e-9  # float64 throughout: only the slicing can differ


def test_shards_reproduce_the_full_correction_at_tp2(result: dict) -> None:
    assert result["column_err"] < 1e-9
    assert result["row_sum_err"] < 1e-9
    assert result["uncorrected"] is False


def test_loader_refusals_name_the_setting_and_the_rule(result: dict) -> None:
    assert result["wrong_rank"].startswith("SM70_CLEF_DIR=")
    assert "rank = 8, but SM70_CLEF_RANK is 16" in result["wrong_rank"]
    assert result["no_folder"].startswith("SM70_CLEF_DIR=")
    assert "has no clef.json" in result["no_folder"]
    assert "40.mlp.down_proj: 40 input features on this rank" in result["wrong_width"]
    assert "\n" not in result["wrong_rank"] + result["wrong_width"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_ranks_shards_share_one_allocation_the_size_the_plan_counts(result: dict,
                                                                         tp: int) -> None:
    a = result[f"arena_tp{tp}"]
    assert a["storages"] == 1
    assert a["offsets_aligned"] is True
    assert a["nbytes"] == a["rule"] and a["nbytes"] % (2 << 20) == 0
    # every counted shard was placed, and nothing else
    assert a["used"] == a["placed"] and a["tensors"] == a["counted"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_layer_attached_twice_overflows_the_counted_bytes(result: dict, tp: int) -> None:
    assert "bytes counted for them" in result[f"twice_tp{tp}"]
    assert "corrected twice" in result[f"twice_tp{tp}"]


def test_a_pipeline_stage_counts_and_holds_only_its_layers(result: dict) -> None:
    assert "decoder layer 43 is not among this worker's layers (0-41)" in result["other_stage"]
    assert result["stage_nbytes"] == result["stage_rule"]
    assert result["stage_counted"] == result["stage_corrections"] < result["all_counted"]


def test_the_batch_mask_is_rewritten_every_batch(result: dict) -> None:
    assert result["mask"] == [0, 0, 1, 1, 1, 0, 0, 0]
    assert result["any"] is True
    assert result["mask_after_chat"] == [0] * 8
    assert result["any_after_chat"] is False
    assert "9 scheduled tokens exceed its 8 rows" in result["bad_layout"]


def test_a_shorter_chat_batch_clears_stale_clef_rows_and_chat_after_chat_copies_nothing(
        result: dict) -> None:
    assert result["mask_shorter_chat"] == [0] * 8
    assert result["marker_after_chat_chat"] == 7
