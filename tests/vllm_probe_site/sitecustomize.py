"""Lets torchvision's Python half import next to CPU torch, in every process of the probe.

Only for tests/vllm_config_probe.py (its PYTHONPATH names this folder). PyPI's torchvision
is a CUDA build whose C ops cannot load next to CPU torch (.ci/setup.d/35-vllm-0.22.1-py.sh
drops its libraries). torchvision then imports fine except for two fake-kernel
registrations that it makes without checking that its ops loaded; giving those two ops a
schema first lets the import finish. vLLM's config code never calls them, and the model
inspection runs in a subprocess of its own, hence a site hook rather than a call in the
probe.
"""

from __future__ import annotations

import importlib.abc
import sys

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            for op in ("nms", "qnms"):
                torch.library.define(f"torchvision::{op}", _SCHEMA)
        return None  # the normal finders import it


sys.meta_path.insert(0, _BeforeTorchvision())
