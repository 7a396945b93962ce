"""The scoring head's forward (vllm_patch.clef.head_forward) against the head written out in
plain PyTorch, one request at a time in float64 (tests/gpu/clef/head_reference.py), on the
CPU (torch in a child, tests/serve_venv.py); the H200 run repeats it at the real widths.

Two requests packed in one call: if the block-diagonal mask let one request's positions see
the other's, the packed logits would differ from the per-request reference; a head tensor of
the wrong shape is refused naming it; the head loads from a checked SM70_CLEF_DIR.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serve_venv import run_json

CHILD = r'''
import json, sys
import torch
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/gpu/clef")
from clef_fixture import TINY_CONFIG, TINY_HEAD
from head_reference import reference_logits
from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.head import head_tensors, parse_head_config
from vllm_patch.clef.head_forward import ClefHead

req = json.loads(sys.stdin.read())
cfg = parse_head_config({**TINY_HEAD, "blocks": 2}, 32)
g = torch.Generator().manual_seed(0)
ts = {n: (torch.randn(*s, generator=g) * (1.0 if "norm" in n else 0.2)).half()
      for n, s in head_tensors(cfg).items()}
head = ClefHead(cfg, ts, torch.device("cpu"))
hidden = torch.randn(40, 32, generator=g).half()
positions = [3, 5, 9, 11, 20, 22, 25, 30, 31]
roles = [0, 1, 1, 0, 1, 1, 1, 0, 1]
kinds = [0, 0, 0, 2, 2, 2, 2, 1, 1]
starts = req["starts"]
got = head.float()(hidden.float(), torch.tensor(positions), torch.tensor(roles),
                   torch.tensor(kinds), starts) if req["fp32"] else head(
    hidden, torch.tensor(positions), torch.tensor(roles), torch.tensor(kinds), starts)
want = reference_logits(ts, cfg.blocks, cfg.attention_heads, hidden, positions, roles, kinds,
                        starts)
out = {"err": max(abs(a - b) for a, b in zip(got.tolist(), want)),
       "scale": max(abs(b) for b in want)}
bad = dict(ts); bad["head.out.weight"] = torch.zeros(2, 64).half()
try:
    ClefHead(cfg, bad, torch.device("cpu")); out["refusal"] = None
except ClefError as exc:
    out["refusal"] = str(exc)
from pathlib import Path
from clef_fixture import write_clef_dir
from vllm_patch.clef.head_forward import head_from_folder
folder = write_clef_dir(Path(req["dir"]))
loaded = head_from_folder(folder, TINY_CONFIG, 8, torch.device("cpu"))
out["loaded_blocks"] = loaded.cfg.blocks
out["loaded_logits"] = loaded(hidden, torch.tensor(positions), torch.tensor(roles),
                              torch.tensor(kinds), starts).shape[0]
try:
    head_from_folder(folder, TINY_CONFIG, 16, torch.device("cpu")); out["rank_refusal"] = None
except ClefError as exc:
    out["rank_refusal"] = str(exc)
print(json.dumps(out))
'''


@pytest.mark.parametrize("starts", [[0, 3, 9], [0, 9], [0, 7, 9]])
def test_packed_requests_score_like_each_request_alone(starts: list[int],
                                                       tmp_path: Path) -> None:
    r: dict[str, Any] = run_json(["-c", CHILD], {"starts": starts, "fp32": True,
                                                 "dir": str(tmp_path / "clef")}, timeout=300)
    assert r["err"] <= 1e-4 * max(1.0, r["scale"])
    assert r["refusal"] == ("head tensor 'head.out.weight': shape (2, 64), the head config "
                            "needs (3, 64)")
    # the fixture folder's head (1 block) loads from SM70_CLEF_DIR and scores every position
    assert r["loaded_blocks"] == 1 and r["loaded_logits"] == 9
    assert r["rank_refusal"].startswith("SM70_CLEF_DIR=")
    assert "SM70_CLEF_RANK is 16" in r["rank_refusal"]
