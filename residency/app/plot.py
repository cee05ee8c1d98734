"""The main job's phase timeline as a picture (``python -m residency --plot timeline.png``).

    write_plot("timeline.png", title="...", records=records, spans=spans, costs=costs)

Two panels.  Above, the run with offloading against its clock: a lane per group, a light bar for
each phase it ran (`PhaseSpan`), a dark bar for each load into it (`TransitionRecord`: its
seconds, labelled with the bytes moved).  Below, each phase change made again after the run
(`ChangeCosts`): its median seconds over the floor's, with the min-max over the repeats as an
error bar; a change whose ratio would say nothing about the copy gets a note in its row instead
(see [Note: when x floor means something] in residency/app/timeline.py).

matplotlib (the ``plot`` extra) is imported when a picture is drawn, not when this module is; the
figure is drawn on its own Agg canvas, never through pyplot, so no global figure or back end is
left behind.  The format follows the file name: .png, .svg or .pdf.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from residency.options.budget import format_nbytes
from residency.core.errors import ResidencyError
from residency.group.records import TransitionRecord

if TYPE_CHECKING:  # annotations only: timeline is a module of the same layer
    from residency.app.timeline import ChangeCosts, PhaseSpan

__all__ = ["PlotError", "require_matplotlib", "write_plot"]

#: Colours: a phase, a load, a ratio, the note of a ratio left out.
_PHASE, _LOAD, _RATIO, _LEFT_OUT = "#b9d3ee", "#1f4e79", "#c0504d", "#7f7f7f"
#: The ratios' axis is logarithmic once their largest is this many times their smallest.
_LOG_FROM = 20


class PlotError(ResidencyError, ImportError):
    """``--plot`` asked for a picture and matplotlib is not installed."""


def require_matplotlib():
    """The `matplotlib` module, or a `PlotError` that says how to install it.

        require_matplotlib()       # before a long run: fail now, not after it
    """
    try:
        import matplotlib
    except ImportError:
        raise PlotError("drawing the timeline (--plot) needs matplotlib, which is not "
                        "installed: pip install -e \".[plot]\"") from None
    return matplotlib


def write_plot(path: str | Path, *, title: str, records: Sequence[TransitionRecord],
               spans: Sequence[PhaseSpan], costs: ChangeCosts) -> Path:
    """Draw the run's timeline and the repeated changes' ratios into `path`; returns it.

        write_plot("t.png", title=run.title, records=run.records, spans=run.spans,
                   costs=run.costs)
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(figure)  # the figure's own canvas: pyplot's state is never touched
    above, below = figure.subplots(2, 1, height_ratios=[3, 2])
    figure.suptitle(title, fontsize=10)
    _draw_run(above, records, spans)
    _draw_ratios(below, costs)
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


def _origin(records: Sequence[TransitionRecord], spans: Sequence[PhaseSpan]) -> float:
    starts = [record.start for record in records] + [span.start for span in spans]
    return min(starts, default=0.0)


def _draw_run(axes, records: Sequence[TransitionRecord], spans: Sequence[PhaseSpan]) -> None:
    """A lane per group: its phases (light) and the loads into it (dark), in ms from the start."""
    origin = _origin(records, spans)
    lanes = list(dict.fromkeys([s.name for s in spans] + [r.to_group for r in records
                                                           if r.to_group is not None]))
    lane = {name: index for index, name in enumerate(lanes)}
    for span in spans:
        axes.barh(lane[span.name], (span.end - span.start) * 1e3,
                  left=(span.start - origin) * 1e3, height=0.6, color=_PHASE)
    for record in records:
        if record.to_group is None:
            continue
        left, width = (record.start - origin) * 1e3, record.seconds * 1e3
        axes.barh(lane[record.to_group], width, left=left, height=0.6, color=_LOAD)
        axes.annotate(format_nbytes(record.nbytes), (left + width, lane[record.to_group] + 0.32),
                      fontsize=7, va="bottom")
    axes.set_yticks(range(len(lanes)), lanes)
    axes.invert_yaxis()
    axes.set_xlabel("ms since the run with offloading started")
    axes.set_title("the run: phases (light) and the loads into them (dark, bytes moved)",
                   fontsize=9)
    axes.grid(axis="x", alpha=0.3)


def _draw_ratios(axes, costs: ChangeCosts) -> None:
    """Each change made again: median x floor, min-max as an error bar; a change whose ratio is
    left out gets a note in its row instead of a point."""
    changes = list(costs.changes)
    for index, change in enumerate(changes):
        if change.comparable:
            ratios = change.times_floor
            low, high = ratios.spread
            axes.errorbar([ratios.median], [index],
                          xerr=[[ratios.median - low], [high - ratios.median]], fmt="o",
                          color=_RATIO, capsize=4)
        else:
            axes.annotate(f"x floor left out: {format_nbytes(change.nbytes)}, floor "
                          f"{change.floor.median * 1e3:.3g} ms (the report's legend says why)",
                          (0.01, index), xycoords=("axes fraction", "data"), va="center",
                          fontsize=8, color=_LEFT_OUT)
    shown = [change.times_floor.spread for change in changes if change.comparable]
    if not shown:
        axes.set_xlim(0.0, 2.0)
    elif max(high for _, high in shown) > _LOG_FROM * min(low for low, _ in shown):
        axes.set_xscale("log")  # ratios of a busy CPU span decades: each one stays readable
    axes.set_yticks(range(len(changes)), [change.change for change in changes], fontsize=8)
    axes.set_ylim(len(changes) - 0.5, -0.5)
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_xlabel(f"x floor: seconds over a plain copy of as many bytes (median of "
                    f"{costs.repeats}, bar: min-max)")
    axes.set_title("each phase change made again after the run", fontsize=9)
    axes.grid(axis="x", alpha=0.3)
