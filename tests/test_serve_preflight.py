"""Pre-flight verdicts (pure): every check, each way it can go."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from sm70ctl.devices.selection import resolve_gpu_entries
from sm70ctl.runtime.probes import GpuUse, ModelDirState
from sm70ctl.serve.preflight import (
    FAIL,
    MIB,
    PASS,
    SKIP,
    WARN,
    CacheState,
    Check,
    PortState,
    PreflightInputs,
    check_attention,
    check_cache,
    check_gpus,
    check_host,
    check_lock,
    check_model,
    check_plan,
    check_port,
    check_quant,
    check_serve_python,
    failures,
    run_checks,
)

GPUS = (
    GpuUse(0, "GPU-aaaa1111-0000", "Tesla V100-SXM2-32GB", 3, ()),
    GpuUse(1, "GPU-bbbb2222-0000", "Tesla V100-SXM2-32GB", 3, ()),
    GpuUse(2, "GPU-bbbb3333-0000", "Tesla V100-SXM2-32GB", 3, ()),
)


def inputs(**over) -> PreflightInputs:
    base = PreflightInputs(
        device="cuda",
        host="127.0.0.1",
        host_is_loopback=True,
        api_key_set=False,
        port=8000,
        port_state=PortState(True),
        lock_holder=None,
        lock_ours=True,
        serve_python="/env/bin/python",
        serve_python_ok=True,
        model=ModelDirState("/m", True, {**_reference_config(),
                                         "architectures": ["Qwen3_5ForConditionalGeneration"],
                                         "quantization_config": {}}),
        quantization="gptq",
        quant_problems=[],
        cache=CacheState(True, "warmed and verified in a fresh process", "abcd"),
        allow_cold=False,
        gpus_wanted=["0", "1"],
        gpus=GPUS,
        plan=("pass", "fits"),
    )
    return dataclasses.replace(base, **over)


def test_all_good_passes_everything() -> None:
    checks = run_checks(inputs())
    assert failures(checks) == []
    assert {c.status for c in checks} == {PASS}
    assert [c.name for c in checks] == [
        "bind address", "port lock", "port", "serving interpreter", "model folder",
        "quantisation config", "attention backend", "memory plan", "GPU indices",
        "GPUs exclusive", "compile cache",
    ]


@pytest.mark.parametrize(("loopback", "key", "status"), [
    (True, False, PASS), (True, True, PASS), (False, True, PASS), (False, False, FAIL),
])
def test_host(loopback: bool, key: bool, status: str) -> None:
    c = check_host(inputs(host="10.0.0.5" if not loopback else "127.0.0.1",
                          host_is_loopback=loopback, api_key_set=key))
    assert c.status == status
    if status == FAIL:
        assert "10.0.0.5" in c.detail and "SM70_API_KEY" in c.detail


def test_lock_held_by_other_names_pid() -> None:
    c = check_lock(inputs(lock_ours=False, lock_holder={"pid": 4242}))
    assert c.status == FAIL and "pid 4242" in c.detail and "4242" in c.hint
    assert check_lock(inputs(lock_ours=False, lock_holder=None)).status == PASS
    assert check_lock(inputs(lock_ours=True)).status == PASS


def test_port() -> None:
    c = check_port(inputs(port_state=PortState(False, "another process is listening")))
    assert c.status == FAIL and "127.0.0.1:8000 is in use" in c.detail
    assert check_port(inputs()).status == PASS


def test_serve_python() -> None:
    c = check_serve_python(inputs(serve_python_ok=False))
    assert c.status == FAIL and "SM70_SERVE_PYTHON=/env/bin/python" in c.detail


def test_model_folder() -> None:
    assert check_model(inputs(model=ModelDirState("/x", False))).status == FAIL
    c = check_model(inputs(model=ModelDirState("/x", True, None, "config.json is missing")))
    assert c.status == FAIL and "config.json is missing" in c.detail
    assert check_model(inputs()).status == PASS


@pytest.mark.parametrize(("quant", "problems", "status"), [
    ("gptq", [], PASS),
    ("gptq", ["bits is 4, must be 8"], FAIL),
    ("gptq", None, FAIL),  # gptq requested, checkpoint has no quantization_config
    ("none", None, PASS),
    ("none", [], FAIL),  # quantised checkpoint served as unquantised
])
def test_quant(quant: str, problems, status: str) -> None:
    c = check_quant(inputs(quantization=quant, quant_problems=problems))
    assert c.status == status
    if problems:
        assert problems[0] in c.detail


def test_quant_many_problems_are_summarised() -> None:
    c = check_quant(inputs(quant_problems=[f"p{i}" for i in range(7)]))
    assert "p0" in c.detail and "p3" in c.detail and "p4" not in c.detail and "+3 more" in c.detail


def test_quant_skipped_without_config() -> None:
    c = check_quant(inputs(model=ModelDirState("/x", True, None, "bad json")))
    assert c.status == SKIP


@pytest.mark.parametrize(("warm", "allow", "status"), [
    (True, False, PASS), (True, True, PASS), (False, True, WARN), (False, False, FAIL),
])
def test_cache(warm: bool, allow: bool, status: str) -> None:
    c = check_cache(inputs(cache=CacheState(warm, "torch: 2.13.0 -> 2.14.0", "ffff"),
                           allow_cold=allow))
    assert c.status == status
    assert "ffff" in c.detail
    if not warm:
        assert "torch: 2.13.0 -> 2.14.0" in c.detail


def test_gpus_skipped_on_cpu_never_passed() -> None:
    checks = check_gpus(inputs(device="cpu", gpus=(), nvml_error="no NVML"))
    assert [c.status for c in checks] == [SKIP, SKIP]
    assert all("device cpu" in c.detail for c in checks)


def test_gpus_without_nvml_fail() -> None:
    resolve, busy = check_gpus(inputs(gpus=(), nvml_error="NVML Shared Library Not Found"))
    assert resolve.status == FAIL and "NVML Shared Library Not Found" in resolve.detail
    assert busy.status == SKIP


def test_uuid_resolution_pci_order() -> None:
    idx, problems = resolve_gpu_entries(["GPU-bbbb3333-0000", "GPU-aaaa"], GPUS)
    assert (idx, problems) == ([2, 0], [])
    resolve, _ = check_gpus(inputs(gpus_wanted=["GPU-bbbb3333-0000", "1"]))
    assert resolve.status == PASS
    assert "CUDA_VISIBLE_DEVICES=2,1" in resolve.detail


@pytest.mark.parametrize(("wanted", "fragment"), [
    (["GPU-bbbb"], "matches 2 GPUs"),
    (["7"], "matches no GPU"),
    (["GPU-ffff"], "matches no GPU"),
    (["0", "GPU-aaaa1111"], "names GPU 0 twice"),
    (["first"], "matches no GPU"),
])
def test_uuid_resolution_problems(wanted: list[str], fragment: str) -> None:
    resolve, busy = check_gpus(inputs(gpus_wanted=wanted))
    assert resolve.status == FAIL and fragment in resolve.detail
    assert busy.status == SKIP


def test_busy_gpu_names_processes() -> None:
    gpus = (GPUS[0], dataclasses.replace(GPUS[1], memory_used_mib=9000,
                                         processes=((321, "python3", 8990), (654, None, None))))
    _, busy = check_gpus(inputs(gpus=gpus, busy_bytes=500 * MIB))
    assert busy.status == FAIL
    assert "GPU 1 has 9000 MiB in use" in busy.detail
    assert "pid 321 (python3, 8990 MiB)" in busy.detail and "pid 654 (?)" in busy.detail
    assert "SM70_GPU_BUSY_MIB=500 MiB" in busy.detail


def test_busy_gpu_outside_selection_is_ignored() -> None:
    gpus = (*GPUS[:2], dataclasses.replace(GPUS[2], memory_used_mib=30000))
    _, busy = check_gpus(inputs(gpus=gpus))
    assert busy.status == PASS


@pytest.mark.parametrize("used", [0, 499, 500, 501, 5000])
def test_busy_threshold(used: int) -> None:
    gpus = (dataclasses.replace(GPUS[0], memory_used_mib=used), GPUS[1])
    _, busy = check_gpus(inputs(gpus=gpus, busy_bytes=500 * MIB))
    assert busy.status == (FAIL if used > 500 else PASS)


def test_busy_without_visible_processes() -> None:
    gpus = (dataclasses.replace(GPUS[0], memory_used_mib=2000), GPUS[1])
    _, busy = check_gpus(inputs(gpus=gpus))
    assert "no process visible" in busy.detail


def test_plan_verdict() -> None:
    assert check_plan(inputs(plan=None)).status == SKIP
    c = check_plan(inputs(plan=("fail", "KV pool overflows GPU 0 by 1.2 GiB")))
    assert c.status == FAIL and "1.2 GiB" in c.detail


def test_every_failure_is_reported_not_just_the_first() -> None:
    bad = inputs(
        host="0.0.0.0", host_is_loopback=False, port_state=PortState(False),
        serve_python_ok=False, model=ModelDirState("/nope", False),
        cache=CacheState(False, "empty", "x"), plan=("fail", "overflow"),
    )
    names = {c.name for c in failures(run_checks(bad))}
    assert names == {"bind address", "port", "serving interpreter", "model folder",
                     "memory plan", "compile cache"}


def test_statuses_are_known_words() -> None:
    combos = itertools.product(["cuda", "cpu"], [True, False], [True, False])
    for device, warm, port_free in combos:
        checks = run_checks(inputs(device=device, cache=CacheState(warm, "r"),
                                   port_state=PortState(port_free)))
        assert all(isinstance(c, Check) and c.status in (PASS, FAIL, WARN, SKIP) for c in checks)
        assert all(c.hint for c in checks if c.status == FAIL)


@pytest.mark.parametrize("config", [{"text_config": 5}, {"text_config": "quantization_config"},
                                    {"text_config": None}, {"model_type": "x"}])
def test_quant_probe_takes_odd_configs_as_unquantised(config) -> None:
    from sm70ctl.serve.probes import quant_problems

    assert quant_problems(config) is None


def test_quant_probe_finds_nested_config() -> None:
    from sm70ctl.serve.probes import quant_problems

    problems = quant_problems({"text_config": {"quantization_config": {"bits": 4}}})
    assert problems and any("bits" in p for p in problems)


def _reference_config(**text: object) -> dict:
    import json

    from sm70ctl.plan.model_config import builtin_config_path

    cfg = json.loads(builtin_config_path().read_text())
    cfg["text_config"].update(text)
    return cfg


def test_sm70_paged_takes_the_reference_model_at_tp_1_2_and_4() -> None:
    model = ModelDirState("/m", True, _reference_config())
    for tp in (1, 2, 4):
        c = check_attention(inputs(model=model, tensor_parallel_size=tp))
        assert c.status == PASS, (tp, c)
    assert inputs().attention_backend == "SM70_PAGED"  # the default


def test_sm70_paged_refuses_another_head_size_or_group_naming_the_setting() -> None:
    head = ModelDirState("/m", True, _reference_config(head_dim=128))
    c = check_attention(inputs(model=head, tensor_parallel_size=2))
    assert c.status == FAIL and c.detail.startswith("SM70_ATTENTION_BACKEND=SM70_PAGED ")
    assert "head_dim 128" in c.detail and "256" in c.detail and "\n" not in c.detail
    assert c.hint == "set SM70_ATTENTION_BACKEND=TRITON_ATTN"
    assert c in failures(run_checks(inputs(model=head, tensor_parallel_size=2)))
    # 24 q / 4 KV heads at TP=8: 3 query heads share each copied KV head, not 6
    ref = ModelDirState("/m", True, _reference_config())
    c = check_attention(inputs(model=ref, tensor_parallel_size=8))
    assert c.status == FAIL and "3 query / 1 KV heads per GPU" in c.detail
    # vLLM's own backend takes both
    for m, tp in ((head, 2), (ref, 8)):
        assert check_attention(inputs(model=m, tensor_parallel_size=tp,
                                      attention_backend="TRITON_ATTN")).status == PASS


def test_the_attention_check_skips_what_it_cannot_read() -> None:
    assert check_attention(inputs(model=ModelDirState("/m", False))).status == SKIP
    bare = ModelDirState("/m", True, {"architectures": ["Qwen3_5ForConditionalGeneration"]})
    assert check_attention(inputs(model=bare)).status == SKIP  # no shapes to check
