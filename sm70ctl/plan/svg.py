"""The plan as a picture: one horizontal stacked bar per GPU, hand-written SVG (pure), and an
atomic file write (the edge)."""

from __future__ import annotations

from xml.sax.saxutils import escape

from sm70ctl.plan.plan import BUDGET, KV, STATE, GiB, Plan
from sm70ctl.plan.report import GROUPS, SHORT, gib, group_of

W, LEFT, RIGHT = 1100, 150, 40
BAR_H, GAP, TOP = 46, 34, 92
FREE = "#e9ecef"
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def _drawn(plan: Plan, gi: int) -> list[tuple[str, int]]:
    """(key, bytes) of what a GPU's bar shows. When only the KV pool is short of
    SM70_MAX_MODEL_LEN, the KV segment is what that length needs, not the configured pool:
    the bar then shows the memory the setting asks for, and free space only if the budget
    really has it after that."""
    g = plan.gpus[gi]
    short = g.overflow is not None and g.overflow.kind == KV
    return [(it.key, g.kv_needed_bytes if short and it.key == "pool.kv" else it.bytes)
            for it in g.items]


def _used(plan: Plan, gi: int) -> int:
    return sum(b for _, b in _drawn(plan, gi))


def _segments(plan: Plan, gi: int) -> list[tuple[str, str, str, int]]:
    g = plan.gpus[gi]
    sums: dict[str, int] = {}
    for key, b in _drawn(plan, gi):
        k = group_of(key)
        sums[k] = sums.get(k, 0) + b
    labels = {"pool.kv": f"KV that SM70_MAX_MODEL_LEN={plan.inputs.max_model_len:,} needs"}
    short = g.overflow is not None and g.overflow.kind == KV
    segs = [(k, labels[k] if short and k in labels else label, colour, sums[k])
            for k, label, colour in GROUPS if sums.get(k)]
    free = g.budget - _used(plan, gi)
    if free > 0:
        segs.append(("free", "free inside the budget", FREE, free))
    return segs


def _verdict(plan: Plan) -> str:
    ov = plan.overflow
    if ov is None:
        conc = plan.concurrency(plan.context)
        return (f"fits: max model length {plan.inputs.max_model_len:,}; the KV pool holds "
                f"{plan.longest_sequence:,} tokens; {conc['sequences']} sequence(s) of "
                f"{plan.context:,} at once")
    over = max(_used(plan, gi) - g.budget for gi, g in enumerate(plan.gpus))
    if ov.kind == BUDGET:
        return (f"does NOT fit: the budget first overflows at {ov.item} (by "
                f"{gib(ov.by_bytes)} GiB); everything planned is {gib(max(over, 0))} GiB over")
    if ov.kind == STATE:
        return (f"does NOT fit: the GDN state pool is {gib(ov.by_bytes)} GiB larger than the "
                "pool")
    tail = (f"with that KV the GPUs are {gib(over)} GiB over the budget" if over > 0 else
            f"the budget has room: raise SM70_KV_CACHE_BYTES by {gib(ov.by_bytes)} GiB")
    return (f"does NOT fit: SM70_MAX_MODEL_LEN={plan.inputs.max_model_len:,} needs "
            f"{gib(ov.by_bytes)} GiB more KV than the pool has; {tail}")


def render_svg(plan: Plan, title: str) -> str:
    n = len(plan.gpus)
    used = [_used(plan, gi) for gi in range(n)]
    scale_bytes = max(max(g.gpu.total_bytes, u) for g, u in zip(plan.gpus, used, strict=True))
    over = max(u - g.budget for g, u in zip(plan.gpus, used, strict=True))
    px = (W - LEFT - RIGHT - (130 if over > 0 else 0)) / scale_bytes
    legend_rows = (len(GROUPS) + 2 + 2) // 3
    height = TOP + n * (BAR_H + GAP) + 40 + legend_rows * 24 + 30
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{height}' "
        f"viewBox='0 0 {W} {height}' {FONT}>",
        "<defs><pattern id='hatch' width='8' height='8' patternUnits='userSpaceOnUse' "
        "patternTransform='rotate(45)'><rect width='8' height='8' fill='#fff'/>"
        "<line x1='0' y1='0' x2='0' y2='8' stroke='#ced4da' stroke-width='3'/></pattern></defs>",
        f"<rect width='{W}' height='{height}' fill='white'/>",
        f"<text x='20' y='32' font-size='20' font-weight='bold'>{escape(title)}</text>",
    ]
    verdict = _verdict(plan)
    out.append(f"<text x='20' y='56' font-size='14' fill='{'#2b9348' if plan.fits else '#c1121f'}'>"
               f"{escape(verdict)}</text>")
    # GiB grid
    axis_y = TOP + n * (BAR_H + GAP) - GAP + 8
    step = 4 if scale_bytes > 24 * GiB else 2
    for v in range(0, int(scale_bytes / GiB) + 1, step):
        x = LEFT + v * GiB * px
        out.append(f"<line x1='{x:.1f}' y1='{TOP - 8}' x2='{x:.1f}' y2='{axis_y}' "
                   "stroke='#dee2e6' stroke-width='1'/>")
        out.append(f"<text x='{x:.1f}' y='{axis_y + 16}' font-size='11' fill='#495057' "
                   f"text-anchor='middle'>{v} GiB</text>")
    for gi, g in enumerate(plan.gpus):
        y = TOP + gi * (BAR_H + GAP)
        out.append(f"<text x='{LEFT - 10}' y='{y + BAR_H / 2 - 2}' font-size='14' "
                   f"text-anchor='end' font-weight='bold'>GPU {g.gpu.index}</text>")
        out.append(f"<text x='{LEFT - 10}' y='{y + BAR_H / 2 + 14}' font-size='11' "
                   f"text-anchor='end' fill='#495057'>{gib(g.gpu.total_bytes)} GiB</text>")
        total_x = LEFT + g.gpu.total_bytes * px
        budget_x = LEFT + g.budget * px
        # what the utilisation keeps out of the budget, hatched behind the segments
        out.append(f"<rect x='{budget_x:.2f}' y='{y}' width='{total_x - budget_x:.2f}' "
                   f"height='{BAR_H}' fill='url(#hatch)'><title>outside the budget: "
                   f"{g.gpu.total_bytes - g.budget:,} B</title></rect>")
        x = float(LEFT)
        for key, label, colour, b in _segments(plan, gi):
            w = b * px
            fill = "url(#hatch)" if key == "outside" else colour
            out.append(f"<rect x='{x:.2f}' y='{y}' width='{w:.2f}' height='{BAR_H}' "
                       f"fill='{fill}' stroke='white' stroke-width='1'>"
                       f"<title>{escape(label)}: {b:,} B ({gib(b)} GiB)</title></rect>")
            text_colour = "#212529" if key in ("free", "outside", "workspace") else "white"
            short = SHORT.get(key, "")
            if w > 46:
                text = f"{short} {gib(b)}" if short and w > 30 + 8 * len(short) else gib(b)
                out.append(f"<text x='{x + w / 2:.1f}' y='{y + BAR_H / 2 + 5}' font-size='12' "
                           f"text-anchor='middle' fill='{text_colour}'>{escape(text)}</text>")
            x += w
        out.append(f"<rect x='{LEFT}' y='{y}' width='{total_x - LEFT:.2f}' height='{BAR_H}' "
                   "fill='none' stroke='#212529' stroke-width='1.5'/>")
        if used[gi] > g.budget:
            out.append(f"<text x='{x + 4:.1f}' y='{y + BAR_H / 2 + 5}' font-size='12' "
                       f"fill='#c1121f'>over by {gib(used[gi] - g.budget)} GiB</text>")
        out.append(f"<line x1='{budget_x:.1f}' y1='{y - 6}' x2='{budget_x:.1f}' "
                   f"y2='{y + BAR_H + 6}' stroke='#c1121f' stroke-width='2' "
                   "stroke-dasharray='4 3'/>")
        out.append(f"<text x='{budget_x:.1f}' y='{y - 9}' font-size='10' fill='#c1121f' "
                   f"text-anchor='end'>budget {gib(g.budget)} GiB</text>")
    # legend with the first GPU's figures
    ly = axis_y + 40
    g0 = plan.gpus[0]
    entries = [*_segments(plan, 0), ("outside", "outside the budget (1 - utilisation)", "",
                                     g0.gpu.total_bytes - g0.budget)]
    col_w = (W - 40) / 3
    for i, (key, label, colour, b) in enumerate(entries):
        cx = 20 + (i % 3) * col_w
        cy = ly + (i // 3) * 24
        fill = "url(#hatch)" if key == "outside" else colour
        out.append(f"<rect x='{cx:.1f}' y='{cy - 12}' width='16' height='16' fill='{fill}' "
                   "stroke='#adb5bd' stroke-width='0.5'/>")
        out.append(f"<text x='{cx + 22:.1f}' y='{cy + 1}' font-size='12'>{escape(label)}: "
                   f"{gib(b)} GiB</text>")
    note_y = ly + ((len(entries) + 2) // 3) * 24 + 4
    out.append(f"<text x='20' y='{note_y}' font-size='11' fill='#6c757d'>Figures in GiB per "
               "GPU, legend for GPU 0. Computed by sm70ctl plan from shapes and settings: "
               "projected, not measured.</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
