"""Pre-flight verdicts for `sm70ctl serve` (pure: plain probe data in, checks out).

Each check answers pass, fail, warn or skip. "skip" means the check did not run (for
example the GPU checks under `--device cpu`) and is never counted as a pass: the
rendering shows it as skipped and the JSON keeps the status word.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sm70ctl.devices.selection import resolve_gpu_entries
from sm70ctl.runtime.probes import GpuUse, ModelDirState

MIB = 1024 * 1024

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    hint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PortState:
    free: bool
    detail: str = ""


@dataclass(frozen=True)
class CacheState:
    warm: bool
    reason: str
    fingerprint: str | None = None


@dataclass(frozen=True)
class PreflightInputs:
    device: str  # "cuda" or "cpu"
    host: str
    host_is_loopback: bool
    api_key_set: bool
    port: int
    port_state: PortState
    lock_holder: Mapping[str, Any] | None  # another process holds the port lock
    lock_ours: bool  # we took the lock for this run
    serve_python: str
    serve_python_ok: bool
    model: ModelDirState
    quantization: str
    quant_problems: Sequence[str] | None  # None: no quantization_config to validate
    cache: CacheState
    allow_cold: bool
    gpus_wanted: Sequence[str] = ()
    nvml_error: str | None = None
    gpus: Sequence[GpuUse] = ()
    busy_bytes: int = 500 * MIB
    plan: tuple[str, str] | None = None  # (status, detail) from the memory plan
    extra: list[Check] = field(default_factory=list)
    attention_backend: str = "SM70_PAGED"  # SM70_ATTENTION_BACKEND
    tensor_parallel_size: int = 1
    # the verdict on the name vLLM is given for it (sm70ctl.serve.backend_name)
    backend_name: Check | None = None


def check_host(i: PreflightInputs) -> Check:
    if i.host_is_loopback:
        return Check("bind address", PASS, f"{i.host} (loopback only)")
    if i.api_key_set:
        return Check("bind address", PASS, f"{i.host} (API key required by the server)")
    return Check(
        "bind address",
        FAIL,
        f"{i.host} is not a loopback address and SM70_API_KEY is empty",
        "set SM70_API_KEY, or SM70_HOST=127.0.0.1",
    )


def check_lock(i: PreflightInputs) -> Check:
    if i.lock_ours:
        return Check("port lock", PASS, f"port {i.port} lock held by this process")
    if i.lock_holder:
        pid = i.lock_holder.get("pid", "unknown")
        return Check(
            "port lock",
            FAIL,
            f"another sm70ctl serve (pid {pid}) holds the lock for port {i.port}",
            f"stop pid {pid}, or pick another SM70_PORT",
        )
    return Check("port lock", PASS, f"port {i.port} lock is free")


def check_port(i: PreflightInputs) -> Check:
    if i.port_state.free:
        return Check("port", PASS, f"{i.host}:{i.port} is free")
    return Check(
        "port",
        FAIL,
        f"{i.host}:{i.port} is in use{': ' + i.port_state.detail if i.port_state.detail else ''}",
        "stop whatever listens there, or pick another SM70_PORT",
    )


def check_serve_python(i: PreflightInputs) -> Check:
    if i.serve_python_ok:
        return Check("serving interpreter", PASS, i.serve_python)
    return Check(
        "serving interpreter",
        FAIL,
        f"SM70_SERVE_PYTHON={i.serve_python} is not an executable file",
        "run `sm70ctl build`, or point SM70_SERVE_PYTHON at the vLLM environment's python",
    )


def check_model(i: PreflightInputs) -> Check:
    m = i.model
    if not m.exists:
        return Check(
            "model folder",
            FAIL,
            f"SM70_MODEL_DIR={m.path} does not exist",
            "run `sm70ctl weights fetch`, or set SM70_MODEL_DIR",
        )
    if m.config is None:
        return Check(
            "model folder",
            FAIL,
            f"{m.path}/config.json is unreadable: {m.error or 'missing'}",
            "re-fetch the checkpoint (`sm70ctl weights fetch`)",
        )
    arch = m.config.get("architectures") or ["?"]
    return Check("model folder", PASS, f"{m.path} ({arch[0]})")


def check_quant(i: PreflightInputs) -> Check:
    if i.model.config is None:
        return Check("quantisation config", SKIP, "no readable config.json")
    if i.quantization == "none":
        if i.quant_problems is not None:
            return Check(
                "quantisation config",
                FAIL,
                "the checkpoint has a quantization_config but SM70_QUANTIZATION=none",
                "set SM70_QUANTIZATION=gptq, or serve an unquantised checkpoint",
            )
        return Check("quantisation config", PASS, "unquantised checkpoint (SM70_QUANTIZATION=none)")
    if i.quant_problems is None:
        return Check(
            "quantisation config",
            FAIL,
            f"SM70_QUANTIZATION={i.quantization} but config.json has no quantization_config",
            "serve the GPTQ int8 checkpoint, or set SM70_QUANTIZATION=none",
        )
    if i.quant_problems:
        shown = "; ".join(i.quant_problems[:4])
        more = f" (+{len(i.quant_problems) - 4} more)" if len(i.quant_problems) > 4 else ""
        return Check(
            "quantisation config",
            FAIL,
            f"would load but produce garbage: {shown}{more}",
            "fix the checkpoint's quantization_config (`sm70ctl weights verify`)",
        )
    return Check("quantisation config", PASS, f"{i.quantization}: valid")


def check_attention(i: PreflightInputs) -> Check:
    """SM70_PAGED's kernels take one head size and one GQA group (per GPU): a model with
    others is refused here, before vLLM starts, not by vLLM's backend check later."""
    name = "attention backend"
    if i.attention_backend != "SM70_PAGED":
        return Check(name, PASS, f"{i.attention_backend} (vLLM's own)")
    if i.model.config is None:
        return Check(name, SKIP, "no readable config.json")
    from sm70ctl.errors import Sm70Error
    from sm70ctl.plan.model_config import parse_config
    from sm70ctl.plan.shapes import kv_heads_per_gpu
    from vllm_patch.attention import rules

    try:
        m = parse_config(dict(i.model.config))
    except (Sm70Error, KeyError, TypeError, ValueError):
        return Check(name, SKIP, "config.json does not parse (the memory plan says why)")
    if not m.full_layers:
        return Check(name, PASS, "SM70_PAGED: the model has no full-attention layer")
    tp = max(1, i.tensor_parallel_size)
    q, kv = m.num_attention_heads // tp, kv_heads_per_gpu(m, tp)
    problems = []
    if m.head_dim != rules.HEAD_SIZE:
        problems.append(f"head_dim {m.head_dim} (its kernels take {rules.HEAD_SIZE})")
    if q != rules.GQA_GROUP * kv:
        problems.append(f"{q} query / {kv} KV heads per GPU at SM70_TENSOR_PARALLEL_SIZE={tp} "
                        f"(its decode kernel's group is {rules.GQA_GROUP}:1)")
    if problems:
        return Check(name, FAIL,
                     "SM70_ATTENTION_BACKEND=SM70_PAGED cannot serve this model: "
                     + "; ".join(problems), "set SM70_ATTENTION_BACKEND=TRITON_ATTN")
    return Check(name, PASS, f"SM70_PAGED: head_dim {m.head_dim}, GQA {rules.GQA_GROUP}:1 "
                 "per GPU")


def check_cache(i: PreflightInputs) -> Check:
    fp = f" [{i.cache.fingerprint}]" if i.cache.fingerprint else ""
    if i.cache.warm:
        return Check("compile cache", PASS, f"warm{fp}: {i.cache.reason}")
    if i.allow_cold:
        return Check(
            "compile cache",
            WARN,
            f"cold{fp}: {i.cache.reason}; starting anyway (--allow-cold), the first start "
            "compiles and may take many minutes",
        )
    return Check(
        "compile cache",
        FAIL,
        f"cold{fp}: {i.cache.reason}",
        "run `sm70ctl warmup`, or pass --allow-cold",
    )


def check_gpus(i: PreflightInputs) -> list[Check]:
    if i.device == "cpu":
        why = "device cpu: not checked"
        return [Check("GPU indices", SKIP, why), Check("GPUs exclusive", SKIP, why)]
    if i.nvml_error is not None:
        return [
            Check(
                "GPU indices",
                FAIL,
                f"NVML unavailable: {i.nvml_error}",
                "install the NVIDIA driver, or use --device cpu for a CPU test server",
            ),
            Check("GPUs exclusive", SKIP, "no NVML"),
        ]
    indices, problems = resolve_gpu_entries(i.gpus_wanted, i.gpus)
    if problems:
        resolve = Check(
            "GPU indices", FAIL, "; ".join(problems), "fix SM70_GPUS (indices or GPU-UUIDs)"
        )
        return [resolve, Check("GPUs exclusive", SKIP, "GPUs not resolved")]
    by_index = {g.index: g for g in i.gpus}
    mapping = ", ".join(
        f"{w}->{n}" if str(w).strip() != str(n) else str(n)
        for w, n in zip(i.gpus_wanted, indices, strict=True)
    )
    resolve = Check("GPU indices", PASS, f"CUDA_VISIBLE_DEVICES={','.join(map(str, indices))} "
                    f"(PCI bus order; {mapping})")
    busy = []
    for n in indices:
        g = by_index[n]
        used = g.memory_used_mib
        if used is not None and used * MIB > i.busy_bytes:
            procs = ", ".join(
                f"pid {pid} ({name or '?'}{f', {mib} MiB' if mib is not None else ''})"
                for pid, name, mib in g.processes
            ) or "no process visible (another container?)"
            busy.append(f"GPU {n} has {used} MiB in use by {procs}")
    limit = i.busy_bytes // MIB
    if busy:
        return [
            resolve,
            Check(
                "GPUs exclusive",
                FAIL,
                "; ".join(busy) + f" (limit SM70_GPU_BUSY_MIB={limit} MiB)",
                "stop those processes, or choose other SM70_GPUS",
            ),
        ]
    return [resolve, Check("GPUs exclusive", PASS, f"each uses <= {limit} MiB")]


def check_plan(i: PreflightInputs) -> Check:
    if i.plan is None:
        return Check("memory plan", SKIP, "memory planner not available")
    status, detail = i.plan
    return Check("memory plan", status, detail)


def run_checks(i: PreflightInputs) -> list[Check]:
    """Every verdict, in the order they are shown."""
    return [
        check_host(i),
        check_lock(i),
        check_port(i),
        check_serve_python(i),
        check_model(i),
        check_quant(i),
        check_attention(i),
        *([i.backend_name] if i.backend_name is not None else []),
        check_plan(i),
        *check_gpus(i),
        check_cache(i),
        *i.extra,
    ]


def failures(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if c.status == FAIL]
