"""No dead knobs: every SM70_* variable changes what the production code that consumes it
produces.

Each of the 98 variables is set to its schema example (a valid non-default value, with the
companions `example_with` names), and every consumer the schema declares is run twice, on
the defaults and on the changed settings; what it produces must differ. The consumers are the
real ones, called through their modules (so the mutation test below can replace them):
  vllm_flag / vllm_secret / vllm_env  sm70ctl.runtime's command line, secrets file, environment
  plugin      the plugin config that environment carries, read back by vllm_patch.config, and
              for the fields the plugin acts on, what vllm_patch.plugin registers from it
              (the Clef fields: what the API server's Clef middleware answers with them)
  kernel      the compile-cache fingerprint (names the cache folder)
  build       sm70ctl build's BuildConfig and the environment of its compile steps
  plan        PlanInputs.from_settings (what every plan computes with)
  supervisor  serve's pre-flight inputs (the world probed through fakes) and the ServerLog /
              ServerSpec the launch builds
  doctor      DoctorConfig.from_settings;  weights  FetchConfig.from_settings
A consumer marked `pending: N` in the schema is produced but read by no code yet (issue N):
it is still checked to receive the value, and the variables with nothing else are listed as
not consumed yet. The mutation test makes production consumers ignore a variable and checks
that `dead_consumers` reports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sm70ctl.build import command as build_command
from sm70ctl.build import plan as build_plan
from sm70ctl.build.toolchain import BYTES_PER_NVCC_JOB, ToolchainProbe
from sm70ctl.doctor.config import DoctorConfig
from sm70ctl.output import Output
from sm70ctl.plan.plan import PlanInputs
from sm70ctl.runtime import command_line, compile_cache, environment, secrets
from sm70ctl.runtime.plugin_config import PLUGIN_CONFIG_ENV
from sm70ctl.serve import clef_args
from sm70ctl.serve import command as serve_command
from sm70ctl.settings import SettingsError, load_schema, load_settings
from sm70ctl.settings.schema import VarSpec, parse_schema
from sm70ctl.weights.fetch import FetchConfig
from vllm_patch import plugin
from vllm_patch.attention import rules as attention_rules
from vllm_patch.config import PluginConfig
from vllm_patch.quantization import draft_int8

SCHEMA = load_schema()
# What the fake toolchain probe reports: memory for one compile job, so that MAX_JOBS
# derived from it is 1 on any machine, never the example's value.
PROBE = ToolchainProbe(nvcc="/opt/cuda/bin/nvcc", nvcc_release="12.8", cuda_home="/opt/cuda",
                       host_cc="gcc", host_cc_version="12.2.0",
                       mem_available=BYTES_PER_NVCC_JOB)


# --- the consumers ---------------------------------------------------------------------
def _flag(argv: list[str], flag: str) -> tuple[str, ...]:
    """Every occurrence of a flag (or its --no- form) with its value, if it takes one."""
    negated = "--no-" + flag[2:]
    seen: list[str] = []
    for i, arg in enumerate(argv):
        if arg in (flag, negated):
            seen.append(arg)
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                seen.append(argv[i + 1])
    return tuple(seen)


def _env(settings: Any) -> dict[str, str]:
    return environment.vllm_env(settings, p2p_available=None)


def _plugin_config(settings: Any) -> PluginConfig:
    """What the plugin reads: the config the vLLM environment carries, parsed by the plugin."""
    return PluginConfig.from_env({PLUGIN_CONFIG_ENV: _env(settings)[PLUGIN_CONFIG_ENV]})


@contextlib.contextmanager
def _fake_module(name: str, **attrs: Any) -> Iterator[None]:
    """`name` replaced by a recorder module and vLLM reported installed: the plugin's
    registration code runs on the CPU, without vLLM or torch."""
    fake = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(fake, k, v)
    real_find_spec = importlib.util.find_spec
    saved = sys.modules.get(name)
    sys.modules[name] = fake
    importlib.util.find_spec = lambda mod, *a: (  # type: ignore[assignment]
        object() if mod == "vllm" else real_find_spec(mod, *a))
    try:
        yield
    finally:
        importlib.util.find_spec = real_find_spec  # type: ignore[assignment]
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def _registered_quantization(config: PluginConfig) -> str:
    """What the plugin registers for this config (sm70_gptq imports vLLM and torch)."""
    with _fake_module("vllm_patch.quantization.sm70_gptq",
                      register=lambda rows, lm_head: f"sm70_gptq rows={rows} lm_head={lm_head}"):
        return plugin._register_quantization(config)


def _registered_gdn_layer(config: PluginConfig) -> str:
    """Whether the plugin installs its GDN layer for this config."""
    with _fake_module("vllm_patch.gdn.layer", register=lambda int16_state=False, prefill="fla": (
            f"sm70 GDN layer registered, int16 state {int16_state}, prefill on {prefill}")):
        return plugin._register_gdn_layer(config)


def _installed_prompt_logprobs(config: PluginConfig) -> str:
    """What the plugin installs for prompt logprobs (runtime patch R5)."""
    with _fake_module("vllm_patch.logprobs.runner_patch",
                      install_when_imported=lambda rows: f"sliced prompt logprobs, {rows} rows"):
        return plugin._install_prompt_logprobs(config)


def _installed_ngram_assist(config: PluginConfig) -> str:
    """What the plugin arms for the n-gram assist (runtime patch R6): the hook gets the spec
    section whole and its runner_state builds AssistParams from ngram_min/ngram_max
    (exercised in the serving venv by tests/spec_assist_probe.py)."""
    with _fake_module("vllm_patch.spec_decode.runner_hook", install_when_imported=lambda spec: (
            f"n-gram assist armed, n {spec.ngram_min}..{spec.ngram_max}")):
        return plugin._install_ngram_assist(config)


class _ClefEngine:
    """vLLM's engine client for one scoring request: a tokenizer of one token per word,
    and the head's per-position logits (zeros) from the workers' collective_rpc."""

    def __init__(self) -> None:
        self.positions = 0

    def get_tokenizer(self) -> Any:
        return types.SimpleNamespace(encode=lambda text, add_special_tokens=True: [
            len(w) for w in text.split()])

    async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        self.positions = len(params["extra_args"]["sm70_clef_score"]["positions"])
        yield types.SimpleNamespace(finished=True)

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [[0.0] * self.positions]


class _ClefApp:
    """vLLM's API app as the Clef middleware sees it (the tiny model's config, a 4,096-token
    chat context); answers 200 to what the middleware passes on."""

    def __init__(self) -> None:
        from clef_fixture import TINY_CONFIG

        hf = types.SimpleNamespace(to_dict=lambda: dict(TINY_CONFIG))
        self.state = types.SimpleNamespace(
            args=types.SimpleNamespace(served_model_name=["m"], max_model_len=4096),
            engine_client=_ClefEngine(),
            vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(
                hf_config=hf)))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from vllm_patch.clef import api

        await api.send_json(send, 200, {"passed": True})


def _clef_answer(clef: Any, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """The status and error message vllm_patch.clef.api's middleware, built from this clef
    section as `sm70ctl serve --middleware` builds it in the API server, answers a POST."""
    import asyncio
    import json

    from vllm_patch.clef import api

    msgs = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[Any] = []

    async def receive() -> Any:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "app": _ClefApp()}
    middleware = api.ClefMiddleware(scope["app"], clef)
    middleware.make_params = lambda **kw: kw  # vLLM's SamplingParams
    asyncio.run(middleware(scope, receive, send))
    answer = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return sent[0]["status"], str(answer.get("error", {}).get("message", ""))


def _example(name: str) -> int:
    return int(SCHEMA.by_name[name].example)


_CLEF_DIR: list[Path] = []


def _tiny_clef_dir() -> Path:
    """A valid Clef folder for the tiny config (tests/clef_fixture.py) at the rank of
    SM70_CLEF_RANK's example, made once."""
    if not _CLEF_DIR:
        import tempfile

        from clef_fixture import write_clef_dir

        root = Path(tempfile.mkdtemp(prefix="sm70-clef-consumers-"))
        _CLEF_DIR.append(write_clef_dir(root / "clef", rank=_example("SM70_CLEF_RANK")))
    return _CLEF_DIR[0]


def _score_body(questions: int = 1, words: int = 4) -> dict[str, Any]:
    q = {"kind": "choice", "text": "Which?", "options": ["a", "b"]}
    return {"model": "m-clef", "input": " ".join(["w"] * words),
            "questions": [{**q, "id": f"q{i}"} for i in range(questions)]}


def _clef_effect(field: str) -> Callable[[PluginConfig], Any]:
    """How the middleware's answers show one clef field: `enabled`, whether the Clef name
    exists on a generation route; `dir`, which folder the scoring route reads (neither the
    default nor the example exists: the refusal names it); `rank`, a scoring request on a
    folder of the example's rank (refused at another rank); `max_questions` and
    `max_model_len`, on that folder at its rank, a request between the example's limit and
    the default's (served under one, refused under the other)."""
    def effect(config: PluginConfig) -> Any:
        clef = config.clef
        if field == "enabled":
            return _clef_answer(clef, "/v1/chat/completions",
                                {"model": "m-clef", "messages": []})
        if field == "dir":
            return _clef_answer(clef, "/v1/clef/score", _score_body())
        clef = dataclasses.replace(clef, dir=str(_tiny_clef_dir()))
        if field == "rank":
            return _clef_answer(clef, "/v1/clef/score", _score_body())
        clef = dataclasses.replace(clef, rank=_example("SM70_CLEF_RANK"))
        if field == "max_questions":
            body = _score_body(questions=_example("SM70_CLEF_MAX_QUESTIONS") + 1)
        else:
            body = _score_body(words=_example("SM70_CLEF_MAX_MODEL_LEN") + 100)
        return _clef_answer(clef, "/v1/clef/score", body)

    return effect


# Plugin fields the plugin's code acts on today, and how to see what it did with them.
PLUGIN_EFFECTS: dict[str, Callable[[PluginConfig], Any]] = {
    "gemm.int8_gemv": _registered_quantization,
    "gemm.gemv_max_rows": _registered_quantization,
    "gemm.int8_lm_head": _registered_quantization,
    # what sm70_gptq's get_quant_method asks for an fp16 MTP layer (int8 method or vLLM's)
    "spec.draft_head_dtype": lambda config: draft_int8.draft_int8(
        config.spec.draft_head_dtype, "mtp.fc"),
    "gdn.kernel": lambda config: _registered_gdn_layer(config),
    "gdn.state_dtype": lambda config: _registered_gdn_layer(config),
    "logprobs.prompt_chunk": lambda config: _installed_prompt_logprobs(config),
    # the kernel SM70_PAGED's metadata builder routes prefill rows to (backend.prefill_kernel)
    "attention.prefill_kernel": lambda config: attention_rules.prefill_route(config),
    "spec.ngram_assist": _installed_ngram_assist,
    "spec.ngram_min": _installed_ngram_assist,
    "spec.ngram_max": _installed_ngram_assist,
    # the Clef fields are read where Clef runs, not at registration: the API server's
    # middleware (all five, CPU-testable) and the workers' served_source (enabled, dir, rank)
    **{f"clef.{f}": _clef_effect(f)
       for f in ("enabled", "dir", "rank", "max_questions", "max_model_len")},
}


def _plugin(target: str, settings: Any) -> Any:
    config = _plugin_config(settings)
    effect = PLUGIN_EFFECTS.get(target)
    if effect is not None:
        return effect(config)
    value: Any = config
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _build(target: str, settings: Any) -> Any:
    cfg = build_command._config(settings, mirror=None, offline=False, stop_after="install")
    if target.isupper():  # a variable of the compile steps' environment
        return build_plan._compile_env(cfg, PROBE).get(target)
    return getattr(cfg, target)


class _Recorded:
    """What the fakes below saw during one supervisor run."""

    def __init__(self) -> None:
        self.log: dict[str, Any] = {}
        self.spec: Any = None
        self.lock_paths: list[Path] = []


def _supervisor(target: str, settings: Any, world: _Recorded) -> Any:
    obj, _, field = target.partition(".")
    if obj in ("PreflightInputs", "port_lock"):
        gathered = serve_command._gather(settings, "cuda", allow_cold=False, lock_ours=False,
                                         environ={})
        if obj == "port_lock":
            return tuple(world.lock_paths)
        return getattr(gathered["inputs"], field)
    serve_command._launch(settings, Output(json_mode=True), ["vllm"], {}, {}, [], None, {},
                          Path("serve.lock"), threading.Event(), [])
    if obj == "ServerLog":
        return world.log[field]
    return getattr(world.spec, field)


def consumer_output(kind: str, target: str, settings: Any, world: _Recorded) -> Any:
    """What the production consumer `kind` produces at `target` for these settings."""
    if kind == "vllm_flag":  # the server's whole command line, as serve builds it
        argv = command_line.vllm_argv(settings) + clef_args.clef_argv(settings)
        return argv[0] if target == "PYTHON" else _flag(argv, target)
    if kind == "vllm_secret":
        text = secrets.secrets_yaml(settings)
        if text is None:
            return None
        import yaml

        return yaml.safe_load(text).get(target)
    if kind == "vllm_env":
        return _env(settings).get(target)
    if kind == "plugin":
        return _plugin(target, settings)
    if kind == "kernel":
        return compile_cache.compile_fingerprint(settings)
    if kind == "build":
        return _build(target, settings)
    if kind == "plan":
        return getattr(PlanInputs.from_settings(settings), target)
    if kind == "supervisor":
        return _supervisor(target, settings, world)
    if kind == "doctor":
        return getattr(DoctorConfig.from_settings(settings), target)
    if kind == "weights":
        return getattr(FetchConfig.from_settings(settings), target)
    raise AssertionError(f"no consumer of kind {kind!r} in this test")


def _baseline(spec: VarSpec) -> Any:
    """Defaults plus the example's companions where those alone are valid, so a companion
    is never what makes the difference (SM70_HOST's example needs an API key)."""
    try:
        return load_settings(dict(spec.example_with))
    except SettingsError:
        # e.g. SM70_GPUS=0 alone breaks the GPU-count rule: then no companion may feed a
        # consumer of this variable, or the difference could be the companion's.
        for consumer in spec.consumers:
            for other in spec.example_with:
                assert consumer not in SCHEMA.by_name[other].consumers, (spec.name, other)
        return load_settings({})


def dead_consumers(spec: VarSpec, world: _Recorded) -> list[str]:
    """The consumers of `spec` whose output its example value does not change."""
    changed = load_settings({spec.name: spec.example, **spec.example_with})
    baseline = _baseline(spec)
    assert changed.source_of(spec.name) == "environment"
    dead = []
    for c in spec.consumers:
        before = consumer_output(c.kind, c.target, baseline, world)
        after = consumer_output(c.kind, c.target, changed, world)
        if before == after:
            dead.append(f"{spec.name}={spec.example!r} does not change {c.kind}:{c.target}")
    return dead


# --- the world the supervisor's consumers probe -----------------------------------------
@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[_Recorded]:
    from sm70ctl import locking
    from sm70ctl.runtime import cache_status, probes, server
    from sm70ctl.serve import probes as serve_probes
    from sm70ctl.serve import supervisor

    seen = _Recorded()

    class FakeLog:
        def __init__(self, path: Path, max_bytes: int, backups: int, **_: Any) -> None:
            seen.log = {"path": path, "max_bytes": max_bytes, "backups": backups}

        def note(self, *_: Any, **__: Any) -> None:
            pass

        def close(self) -> None:
            pass

    def fake_supervise(spec: Any, log: Any, stop: Any, events: Any) -> int:
        seen.spec = spec
        return 0

    def fake_holder(path: Path) -> None:
        seen.lock_paths.append(path)

    verdict = types.SimpleNamespace(warm=True, reason="warm", fingerprint="0" * 16)
    monkeypatch.setattr(server, "ServerLog", FakeLog)
    monkeypatch.setattr(supervisor, "supervise", fake_supervise)
    monkeypatch.setattr(locking, "probe_holder", fake_holder)
    monkeypatch.setattr(probes, "probe_gpus", lambda settings: ([], None))
    monkeypatch.setattr(probes, "probe_executable", lambda path: True)
    monkeypatch.setattr(serve_probes, "probe_port", lambda host, port: None)
    monkeypatch.setattr(cache_status, "cache_status", lambda *a, **k: (verdict, {}))
    monkeypatch.setattr(serve_command, "_plan_verdict", lambda settings, device: ("pass", ""))
    monkeypatch.chdir(tmp_path)
    yield seen


# --- the tests --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SCHEMA.variables, ids=[v.name for v in SCHEMA.variables])
def test_non_default_value_changes_what_every_consumer_produces(spec: VarSpec,
                                                                world: _Recorded) -> None:
    assert not dead_consumers(spec, world)


def test_every_variable_is_consumed_or_marked_pending() -> None:
    for spec in SCHEMA.variables:
        assert spec.consumed or spec.pending_issues, f"{spec.name}: nothing reads it, no issue"
    # Each plugin field the plugin acts on must not be marked pending, and the reverse.
    for spec in SCHEMA.variables:
        for c in spec.consumers:
            if c.kind == "plugin":
                assert (c.target in PLUGIN_EFFECTS) == (c.pending is None), (
                    f"{spec.name} -> {c.target}: the plugin acts on it, or it is pending")
    assert len(SCHEMA.variables) == 98, len(SCHEMA.variables)


def test_example_companions_do_not_include_the_variable_itself() -> None:
    for spec in SCHEMA.variables:
        assert spec.name not in spec.example_with


def _ignoring(func: Callable[..., Any], attr: str, default: Any) -> Callable[..., Any]:
    """`func` as if its author had forgotten one setting: it always sees the default."""
    def wrapper(settings: Any, *args: Any, **kwargs: Any) -> Any:
        return func(settings.model_copy(update={attr: default}), *args, **kwargs)

    return wrapper


# (variable, module, function): production consumers made to ignore one variable. The first
# four are the ones issue 20 made dead without any test failing.
MUTATIONS = [
    ("SM70_LOG_MAX_BYTES", serve_command, "_launch"),
    ("SM70_LOG_BACKUPS", serve_command, "_launch"),
    ("SM70_MAX_JOBS", build_command, "_config"),
    ("SM70_NVCC_THREADS", build_command, "_config"),
    ("SM70_GPU_BUSY_MIB", serve_command, "_gather"),
    ("SM70_PORT", command_line, "vllm_argv"),
    ("SM70_CLEF", clef_args, "clef_argv"),
    ("SM70_CACHE_DIR", environment, "vllm_env"),
    ("SM70_API_KEY", secrets, "secrets_yaml"),
    ("SM70_KV_CACHE_BYTES", PlanInputs, "from_settings"),
    ("SM70_GPUS", DoctorConfig, "from_settings"),
    ("SM70_HF_TOKEN", FetchConfig, "from_settings"),
]


@pytest.mark.parametrize(("name", "owner", "func"), MUTATIONS,
                         ids=[f"{n}-{f}" for n, _, f in MUTATIONS])
def test_a_consumer_that_ignores_its_variable_is_reported(
        name: str, owner: Any, func: str, world: _Recorded,
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SCHEMA.by_name[name]
    assert not dead_consumers(spec, world)
    attr_default = getattr(load_settings({}), spec.attr)
    original = getattr(owner, func)
    if isinstance(owner, type):  # a classmethod: wrap the bound function
        bound = original
        monkeypatch.setattr(owner, func, classmethod(
            lambda cls, settings, *a, **k: bound(settings.model_copy(
                update={spec.attr: attr_default}), *a, **k)))
    else:
        monkeypatch.setattr(owner, func, _ignoring(original, spec.attr, attr_default))
    assert dead_consumers(spec, world), f"{name} ignored by {func} went unnoticed"


def test_a_plugin_that_ignores_a_field_is_reported(world: _Recorded,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SCHEMA.by_name["SM70_GEMV_MAX_ROWS"]
    assert not dead_consumers(spec, world)
    original = plugin._register_quantization
    monkeypatch.setattr(plugin, "_register_quantization", lambda config: original(
        dataclasses.replace(config, gemm=dataclasses.replace(config.gemm, gemv_max_rows=8))))
    assert dead_consumers(spec, world)


def _ngram_min_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    original = plugin._install_ngram_assist
    monkeypatch.setattr(plugin, "_install_ngram_assist", lambda config: original(
        dataclasses.replace(config, spec=dataclasses.replace(config.spec, ngram_min=2))))


def _clef_rank_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_patch.clef import manifest

    original = manifest.parse_manifest
    monkeypatch.setattr(manifest, "parse_manifest", lambda raw, d, rank=None: original(raw, d))


def _clef_questions_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_patch.clef import scoring

    original = scoring.limits_for
    monkeypatch.setattr(scoring, "limits_for", lambda head, max_questions: original(head, 64))


def _clef_length_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_patch.clef import api

    original = api.route
    monkeypatch.setattr(api, "route", lambda *a: original(*a[:5], 16384, *a[6:]))


# (variable, how the plugin or the code reading its field is made to ignore it)
PLUGIN_MUTATIONS = [
    ("SM70_NGRAM_MIN", _ngram_min_ignored),
    ("SM70_CLEF_RANK", _clef_rank_ignored),
    ("SM70_CLEF_MAX_QUESTIONS", _clef_questions_ignored),
    ("SM70_CLEF_MAX_MODEL_LEN", _clef_length_ignored),
]


@pytest.mark.parametrize(("name", "ignore"), PLUGIN_MUTATIONS,
                         ids=[n for n, _ in PLUGIN_MUTATIONS])
def test_code_that_ignores_a_plugin_field_is_reported(
        name: str, ignore: Callable[[pytest.MonkeyPatch], None], world: _Recorded,
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SCHEMA.by_name[name]
    assert not dead_consumers(spec, world)
    ignore(monkeypatch)
    assert any("plugin:" in d for d in dead_consumers(spec, world)), name


def test_a_fingerprint_that_leaves_out_a_key_is_reported(world: _Recorded,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SCHEMA.by_name["SM70_GDN_KERNEL"]
    original = compile_cache.compile_key_items
    monkeypatch.setattr(compile_cache, "compile_key_items", lambda settings: {
        k: v for k, v in original(settings).items() if k != spec.name})
    assert any("kernel:" in d for d in dead_consumers(spec, world))


def test_schema_pending_marks_are_checked() -> None:
    def doc(consumer: dict[str, Any]) -> dict[str, Any]:
        var = {"name": "SM70_X", "category": "c", "type": "int", "default": 1, "summary": "s",
               "help": "h", "consumers": [consumer]}
        return {"version": 1, "categories": {"c": {"title": "C", "summary": "c"}},
                "variables": [var]}

    spec = parse_schema(doc({"kind": "plugin", "target": "a.b", "pending": 22})).variables[0]
    assert not spec.consumed and spec.status() == "not consumed yet (issue 22)"
    assert parse_schema(doc({"kind": "plan", "target": "x"})).variables[0].consumed
    for bad in ({"kind": "plugin", "target": "a", "pending": "22"},
                {"kind": "plugin", "target": "a", "pending": 0},
                {"kind": "plugin", "target": "a", "pendng": 22}):
        with pytest.raises(Exception, match="bad consumer"):
            parse_schema(doc(bad))


def test_env_check_says_which_set_variables_nothing_reads_yet() -> None:
    import json

    from typer.testing import CliRunner

    from sm70ctl.cli import app

    idle = next(v for v in SCHEMA.variables if not v.consumed)
    used = SCHEMA.by_name["SM70_PORT"]
    env = {idle.name: idle.example, used.name: used.example, **idle.example_with}
    result = CliRunner().invoke(app, ["env", "check", "--json"], env=env)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["not_consumed_yet"] == {idle.name: idle.status()}
    text = CliRunner().invoke(app, ["env", "check"], env=env)
    assert f"{idle.name} is set but not consumed yet" in text.output
    assert f"{used.name} is set but" not in text.output


def test_sm70_chunk_changes_what_the_gdn_layer_is_registered_with() -> None:
    """SM70_GDN_KERNEL's third choice: the same layer as sm70, its prefill on our ops."""
    def registered(kernel: str) -> str:
        return _registered_gdn_layer(_plugin_config(load_settings(
            environ={"SM70_GDN_KERNEL": kernel, "SM70_GDN_STATE_DTYPE": "float32"})))

    assert registered("sm70").endswith("prefill on fla")
    assert registered("sm70_chunk").endswith("prefill on sm70")
    assert registered("triton").startswith("off")
