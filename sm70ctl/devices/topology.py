"""Which all-reduce serves tensor parallelism, from what the NVML probe found (pure).

The link of a GPU pair (`link_kind`, from a `PairProbe`): "nvlink" (an active NVLink link
between them, or NVML's NVLink P2P status ok), "pcie_p2p" (no NVLink, driver P2P reads ok)
or "none". The choice (`choose_allreduce`) for the serving GPUs:

| link of each tensor-parallel pair | all-reduce                            | NCCL_P2P_DISABLE |
|-----------------------------------|---------------------------------------|------------------|
| nvlink                            | fp16 over IPC peer memory             | 0                |
| pcie_p2p                          | the 12-bit exchange over peer memory  | 0                |
| none                              | NCCL                                  | 1                |

fp16 over NVLink, where the 12-bit exchange measured 0.8x its speed (packing costs more
than the bytes it saves on a fast link); 12-bit over PCIe, where it sends 3/4 of the bytes
on the slow link and won. NCCL_P2P_DISABLE follows P2P between every pair of the serving
GPUs (pipeline stages talk too). With pipeline parallelism the tensor-parallel pairs are
consecutive entries of SM70_GPUS (vLLM's rank order), and the weakest pair's link decides
for all (the plugin configuration is one per server).

Overrides: SM70_P2P (`on`/`off` force NCCL_P2P_DISABLE; `off` also rules out the IPC
all-reduce, which needs peer access; `on` over a link NVML reports without P2P is taken
as PCIe with P2P) and SM70_ALLREDUCE_MODE (`fp16`/`int12` force the exchange wherever peer
access is possible; asking for one where it is not is one error naming the settings).
A tensor-parallel size other than 2 goes to NCCL (the kernels are for two GPUs). An
unprobed topology leaves NCCL_P2P_DISABLE unset and gives NCCL under `auto`: the IPC path
is never guessed onto an unknown link.

This is the one rule: the doctor's interconnect check names links with `link_kind`, and
sm70ctl.runtime passes `choose_allreduce`'s result to vLLM (NCCL_P2P_DISABLE and the
plugin configuration's resolved `allreduce.mode`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from sm70ctl.devices.nvml import PairProbe
from sm70ctl.errors import Sm70Error

Link = Literal["nvlink", "pcie_p2p", "none"]
Mode = Literal["fp16", "int12", "nccl"]
Links = Mapping[tuple[int, int], Link]

# What each link gets under SM70_ALLREDUCE_MODE=auto.
AUTO_MODE: dict[str, Mode] = {"nvlink": "fp16", "pcie_p2p": "int12", "none": "nccl"}


@dataclass(frozen=True)
class AllreduceChoice:
    mode: Mode  # what the plugin's communicator runs for the TP all-reduce
    nccl_p2p_disable: str | None  # "0", "1", or None: leave NCCL's own default
    link: Link | None  # of the two serving GPUs; None when not probed or not two GPUs
    p2p_available: bool | None  # P2P between every pair of serving GPUs; None: unknown
    reason: str


def link_kind(pair: PairProbe) -> Link:
    if (pair.nvlink_active or 0) > 0 or pair.p2p_nvlink == "ok":
        return "nvlink"
    if pair.p2p_read == "ok":
        return "pcie_p2p"
    return "none"


def serving_links(
    pairs: Sequence[PairProbe], indices: Sequence[int]
) -> dict[tuple[int, int], Link] | None:
    """The link of every pair of the serving GPUs (CUDA indices), keyed (lower, higher);
    None when a pair was not probed."""
    by_pair = {(min(p.a, p.b), max(p.a, p.b)): p for p in pairs}
    out: dict[tuple[int, int], Link] = {}
    wanted = sorted(set(indices))
    for n, a in enumerate(wanted):
        for b in wanted[n + 1 :]:
            pair = by_pair.get((a, b))
            if pair is None:
                return None
            out[(a, b)] = link_kind(pair)
    return out


def p2p_available(links: Links | None) -> bool | None:
    """Driver P2P between every pair (NVLink counts); None when unknown."""
    if links is None:
        return None
    return all(kind != "none" for kind in links.values())


def nccl_p2p_disable(p2p: str, available: bool | None) -> str | None:
    """NCCL_P2P_DISABLE: forced by SM70_P2P (`on`/`off`), else from the topology (None:
    unknown, leave unset)."""
    if p2p == "on":
        return "0"
    if p2p == "off":
        return "1"
    if p2p != "auto":
        raise Sm70Error(f"SM70_P2P={p2p}: expected auto, on or off")
    if available is None:
        return None
    return "0" if available else "1"


_STRENGTH: dict[str, int] = {"none": 0, "pcie_p2p": 1, "nvlink": 2}
_AUTO_REASON = {
    "nvlink": "NVLink: fp16 exchange",
    "pcie_p2p": "PCIe with P2P: 12-bit exchange",
    "none": "no P2P: NCCL with NCCL_P2P_DISABLE=1",
}


def tensor_parallel_pairs(gpu_indices: Sequence[int], tp: int) -> list[tuple[int, int]]:
    """The GPU pairs of each tensor-parallel group of 2 (consecutive entries, vLLM's rank
    order), keyed (lower, higher)."""
    if tp != 2:
        return []
    firsts, seconds = gpu_indices[0::2], gpu_indices[1::2]
    return [(min(a, b), max(a, b)) for a, b in zip(firsts, seconds, strict=False)]


def choose_allreduce(
    *, mode: str, p2p: str, tensor_parallel_size: int, gpu_indices: Sequence[int],
    links: Links | None,
) -> AllreduceChoice:
    """The all-reduce for the serving GPUs `gpu_indices` (CUDA indices, SM70_GPUS order)
    whose pairwise links are `links` (None: not probed), under SM70_ALLREDUCE_MODE=`mode`,
    SM70_P2P=`p2p` and SM70_TENSOR_PARALLEL_SIZE=`tensor_parallel_size`."""
    if mode not in ("auto", "fp16", "int12"):
        raise Sm70Error(f"SM70_ALLREDUCE_MODE={mode}: expected auto, fp16 or int12")
    available = p2p_available(links)
    disable = nccl_p2p_disable(p2p, available)
    tp = tensor_parallel_size
    pairs = tensor_parallel_pairs(gpu_indices, tp)
    link: Link | None = None
    if links is not None and pairs and all(p in links for p in pairs):
        link = min((links[p] for p in pairs), key=lambda k: _STRENGTH[k])

    def choice(m: str, reason: str) -> AllreduceChoice:
        return AllreduceChoice(m, disable, link, available, reason)  # type: ignore[arg-type]

    if tp != 2:
        if mode == "int12":
            raise Sm70Error(
                f"SM70_ALLREDUCE_MODE=int12 needs a tensor-parallel size of 2, not {tp}",
                hint="set SM70_ALLREDUCE_MODE=auto (NCCL) or SM70_TENSOR_PARALLEL_SIZE=2",
            )
        return choice("nccl", f"tensor-parallel size {tp}: the IPC all-reduce is for 2 GPUs")
    if p2p == "off":
        if mode != "auto":
            raise Sm70Error(
                f"SM70_ALLREDUCE_MODE={mode} needs peer access, which SM70_P2P=off forbids",
                hint="set SM70_ALLREDUCE_MODE=auto (NCCL without P2P) or SM70_P2P=auto",
            )
        return choice("nccl", "SM70_P2P=off: NCCL without P2P")
    if mode != "auto":
        if link == "none" and p2p == "auto":
            raise Sm70Error(
                f"SM70_ALLREDUCE_MODE={mode} needs P2P between the tensor-parallel GPUs, "
                "which NVML reports as unavailable",
                hint="set SM70_ALLREDUCE_MODE=auto (NCCL without P2P), or enable P2P and "
                     "set SM70_P2P=on",
            )
        return choice(mode, f"SM70_ALLREDUCE_MODE={mode}")
    if link is None:
        return choice("nccl", "topology not probed: NCCL")
    if link == "none" and p2p == "on":
        return choice("int12", "SM70_P2P=on over a link NVML reports without P2P: "
                               "taken as PCIe with P2P, 12-bit exchange")
    return choice(AUTO_MODE[link], _AUTO_REASON[link])
