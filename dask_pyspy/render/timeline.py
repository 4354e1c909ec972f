"""The timeline chart of reports and the dashboard page: stacked areas of the busiest
series (task prefixes, activities) over time, per process kind, wall and CPU, and
under them each process's resident memory.

Drawn here as SVG geometry (the template writes the markup, escaping every name), so
the report stays one file with no chart library. Heights are seconds per second of the
step: how many threads were busy on average, so a 10-minute and a 24-hour window read
alike.
"""

from __future__ import annotations

import datetime
import math
import statistics
from typing import Any

from dask_pyspy.memory import OUTSIDE
from dask_pyspy.render.pages import when

TOP_SERIES = 10  # per kind; the rest sum into "other"
OTHER = "other"
# Tableau's 10 categorical colours, then grey for "other": inferno's "hot" flame graph
# palette gives every name a warm shade, too alike to tell stacked series apart.
PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
)  # fmt: skip
OTHER_COLOUR = "#d9d9d9"
WIDTH, HEIGHT = 1000, 150  # the plot area, in the SVG's own units
LEFT, RIGHT, BOTTOM, TOP = 50, 40, 18, 10  # room for the value axis, the last time label, the time axis, the top
KINDS = ("worker", "scheduler")  # the order charts are shown in
WEIGHTS = {"wall": "threads busy (wall s per s)", "cpu": "cores used (CPU s per s)"}
# Time axis label intervals: the first leaving at most MAX_TICKS labels.
TICK_INTERVALS = (
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800,
)  # fmt: skip
MAX_TICKS = 10
MOST_LINES = 8  # processes of a kind drawn a memory line each; more as min, median and max
MOST_HELD = 8  # task prefixes stacked under resident memory; the rest as "other"
SPREAD = (("most", "#e15759", max), ("median", "#4e79a7", statistics.median), ("least", "#59a14f", min))
BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))
ARROW_LEAST = 2**20  # arrow's pool is drawn where it held this much at some step
# Event-loop stalls: a row per process, the most stalled; past that, one row for the rest.
STALL_ROWS = 8
STALL_ROW = 24  # the row's height, in the SVG's units: the process's name, then its marks
STALL_NAME = 11
STALL_LABEL = 16  # the strip's own label, above its rows
STALL_COLOUR = "#c0392b"
# Marks closer than this (in the plot's 1000 units) merge into one, so a row holds at most
# about a thousand however many stalls a day had; a short stall still shows this wide.
MERGE_GAP = 1.0
MIN_MARK = 1.5
Records = list[list[float]]  # [start (Unix s), duration (s)] per stall, oldest first


def _top(series: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The kind's largest series (the timeline lists them largest first), each with its colour."""
    mine = [s for s in series if s["kind"] == kind][:TOP_SERIES]
    return [{**s, "colour": PALETTE[i % len(PALETTE)]} for i, s in enumerate(mine)]


def _other(top: list[dict[str, Any]], totals: dict[str, Any], weight: str) -> list[float]:
    """What the kind's totals hold beyond its top series, per step."""
    shown = [sum(s[weight][i] for s in top) for i in range(len(totals[weight]))]
    return [max(total - part, 0.0) for total, part in zip(totals[weight], shown)]


def _nice(top: float) -> float:
    """A round axis maximum at or above `top`: 1, 2 or 5 times a power of ten."""
    if top <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(top))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= top)


def _path(bottom: list[float], top: list[float], scale: float) -> str:
    """A stacked layer between `bottom` and `top` (per step), as steps: each step is flat."""
    width = WIDTH / len(top)

    def y(v: float) -> str:
        return f"{TOP + HEIGHT - v * scale:.1f}"

    ahead = " ".join(f"H{LEFT + i * width:.1f} V{y(v)} H{LEFT + (i + 1) * width:.1f}" for i, v in enumerate(top))
    back = " ".join(
        f"H{LEFT + (i + 1) * width:.1f} V{y(v)} H{LEFT + i * width:.1f}" for i, v in reversed(list(enumerate(bottom)))
    )
    return f"M{LEFT:.1f} {y(bottom[0])} {ahead} {back} Z"


def _local(t: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(t)


def _time_ticks(start: float, stop: float) -> list[dict[str, Any]]:
    """Labels at round local times: seconds shown only for intervals under a minute,
    the date at midnight and on the first label of a window over a day."""
    span = max(stop - start, 1.0)
    interval = next((t for t in TICK_INTERVALS if span / t <= MAX_TICKS), TICK_INTERVALS[-1])
    # Round in local time, where the labels are: 15:00, not 15:00 UTC shown as 15:30.
    shift = (_local(start).astimezone().utcoffset() or datetime.timedelta()).total_seconds()
    first = math.ceil((start + shift) / interval) * interval - shift
    ticks: list[dict[str, Any]] = []
    t = first
    while t <= stop:
        when = _local(t)
        clock = "%H:%M:%S" if interval < 60 else "%H:%M"
        dated = (when.hour, when.minute, when.second) == (0, 0, 0) or (not ticks and span > 86400)
        ticks.append(
            {"x": LEFT + WIDTH * (t - start) / span, "label": when.strftime(("%m-%d " if dated else "") + clock)}
        )
        t += interval
    return ticks


def _value_ticks(top: float) -> list[dict[str, Any]]:
    return [{"y": TOP + HEIGHT - HEIGHT * f, "label": f"{top * f:g}"} for f in (0.0, 0.5, 1.0)]


def _chart(timeline: dict[str, Any], kind: str, weight: str, top: list[dict[str, Any]], ymax: float) -> dict[str, Any]:
    """One stacked chart of a kind's `weight` (wall or cpu), in threads on a shared scale."""
    step = timeline["step"]
    totals = timeline["kinds"][kind]
    layers = [(s["name"], s["group"], s["colour"], s[weight]) for s in top]
    layers.append((OTHER, "other", OTHER_COLOUR, _other(top, totals, weight)))
    scale = HEIGHT / ymax
    bottom = [0.0] * timeline["steps"]
    drawn = []
    for name, group, colour, seconds in layers:
        rate = [b + v / step for b, v in zip(bottom, seconds)]
        drawn.append(
            {
                "name": name,
                "group": group,
                "colour": colour,
                "seconds": sum(seconds),
                "per_step": ",".join(f"{v:.6g}" for v in seconds),
                "path": _path(bottom, rate, scale),
            }
        )
        bottom = rate
    return {"weight": weight, "label": WEIGHTS[weight], "layers": drawn, "ticks": _value_ticks(ymax)}


def _steps_line(values: list[float | None], scale: float) -> str:
    """A line through `values` (per step), flat across each step, broken where None."""
    width = WIDTH / len(values)
    parts, drawing = [], False
    for i, v in enumerate(values):
        if v is None:
            drawing = False
            continue
        y = f"{TOP + HEIGHT - v * scale:.1f}"
        parts.append(f"{'V' if drawing else f'M{LEFT + i * width:.1f}'} {y} H{LEFT + (i + 1) * width:.1f}")
        drawing = True
    return " ".join(parts)


def _memory_lines(processes: list[dict[str, Any]], steps: int) -> list[tuple[str, str, list[float | None]]]:
    """A line per process, or the most, median and least across them per step when many."""
    if len(processes) <= MOST_LINES:
        return [(p["name"], PALETTE[i % len(PALETTE)], p["rss"]) for i, p in enumerate(processes)]
    seen = [[p["rss"][i] for p in processes if p["rss"][i] is not None] for i in range(steps)]
    return [(name, colour, [f(v) if v else None for v in seen]) for name, colour, f in SPREAD]


def _held(processes: list[dict[str, Any]], steps: int, colours: dict[str, str]) -> list[tuple[str, str, list[float]]]:
    """Bytes held by task prefix, summed over the processes per step, largest peak
    first: the MOST_HELD largest, the rest as "other"; a prefix drawn in the CPU charts
    keeps its colour there."""
    summed: dict[str, list[float]] = {}
    for p in processes:
        for row in p.get("in_use", ()):
            name = row["prefix"] or OUTSIDE
            into = summed.setdefault(name, [0.0] * steps)
            for i, v in enumerate(row["bytes"]):
                into[i] += v or 0.0
    ranked = sorted(summed.items(), key=lambda kv: -max(kv[1]))
    shown, rest = ranked[:MOST_HELD], ranked[MOST_HELD:]
    if rest:
        shown.append((OTHER, [sum(values) for values in zip(*(v for _, v in rest))]))
    spare = iter(c for c in PALETTE if c not in colours.values())
    return [
        (name, OTHER_COLOUR if name == OTHER else colours.get(name) or next(spare, OTHER_COLOUR), v)
        for name, v in shown
    ]


def _arrow(processes: list[dict[str, Any]], steps: int) -> list[float | None] | None:
    """What arrow's pool held, summed over the processes per step; None where none noted
    it, or it never held ARROW_LEAST (pyarrow imported, hardly used)."""
    noted = [p["arrow"] for p in processes if p.get("arrow")]
    seen = [[a[i] for a in noted if a[i] is not None] for i in range(steps)]
    summed = [sum(v) if v else None for v in seen]
    return summed if max((v for v in summed if v is not None), default=0.0) >= ARROW_LEAST else None


def _memory(timeline: dict[str, Any], kind: str, colours: dict[str, str]) -> dict[str, Any] | None:
    """The kind's resident memory over time, the bytes task prefixes held stacked under
    it where tracked, and arrow's pool where noted; None where its processes kept none."""
    mine = [p for p in timeline.get("processes", []) if p["kind"] == kind and any(v is not None for v in p["rss"])]
    if not mine:
        return None
    steps = timeline["steps"]
    lines, held, arrow = _memory_lines(mine, steps), _held(mine, steps, colours), _arrow(mine, steps)
    stacked = [sum(values[i] for _, _, values in held) for i in range(steps)]
    top = max([v for _, _, values in lines for v in values if v is not None] + stacked + [v for v in arrow or () if v])
    unit, size = next((u, s) for u, s in BYTE_UNITS if top >= s or s == 1)
    ymax = _nice(top / size)
    drawn = [
        {
            "name": name,
            "colour": colour,
            "path": _steps_line(values, HEIGHT / ymax / size),
            "peak": f"{max(v for v in values if v is not None) / size:.3g} {unit}",
        }
        for name, colour, values in lines
    ]
    areas, bottom = [], [0.0] * steps
    for name, colour, values in held:
        above = [b + v / size for b, v in zip(bottom, values)]
        areas.append(
            {
                "name": name,
                "colour": colour,
                "path": _path(bottom, above, HEIGHT / ymax),
                "peak": f"{max(values) / size:.3g} {unit}",
            }
        )
        bottom = above
    spread = len(mine) > MOST_LINES
    label = f"resident memory ({unit}){f': across {len(mine)} processes' if spread else ''}"
    if areas:
        label += "; bytes held by task prefix, stacked"
    pool = arrow and {
        "path": _steps_line(arrow, HEIGHT / ymax / size),
        "peak": f"{max(v for v in arrow if v is not None) / size:.3g} {unit}",
    }
    return {"label": label, "lines": drawn, "held": areas, "arrow": pool, "ticks": _value_ticks(ymax)}


def _clip(records: Records, start: float, stop: float) -> Records:
    """The stalls overlapping the chart, oldest first."""
    return sorted([s, d] for s, d in records if s <= stop and s + d >= start)


def _mark(first: list[float], start: float, scale: float) -> dict[str, Any]:
    x = LEFT + max(first[0] - start, 0.0) * scale
    end = LEFT + (first[0] + first[1] - start) * scale
    return {"x": x, "end": max(end, x + MIN_MARK), "stalls": [first]}


def _merged(records: Records, start: float, stop: float) -> list[dict[str, Any]]:
    """The row's marks: each stall from its start to its end, those less than MERGE_GAP
    apart drawn as one, a mark's opacity the share of its width stalled."""
    scale = WIDTH / max(stop - start, 1e-9)
    marks: list[dict[str, Any]] = []
    for record in _clip(records, start, stop):
        mark = _mark(record, start, scale)
        if marks and mark["x"] <= marks[-1]["end"] + MERGE_GAP:
            marks[-1]["end"] = max(marks[-1]["end"], mark["end"])
            marks[-1]["stalls"].append(record)
        else:
            marks.append(mark)
    right = LEFT + WIDTH
    return [_mark_drawn(m, min(m["end"], right) - m["x"], scale) for m in marks]


def _mark_drawn(mark: dict[str, Any], width: float, scale: float) -> dict[str, Any]:
    stalls = mark["stalls"]
    seconds = sum(d for _, d in stalls)
    longest = max(stalls, key=lambda r: r[1])
    if len(stalls) == 1:
        title = f"stall of {longest[1]:.2f} s at {_clock(longest[0])}"
    else:
        title = (
            f"{len(stalls)} stalls, {seconds:.2f} s in all, from {_clock(stalls[0][0])}; "
            f"the longest {longest[1]:.2f} s at {_clock(longest[0])}"
        )
    return {
        "x": f"{mark['x']:.1f}",
        "width": f"{max(width, MIN_MARK):.1f}",
        "count": len(stalls),
        "start": longest[0],
        "opacity": f"{max(min(seconds * scale / max(width, MIN_MARK), 1.0), 0.4):.2f}",
        "title": title,
    }


def _clock(t: float) -> str:
    return _local(t).strftime("%H:%M:%S.%f")[:-3]


def _stall_rows(mine: list[tuple[str, Records]]) -> list[tuple[str, Records]]:
    """The kind's stalled processes, the most stalled first; the rest in one row past STALL_ROWS."""
    mine = sorted(mine, key=lambda p: -sum(d for _, d in p[1]))
    if len(mine) <= STALL_ROWS:
        return mine
    rest = mine[STALL_ROWS - 1 :]
    merged = [r for _, records in rest for r in records]
    return [*mine[: STALL_ROWS - 1], (f"{len(rest)} other processes", merged)]


def _stalls(stalls: dict[str, Records], kind: str, start: float, stop: float) -> dict[str, Any] | None:
    """The kind's stall strip: a row of marks per process; None where none stalled."""
    mine = [(name, _clip(r, start, stop)) for name, r in stalls.items() if _kind(name) == kind]
    mine = [(name, r) for name, r in mine if r]
    if not mine:
        return None
    rows = [
        {"name": name, "y": TOP + STALL_LABEL + i * STALL_ROW, "marks": _merged(records, start, stop)}
        for i, (name, records) in enumerate(_stall_rows(mine))
    ]
    count = sum(len(r) for _, r in mine)
    seconds = sum(d for _, r in mine for _, d in r)
    bottom = TOP + STALL_LABEL + len(rows) * STALL_ROW
    return {
        "label": f"event-loop stalls: {count:,}, {seconds:.1f} s in all",
        "rows": rows,
        "row": STALL_ROW,
        "name": STALL_NAME,
        "colour": STALL_COLOUR,
        "bottom": bottom,
        "height": bottom + BOTTOM,
    }


def _kind(process: str) -> str:
    """The kind a process is drawn under, as `timeline()` sorts them."""
    return "scheduler" if process.startswith("scheduler") else "worker"


def charts(timeline: dict[str, Any], stalls: dict[str, Records] | None = None) -> dict[str, Any]:
    """The report's timeline, from a profile's `timeline()`: per process kind, a wall and
    a CPU chart with a shared legend, its stalls (`stalls`: each process's records by
    name) and its resident memory."""
    start, step, steps = timeline["start"], timeline["step"], timeline["steps"]
    stop = start + step * steps
    kinds = []
    for kind in (k for k in KINDS if k in timeline["kinds"]):
        totals = timeline["kinds"][kind]
        if not any(totals["wall"]):
            continue
        top = _top(timeline["series"], kind)
        ymax = _nice(max(totals["wall"]) / step)
        wall, cpu = (_chart(timeline, kind, weight, top, ymax) for weight in WEIGHTS)
        legend = [
            {"name": w["name"], "colour": w["colour"], "wall": w["seconds"], "cpu": c["seconds"]}
            for w, c in zip(wall["layers"], cpu["layers"])
        ]
        kinds.append(
            {
                "kind": kind,
                "processes": totals["processes"],
                "charts": [wall, cpu],
                "legend": legend,
                "memory": _memory(timeline, kind, {s["name"]: s["colour"] for s in top}),
                "stalls": _stalls(stalls or {}, kind, start, stop),
            }
        )
    return {
        "start": start,
        "step": step,
        "steps": steps,
        "from": when(start),
        "to": when(stop),
        "kinds": kinds,
        "times": _time_ticks(start, stop),
        "top": TOP_SERIES,
        "size": {
            "width": LEFT + WIDTH + RIGHT,
            "height": TOP + HEIGHT + BOTTOM,
            "left": LEFT,
            "plot": WIDTH,
            "top": TOP,
            "bottom": TOP + HEIGHT,
        },
    }
