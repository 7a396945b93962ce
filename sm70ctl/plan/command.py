"""`sm70ctl plan`: argument plumbing, the edges (settings, config file, NVML, SVG file) and
rendering. The arithmetic lives in plan.py and below, all pure."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from sm70ctl.options import EnvFileOpt, JsonOpt

ModelDirOpt = Annotated[
    Optional[Path],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
    typer.Option("--model-dir", help="Plan the model whose config.json is in this folder.",
                 file_okay=False, metavar="DIR"),
]
ConfigOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--config", help="Plan the model described by this Hugging Face config.json.",
                 dir_okay=False, metavar="FILE"),
]
GpusOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--gpus", help="GPUs to plan for instead of NVML's: NxSIZE or a list, each "
                 "size with its unit, e.g. 2x32GiB, 2x16GiB, 32GiB,16GiB, 34089730048B, 2xv100 "
                 "(34,089,730,048 B, NVML's V100 total).",
                 metavar="SPEC"),
]
MaxLenOpt = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option("--max-model-len", help="Override SM70_MAX_MODEL_LEN.", min=1, metavar="N"),
]
MaxSeqsOpt = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option("--max-num-seqs", help="Override SM70_MAX_NUM_SEQS.", min=1, metavar="N"),
]
ContextOpt = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option("--context", help="Report how many sequences of N tokens fit at once "
                 "(default: the max model length).", min=1, metavar="N"),
]
PathOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--path", help="Which pool the plan describes: `served` (default), what "
                 "vLLM 0.22.1 allocates today (float32 GDN state pages in its one hybrid "
                 "pool, TRITON_ATTN's block alignment); `target`, the design that "
                 "SM70_GDN_STATE_DTYPE, SM70_SPLIT_POOLS and SM70_STATE_BLOCK_MULTIPLIER "
                 "describe, not served yet (issue 23).", metavar="served|target"),
]
SvgOpt = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--svg", help="Also draw the plan as a stacked bar per GPU into FILE.",
                 dir_okay=False, metavar="FILE"),
]

HELP = (
    "Byte-exact GPU memory plan: weights by tensor class, Clef, workspaces, the GDN state pool "
    "and the KV pool, per GPU.\n\n"
    "Reads the model's config.json (--config, --model-dir, else SM70_MODEL_DIR's when it "
    "exists, else the built-in Qwen3.8-27B GPTQ-int8 description), the SM70_* settings, and "
    "the GPUs (--gpus, else NVML, else the reference 2 x V100-SXM2-32GB). Reports the "
    "longest single sequence and how many sequences of --context tokens fit; exits 1, naming "
    "the item that overflows and by how many bytes, when SM70_MAX_MODEL_LEN does not fit. "
    "All figures are projected from shapes, not measured.\n\n"
    "Examples:\n\n"
    "    sm70ctl plan                                  # the reference plan\n\n"
    "    sm70ctl plan --json                           # bytes per item, per GPU\n\n"
    "    sm70ctl plan --gpus 2x16GiB                   # what fits on smaller cards\n\n"
    "    sm70ctl plan --max-model-len 1048576          # refused: names the overflow\n\n"
    "    sm70ctl plan --context 32768 --svg plan.svg   # concurrency at 32K, and a picture\n\n"
    "    SM70_CLEF=true sm70ctl plan --model-dir /srv/models/qwen3.8-27b-gptq-int8"
)


def register(app: typer.Typer) -> None:
    @app.command("plan", help=HELP)
    def plan(
        model_dir: ModelDirOpt = None,
        config: ConfigOpt = None,
        gpus: GpusOpt = None,
        max_model_len: MaxLenOpt = None,
        max_num_seqs: MaxSeqsOpt = None,
        context: ContextOpt = None,
        svg: SvgOpt = None,
        path: PathOpt = None,
        json_out: JsonOpt = False,
        env_file: EnvFileOpt = None,
    ) -> None:
        from sm70ctl.errors import EXIT_USAGE, Sm70Error, UsageError
        from sm70ctl.output import Output
        from sm70ctl.plan.plan import what_fits
        from sm70ctl.plan.pools import PATHS
        from sm70ctl.plan.report import plan_to_dict
        from sm70ctl.plan.run import BUILTIN_SOURCE, plan_for_settings
        from sm70ctl.settings import SettingsError, load_settings

        out = Output(json_out)
        # the overrides get the variables' own checks (range, cross-field rules)
        overrides = {name: (str(value), option) for name, value, option in (
            ("SM70_MAX_MODEL_LEN", max_model_len, "--max-model-len"),
            ("SM70_MAX_NUM_SEQS", max_num_seqs, "--max-num-seqs")) if value is not None}
        try:
            settings = load_settings(env_file=env_file, overrides=overrides)
        except SettingsError as exc:
            if any(p.source in ("--max-model-len", "--max-num-seqs") for p in exc.problems):
                exc.exit_code = EXIT_USAGE  # a bad option is a usage error
            raise
        if context is not None and context > settings.max_model_len:
            raise UsageError(
                f"--context {context:,} is longer than SM70_MAX_MODEL_LEN="
                f"{settings.max_model_len:,}: no request can be that long",
                hint="give --context at or below the max model length, or raise "
                     "--max-model-len",
            )
        if path is not None and path not in PATHS:
            raise UsageError(f"--path {path!r}: allowed: {', '.join(PATHS)}")
        run = plan_for_settings(settings, config=config, model_dir=model_dir, gpus=gpus,
                                context=context, path=path)
        result, model, model_source, src, inputs = (
            run.plan, run.model, run.model_source, run.gpus, run.inputs)
        needed = inputs.tensor_parallel_size * inputs.pipeline_parallel_size
        data = plan_to_dict(result, {"model_source": model_source, "gpus_source": src.source,
                                     "gpus_note": src.note, "settings_source": "SM70_* settings"})
        steps = [] if result.fits else what_fits(model, inputs, src.gpus[:needed])
        data["what_fits"] = steps
        if svg is not None:
            from sm70ctl.fsutil import atomic_write_text
            from sm70ctl.plan.svg import render_svg

            name = ("Qwen3.8-27B GPTQ int8" if model_source == BUILTIN_SOURCE
                    else Path(model.source).parent.name or model.architecture)
            title = (f"Memory plan per GPU: {name}, TP={inputs.tensor_parallel_size} "
                     f"PP={inputs.pipeline_parallel_size}, {len(result.gpus)} GPU(s)")
            try:
                atomic_write_text(svg, render_svg(result, title))
            except OSError as exc:
                raise Sm70Error(f"--svg {svg}: cannot write: {exc.strerror or exc}",
                                hint="give a writable file path") from exc
        out.emit(data, lambda console: _render(console, data))
        if svg is not None:
            out.info(f"wrote {svg}")
        if result.overflow is not None:
            raise Sm70Error(result.overflow.message,
                        hint=_overflow_hint(steps, _min_model_len()))


def _min_model_len() -> int:
    """SM70_MAX_MODEL_LEN's lower bound: a row promising fewer tokens cannot be applied."""
    from sm70ctl.settings.schema import load_schema

    spec = load_schema().get("SM70_MAX_MODEL_LEN")
    return int(spec.min) if spec is not None and spec.min is not None else 1


def _overflow_hint(steps: list[dict[str, Any]], min_len: int = 1) -> str:
    """The fix line of a plan that does not fit: the first relaxation that holds
    SM70_MAX_MODEL_LEN, else the one with the longest sequence, else: nothing fits (also
    when the longest is below what SM70_MAX_MODEL_LEN may be set to)."""
    best = max(steps, key=lambda st: st["longest_sequence"])
    first = next((st for st in steps if st["holds_max_model_len"]), None)
    pick = first or best
    if pick["longest_sequence"] < max(min_len, 1):
        env = " ".join(f"{k}={v}" for k, v in steps[-1]["settings"].items())
        room = ("no room for one sequence's KV and state" if pick["longest_sequence"] <= 0
                else f"room for {pick['longest_sequence']:,} tokens, below SM70_MAX_MODEL_LEN's "
                     f"minimum of {min_len:,}")
        return (f"nothing fits on these GPUs: even with {env} the weights and workspaces "
                f"leave {room}; use larger GPUs (--gpus) "
                "or more of them (SM70_TENSOR_PARALLEL_SIZE / SM70_PIPELINE_PARALLEL_SIZE)")
    env = " ".join(f"{k}={v}" for k, v in pick["settings"].items())
    then = ("SM70_MAX_MODEL_LEN fits" if first is not None
            else "set SM70_MAX_MODEL_LEN at or below it")
    return (f"what fits on these GPUs: with {env} the longest single sequence is "
            f"{pick['longest_sequence']:,} tokens ({then}); the table lists each step")


PATH_NOTE = {"served": "what vLLM 0.22.1 allocates today",
             "target": "the design of issue 23, not served yet"}


def _render(console: Any, data: dict[str, Any]) -> None:
    from sm70ctl.output import make_table
    from sm70ctl.plan.report import gib, mib

    gpus = data["gpus"]
    # GPUs with identical item lists share one column (TP ranks of one stage)
    columns: list[tuple[str, dict[str, Any]]] = []
    for g in gpus:
        sig = [(i["key"], i["bytes"]) for i in g["items"]] + [g["budget_bytes"]]
        for name, rep in columns:
            if rep["_sig"] == sig:
                columns[columns.index((name, rep))] = (f"{name},{g['index']}", rep)
                break
        else:
            columns.append((f"GPU {g['index']}", {**g, "_sig": sig}))
    heads = ["section", "item"]
    for name, _ in columns:
        heads += [f"{name} bytes", "MiB", "GiB"]
    rows: list[list[Any]] = []
    keys = list(dict.fromkeys(i["key"] for _, g in columns for i in g["items"]))
    for key in keys:
        row: list[Any] = []
        for _, g in columns:
            item = next((i for i in g["items"] if i["key"] == key), None)
            if not row:
                row = [item["section"] if item else "", item["label"] if item else key]
            row += ([f"{item['bytes']:,}", mib(item["bytes"]), gib(item["bytes"])]
                    if item else ["", "", ""])
        rows.append(row)
    for label, field in (("weights total", "weights_bytes"), ("used", "used_bytes"),
                         ("budget", "budget_bytes"), ("free inside budget", "free_bytes"),
                         ("pool the budget allows", "pool_available_bytes"),
                         ("GPU total", "total_bytes")):
        row = ["total", label]
        for _, g in columns:
            row += [f"{g[field]:,}", mib(g[field]), gib(g[field])]
        rows.append(row)
    m = data["model"]
    console.print(make_table(
        f"Memory plan per GPU ({m['source']} model, {data['gpus_source']} GPUs)", heads, rows))
    inp = data["inputs"]
    conc = data["concurrency"]
    page = data["gdn_page_bytes"]
    lines = [
        f"model: {m['path']} [{m['source']}]: {m['layers']} layers "
        f"({m['full_attention_layers']} full attention, {m['linear_attention_layers']} GDN), "
        f"{m['quantization'] or '16-bit'}",
        f"GPUs: {data['gpus_note']}",
        f"TP={inp['tensor_parallel_size']} PP={inp['pipeline_parallel_size']}, "
        f"KV {inp['kv_cache_dtype']}: {data['kv_bytes_per_token_per_layer']:,} B per token "
        f"per layer, {data['kv_bytes_per_token']:,} B per token per GPU",
    ]
    pool = gpus[0]["pool"]
    if page and pool["mode"] == "served":
        lines.append(f"GDN page per layer per GPU: {page['total']:,} B = "
                     f"{page['recurrent'] // 1024:,} KiB {data['gdn_state_dtype']} state + "
                     f"{page['conv'] // 1024:,} KiB conv, padded to the "
                     f"{pool['page_bytes']:,} B page of {pool['block_size']:,}-token blocks; "
                     f"{pool['num_blocks']:,} blocks of {pool['layer_group']} layers, a request "
                     f"takes {pool['slots_per_seq']} state pages in each of "
                     f"{pool['gdn_groups']} GDN groups")
    elif page:
        lines.append(f"GDN page per layer per GPU: {page['total']:,} B = "
                     f"{page['recurrent'] // 1024:,} KiB {data['gdn_state_dtype']} state + "
                     f"{page['conv'] // 1024:,} KiB conv; state slots "
                     f"{pool['slots']} ({inp['max_num_seqs']} seqs x "
                     f"{inp['state_block_multiplier']})")
    lines.append(f"plan path: {inp['path']} ({PATH_NOTE[inp['path']]})")
    if data["within_budget"]:
        lines.append(f"longest single sequence: {data['longest_sequence_tokens']:,} tokens "
                     f"(max model length {data['max_model_len']:,})")
        lines.append(f"at {conc['context']:,} tokens: {conc['sequences']} sequence(s) at once "
                     f"(KV allows {conc['by_kv']}, state slots {conc['by_state']}, "
                     f"max_num_seqs {conc['by_max_num_seqs']})")
    else:
        # a pool past the budget cannot be allocated: it holds no sequence at all
        lines.append("longest single sequence: none: the items pass the budget (below), so "
                     "no pool can be allocated")
    for line in lines:
        console.print(line, markup=False, highlight=False)
    for w in data["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    if data["fits"]:
        console.print(f"[green]fits[/green]: {data['max_model_len']:,} tokens on "
                      f"{len(gpus)} GPU(s). Projected from shapes, not measured.")
    else:
        console.print(f"[bold red]does not fit[/bold red]: {data['overflow']['message']}",
                      highlight=False)
        steps = data.get("what_fits") or []
        if steps:
            console.print(make_table(
                "What fits instead (each step keeps the ones above; pool per GPU)",
                ["step", "settings changed", "pool bytes", "GiB", "longest sequence",
                 f"holds {data['max_model_len']:,}"],
                [[st["step"],
                  " ".join(f"{k}={v}" for k, v in st["settings"].items()),
                  f"{st['pool_bytes']:,}", gib(st["pool_bytes"]),
                  f"{st['longest_sequence']:,}", "yes" if st["holds_max_model_len"] else "no"]
                 for st in steps]))
