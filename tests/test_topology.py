"""The all-reduce choice by topology (sm70ctl/devices/topology.py) on recorded machines
(tests/data/doctor/*.json: NVLink, PCIe with and without P2P, and FACTS.md's mixed 4-GPU
host), with the SM70_ALLREDUCE_MODE / SM70_P2P overrides, and what the runtime passes to
vLLM from it (NCCL_P2P_DISABLE and the plugin configuration's resolved allreduce.mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sm70ctl.devices import nvml, topology
from sm70ctl.devices.selection import resolve_gpus
from sm70ctl.doctor import checks as ck
from sm70ctl.doctor import probes as pr
from sm70ctl.errors import Sm70Error
from sm70ctl.runtime.environment import vllm_env
from sm70ctl.settings import load_settings
from vllm_patch.config import PluginConfig

DATA = Path(__file__).parent / "data" / "doctor"


def recorded(name: str) -> nvml.NvmlProbe:
    probe = pr.load_probe_dict(json.loads((DATA / f"{name}.json").read_text())).nvml
    assert probe is not None and probe.available
    return probe


def choose(name: str, gpus: str = "0,1", mode: str = "auto", p2p: str = "auto",
           tp: int = 2) -> topology.AllreduceChoice:
    probe = recorded(name)
    indices = [m.index for m in resolve_gpus(gpus.split(","), probe.gpus)]
    assert None not in indices
    links = topology.serving_links(probe.pairs, indices)
    return topology.choose_allreduce(mode=mode, p2p=p2p, tensor_parallel_size=tp,
                                     gpu_indices=indices, links=links)


# ------------------------------------------------------------------ recorded machines
@pytest.mark.parametrize(("name", "gpus", "mode", "disable", "link"), [
    ("v100_nvlink", "0,1", "fp16", "0", "nvlink"),
    ("v100_pcie_p2p", "0,1", "int12", "0", "pcie_p2p"),
    ("v100_pcie_no_p2p", "0,1", "nccl", "1", "none"),
    # FACTS.md's mixed host: NVLink only between 2 and 3, 0 and 1 under one host bridge
    ("mixed_4gpu", "2,3", "fp16", "0", "nvlink"),
    ("mixed_4gpu", "3,2", "fp16", "0", "nvlink"),
    ("mixed_4gpu", "0,1", "int12", "0", "pcie_p2p"),
    ("mixed_4gpu", "1,2", "nccl", "1", "none"),
])
def test_the_link_picks_the_all_reduce(name, gpus, mode, disable, link) -> None:
    got = choose(name, gpus)
    assert (got.mode, got.nccl_p2p_disable, got.link) == (mode, disable, link)
    assert got.p2p_available is (disable == "0")


def test_pipeline_stages_on_the_mixed_host_take_the_weakest_pair() -> None:
    # TP=2 x PP=2 over all four: groups (0,1) PCIe P2P and (2,3) NVLink; the cross-socket
    # pairs have no P2P, so NCCL (which also carries the pipeline sends) gets P2P off
    got = choose("mixed_4gpu", "0,1,2,3")
    assert (got.mode, got.link, got.nccl_p2p_disable) == ("int12", "pcie_p2p", "1")
    got = choose("mixed_4gpu", "2,3,0,1")
    assert got.mode == "int12"
    # TP=4: not the two-GPU kernels
    got = choose("mixed_4gpu", "0,1,2,3", tp=4)
    assert (got.mode, got.link) == ("nccl", None)


def test_doctor_and_the_choice_read_links_alike() -> None:
    """The doctor's interconnect check names the link with the same function."""
    assert ck.link_kind is topology.link_kind
    for name, want in (("v100_nvlink", "nvlink"), ("v100_pcie_p2p", "pcie_p2p"),
                       ("v100_pcie_no_p2p", "none")):
        (pair,) = recorded(name).pairs
        assert topology.link_kind(pair) == want


@pytest.mark.parametrize(("pair", "kind"), [
    (nvml.PairProbe(nvlink_active=2, p2p_read="ok", p2p_nvlink="ok"), "nvlink"),
    (nvml.PairProbe(nvlink_active=0, p2p_read="ok", p2p_nvlink="ok"), "nvlink"),  # a switch
    (nvml.PairProbe(nvlink_active=None, p2p_read="ok", p2p_nvlink=None), "pcie_p2p"),
    (nvml.PairProbe(nvlink_active=0, p2p_read="topology_not_supported"), "none"),
    (nvml.PairProbe(), "none"),  # nothing answered: no P2P assumed
])
def test_link_kind(pair, kind) -> None:
    assert topology.link_kind(pair) == kind


def test_an_unprobed_pair_is_unknown() -> None:
    pairs = [nvml.PairProbe(a=0, b=1, p2p_read="ok")]
    assert topology.serving_links(pairs, [1, 0]) == {(0, 1): "pcie_p2p"}
    assert topology.serving_links(pairs, [0, 2]) is None
    got = topology.choose_allreduce(mode="auto", p2p="auto", tensor_parallel_size=2,
                                    gpu_indices=[0, 2], links=None)
    assert (got.mode, got.nccl_p2p_disable, got.link, got.p2p_available) == (
        "nccl", None, None, None)


# ------------------------------------------------------------------ overrides
@pytest.mark.parametrize(("name", "mode", "p2p", "want_mode", "want_disable"), [
    ("v100_nvlink", "int12", "auto", "int12", "0"),
    ("v100_pcie_p2p", "fp16", "auto", "fp16", "0"),
    ("v100_nvlink", "auto", "off", "nccl", "1"),
    ("v100_pcie_p2p", "auto", "off", "nccl", "1"),
    ("v100_pcie_no_p2p", "auto", "on", "int12", "0"),  # the operator says P2P works
    ("v100_pcie_no_p2p", "fp16", "on", "fp16", "0"),
    ("v100_nvlink", "auto", "on", "fp16", "0"),
])
def test_overrides(name, mode, p2p, want_mode, want_disable) -> None:
    got = choose(name, mode=mode, p2p=p2p)
    assert (got.mode, got.nccl_p2p_disable) == (want_mode, want_disable)


@pytest.mark.parametrize(("name", "mode", "p2p", "tp", "words"), [
    ("v100_nvlink", "fp16", "off", 2, ("SM70_ALLREDUCE_MODE=fp16", "SM70_P2P=off")),
    ("v100_pcie_p2p", "int12", "off", 2, ("SM70_ALLREDUCE_MODE=int12", "SM70_P2P=off")),
    ("v100_pcie_no_p2p", "int12", "auto", 2, ("SM70_ALLREDUCE_MODE=int12", "P2P")),
    ("v100_pcie_no_p2p", "fp16", "auto", 2, ("SM70_ALLREDUCE_MODE=fp16", "P2P")),
    ("mixed_4gpu", "int12", "auto", 4, ("SM70_ALLREDUCE_MODE=int12", "4")),
])
def test_impossible_overrides_are_one_line_naming_the_settings(name, mode, p2p, tp,
                                                               words) -> None:
    gpus = "0,1,2,3" if tp == 4 else "0,1"
    with pytest.raises(Sm70Error) as info:
        choose(name, gpus, mode=mode, p2p=p2p, tp=tp)
    assert "\n" not in info.value.message and info.value.hint
    for w in words:
        assert w in info.value.message


def test_bad_setting_values_are_refused() -> None:
    with pytest.raises(Sm70Error, match="SM70_ALLREDUCE_MODE=fp8"):
        topology.choose_allreduce(mode="fp8", p2p="auto", tensor_parallel_size=2,
                                  gpu_indices=[0, 1], links=None)
    with pytest.raises(Sm70Error, match="SM70_P2P=maybe"):
        topology.nccl_p2p_disable("maybe", True)


def test_tensor_parallel_size_one_is_nccl() -> None:
    got = choose("v100_nvlink", "0", tp=1)
    assert got.mode == "nccl" and got.link is None


def test_nccl_p2p_disable_rule() -> None:
    table = {(p, a): topology.nccl_p2p_disable(p, a)
             for p in ("auto", "on", "off") for a in (True, False, None)}
    assert table == {
        ("auto", True): "0", ("auto", False): "1", ("auto", None): None,
        ("on", True): "0", ("on", False): "0", ("on", None): "0",
        ("off", True): "1", ("off", False): "1", ("off", None): "1",
    }


# ------------------------------------------------------------------ what vLLM receives
def settings(**env: str):
    return load_settings(environ={f"SM70_{k.upper()}": v for k, v in env.items()})


@pytest.mark.parametrize(("name", "mode", "disable"), [
    ("v100_nvlink", "fp16", "0"), ("v100_pcie_p2p", "int12", "0"),
    ("v100_pcie_no_p2p", "nccl", "1"),
])
def test_the_runtime_passes_the_choice_to_vllm(name, mode, disable) -> None:
    choice = choose(name)
    env = vllm_env(settings(), gpu_indices=[0, 1], allreduce=choice)
    assert env["NCCL_P2P_DISABLE"] == disable
    config = PluginConfig.from_json(env["SM70_PLUGIN_CONFIG"])
    assert config.allreduce.mode == mode
    assert config.allreduce.buffer_bytes == 16 * 1024**2


def test_without_a_probe_the_runtime_passes_the_setting_unresolved() -> None:
    env = vllm_env(settings(allreduce_mode="int12"), gpu_indices=[0, 1])
    assert "NCCL_P2P_DISABLE" not in env
    assert PluginConfig.from_json(env["SM70_PLUGIN_CONFIG"]).allreduce.mode == "int12"


def test_the_runtime_reuses_the_one_p2p_rule() -> None:
    """SM70_P2P forced on wins over the probe in both the env and the choice."""
    choice = choose("v100_pcie_no_p2p", p2p="on")
    env = vllm_env(settings(p2p="on"), gpu_indices=[0, 1], allreduce=choice)
    assert env["NCCL_P2P_DISABLE"] == "0"
    assert PluginConfig.from_json(env["SM70_PLUGIN_CONFIG"]).allreduce.mode == "int12"


@pytest.mark.parametrize(("name", "mode", "disable"), [
    ("v100_nvlink", "fp16", "0"), ("v100_pcie_no_p2p", "nccl", "1"),
])
def test_serve_probes_the_choice_through_the_one_nvml_probe(monkeypatch, name, mode,
                                                            disable) -> None:
    """runtime.probes.probe_allreduce (what serve's pre-flight gathers) reads the recorded
    machine's pairs; without NVML, or with unresolved GPUs, the topology is unknown."""
    from sm70ctl.runtime import probes as rprobes
    from sm70ctl.runtime.environment import managed_env

    seen: list[list[str]] = []

    def fake_probe(selected):
        seen.append(list(selected))
        return recorded(name)

    monkeypatch.setattr(rprobes, "probe_nvml", fake_probe)
    choice = rprobes.probe_allreduce(settings(), [0, 1])
    assert seen == [["0", "1"]]
    assert (choice.mode, choice.nccl_p2p_disable) == (mode, disable)
    env = managed_env(settings(), "cuda", Path("/tmp/entry"), [0, 1], allreduce=choice)
    assert env["NCCL_P2P_DISABLE"] == disable
    assert PluginConfig.from_json(env["SM70_PLUGIN_CONFIG"]).allreduce.mode == mode
    assert rprobes.probe_allreduce(settings(), None).mode == "nccl"
    monkeypatch.setattr(rprobes, "probe_nvml", lambda selected: nvml.NvmlProbe())
    unknown = rprobes.probe_allreduce(settings(), [0, 1])
    assert (unknown.mode, unknown.nccl_p2p_disable) == ("nccl", None)
