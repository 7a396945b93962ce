"""The figures the H200 run (tests/gpu/clef/device_clef.py) measures against are
`sm70ctl plan`'s: the correction per GPU at rank 256 (TP=2 and TP=1) and the head's bound.
The device image may lack sm70ctl's dependencies, so the script carries the numbers; this
holds them equal to the plan, and its batch layouts to what their docstring says.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from sm70ctl.plan import clef as plan_clef
from sm70ctl.plan.model_config import builtin_config_path, load_config

SCRIPT = Path(__file__).resolve().parent / "gpu" / "clef" / "device_clef.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_clef", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_clef", mod)
    spec.loader.exec_module(mod)
    return mod


def test_the_scripts_plan_figures_are_the_plans() -> None:
    dev = _script()
    model = load_config(builtin_config_path())
    for tp in (1, 2):
        items = plan_clef.clef_items(model, tp, range(model.num_layers), True, dev.RANK)
        got = {key: b for key, _, b, _ in items}
        assert got["clef.correction"] == dev.PLAN_CORRECTION[tp], tp
        assert got["clef.head"] == dev.PLAN_HEAD_BYTES


def test_batch_layouts_mix_chat_and_clef_requests() -> None:
    dev = _script()
    for m in dev.MS:
        qsl, flags = dev.batch_layout(m)
        assert qsl[0] == 0 and qsl[-1] == m and len(qsl) == len(flags) + 1
        assert any(flags)
        if m > 1:
            assert not all(flags)


def test_the_tolerance_grows_with_the_worse_reference_error() -> None:
    dev = _script()
    assert dev.clef_tolerance(0.01, 0.02, 32.0) == 2 * 0.02 + 32.0 / 1024
    assert dev.clef_tolerance(0.02, 0.01, 0.0) == 0.04
