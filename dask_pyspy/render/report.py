"""Self-contained HTML reports: summary, flame graphs, task prefixes, the raw profile;
and the scheduler dashboard's page, which is a report with a header.

This module turns a profile into the figures the templates show (templates/report.html,
dashboard.html, notebook.html), the per-process tables in `tables`; the markup, and
escaping every name from user code, is the templates'. Flame graphs are rendered in
Rust (inferno).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from dask_pyspy.render import memory, stalls, tables, timeline
from dask_pyspy.render.findings import Summary, function_file, window
from dask_pyspy.render.pages import render, when


class Drawable(Protocol):
    """What a report reads of a `dask_pyspy.Profile`, named here so that rendering needs
    no import of the model (which imports this module to render itself)."""

    by: str
    weight: str

    @property
    def metadata(self) -> dict[str, Any]: ...

    @property
    def processes(self) -> list[dict[str, Any]]: ...

    @property
    def n_samples(self) -> int: ...

    @property
    def keeps_times(self) -> bool: ...

    def summary(self) -> Summary: ...

    def timeline(self) -> dict[str, Any]: ...

    def flamegraph_svg(
        self,
        title: str,
        *,
        by: str = ...,
        prefix: str | None = ...,
        tasks: bool | None = ...,
        span: list[str] | None = ...,
        activity: str | None = ...,
        stalls: bool = ...,
    ) -> str | None: ...

    def process_flamegraph_svgs(self, titles: dict[int, str]) -> dict[int, str | None]: ...

    def aggregated(self, keys: bool = ...) -> Drawable: ...

    def to_bytes(self, compress: bool = ...) -> bytes: ...


def _overview(profile: Drawable, summary: dict[str, Any]) -> list[Any]:
    start, stop = window(profile.metadata, summary)
    return [
        f"{when(start)} - {when(stop)}",
        float(stop - start) if start is not None and stop is not None else 0.0,
        len(profile.processes),
        sum(p["threads"] for p in summary["processes"]),
        summary["samples"],
        float(summary["seconds"]),
    ]


def _top(functions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"top": functions}


def _prefixes(
    summary: dict[str, Any], tasks: dict[str, dict[str, dict[str, float]]], columns: dict[str, str]
) -> Iterator[list[Any]]:
    """A row per task prefix with its tasks' own wall time, then the time outside tasks."""
    wall: dict[str, list[float]] = {}
    for per_worker in tasks.values():
        for prefix, t in per_worker.items():
            w = wall.setdefault(prefix, [0, 0.0])
            w[0] += t["count"]
            w[1] += t["seconds"]
    total = summary["seconds"] or 1.0
    for p in summary["prefixes"]:
        count, secs = wall.get(p["prefix"], [0, 0.0])
        yield [
            p["prefix"],
            float(p["seconds"]),
            float(100 * p["seconds"] / total),
            *tables.split(p, columns),
            int(count),
            float(secs),
            _top(p["top"]),
        ]
    untagged = summary["untagged"]
    yield [
        "(no task)",
        float(untagged["seconds"]),
        float(100 * untagged["seconds"] / total),
        *tables.split(untagged, columns),
        "",
        "",
        _top(untagged["top"]),
    ]


MAX_ACTIVITY_ROWS = 25  # a table, not a list of every message kind; the rest sum into one row
MAX_ACTIVITY_GRAPHS = 6
ACTIVITY_GRAPH_SHARE = 0.01  # of all sampled time: smaller activities get no graph of their own
NO_CALLS = "\u2014"  # calls are counted for dispatched work, not for a loop's reads or base
ACTIVITY_HEADER = ["activity", "process kind", "sampled s", "CPU s", "GIL share", "calls"]
GIL_SHARE = ACTIVITY_HEADER.index("GIL share")


def _gil_columns(row: list[Any], gil: bool) -> list[Any]:
    """An activity table's row (or header) as shown: without the GIL share where there is no GIL."""
    return row if gil else row[:GIL_SHARE] + row[GIL_SHARE + 1 :]


def _activity_row(a: dict[str, Any]) -> list[Any]:
    """An activity's time, CPU and share of it holding the GIL (how much of the loop was Python)."""
    return [
        a["activity"],
        a["kind"],
        float(a["seconds"]),
        float(a["cpu"]),
        f"{100 * a['gil'] / (a['seconds'] or 1.0):.0f}%",
        a["calls"] if "calls" in a else NO_CALLS,
    ]


def _activities(rows: list[dict[str, Any]], gil: bool) -> list[list[Any]]:
    """The largest activities (the summary lists them largest first), then the rest as one
    row; without the GIL share where there is no GIL."""
    shown, rest = rows[:MAX_ACTIVITY_ROWS], rows[MAX_ACTIVITY_ROWS:]
    table = [_activity_row(a) for a in shown]
    if rest:
        summed = ("seconds", "cpu", "gil", *(("calls",) if all("calls" in a for a in rest) else ()))
        other = {k: sum(a[k] for a in rest) for k in summed}
        table.append(_activity_row({"activity": f"other activities ({len(rest)})", "kind": "", **other}))
    return [_gil_columns(row, gil) for row in table]


def _activity_graphs(profile: Drawable, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Graphs of the busiest activities; "(no task)", with no activity, is in the outside graph."""
    least = ACTIVITY_GRAPH_SHARE * summary["seconds"]
    busiest = [a for a in summary["activities"] if a["kind"] and a["seconds"] >= least][:MAX_ACTIVITY_GRAPHS]
    return [
        _graph(
            profile.flamegraph_svg(f"Activity {a['activity']}", tasks=False, activity=a["activity"]),
            a["activity"],
            f"Flame graph of {a['activity']} ({a['seconds']:.2f} s)",
        )
        for a in busiest
    ]


SCHEDULER_KIND = "scheduler"  # the activities of the scheduler's event loop, and the name its process starts with


def _scheduler(summary: dict[str, Any], gil: bool) -> dict[str, Any] | None:
    """The scheduler's activities, and their share of its process's sampled time; None
    if no sample is in one."""
    rows = [a for a in summary["activities"] if a["kind"] == SCHEDULER_KIND]
    if not rows:
        return None
    busy = sum(a["seconds"] for a in rows)
    own = sum(p["seconds"] for p in summary["processes"] if p["name"].startswith(SCHEDULER_KIND))
    return {
        "activities": _activities(rows, gil),
        "seconds": float(busy),
        "process_seconds": float(own),
        # A profile without the scheduler's process (scheduler=False) has no share to show.
        "share": f"{100 * busy / own:.0f}%" if own else "",
    }


GROUPS = {"task": "task", "prefix": "task prefix", "span": "span"}


def _lead_by(profile: Drawable) -> str:
    """The grouping of the leading graph: task keys or spans if asked for, else task prefixes."""
    return profile.by if profile.by in ("task", "span") else "prefix"


def _graph(svg: str | None, title: str, summary: str) -> dict[str, Any]:
    return {"svg": svg, "title": title, "summary": summary}


def _graphs(profile: Drawable, summary: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    """The whole cluster by task (or prefix), outside tasks and by thread; one graph per
    prefix, per span, per busy activity and per process; the activities' tables."""
    by = _lead_by(profile)
    what = "CPU time" if profile.weight == "cpu" else "time"
    spans = [(" / ".join(s["path"]), s) for s in summary["spans"]]
    gil = "gil" in columns
    return {
        "what": what,
        "group": GROUPS[by],
        "lead": profile.flamegraph_svg(f"Task {what} by {GROUPS[by]}", by=by, tasks=True),
        "outside": profile.flamegraph_svg("Outside tasks", tasks=False),
        "untagged": 100 * summary["untagged"]["seconds"] / (summary["seconds"] or 1.0),
        "activity_header": _gil_columns(ACTIVITY_HEADER, gil),
        "activities": _activities(summary["activities"], gil),
        "activity_graphs": _activity_graphs(profile, summary),
        "scheduler": _scheduler(summary, gil),
        "threads": profile.flamegraph_svg("All processes by thread"),
        "prefix_graphs": [
            _graph(
                profile.flamegraph_svg(f"Task prefix {p['prefix']}", by="prefix", prefix=p["prefix"]),
                p["prefix"],
                f"Flame graph of {p['prefix']} ({p['seconds']:.2f} s)",
            )
            for p in summary["prefixes"]
        ],
        "spans": [[name, float(s["seconds"]), *tables.split(s, columns), _top(s["top"])] for name, s in spans],
        "span_graphs": [
            _graph(
                profile.flamegraph_svg(f"Span {name}", by="prefix", span=s["path"]),
                name,
                f"Flame graph of span {name} ({s['seconds']:.2f} s)",
            )
            for name, s in spans
        ],
        **_process_graphs(profile, summary),
    }


MAX_PROCESS_GRAPHS = 32  # a 1000-worker report stays a page, not a thousand graphs


def _process_graphs(profile: Drawable, summary: dict[str, Any]) -> dict[str, Any]:
    """A graph per process, the busiest first, at most MAX_PROCESS_GRAPHS."""
    busiest, processes = tables.busiest(summary), profile.processes
    names = {i: processes[i]["name"] for i in busiest[:MAX_PROCESS_GRAPHS]}
    svgs = profile.process_flamegraph_svgs({i: f"Process {name}" for i, name in names.items()})
    graphs = [_graph(svgs[i], name, f"Flame graph of {name}, raw stacks") for i, name in names.items()]
    return {"process_graphs": graphs, "more_processes": max(len(busiest) - MAX_PROCESS_GRAPHS, 0)}


AGGREGATE_ABOVE = 200_000  # samples; a report of more reads an aggregated copy: same totals, minutes less


def _for_views(profile: Drawable) -> Drawable:
    # Collected with aggregate=True, its samples are already at most one per aggregate.
    large = profile.n_samples > AGGREGATE_ABOVE and not profile.metadata.get("aggregate")
    return profile.aggregated(keys=True) if large else profile


def _speedscope(profile: Drawable) -> str:
    """The speedscope file to download, in base64; none for an empty profile."""
    return base64.b64encode(profile.to_bytes(compress=True)).decode() if profile.n_samples else ""


def _report(profile: Drawable, title: str, stalled: list[stalls.Stats] | None = None) -> dict[str, Any]:
    """What the report template shows; `stalled`: each process's stalls where they come
    from elsewhere than the profile's processes."""
    raw, profile = profile, _for_views(profile)
    with ThreadPoolExecutor(1) as pool:
        # The slowest part of a large cluster's report, written in Rust without the GIL
        # while the rest is drawn.
        speedscope = pool.submit(_speedscope, profile)
        if stalled is None:
            stalled = stalls.of_profile(raw.processes)
        return {**_figures(raw, profile, title, stalled), "speedscope": speedscope.result()}


def _stall_section(profile: Drawable, stalled: list[stalls.Stats]) -> dict[str, Any] | None:
    if not any(s.get("records") for _, s in stalled):
        return None  # before drawing a graph for nothing
    # By activity: each loop's time under what it was running, a GIL holder's under its task prefix.
    graph = profile.flamegraph_svg("Inside event-loop stalls", by="activity", stalls=True)
    return stalls.section(stalled, graph)


def _figures(raw: Drawable, profile: Drawable, title: str, stalled: list[stalls.Stats]) -> dict[str, Any]:
    """What the report template shows but the speedscope file; `profile` is `raw` or
    its aggregated copy."""
    summary = profile.summary()
    columns = tables.state_columns(profile.processes)
    records = {name: s.get("records") or [] for name, s in stalled}
    return {
        "title": title,
        # From the raw samples: finer than an aggregated copy's 10 s cells.
        "timeline": timeline.charts(raw.timeline(), records) if raw.n_samples and raw.keeps_times else None,
        "stalls": _stall_section(profile, stalled),
        "memory": memory.section(raw.processes),
        "summary": summary,
        "findings": summary.findings,
        # Whether the speedscope file's samples are aggregated.
        "aggregated": profile is not raw or bool(raw.metadata.get("aggregate")),
        "overview": _overview(profile, summary),
        "processes": list(tables.process_rows(profile.processes, summary)),
        "split_header": ["CPU s", *columns.values()],
        "free_threaded": "gil" not in columns,
        "states": list(tables.state_rows(profile.processes, summary, columns)),
        "missing": [[k, v] for k, v in (profile.metadata.get("missing") or {}).items()],
        "prefixes": list(_prefixes(summary, profile.metadata.get("tasks") or {}, columns)),
        **_graphs(profile, summary, columns),
        "functions": [
            [f["name"], function_file(f), float(f["seconds"]), *tables.split(f, columns)] for f in summary["top"]
        ],
        "everything": ["every sample", float(summary["seconds"]), *tables.split(summary, columns)],
        "idle_sampled": any(p["stats"]["config"]["idle"] for p in profile.processes),
    }


def render_html(profile: Drawable, title: str = "dask-pyspy report") -> str:
    """The whole report as one HTML page that needs no network."""
    return render("report.html", **_report(profile, title))


REFRESH_CHOICES = (0, 5, 30)
WINDOWS = (10, 30, 60, 300, 900)  # seconds the dashboard page links to


def render_dashboard(
    profile: Drawable,
    window: tuple[float, float],
    last: float | None,
    stacks: str,
    refresh: int = 0,
    stalled: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The scheduler dashboard's page: a window picker, auto-refresh, live stacks, then the
    report; `window` (Unix seconds) is the last `last` seconds, or a chosen range where None.
    `stalled`: each process's stalls in the window, by name, as the scheduler's `stalls`
    handler gives them (else the profile's own)."""
    shown = f"last {last:g} s" if last is not None else f"{when(window[0])} to {when(window[1])}"
    return render(
        "dashboard.html",
        **_report(
            profile,
            f"dask-pyspy: {shown} of the cluster",
            None if stalled is None else [(name, s) for name, s in stalled.items() if s],
        ),
        shown=f"the last {last:g} seconds" if last is not None else f"{shown} ({window[1] - window[0]:.0f} s)",
        stacks=stacks,
        refresh=refresh,
        refresh_choices=REFRESH_CHOICES,
        windows=WINDOWS,
    )


def render_notebook(profile: Drawable) -> str:
    """A compact view for Jupyter: the findings in words and the whole-cluster flame graph."""
    profile = _for_views(profile)
    lead = profile.flamegraph_svg("dask-pyspy", by=_lead_by(profile))
    return render("notebook.html", findings=profile.summary().findings, lead=lead)
