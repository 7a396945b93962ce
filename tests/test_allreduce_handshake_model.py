"""An exhaustive check of the two-GPU handshake's DESIGN (csrc/allreduce/two_gpu.cuh,
docs/allreduce.md): a model, not the kernel, since the kernel has not run on two GPUs.

Two ranks, each running the same sequence of calls of changing sizes on one stream (a
rank's call k+1 starts only when all its blocks finished call k). Each block of a call, in
the kernel's order: write its elements (grid-stride: element i belongs to block i mod grid)
into staging half e mod 2 of its own buffer, e being its call count; raise the peer's flag
to e; wait until its own flag reaches e; read the peer's staging of its elements. Every
interleaving of the four blocks' steps is explored; the check: every read sees exactly the
peer's data of the same call, and no interleaving gets stuck.

Each design shortcut the kernel avoids (one staging half, an equality wait, raising the
flag before writing; contiguous chunks sized by the call without a fixed grid or without
stream order) must break the model, showing the checks can fail. Two properties the
kernel has are shown to be each sufficient on their own: the grid-stride mapping (every
element always on the same pair of blocks), and a fixed grid with stream order.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

STATES: dict = {}  # design -> states explored (a model that explores nothing proves nothing)


@dataclass(frozen=True)
class Design:
    halves: int = 2  # staging halves chosen by call-count parity
    fixed_grid: bool = True  # every block takes part in every call
    wait_reached: bool = True  # wait until flag >= e (False: flag == e)
    flag_after_write: bool = True
    stream_order: bool = True  # a rank's call k+1 starts after all its blocks ended call k
    chunked: bool = False  # block b takes a contiguous n/grid chunk (not grid-stride)
    blocks: int = 3
    sizes: tuple[int, ...] = (5, 1, 3, 6, 2, 4)  # elements per call, both ranks alike


def blocks_of(design: Design, n: int) -> list[int]:
    return list(range(design.blocks)) if design.fixed_grid else list(range(min(design.blocks, n)))


def elements(design: Design, n: int, members: list[int], b: int) -> list[int]:
    """The elements block b handles in a call of n elements run by blocks `members`."""
    grid, j = len(members), members.index(b)
    if design.chunked:
        return [i for i in range(n) if i * grid // n == j]
    return [i for i in range(n) if i % grid == j]  # the kernel's grid-stride loop


def explore(design: Design) -> list[str]:
    """Problems found over every interleaving (empty: the design holds)."""
    calls = len(design.sizes)
    members = [blocks_of(design, n) for n in design.sizes]
    # per (rank, block): (call index, phase); phases: 0 write, 1 signal, 2 wait, 3 read;
    # call index == calls: finished
    start = (
        tuple((0, 0) for _ in range(2 * design.blocks)),  # pc
        tuple(0 for _ in range(2 * design.blocks)),  # call counts (epochs)
        tuple(0 for _ in range(2 * design.blocks)),  # flags (written by the peer)
        tuple(-1 for _ in range(2 * design.halves * max(design.sizes))),  # staging: writer's call
    )
    problems: list[str] = []
    seen = set()
    stack = [start]

    def idx(r: int, b: int) -> int:
        return r * design.blocks + b

    def stage(r: int, h: int, i: int) -> int:
        return (r * design.halves + h) * max(design.sizes) + i

    def next_call(k: int, b: int) -> int:
        while k < calls and b not in members[k]:
            k += 1
        return k

    while stack and len(problems) < 5:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        pc, ep, fl, st = state
        moves = []
        for r in range(2):
            for b in range(design.blocks):
                k, ph = pc[idx(r, b)]
                k = next_call(k, b)
                if k >= calls:
                    continue
                if ph == 0 and design.stream_order and not all(
                    (pc[idx(r, o)][1] == 0 and next_call(pc[idx(r, o)][0], o) >= k)
                    or (pc[idx(r, o)][1] > 0 and pc[idx(r, o)][0] >= k)
                    for o in range(design.blocks) if o != b
                ):
                    continue  # an earlier call of this rank is still running
                e = ep[idx(r, b)] + (1 if ph == 0 else 0)
                h = e % design.halves
                mine = elements(design, design.sizes[k], members[k], b)
                pcl, epl, fll, stl = list(pc), list(ep), list(fl), list(st)
                order = (0, 1) if design.flag_after_write else (1, 0)
                step = order[ph] if ph < 2 else ph
                if step == 0:  # write own staging
                    for i in mine:
                        stl[stage(r, h, i)] = k
                    if ph == 0:
                        epl[idx(r, b)] = e
                elif step == 1:  # raise the peer's flag
                    if ph == 0:
                        epl[idx(r, b)] = e
                    fll[idx(1 - r, b)] = ep[idx(r, b)] + (1 if ph == 0 else 0)
                elif step == 2:  # wait
                    f = fl[idx(r, b)]
                    if not (f >= e if design.wait_reached else f == e):
                        continue
                else:  # read the peer's staging
                    for i in mine:
                        got = st[stage(1 - r, h, i)]
                        if got != k:
                            problems.append(f"rank {r} block {b} call {k} read element {i} "
                                            f"of the peer's call {got}")
                pcl[idx(r, b)] = (k + 1, 0) if ph == 3 else (k, ph + 1)
                moves.append((tuple(pcl), tuple(epl), tuple(fll), tuple(stl)))
        blocks = design.blocks
        if not moves and any(next_call(k, i % blocks) < calls for i, (k, _) in enumerate(pc)):
            problems.append(f"stuck: {pc}")
        stack.extend(moves)
    STATES[design] = len(seen)
    return problems


def test_the_design_holds_on_every_interleaving() -> None:
    assert explore(Design()) == []
    assert STATES[Design()] > 10_000


@pytest.mark.parametrize("design", [
    Design(halves=1),
    Design(wait_reached=False),
    Design(flag_after_write=False),
    Design(chunked=True, stream_order=False),
    Design(chunked=True, fixed_grid=False),
], ids=["one-half", "equality-wait", "flag-before-write", "chunks-without-stream-order",
        "chunks-with-a-grid-by-size"])
def test_each_shortcut_breaks_it(design: Design) -> None:
    assert explore(design) != []


@pytest.mark.parametrize("design", [
    Design(fixed_grid=False),
    # without stream order the interleavings multiply: the smaller model of two blocks
    Design(stream_order=False, blocks=2, sizes=(4, 1, 3, 4, 2)),
    Design(fixed_grid=False, stream_order=False, blocks=2, sizes=(4, 1, 3, 4, 2)),
], ids=["grid-by-size", "no-stream-order", "both"])
def test_what_the_safety_does_not_rest_on(design: Design) -> None:
    """Each element always travels between the same pair of blocks (grid-stride over a
    grid that only grows to its cap), so the block pairs are independent channels: neither
    the fixed grid nor the order of a rank's kernels is what makes the design safe (the
    kernel keeps both anyway). They are the second argument, which would carry a mapping
    that moves elements between blocks (contiguous chunks sized by the call)."""
    assert explore(design) == []
    assert explore(Design(chunked=True)) == []
