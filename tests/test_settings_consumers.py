"""No dead knobs: every SM70_* variable changes what each of its consumers receives.

Parametrised over all 98 variables: each is set to its schema example (a valid,
non-default value) and, for every consumer the schema declares, the consumer's output at
the declared target must differ from the output with defaults. The reverse holds too:
every field a consumer receives is declared by some variable.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import yaml

from sm70ctl.runtime.command_line import vllm_argv
from sm70ctl.runtime.compile_cache import compile_fingerprint, compile_key_items
from sm70ctl.runtime.environment import vllm_env as _vllm_env
from sm70ctl.runtime.plugin_config import plugin_config_obj
from sm70ctl.runtime.secrets import secrets_yaml
from sm70ctl.settings import SettingsError, load_schema, load_settings
from sm70ctl.settings.consumers import CONSUMER_FUNCTIONS

SCHEMA = load_schema()
DEFAULTS = load_settings({})


def vllm_env(settings: Any) -> dict[str, str]:
    return _vllm_env(settings, p2p_available=None)


def flag_view(argv: list[str], flag: str) -> tuple[str, ...]:
    """Every occurrence of a flag (or its --no- form) with its value, if it takes one."""
    negated = "--no-" + flag[2:]
    seen: list[str] = []
    for i, arg in enumerate(argv):
        if arg in (flag, negated):
            seen.append(arg)
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                seen.append(argv[i + 1])
    return tuple(seen)


def consumer_view(kind: str, target: str, settings: Any) -> Any:
    if kind == "vllm_flag":
        argv = vllm_argv(settings)
        if target == "PYTHON":
            return argv[0]
        return flag_view(argv, target)
    if kind == "vllm_secret":
        text = secrets_yaml(settings)
        return None if text is None else yaml.safe_load(text).get(target)
    if kind == "vllm_env":
        return vllm_env(settings).get(target)
    if kind == "plugin":
        return plugin_config_obj(settings).get(target)
    if kind == "kernel":
        return compile_key_items(settings).get(target), compile_fingerprint(settings)
    return getattr(CONSUMER_FUNCTIONS[kind](settings), target)


@pytest.mark.parametrize("spec", SCHEMA.variables, ids=[v.name for v in SCHEMA.variables])
def test_non_default_value_reaches_every_consumer(spec):
    changed = load_settings({spec.name: spec.example, **spec.example_with})
    baseline = _baseline(spec)
    assert changed.source_of(spec.name) == "environment"
    for consumer in spec.consumers:
        before = consumer_view(consumer.kind, consumer.target, baseline)
        after = consumer_view(consumer.kind, consumer.target, changed)
        assert before != after, (
            f"{spec.name}={spec.example!r} does not change {consumer.kind}:{consumer.target}"
        )


def test_example_companions_do_not_include_the_variable_itself():
    for spec in SCHEMA.variables:
        assert spec.name not in spec.example_with


def _baseline(spec: Any) -> Any:
    """Defaults plus the example's companions where those alone are valid, so a companion
    is never what makes the difference (e.g. SM70_HOST's example needs an API key)."""
    if not spec.example_with:
        return DEFAULTS
    try:
        return load_settings(dict(spec.example_with))
    except SettingsError:
        # e.g. SM70_GPUS=0 alone breaks the GPU-count rule; then the companions must
        # not touch any target of this variable.
        for consumer in spec.consumers:
            for other in spec.example_with:
                assert consumer not in SCHEMA.by_name[other].consumers, (spec.name, other)
        return DEFAULTS


def _leaves(obj: Any, prefix: str = "") -> list[str]:
    out = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if hasattr(value, "__dataclass_fields__"):
            out += _leaves(value, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def _targets(kind: str) -> set[str]:
    return {c.target for v in SCHEMA.variables for c in v.consumers if c.kind == kind}


@pytest.mark.parametrize("kind", sorted(CONSUMER_FUNCTIONS))
def test_every_consumer_field_is_fed_by_a_variable(kind):
    result = CONSUMER_FUNCTIONS[kind](DEFAULTS)
    assert {f.name for f in fields(result)} == _targets(kind)


def test_every_plugin_field_is_fed_by_a_variable():
    leaves = set(_leaves(plugin_config_obj(DEFAULTS))) - {"version"}
    assert leaves == _targets("plugin")


def test_kernel_consumers_are_exactly_the_compile_key_variables():
    marked = {v.name for v in SCHEMA.variables if v.compile_key}
    assert marked == _targets("kernel") == set(compile_key_items(DEFAULTS))


def test_managed_env_vars_are_declared_or_fixed():
    fixed = {"CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
             "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "SM70_PLUGIN_CONFIG", "SM70_KERNELS_BUILD_DIR"}
    env = _vllm_env(load_settings({"SM70_PROFILE_DIR": "/tmp/p"}), p2p_available=True)
    assert set(env) - fixed <= _targets("vllm_env")
    assert _targets("vllm_env") <= set(env)


def test_every_emitted_flag_is_declared():
    s = load_settings({"SM70_BLOCK_SIZE": "64", "SM70_ENFORCE_EAGER": "true",
                       "SM70_API_KEY": "k"})
    # --config carries the vllm_secret keys (the API key file), never a setting of its own
    declared = _targets("vllm_flag") | {"--config"}
    assert _targets("vllm_secret") == {"api-key"}
    for arg in vllm_argv(s):
        if arg.startswith("--"):
            name = "--" + arg[len("--no-"):] if arg.startswith("--no-") else arg
            assert name in declared, arg


# The plan's and the doctor's consumer views above are their real inputs; check the
# classes directly too, as the commands build them.
REAL = {"plan": "sm70ctl.plan.plan:PlanInputs", "doctor": "sm70ctl.doctor.config:DoctorConfig"}


@pytest.mark.parametrize("kind", sorted(REAL))
def test_real_plan_and_doctor_inputs_see_their_variables(kind):
    import importlib

    module, name = REAL[kind].split(":")
    build = getattr(importlib.import_module(module), name).from_settings
    dead = []
    for spec in SCHEMA.variables:
        if not any(c.kind == kind for c in spec.consumers):
            continue
        changed = load_settings({spec.name: spec.example, **spec.example_with})
        if build(changed) == build(_baseline(spec)):
            dead.append(spec.name)
    assert dead == [], f"{kind} ignores {dead}"

