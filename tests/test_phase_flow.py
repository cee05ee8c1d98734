"""The calls between files on one module-mode phase change, traced (issue 21): calls go down, few
hops between owners, and docs/design.md's list of them stays true.

The traced change evicts a group that holds an edit (written back: detection on) and loads another,
on the CPU.  docs/design.md, "The flow of a phase change", lists its crossings in order between the
markers this file reads; a change to the path that adds, removes or reorders one fails here until
the doc says so.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from residency import Scheduler

from _flow import import_closure, trace
from _interrupts import tiny_dit

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"
#: The most crossings between files one phase change may make, each one owner asked once for one
#: step: the turns three times (join, grant, leave: the holds, with the order of turns and the
#: wait log in the same file), the placement once, the group three times (evict, what changed on
#: the host, load), the log once; the group its tensors twice per direction (what changed, then
#: re-point), its storage once per direction and once for the load's completion, its digests
#: once per direction.  Parts apart and streams only when a group has them.
MOST_CROSSINGS = 17


def _phase_change() -> tuple[Scheduler, object]:
    torch.manual_seed(0)
    scheduler = Scheduler("cpu")
    edited, other = nn.Linear(64, 64), nn.Linear(64, 64)
    scheduler.add("edited", edited)
    scheduler.add("other", other)
    for _ in range(2):  # warm: both buffers allocated, every view made
        for name in ("edited", "other"):
            with scheduler.resident(name):
                pass
    with scheduler.resident("edited"), torch.no_grad():
        edited.weight.data[0, 0] += 1.0  # a bytes-only edit: only the digests see it

    def change() -> None:
        with scheduler.resident("other"):
            pass

    return scheduler, change


def _documented(section: str) -> list[str]:
    text = DESIGN.read_text()
    match = re.search(rf"<!-- flow: {section} -->\n```\n(.*?)```", text, re.S)
    assert match, f"docs/design.md has no list marked <!-- flow: {section} -->"
    return [line.split("#")[0].strip() for line in match.group(1).splitlines()
            if line.split("#")[0].strip()]


def test_a_phase_change_calls_only_downward_in_few_hops():
    scheduler, change = _phase_change()
    flow = trace(change)
    record = scheduler.transitions[-1]
    assert (record.from_group, record.to_group) == ("edited", "other")
    assert record.written_back > 0  # the traced change really wrote the edit back
    assert flow.calls_up(import_closure()) == []
    assert len(flow.crossings) <= MOST_CROSSINGS, "\n".join(flow.listing())


def test_design_md_lists_the_phase_change_as_traced():
    _, change = _phase_change()
    assert trace(change).listing() == _documented("module-mode phase change")


def _streamed_block():
    """A layer-mode group mid-step: block 0 ran, so block 1's copy is under way; calling block
    1 parks it, prefetches block 2, runs, and evicts it (detection on)."""
    scheduler = Scheduler("cpu")
    dit = tiny_dit(0, depth=4)
    scheduler.add("dit", dit, layers=True)
    x = torch.randn(2, 8)
    phase = scheduler.resident("dit")
    phase.__enter__()
    with torch.no_grad():
        dit(x), dit(x)  # warm: both slots allocated, every view made
        hidden = dit.blocks[0](dit.proj_in(x))
    return scheduler, phase, lambda: dit.blocks[1](hidden)


def test_a_streamed_block_calls_only_downward():
    scheduler, phase, call = _streamed_block()
    with torch.no_grad():
        flow = trace(call)
    phase.__exit__(None, None, None)
    kinds = [r.kind for r in scheduler.block_records][-3:]
    assert kinds == ["prefetch", "compute", "evict"], kinds
    assert flow.calls_up(import_closure()) == []
    assert flow.listing() == _documented("streamed block")


def test_the_tracer_counts_a_callback_as_a_call_up():
    """The check above could fail: a call from a file into one it does not import is up."""
    flow = trace(lambda: None)
    holds = ("residency.scheduler.holds", "Holds.move")
    callback = ((holds, ("residency.scheduler.scheduler", "Scheduler.y")),)
    down = ((holds, ("residency.placement.placement", "Placement.x")),)
    closure = import_closure()
    assert type(flow)(calls=(), crossings=callback).calls_up(closure) == list(callback)
    assert type(flow)(calls=(), crossings=down).calls_up(closure) == []
