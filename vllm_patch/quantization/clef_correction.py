"""Clef's low-rank correction inside our linear methods, for Clef's rows only (issue 25).

A corrected layer (decoder layers 40-63, `vllm_patch.clef.rows.layer_plan`) holds one
(A, B) per slice as non-persistent buffers `sm70_clef_a{i}` [r, K] and `sm70_clef_b{i}`
[n_i, r] (this rank's shard, `vllm_patch.clef.sharding`), and the slice bounds
`sm70_clef_bounds` (lo0, hi0, lo1, hi1, ...) of its output. Row-parallel layers keep A's
columns of this rank's input features and B whole, so each rank's correction is a partial
product the layer's existing all-reduce sums with the base's partial output.

Which rows are Clef's: `ROWS`, one process-wide mask of the current batch (a device buffer
of one byte per row, allocated once, so captured CUDA graphs read it at replay), set per
batch from vLLM's layout by `set_batch` before the forward (the runner's hook calls it with
the batch's query_start_loc and which requests are Clef). The forward is two opaque custom
ops (the int8 layer's whole linear; an in-place add after an fp16 layer's own GEMM), so
torch.compile traces through them and the path (`rows.choose_path`) is chosen at run time.

Loading: `attach` reads `SM70_CLEF_DIR` (the plugin config's `clef.dir`) once per process,
checked by `vllm_patch.clef.validate.validate_clef_dir` against the served model's config at
this TP size, and copies each layer's shard to the layer's device after its weights load,
into one allocation per rank sized by `vllm_patch.clef.arena` (the plan's rule, which says
why one allocation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_patch.clef.arena import aligned, arena_bytes, placed_bytes, shard_sizes
from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.model_dims import ModelDims, model_dims
from vllm_patch.clef.rows import (
    ADDED,
    FUSED,
    PLAIN,
    SlicePlan,
    choose_path,
    clef_token_ranges,
    layer_plan,
    row_mask_bytes,
)
from vllm_patch.clef.sharding import Ranges

OP = "sm70_clef_int8_linear"
OP_BIAS = "sm70_clef_int8_linear_bias"
OP_ADD = "sm70_clef_add"
A_NAME, B_NAME, BOUNDS = "sm70_clef_a{}", "sm70_clef_b{}", "sm70_clef_bounds"
# rows the mask buffer holds before vLLM's config is known (grown eagerly if a batch is
# larger; never during capture)
DEFAULT_ROWS = 8192
# "fused": above the GEMV, corrected int8 layers run the int8 GEMM with the correction in
# its launch (rows.choose_path says why it is off by default)
SETTINGS: dict[str, bool] = {"fused": False}
_lock = threading.Lock()


# ------------------------------------------------------------------ the batch's Clef rows
def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    cur = torch.cuda.current_device()
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


@dataclass
class ClefRows:
    """The current batch's row mask (uint8 on the device) and whether any row is Clef's.

    The buffer is allocated once: a CUDA graph captured after that reads it at replay, so
    once a capture has used it, it is never replaced (a larger batch is refused instead)."""

    mask: torch.Tensor | None = None
    any_clef: bool = False
    rows: int = 0
    captured: bool = False
    # rows [dirty:] of the buffer are known zero: a chat-only step after a chat-only step
    # copies nothing to the device
    dirty: int = 0

    def reserve(self, rows: int, device: torch.device) -> torch.Tensor:
        m = self.mask
        if m is not None and m.numel() >= rows and _same_device(m.device, device):
            return m
        if self.captured or _capturing():
            held = 0 if m is None else m.numel()
            raise ClefError(f"Clef row mask: a batch of {rows} rows, but the buffer CUDA "
                            f"graphs read holds {held} (it is sized from "
                            "max_num_batched_tokens before capture and cannot move after)")
        self.mask = torch.zeros(max(rows, DEFAULT_ROWS), dtype=torch.uint8, device=device)
        self.dirty = 0
        return self.mask

    def set_batch(self, query_start_loc: Sequence[int], is_clef: Sequence[bool],
                  num_tokens: int, device: torch.device | None = None) -> None:
        """Mark the rows of this batch's Clef requests (vLLM's request order, padded rows
        chat); call before every forward, with all flags False for a chat-only batch."""
        ranges = clef_token_ranges(query_start_loc, is_clef, num_tokens)
        dev = device or (self.mask.device if self.mask is not None else torch.device("cuda"))
        buf = self.reserve(num_tokens, dev)
        span = max(num_tokens, self.dirty)
        if span and (ranges or self.dirty):
            host = torch.frombuffer(bytearray(row_mask_bytes(ranges, span)), dtype=torch.uint8)
            if buf.device.type == "cuda":
                # pinned and non-blocking: a pageable copy would wait for the stream, i.e.
                # for the step still running under async scheduling; the stream orders the
                # copy after that step's reads, and torch's pinned pool keeps `host` until
                # the copy has run
                buf[:span].copy_(host.pin_memory(), non_blocking=True)
            else:
                buf[:span].copy_(host)
        self.dirty = ranges[-1][1] if ranges else 0
        self.any_clef = bool(ranges)
        self.rows = num_tokens

    def mask_for(self, m: int, device: torch.device) -> torch.Tensor:
        if _capturing():
            self.captured = True
        return self.reserve(m, device)[:m]


ROWS = ClefRows()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def configure(fused: bool) -> None:
    SETTINGS["fused"] = fused


# ------------------------------------------------------------------ the math (tested on CPU)
def add_correction(y: torch.Tensor, x: torch.Tensor, a_ts: Sequence[torch.Tensor],
                   b_ts: Sequence[torch.Tensor], bounds: Sequence[int],
                   mask: torch.Tensor) -> None:
    """y[:, lo_i:hi_i] += mask * ((x A_i^T) B_i^T), in place, for every slice i.

    Chat rows are left as the layer's own kernel wrote them: chosen by torch.where, not
    by adding a masked zero (an overflowed x A^T times 0 is NaN, and -0 + 0 is +0)."""
    keep = mask.view(-1, 1).bool()
    for i, (a, b) in enumerate(zip(a_ts, b_ts, strict=True)):
        lo, hi = bounds[2 * i], bounds[2 * i + 1]
        t = torch.where(keep, x @ a.t(), 0)
        ys = y[:, lo:hi]
        ys.copy_(torch.where(keep, ys + t @ b.t(), ys))


GemmFn = Callable[..., torch.Tensor]


def fused_gemm(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int,
               bias: torch.Tensor | None, a_ts: Sequence[torch.Tensor],
               b_ts: Sequence[torch.Tensor], bounds: Sequence[int], mask: torch.Tensor,
               gemm: GemmFn) -> torch.Tensor:
    """The int8 GEMM with each slice's correction in its launch: one call of `gemm` (the
    op's signature) per slice on that slice's output rows of W, the outputs side by side.
    The op takes one correction of rank <= 256 per call, and a fused layer's slices have
    a rank each (768 for qkv_proj), so the slices are launched apart."""
    parts = []
    for i, (a, b) in enumerate(zip(a_ts, b_ts, strict=True)):
        lo, hi = bounds[2 * i], bounds[2 * i + 1]
        parts.append(gemm(x, qw[lo:hi], sz[lo:hi], group_size,
                          None if bias is None else bias[lo:hi], a, b, mask))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# ------------------------------------------------------------------ the custom ops
def _int8(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int,
          max_rows: int, bias: torch.Tensor | None, a_ts: list[torch.Tensor],
          b_ts: list[torch.Tensor], bounds: list[int]) -> torch.Tensor:
    from vllm_patch.ops import kernels

    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m = x2.shape[0]
    fused = bool(SETTINGS["fused"])
    path = choose_path(True, m, max_rows, ROWS.any_clef, _capturing(), fused=fused)
    if m == 0:
        return x.new_empty((*lead, qw.shape[0]))
    if path == FUSED:
        y = fused_gemm(x2, qw, sz, group_size, bias, a_ts, b_ts, bounds,
                       ROWS.mask_for(m, x2.device), kernels.int8_gemm)
    else:
        if fused and m > max_rows:  # the fused mode's chat rows: the same int8 GEMM
            y = kernels.int8_gemm(x2, qw, sz, group_size, bias)
        else:  # the layer's own dispatch, exactly as an uncorrected layer runs
            from vllm_patch.quantization import sm70_gptq

            y = sm70_gptq._run(x2, qw, sz, group_size, max_rows, bias)
        if path == ADDED:
            add_correction(y, x2, a_ts, b_ts, bounds, ROWS.mask_for(m, x2.device))
    return y.reshape(*lead, qw.shape[0])


def _int8_op(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int,
             max_rows: int, a_ts: list[torch.Tensor], b_ts: list[torch.Tensor],
             bounds: list[int]) -> torch.Tensor:
    return _int8(x, qw, sz, group_size, max_rows, None, a_ts, b_ts, bounds)


def _int8_bias_op(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int,
                  max_rows: int, bias: torch.Tensor, a_ts: list[torch.Tensor],
                  b_ts: list[torch.Tensor], bounds: list[int]) -> torch.Tensor:
    return _int8(x, qw, sz, group_size, max_rows, bias, a_ts, b_ts, bounds)


def _int8_fake(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int,
               max_rows: int, a_ts: list[torch.Tensor], b_ts: list[torch.Tensor],
               bounds: list[int]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qw.shape[0]))


def _int8_bias_fake(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group_size: int,
                    max_rows: int, bias: torch.Tensor, a_ts: list[torch.Tensor],
                    b_ts: list[torch.Tensor], bounds: list[int]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qw.shape[0]))


def _add_op(y: torch.Tensor, x: torch.Tensor, a_ts: list[torch.Tensor],
            b_ts: list[torch.Tensor], bounds: list[int]) -> None:
    y2 = y.view(-1, y.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if choose_path(True, m, 0, ROWS.any_clef, _capturing(), quantized=False) == PLAIN:
        return
    add_correction(y2, x2, a_ts, b_ts, bounds, ROWS.mask_for(m, x2.device))


def _add_fake(y: torch.Tensor, x: torch.Tensor, a_ts: list[torch.Tensor],
              b_ts: list[torch.Tensor], bounds: list[int]) -> None:
    return None


def register_ops() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    with _lock:
        if not hasattr(torch.ops.vllm, OP):
            direct_register_custom_op(OP, _int8_op, fake_impl=_int8_fake)
        if not hasattr(torch.ops.vllm, OP_BIAS):
            direct_register_custom_op(OP_BIAS, _int8_bias_op, fake_impl=_int8_bias_fake)
        if not hasattr(torch.ops.vllm, OP_ADD):
            direct_register_custom_op(OP_ADD, _add_op, mutates_args=["y"], fake_impl=_add_fake)


# ------------------------------------------------------------------ per-layer factors
def factors(layer: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    bounds = list(getattr(layer, BOUNDS))
    n = len(bounds) // 2
    return ([getattr(layer, A_NAME.format(i)) for i in range(n)],
            [getattr(layer, B_NAME.format(i)) for i in range(n)], bounds)


def is_corrected(layer: torch.nn.Module) -> bool:
    return hasattr(layer, BOUNDS)


def int8_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                max_rows: int) -> torch.Tensor:
    """The corrected int8 layer's forward (sm70_gptq's apply for a corrected layer)."""
    a, b, bounds = factors(layer)
    qw, sz, g = layer.qweight, layer.sm70_sz, layer.sm70_group_size
    if bias is None:
        return torch.ops.vllm.sm70_clef_int8_linear(x, qw, sz, g, max_rows, a, b, bounds)
    return torch.ops.vllm.sm70_clef_int8_linear_bias(x, qw, sz, g, max_rows, bias, a, b,
                                                     bounds)


def add_to_output(layer: torch.nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An fp16 layer's output y with the correction added to Clef's rows (in place)."""
    a, b, bounds = factors(layer)
    torch.ops.vllm.sm70_clef_add(y, x, a, b, bounds)
    return y


# ------------------------------------------------------------------ loading
def take(t: torch.Tensor, ranges: Ranges, dim: int) -> torch.Tensor:
    """The parts of t along `dim` in `ranges`, joined in order (a rank's shard; one part is a
    view of t, which `ShardArena.place` copies)."""
    parts = [t.narrow(dim, lo, hi - lo) for lo, hi in ranges]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


class ShardArena:
    """One rank's single device allocation for its shards (`vllm_patch.clef.arena`), made at
    the first shard placed; each shard is a view at the next aligned offset."""

    def __init__(self, shard_bytes: Sequence[int]) -> None:
        # room for exactly the counted shards: one more (a layer corrected twice, or one
        # not counted) is refused, not hidden in the allocation's rounding
        self.capacity = placed_bytes(shard_bytes)
        self.nbytes, self.used = arena_bytes(shard_bytes), 0
        self.buf: torch.Tensor | None = None

    def place(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if self.used + aligned(n) > self.capacity:
            raise ClefError(f"Clef's shards on this rank need more than the {self.capacity:,} "
                            "bytes counted for them (vllm_patch.clef.arena.shard_sizes): a "
                            "layer was corrected twice or is not among the counted ones")
        if self.buf is None:
            self.buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        elif not _same_device(self.buf.device, device):
            raise ClefError(f"Clef's shards of one rank on two devices ({self.buf.device}, "
                            f"{device})")
        out = self.buf[self.used:self.used + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used += aligned(n)
        return out


@dataclass
class ClefSource:
    """Where the corrections come from: the model's dims, this rank, Clef's rank, a fetch of
    one whole tensor by name (from the checked folder, or from memory in tests), and the
    decoder layers this worker holds (None: all; a pipeline stage its own), which size the
    rank's one allocation."""

    dims: ModelDims
    tp: int
    tp_rank: int
    fetch: Callable[[str], torch.Tensor]
    clef_rank: int
    layers: Collection[int] | None = None
    attached: list[str] = field(default_factory=list)
    arena: ShardArena = field(init=False)

    def __post_init__(self) -> None:
        self.arena = ShardArena(shard_sizes(self.dims, self.clef_rank, self.tp, self.layers))


def attach_from(source: ClefSource, layer: torch.nn.Module, prefix: str, output_size: int,
                input_size: int, device: torch.device) -> bool:
    """Give `layer` its slices' shards (False when Clef does not correct it)."""
    plans: tuple[SlicePlan, ...] = layer_plan(source.dims, prefix, source.tp, source.tp_rank,
                                              output_size)
    if not plans:
        return False
    layer_i = plans[0].correction.layer
    if source.layers is not None and layer_i not in source.layers:
        held = f"{min(source.layers)}-{max(source.layers)}" if source.layers else "none"
        raise ClefError(f"layer {prefix}: decoder layer {layer_i} is not among this "
                        f"worker's layers ({held})")
    shards = []
    for p in plans:
        a = take(source.fetch(p.correction.a_name), p.a_cols, 1)
        b = take(source.fetch(p.correction.b_name), p.b_rows, 0)
        if a.shape[1] != input_size:
            raise ClefError(f"layer {prefix}: {input_size} input features on this rank, but "
                            f"{p.correction.a_name}'s shard has {a.shape[1]}")
        if a.shape[0] != source.clef_rank or b.shape[1] != source.clef_rank:
            raise ClefError(f"layer {prefix}: {p.correction.a_name} has rank {a.shape[0]} "
                            f"and its B {b.shape[1]}, Clef's rank is {source.clef_rank}")
        shards.append((a, b))
    bounds: list[int] = []
    for i, ((a, b), p) in enumerate(zip(shards, plans, strict=True)):
        layer.register_buffer(A_NAME.format(i), source.arena.place(a.half(), device),
                              persistent=False)
        layer.register_buffer(B_NAME.format(i), source.arena.place(b.half(), device),
                              persistent=False)
        bounds += [p.out_lo, p.out_hi]
    setattr(layer, BOUNDS, tuple(bounds))
    register_ops()
    source.attached.append(prefix)
    return True


class _FolderFetch:
    """Tensors of a checked SM70_CLEF_DIR by name (each file opened once)."""

    def __init__(self, folder: Path, where: Mapping[str, str]) -> None:
        self.folder, self.where, self.open = folder, where, {}

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.where[name]
        if file not in self.open:
            self.open[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
        return self.open[file].get_tensor(name)


def source_from_folder(folder: Path, model_config: Mapping[str, Any], rank: int, tp: int,
                       tp_rank: int, layers: Collection[int] | None = None) -> ClefSource:
    """The checked folder as a source; a refusal names SM70_CLEF_DIR, the file and the rule."""
    from vllm_patch.clef.validate import validate_clef_dir

    try:
        checked = validate_clef_dir(folder, model_config, rank=rank, tp_sizes=(tp,))
    except ClefError as exc:
        raise ClefError(f"SM70_CLEF_DIR={folder}: {exc}") from None
    where = {n: lc.file for lc in checked.corrections
             for n in (lc.correction.a_name, lc.correction.b_name)}
    return ClefSource(model_dims(model_config), tp, tp_rank, _FolderFetch(folder, where), rank,
                      layers)


_source: list[ClefSource | None] = []


def served_source() -> ClefSource | None:
    """The serving process's source, built once: None unless the plugin config's
    `clef.enabled` (SM70_CLEF); the folder is `clef.dir` (SM70_CLEF_DIR)."""
    with _lock:
        if _source:
            return _source[0]
        from vllm_patch.config import PluginConfig

        cfg = PluginConfig.from_env().clef
        src = None
        if cfg.enabled:
            from vllm.config import get_current_vllm_config
            from vllm.distributed import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            vcfg = get_current_vllm_config()
            hf = vcfg.model_config.hf_config.to_dict()
            budget = getattr(vcfg.scheduler_config, "max_num_batched_tokens", None)
            ROWS.reserve(max(int(budget or 0), DEFAULT_ROWS), torch.device(
                "cuda", torch.cuda.current_device()))
            folder = Path(cfg.dir).expanduser()
            device = torch.device("cuda", torch.cuda.current_device())
            src = source_from_folder(folder, hf, cfg.rank,
                                     get_tensor_model_parallel_world_size(),
                                     get_tensor_model_parallel_rank(),
                                     _stage_layers(model_dims(hf).num_layers))
            # the head is loaded with the corrections, while the weights load, so vLLM's
            # memory profile counts it; the runner hook (R6) marks Clef rows per step
            from vllm_patch.clef.head_forward import head_from_folder
            from vllm_patch.clef.runner_hook import install

            _head.append(head_from_folder(folder, hf, cfg.rank, device))
            _hook.append(install())
        _source.append(src)
        return src


def _stage_layers(num_layers: int) -> range:
    """The decoder layers this worker's pipeline stage holds, as vLLM splits them."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    pp = get_pp_group()
    return range(*get_pp_indices(num_layers, pp.rank_in_group, pp.world_size))


_head: list[Any] = []
_hook: list[str] = []


def served_head() -> Any:
    """The scoring head of this worker (None unless `served_source` loaded Clef)."""
    return _head[0] if _head else None


def attach(layer: torch.nn.Module, prefix: str, output_size: int, input_size: int,
           device: torch.device) -> bool:
    """At process_weights_after_loading: the served source's shards for this layer."""
    src = served_source()
    return src is not None and attach_from(src, layer, prefix, output_size, input_size, device)


_method_class: list[type] = []


def _unquantized_class() -> type:
    from vllm.model_executor.layers.linear import (
        UnquantizedLinearMethod,
        register_weight_loader_v2_supported_method,
    )

    class ClefUnquantizedLinearMethod(UnquantizedLinearMethod):
        """fp16 layer (qkv_proj and in_proj_ba stay 16-bit in the checkpoint): its own GEMM,
        then the correction added to Clef's rows. Loads like its base (weight_loader_v2)."""

        def __init__(self, prefix: str) -> None:
            super().__init__()
            self.prefix = prefix

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            (n, k), dev = layer.weight.shape, layer.weight.device  # before any repacking
            super().process_weights_after_loading(layer)
            attach(layer, self.prefix, n, k, dev)

        def apply(self, layer: torch.nn.Module, x: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
            y = super().apply(layer, x, bias)
            return add_to_output(layer, y, x) if is_corrected(layer) else y

    return register_weight_loader_v2_supported_method(ClefUnquantizedLinearMethod)


def unquantized_method(prefix: str, corrected: bool) -> Any:
    """vLLM's fp16 linear method, or its Clef subclass for a layer Clef corrects."""
    if not corrected:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        return UnquantizedLinearMethod()
    with _lock:
        if not _method_class:
            _method_class.append(_unquantized_class())
    return _method_class[0](prefix)


def corrects(prefix: str) -> bool:
    """Whether the served Clef source corrects the layer at `prefix` (False with Clef off)."""
    src = served_source()
    return src is not None and bool(layer_plan(src.dims, prefix, src.tp, src.tp_rank))
