"""docs/clef.md says what the code does: its shapes table and its figures come from the
format's own functions, so a change of layout or sharding that leaves the doc behind fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

from clef_fixture import REAL_CONFIG, real_spec

from vllm_patch.clef.head import REFERENCE_HEAD, head_params, parse_head_config
from vllm_patch.clef.layout import corrections
from vllm_patch.clef.model_dims import model_dims
from vllm_patch.clef.sharding import shard, shard_bytes

DOC = (Path(__file__).resolve().parent.parent / "docs" / "clef.md").read_text()
REAL = json.loads(REAL_CONFIG.read_text())


def _x(shape: tuple[int, int]) -> str:
    return f"{shape[0]} x {shape[1]}"


def test_shapes_table_matches_the_layout() -> None:
    block = DOC.split("<!-- clef-shapes:begin -->")[1].split("<!-- clef-shapes:end -->")[0]
    rows = [r for r in block.strip().splitlines()[2:]]
    got = {}
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        got[cells[0].strip("`")] = cells[1:]
    want = {}
    for c in corrections(model_dims(REAL)):
        s = shard(c, 2, 0)
        fused = (c.fused if c.fused == c.module
                 else f"{c.fused.rsplit('.', 1)[-1]} slice {c.slice_index}")
        want[c.module] = [fused, c.parallel, _x(c.a_shape(256)), _x(c.b_shape(256)),
                          _x(s.a_shape(256)), _x(s.b_shape(256))]
    assert got == want


def test_figures_in_the_doc() -> None:
    cs = corrections(model_dims(REAL))
    tp2 = sum(shard_bytes(c, 256, 2) for c in cs)
    tp1 = sum(shard_bytes(c, 256, 1) for c in cs)
    head = head_params(parse_head_config(REFERENCE_HEAD, 5120))
    spec = real_spec(REAL)["manifest"]
    for figure in (f"{tp2:,} B", f"{tp1:,} B", f"{head:,}\nparameters", f"{2 * head:,} B"):
        assert figure.replace("\n", " ") in DOC.replace("\n", " "), figure
    example = json.loads(re.search(r"```json\n(\{\n \"format\".*?)\n```", DOC, re.S).group(1))
    assert example["head"] == REFERENCE_HEAD == spec["head"]
    assert example["base_model"] == spec["base_model"]
    assert set(example) == set(spec)
