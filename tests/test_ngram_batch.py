"""The batch (torch) form of the n-gram assist (vllm_patch/spec_decode/batch.py) against the
reference definitions (ngram.find_match, chooser.choose / chooser.observe).

Rows are drawn here (seeded) from small alphabets, periodic blocks and random text, at mixed
lengths in one padded batch; the padding copies the row's own pattern, so a form that reads
past a row's length finds tempting matches there. The torch side runs in a child with torch
(this interpreter if it has torch, else the serving environment .serve-venv); without either
the test skips, except under CI=true, where it fails. The child also traces `propose_batch`
with `torch.compile(fullgraph=True)` (eager backend): any host sync or data-dependent branch
is a graph break there, and fails. Each plausible bug in MUTANTS, applied to the source in
the child, must produce a mismatch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_patch.spec_decode.chooser import Acceptance, choose, observe
from vllm_patch.spec_decode.ngram import find_match

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "vllm_patch" / "spec_decode" / "batch.py"
SERVE_PY = ROOT / ".serve-venv" / "bin" / "python"

MUTANTS: tuple[tuple[str, str, str], ...] = (
    ("k-tokens-not-required", "room = pos + k <= last", "room = pos + k <= last + 1"),
    ("earliest-occurrence", "end = ends.amax(dim=1)",
     "end = torch.where(ends < 0, width, ends).amin(dim=1)"),
    ("reads-before-the-row", "alive & (src >= 0) & (tail >= 0)", "alive & (tail >= 0)"),
    ("shortest-wins", "n = run.amax(dim=1)  # [B]",
     "n = torch.where(run >= n_min, run, n_max + 1).amin(dim=1).clamp(max=n_max)"),
    ("n-max-plus-one", "for j in range(n_max):", "for j in range(n_max + 1):"),
    ("tie-goes-to-ngram", "better = ewma_ngram > ewma_mtp + margin",
     "better = ewma_ngram >= ewma_mtp + margin"),
    ("cold-ngram-allowed", "return has_draft & ngram_known & (better | ~mtp_known)",
     "return has_draft & (better | ~mtp_known)"),
    ("observe-ignores-mask", "return torch.where(measured, moved, ewma)", "return moved"),
)

CHILD = r"""
import json, sys, types
import torch
req = json.load(sys.stdin)
text = open(req["source"]).read()

def load(src):
    mod = types.ModuleType("batch_under_test")
    exec(compile(src, "batch.py", "exec"), mod.__dict__)
    return mod

def run(mod, traced=False):
    out = {"groups": [], "choose": None, "observe": None}
    fn = mod.propose_batch
    if traced:
        fn = torch.compile(mod.propose_batch, fullgraph=True, backend="eager", dynamic=False)
    for g in req["groups"]:
        width = max(len(r) + len(p) for r, p in zip(g["rows"], g["pads"]))
        width = max(width, 1)
        tokens = torch.zeros((len(g["rows"]), width), dtype=torch.long)
        for i, (r, p) in enumerate(zip(g["rows"], g["pads"])):
            full = r + p
            tokens[i, :len(full)] = torch.tensor(full, dtype=torch.long)
        lengths = torch.tensor([len(r) for r in g["rows"]], dtype=torch.long)
        drafts, has, n = fn(tokens, lengths, g["k"], g["n_min"], g["n_max"])
        out["groups"].append({"drafts": drafts.tolist(), "has": has.tolist(),
                              "n": n.tolist()})
    c = req["choose"]
    f = lambda xs: torch.tensor([float("nan") if x is None else x for x in xs])
    use = mod.choose_batch(f(c["mtp"]), f(c["ngram"]), torch.tensor(c["has"]), c["margin"])
    out["choose"] = use.tolist()
    o = req["observe"]
    moved = mod.observe_batch(f(o["ewma"]), torch.tensor(o["sample"], dtype=torch.float),
                              torch.tensor(o["measured"]), o["alpha"])
    out["observe"] = [None if x != x else x for x in moved.tolist()]
    a = mod.assist(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                   torch.tensor([True, False]))
    out["assist"] = a.tolist()
    return out

results = {"plain": run(load(text))}
results["traced"] = run(load(text), traced=True)
for name, old, new in req["mutants"]:
    assert text.count(old) == 1, name
    try:
        results[name] = run(load(text.replace(old, new)))
    except Exception as e:
        results[name] = {"error": f"{type(e).__name__}: {e}"}
json.dump(results, sys.stdout)
"""


def _rows(rng: random.Random) -> list[list[int]]:
    rows: list[list[int]] = [[], [1], [4, 4], [1, 2, 1, 2, 1]]
    for _ in range(40):
        kind = rng.randrange(3)
        size = rng.randrange(0, 70)
        if kind == 0:
            rows.append([rng.randrange(3) for _ in range(size)])
        elif kind == 1:
            block = [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
            rows.append((block * 20)[:size])
        else:
            rows.append([rng.randrange(1000) for _ in range(size)])
    return rows


def _request() -> dict[str, Any]:
    rng = random.Random(2026)
    groups = []
    for k, n_min, n_max in ((1, 1, 1), (3, 2, 8), (7, 2, 4), (3, 1, 5), (2, 3, 3)):
        rows = _rows(rng)
        # Padding that continues each row's own pattern (or its first tokens).
        pads = [(r * 3)[: rng.randrange(0, 12)] if r else [0, 0] for r in rows]
        groups.append({"k": k, "n_min": n_min, "n_max": n_max, "rows": rows, "pads": pads})
    values = [None, 0.0, 1.0, 1.25, 2.0, 3.0]
    mtp, ngram, has = [], [], []
    for m in values:
        for g in values:
            for h in (True, False):
                mtp.append(m)
                ngram.append(g)
                has.append(h)
    choose_req = {"mtp": mtp, "ngram": ngram, "has": has, "margin": 0.25}
    obs = {"ewma": [None, None, 1.0, 2.0, 0.5], "sample": [3.0, 2.0, 3.0, 0.0, 1.0],
           "measured": [True, False, True, True, False], "alpha": 0.5}
    return {"source": str(SOURCE), "groups": groups, "choose": choose_req, "observe": obs}


def _python() -> str | None:
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    if SERVE_PY.is_file():
        return str(SERVE_PY)
    return None


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    python = _python()
    if python is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must have torch here or in .serve-venv for the batch n-gram test")
        pytest.skip("no torch here and no .serve-venv")
    req = _request()
    req["mutants"] = [list(m) for m in MUTANTS]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([python, "-c", CHILD], input=json.dumps(req), capture_output=True,
                          text=True, timeout=600, env=env, check=False)
    if proc.returncode != 0:
        pytest.fail(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return {"request": req, "results": json.loads(proc.stdout)}


def _problems(req: dict[str, Any], out: dict[str, Any]) -> list[str]:
    if "error" in out:
        return [out["error"]]
    problems = []
    for g, got in zip(req["groups"], out["groups"], strict=True):
        k, lo, hi = g["k"], g["n_min"], g["n_max"]
        for i, row in enumerate(g["rows"]):
            m = find_match(row, k, lo, hi)
            want = (False, 0, None) if m is None else (True, m.n, m.draft(row, k))
            has, n, drafts = got["has"][i], got["n"][i], got["drafts"][i]
            if (has, n) != want[:2] or (has and drafts != want[2]):
                problems.append(f"k={k} n={lo}..{hi} row {row}: got {(has, n, drafts)}, "
                                f"want {want}")
    c = req["choose"]
    for m, g, h, use in zip(c["mtp"], c["ngram"], c["has"], out["choose"], strict=True):
        want_use = choose(Acceptance(mtp=m, ngram=g), ngram_has_draft=h,
                          margin=c["margin"]) == "ngram"
        if use != want_use:
            problems.append(f"choose mtp={m} ngram={g} has={h}: got {use}")
    o = req["observe"]
    for e, s, meas, got_v in zip(o["ewma"], o["sample"], o["measured"], out["observe"],
                                 strict=True):
        want_v = observe(Acceptance(mtp=e), mtp=s if meas else None, ngram=None,
                         alpha=o["alpha"]).mtp
        if (want_v is None) != (got_v is None) or (
                want_v is not None and not math.isclose(want_v, got_v, rel_tol=1e-6)):
            problems.append(f"observe ewma={e} sample={s} measured={meas}: got {got_v}")
    if out["assist"] != [[1, 1, 1], [0, 0, 0]]:
        problems.append(f"assist: {out['assist']}")
    return problems


def test_batch_form_equals_the_reference(child: dict[str, Any]) -> None:
    problems = _problems(child["request"], child["results"]["plain"])
    assert not problems, "\n".join(problems[:20])


def test_batch_form_traces_without_graph_breaks(child: dict[str, Any]) -> None:
    problems = _problems(child["request"], child["results"]["traced"])
    assert not problems, "\n".join(problems[:20])


def test_the_cases_exercise_drafts_and_misses(child: dict[str, Any]) -> None:
    got = child["results"]["plain"]["groups"]
    flags = [h for g in got for h in g["has"]]
    assert 0.2 < sum(flags) / len(flags) < 0.9


@pytest.mark.parametrize("name", [m[0] for m in MUTANTS])
def test_each_mutant_is_caught(child: dict[str, Any], name: str) -> None:
    assert _problems(child["request"], child["results"][name]), f"mutant {name} survived"
