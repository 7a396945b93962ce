"""The --attention-backend name serve passes for SM70_ATTENTION_BACKEND (issue 22 item 3).

SM70_PAGED exists only in a vLLM with patch 0002; on a stock one serve passes CUSTOM, the
slot the plugin fills there. Three layers: the pure decision; the probe, run with this
interpreter against vllm trees written here (and 0.22.1's own tree, released and patched,
where CI has it); `sm70ctl serve --dry-run --json` on such trees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sm70ctl.runtime.command_line import vllm_argv
from sm70ctl.runtime.probes import BACKEND_REGISTRY, BackendNameProbe, probe_backend_name
from sm70ctl.serve.backend_name import CHECK_NAME, decide_backend_flag
from sm70ctl.serve.preflight import PASS, SKIP, WARN
from sm70ctl.settings import load_settings

# The shape of vLLM 0.22.1's registry.py, cut down: the enum the flag is read from, and a
# second enum that must not count.
REGISTRY = '''\
from enum import Enum, EnumMeta


class _Meta(EnumMeta):
    pass


class AttentionBackendEnum(Enum, metaclass=_Meta):
    """Every backend name. SM70_PAGED is not one of them unless patched."""

    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
{extra}    CUSTOM = None

    def get_path(self) -> str:
        SM70_PAGED = "a local, not a member"
        return SM70_PAGED


class MambaAttentionBackendEnum(Enum, metaclass=_Meta):
    LINEAR = "x"
{mamba}    CUSTOM = None
'''
MEMBER = '    SM70_PAGED = "vllm_patch.attention.Sm70PagedBackend"\n'


def vllm_tree(root: Path, *, member: bool, in_mamba: bool = False,
              registry: str | None = None) -> Path:
    """A `vllm` package under `root` whose registry.py has SM70_PAGED in the attention enum
    (member), or only in the mamba enum (in_mamba); its __init__ fails, so a probe that
    imports vllm cannot answer."""
    pkg = root / "vllm"
    (pkg / BACKEND_REGISTRY).parent.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('vllm must not be imported')\n")
    text = registry if registry is not None else REGISTRY.format(
        extra=MEMBER if member else "", mamba=MEMBER if in_mamba else "")
    (pkg / BACKEND_REGISTRY).write_text(text)
    return root


def path_env(*paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


# --- the decision (pure) -------------------------------------------------------------------
HAS = BackendNameProbe(True, "/srv/vllm", "has")
LACKS = BackendNameProbe(False, "/srv/vllm", "lacks")
TIMED_OUT = BackendNameProbe(None, None, "/x/python did not say where vllm is within 20s")


@pytest.mark.parametrize(("setting", "probe", "value", "status", "words"), [
    ("SM70_PAGED", HAS, "SM70_PAGED", PASS, ["/srv/vllm", "patch 0002"]),
    ("SM70_PAGED", LACKS, "CUSTOM", WARN,
     ["the serving vLLM at /srv/vllm lacks patch 0002's SM70_PAGED name",
      "the plugin's backend serves as CUSTOM"]),
    ("SM70_PAGED", TIMED_OUT, "SM70_PAGED", WARN, ["did not say where vllm is", "as set"]),
    ("SM70_PAGED", None, "SM70_PAGED", WARN, ["not probed"]),
    ("TRITON_ATTN", None, "TRITON_ATTN", SKIP, ["TRITON_ATTN"]),
    # a probe of another setting's tree does not move it
    ("TRITON_ATTN", LACKS, "TRITON_ATTN", SKIP, ["TRITON_ATTN"]),
    ("FLEX_ATTENTION", HAS, "FLEX_ATTENTION", SKIP, ["FLEX_ATTENTION"]),
])
def test_decision_table(setting: str, probe: BackendNameProbe | None, value: str, status: str,
                        words: list[str]) -> None:
    flag = decide_backend_flag(setting, probe)
    assert (flag.value, flag.check.status, flag.check.name) == (value, status, CHECK_NAME)
    for w in words:
        assert w in flag.check.detail


def test_the_decided_value_is_the_flag_on_the_command_line(tmp_path: Path) -> None:
    s = load_settings(environ={"SM70_MODEL_DIR": str(tmp_path)})
    argv = vllm_argv(s, attention_backend=decide_backend_flag(s.attention_backend, LACKS).value)
    assert argv[argv.index("--attention-backend") + 1] == "CUSTOM"
    assert argv.count("--attention-backend") == 1
    plain = vllm_argv(s)  # no decision: the setting as set
    assert plain[plain.index("--attention-backend") + 1] == "SM70_PAGED"


# --- the probe (this interpreter, trees written here) ----------------------------------------
@pytest.mark.parametrize(("member", "in_mamba", "want"), [
    (True, False, True), (False, False, False), (False, True, False)])
def test_probe_reads_the_attention_enum(tmp_path: Path, member: bool, in_mamba: bool,
                                        want: bool) -> None:
    root = vllm_tree(tmp_path / "tree", member=member, in_mamba=in_mamba)
    got = probe_backend_name(Path(sys.executable), env=path_env(root))
    assert got.has_name is want, got
    assert got.vllm_dir is not None and Path(got.vllm_dir) == root / "vllm"


def test_probe_follows_the_servers_path_not_ours(tmp_path: Path) -> None:
    """The first vllm on the serving interpreter's path is the one asked, as it imports."""
    first = vllm_tree(tmp_path / "first", member=False)
    second = vllm_tree(tmp_path / "second", member=True)
    got = probe_backend_name(Path(sys.executable), env=path_env(first, second))
    assert got.has_name is False and Path(str(got.vllm_dir)) == first / "vllm"
    got = probe_backend_name(Path(sys.executable), env=path_env(second, first))
    assert got.has_name is True


def test_probe_unknowns_say_what_was_not_found(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = path_env(empty)
    env["PYTHONNOUSERSITE"] = "1"
    # where no vllm is installed for this interpreter; skip if one is
    proc = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                           "print(u.find_spec('vllm') is None)"], env=env, capture_output=True,
                          text=True, check=True)
    if proc.stdout.strip() == "True":
        got = probe_backend_name(Path(sys.executable), env=env)
        assert got.has_name is None and "finds no vllm package" in got.detail
    no_enum = vllm_tree(tmp_path / "moved", member=True, registry="SM70_PAGED = 1\n")
    got = probe_backend_name(Path(sys.executable), env=path_env(no_enum))
    assert got.has_name is None and "defines no AttentionBackendEnum" in got.detail
    no_file = vllm_tree(tmp_path / "nofile", member=True)
    (no_file / "vllm" / BACKEND_REGISTRY).unlink()
    got = probe_backend_name(Path(sys.executable), env=path_env(no_file))
    assert got.has_name is None and "registry.py is missing" in got.detail
    got = probe_backend_name(tmp_path / "no-python", env=env)
    assert got.has_name is None and "does not run" in got.detail


def test_probe_times_out(tmp_path: Path) -> None:
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    got = probe_backend_name(slow, timeout=0.5)
    assert got.has_name is None and "did not say where vllm is within 0.5s" in got.detail


def test_probe_on_vllm_0_22_1_released_and_patched(tmp_path: Path) -> None:
    """The real registry.py: stock 0.22.1 lacks the name, the tree `sm70ctl build` ships
    (patch 0002) has it."""
    from vllm_cpu_tree import VLLM_TREE, named_tree, require_tree

    require_tree()
    stock = probe_backend_name(Path(sys.executable), env=path_env(VLLM_TREE))
    assert stock.has_name is False, stock
    patched = probe_backend_name(Path(sys.executable),
                                 env=path_env(named_tree(tmp_path / "named")))
    assert patched.has_name is True, patched


# --- serve --dry-run ---------------------------------------------------------------------------
def dry_run(tmp: Path, tree: Path) -> dict:
    env = path_env(tree)
    env.update({"SM70_SERVE_PYTHON": sys.executable, "SM70_LOCK_DIR": str(tmp / "l"),
                "SM70_CACHE_DIR": str(tmp / "c"), "SM70_LOG_DIR": str(tmp / "logs")})
    r = subprocess.run([sys.executable, "-m", "sm70ctl", "serve", "--dry-run", "--json"],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _flag_and_check(data: dict) -> tuple[str, dict]:
    argv = data["command"]
    assert argv.count("--attention-backend") == 1
    check = next(c for c in data["checks"] if c["name"] == CHECK_NAME)
    assert f"--attention-backend {argv[argv.index('--attention-backend') + 1]}" in \
        data["command_line"]
    return argv[argv.index("--attention-backend") + 1], check


def test_dry_run_passes_custom_on_an_unpatched_vllm(tmp_path: Path) -> None:
    flag, check = _flag_and_check(dry_run(tmp_path, vllm_tree(tmp_path / "t", member=False)))
    assert flag == "CUSTOM"
    assert check["status"] == WARN and "lacks patch 0002's SM70_PAGED name" in check["detail"]


def test_dry_run_passes_sm70_paged_on_a_patched_vllm(tmp_path: Path) -> None:
    flag, check = _flag_and_check(dry_run(tmp_path, vllm_tree(tmp_path / "t", member=True)))
    assert (flag, check["status"]) == ("SM70_PAGED", PASS)


# --- vLLM 0.22.1's own parser ------------------------------------------------------------------
def test_stock_vllm_0_22_1_takes_the_line_serve_builds_for_it(tmp_path: Path) -> None:
    """On the released tree (no patch 0002) serve's probe picks CUSTOM, and 0.22.1's parser and
    config builder, with our plugin loaded, keep that launch; the setting's own name, passed
    as set, is what its parser refuses."""
    from vllm_cpu_tree import (
        CONFIG_PROBE,
        SERVE_PYTHON,
        VLLM_TREE,
        launch,
        model_folder,
        require_tree,
        run_probe,
    )

    from sm70ctl.runtime import config_parity as cp

    require_tree()
    s, as_set = launch("as-set", model_folder(tmp_path), {}, tmp_path)
    names = probe_backend_name(SERVE_PYTHON, env=path_env(VLLM_TREE))
    flag = decide_backend_flag(s.attention_backend, names).value
    assert (s.attention_backend, flag) == ("SM70_PAGED", "CUSTOM")
    decided = {**as_set, "name": "decided", "argv": vllm_argv(s, attention_backend=flag)[3:]}
    out, _ = run_probe(CONFIG_PROBE, {"model_dir": str(tmp_path / "model"),
                                      "fields": dict(cp.FIELDS), "cases": [decided, as_set]},
                       tmp_path, named=False)
    got = out["cases"]["decided"]
    assert "error" not in got, f"vLLM 0.22.1 refused serve's launch: {got['error']}"
    assert got["values"]["attention_backend"] == "CUSTOM"
    want = {**cp.requested(s), "attention_backend": "CUSTOM"}
    values = {**got["values"], **{f"cuda_{k}": v for k, v in got["cuda_graphs"].items()}}
    assert not cp.compare(want, values, cp.cpu_platform_rewrites(want))
    refused = out["cases"]["as-set"].get("error", "")
    assert "Unknown attention backend: 'SM70_PAGED'" in refused, out["cases"]["as-set"]


def test_the_shared_flag_rule_serve_and_warmup_use() -> None:
    from sm70ctl.runtime.command_line import attention_backend_flag

    assert attention_backend_flag("SM70_PAGED", False) == "CUSTOM"
    assert attention_backend_flag("SM70_PAGED", True) == "SM70_PAGED"
    assert attention_backend_flag("SM70_PAGED", None) == "SM70_PAGED"
    assert attention_backend_flag("TRITON_ATTN", False) == "TRITON_ATTN"


def test_serve_and_warmup_probe_only_the_patched_name_with_the_servers_path(
        tmp_path: Path) -> None:
    from sm70ctl.runtime.probes import probe_serving_backend

    root = vllm_tree(tmp_path / "tree", member=False)
    s = load_settings(environ={"SM70_MODEL_DIR": str(tmp_path),
                               "SM70_SERVE_PYTHON": sys.executable})
    got = probe_serving_backend(s, path_env(root))
    assert got is not None and got.has_name is False
    assert Path(str(got.vllm_dir)) == root / "vllm"
    other = load_settings(environ={"SM70_MODEL_DIR": str(tmp_path),
                                   "SM70_ATTENTION_BACKEND": "TRITON_ATTN"})
    assert probe_serving_backend(other, path_env(root)) is None
