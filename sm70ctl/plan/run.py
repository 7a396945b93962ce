"""From settings to a plan: which model, which GPUs, then the arithmetic.

Shared by `sm70ctl plan` and serve's pre-flight, so both pick the model and the cards the
same way (SM70_GPUS selects the NVML cards by index or UUID, in its order).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sm70ctl.errors import Sm70Error, UsageError
from sm70ctl.plan.gpus import GpuSource, probe_nvml, resolve_gpus
from sm70ctl.plan.model_config import ModelShape, builtin_config_path, load_config
from sm70ctl.plan.plan import Plan, PlanInputs, compute_plan
from sm70ctl.settings.typed import SettingsView

BUILTIN_SOURCE = "built-in (Qwen3.8-27B GPTQ int8)"


@dataclass(frozen=True)
class PlanRun:
    plan: Plan
    model: ModelShape
    model_source: str
    gpus: GpuSource
    inputs: PlanInputs


def load_model(
    settings_dir: Path | None, config: Path | None = None, model_dir: Path | None = None
) -> tuple[ModelShape, str]:
    """The model to plan and where it came from: --config, --model-dir, SM70_MODEL_DIR's
    config.json when it exists, else the built-in Qwen3.8-27B description."""
    from sm70ctl.readers import check_path

    if config is not None and model_dir is not None:
        raise UsageError("give --config or --model-dir, not both")
    if config is not None:
        return load_config(config), "--config"
    if model_dir is not None:
        # a path the OS cannot take (a component over 255 bytes) is a usage error, not a crash
        try:
            check_path(model_dir / "config.json", "--model-dir")
        except Sm70Error as exc:
            raise UsageError(exc.message) from None
        if not (model_dir / "config.json").is_file():
            raise UsageError(f"--model-dir {model_dir}: no config.json there")
        return load_config(model_dir / "config.json"), "--model-dir"
    if settings_dir is not None and (Path(settings_dir).expanduser() / "config.json").is_file():
        return load_config(Path(settings_dir).expanduser() / "config.json"), "SM70_MODEL_DIR"
    return load_config(builtin_config_path()), BUILTIN_SOURCE


def plan_for_settings(
    settings: SettingsView,
    *,
    config: Path | None = None,
    model_dir: Path | None = None,
    gpus: str | None = None,
    context: int | None = None,
    path: str | None = None,
) -> PlanRun:
    """Plan the configured model on the configured GPUs (`gpus`: a --gpus spec that
    replaces NVML; `path`: the pool path, default `served`, what vLLM allocates today)."""
    inputs = PlanInputs.from_settings(settings, path=path)
    model, source = load_model(inputs.model_dir, config, model_dir)
    needed = inputs.tensor_parallel_size * inputs.pipeline_parallel_size
    src = resolve_gpus(gpus, needed, None if gpus is not None else probe_nvml(),
                       [str(g) for g in settings.gpus])
    plan = compute_plan(model, inputs, src.gpus[:needed], context)
    return PlanRun(plan, model, source, src, inputs)
