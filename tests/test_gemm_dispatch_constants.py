"""The memory plan's copy of sm70_gptq's prefill-GEMM constants (CPU: sm70_gptq imports torch,
so its source is read, not imported)."""

from __future__ import annotations

import ast
from pathlib import Path

from sm70ctl.plan import workspaces

SRC = Path(__file__).resolve().parents[1] / "vllm_patch" / "quantization" / "sm70_gptq.py"


def _constants() -> dict[str, int]:
    out = {}
    for node in ast.parse(SRC.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                if isinstance(node.value, ast.BinOp):  # e.g. 32 << 20
                    out[node.targets[0].id] = eval(compile(ast.Expression(node.value), "", "eval"))
    return out


def test_plan_counts_the_plugins_dequant_slice_and_row_threshold():
    c = _constants()
    assert c["DEQUANT_SLICE_BYTES"] == workspaces.DEQUANT_SLICE_BYTES
    assert c["INT8_GEMM_MAX_ROWS"] == workspaces.INT8_GEMM_MAX_ROWS


def test_the_reference_plan_has_the_dequant_item_only_for_prefill_sized_chunks():
    items = {i.key: i for i in _items(tokens=2048)}
    assert items["gemm.dequant"].bytes == workspaces.DEQUANT_SLICE_BYTES  # gate_up is larger
    assert "gemm.dequant" not in {i.key for i in _items(tokens=255)}
    assert "gemm.dequant" in {i.key for i in _items(tokens=256)}
    assert "gemm.dequant" not in {i.key for i in _items(tokens=2048, int8=False)}


def _items(tokens: int, int8: bool = True):
    from sm70ctl.plan.model_config import builtin_config_path, load_config

    w = workspaces.WorkspaceInputs(2, 1, tokens, 16, 3, 20, 256, (4, 8), 0, 16, 64, 0, 0,
                                   int8_weights=int8)
    model = load_config(builtin_config_path())
    return workspaces.workspace_items(model, w, kinds={"full", "linear"}, last=True,
                                      has_attention=True)
