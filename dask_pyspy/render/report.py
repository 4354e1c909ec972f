"""Self-contained HTML reports: summary, flame graphs, task prefixes, the raw profile;
and the scheduler dashboard's page, which is a report with a header.

This module turns a Profile into the figures the templates show (templates/report.html,
dashboard.html, notebook.html); the markup, and escaping every name from user code, is
the templates'. Flame graphs are rendered in Rust (inferno).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from dask_pyspy.render import timeline
from dask_pyspy.render.pages import render, when

if TYPE_CHECKING:  # the model imports this module to render itself
    from dask_pyspy.model import Profile


def _lost_reads(stats: dict[str, Any]) -> tuple[int, int]:
    """Thread-reads left out (stacks that kept changing through every re-read, or a whole
    failed tick), and reads."""
    reader = stats.get("reader_stats") or {}
    # Profiles saved before re-reads were counted dropped reads as "torn_reads".
    lost = reader.get("lost_reads", reader.get("torn_reads", 0)) + stats["failed_ticks"]
    return lost, reader.get("thread_reads") or stats["ticks"]


def _lost(lost: int, reads: int, title: str = "") -> dict[str, str]:
    """Reads left out as a rate, with `title` (the last whole-tick error) as its tooltip."""
    return {"text": f"{100 * lost / max(reads, 1):.1f}%", "title": title}


def _errors(stats: dict[str, Any]) -> str:
    """Real failures only: a panic, or the fast reader not used where it was wanted."""
    fallback = (stats.get("reader_stats") or {}).get("fallback_reason")
    return "; ".join(e for e in (stats.get("panic"), fallback and f"fast reader not used: {fallback}") if e)


def _rate_note(stats: dict[str, Any]) -> str:
    """Why the achieved rate is below the requested one, and what to do about it."""
    requested, achieved = stats["requested_rate"], stats["achieved_rate"]
    if achieved >= 0.9 * requested:
        return ""
    if stats["throttled_ticks"]:
        budget = 100 * stats["config"]["cpu_budget"]
        return (
            f"held to the CPU budget ({budget:g}% of a core) on {stats['throttled_ticks']:,} of "
            f"{stats['ticks']:,} ticks: raise it with PySpyPlugin(cpu_budget=...) or "
            f"dask config pyspy.cpu-budget, or ask for a lower rate"
        )
    return "the sampling thread fell behind its schedule (a busy machine)"


def _overview(profile: Profile, summary: dict[str, Any]) -> list[Any]:
    window = profile.metadata.get("window") or [summary["first"], summary["last"]]
    duration = (window[1] - window[0]) if None not in window else 0.0
    return [
        f"{when(window[0])} - {when(window[1])}",
        float(duration),
        len(profile.processes),
        sum(p["threads"] for p in summary["processes"]),
        summary["samples"],
        float(summary["seconds"]),
    ]


MAX_PROCESS_ROWS = 20  # per-process tables show the busiest; one line sums the rest
Pair = tuple[dict[str, Any], dict[str, Any]]  # a process and its totals in the summary


def _busiest(summary: dict[str, Any]) -> list[int]:
    """Indices of the summary's processes, the most sampled seconds first."""
    return sorted(range(len(summary["processes"])), key=lambda i: -summary["processes"][i]["seconds"])


def _table_processes(profile: Profile, summary: dict[str, Any]) -> tuple[list[Pair], list[Pair]]:
    """The processes a table lists, with their totals, and the rest: all, in the profile's
    order, up to MAX_PROCESS_ROWS; else the busiest MAX_PROCESS_ROWS, busiest first."""
    pairs = list(zip(profile.processes, summary["processes"]))
    if len(pairs) <= MAX_PROCESS_ROWS:
        return pairs, []
    order = _busiest(summary)
    shown = set(order[:MAX_PROCESS_ROWS])
    return [pairs[i] for i in order[:MAX_PROCESS_ROWS]], [p for i, p in enumerate(pairs) if i not in shown]


def _more(rest: list[Pair]) -> str:
    return f"+ {len(rest):,} more processes"


def _processes(profile: Profile, summary: dict[str, Any]) -> Iterator[list[Any]]:
    """A row per process: its sampler's rate, cost, losses and errors; then the rest
    summed, if there are more than MAX_PROCESS_ROWS."""
    shown, rest = _table_processes(profile, summary)
    for proc, totals in shown:
        s = proc["stats"]
        errors = _errors(s)
        yield [
            proc["name"],
            proc["pid"],
            s.get("reader") or "-",
            totals["threads"],
            totals["samples"],
            float(s["requested_rate"]),
            float(s["achieved_rate"]),
            _rate_note(s),
            float(100 * s["cpu_fraction"]),
            _lost(*_lost_reads(s), s.get("last_error") or ""),
            s["store"]["samples_evicted"],
            {"text": errors, "class": "warn"} if errors else "",
        ]
    if rest:
        yield _processes_rest(rest)


def _processes_rest(rest: list[Pair]) -> list[Any]:
    """The rest's sums; rates and costs per process do not sum, so they are left out."""
    stats = [p["stats"] for p, _ in rest]
    lost, reads = (sum(column) for column in zip(*map(_lost_reads, stats)))
    failing = sum(bool(_errors(s)) for s in stats)
    return [
        _more(rest),
        "",
        "",
        sum(t["threads"] for _, t in rest),
        sum(t["samples"] for _, t in rest),
        "",
        "",
        "",
        "",
        _lost(lost, reads),
        sum(s["store"]["samples_evicted"] for s in stats),
        {"text": f"{failing:,} with errors", "class": "warn"} if failing else "",
    ]


# Thread states, as the summary names them, and their column headings.
STATES = {
    "gil": "on CPU, GIL",
    "no_gil": "on CPU, no GIL",
    "cpu_wait": "waiting for a CPU",
    "gil_wait": "waiting for the GIL",
    "native": "native threads",
    "blocked": "blocked",
}
# Free-threaded processes run Python without a GIL: running Python or C is one state
# there, and nothing waits for a GIL.
FREE_THREADED_STATES = {"on_cpu": "on CPU", **{k: STATES[k] for k in ("cpu_wait", "native", "blocked")}}
SUMMED = {"on_cpu": ("gil", "no_gil")}


def _free_threaded(profile: Profile) -> bool:
    """Every process ran on a free-threaded build with its GIL off."""
    readers = [p["stats"].get("reader_stats") or {} for p in profile.processes]
    return bool(readers) and all(r.get("free_threaded") and not r.get("gil_enabled") for r in readers)


def _columns(profile: Profile) -> dict[str, str]:
    return FREE_THREADED_STATES if _free_threaded(profile) else STATES


OVERSUBSCRIBED = 0.2  # a process waiting this share of its time for a CPU is told so,
OVERSUBSCRIBED_SAMPLES = 50  # once it has this many samples


def _split(row: dict[str, Any], columns: dict[str, str]) -> list[Any]:
    """CPU seconds, then the share of wall time in each state of `columns`."""
    wall = row["seconds"] or 1.0
    seconds = [sum(row.get(s, 0.0) for s in SUMMED.get(k, (k,))) for k in columns]
    return [float(row["cpu"]), *(f"{100 * s / wall:.0f}%" for s in seconds)]


def _window_cpu(proc: dict[str, Any], key: str) -> float:
    return float((proc["stats"].get("window_cpu") or {}).get(key, 0.0))


def _states_row(name: str, pairs: list[Pair], columns: dict[str, str]) -> list[Any]:
    """The time by thread state of `pairs` together, and the CPU of their native threads."""
    totals = {k: sum(t.get(k, 0.0) for _, t in pairs) for k in ("seconds", "cpu", *STATES)}
    return [
        name,
        float(totals["seconds"]),
        *_split(totals, columns),
        sum(_window_cpu(p, "process_cpu_s") for p, _ in pairs),
        sum(_window_cpu(p, "native_cpu_s") for p, _ in pairs),
    ]


def _states(profile: Profile, summary: dict[str, Any], columns: dict[str, str]) -> Iterator[list[Any]]:
    """Each process's time by thread state, and the CPU of its native threads; then
    the rest together, if there are more than MAX_PROCESS_ROWS."""
    shown, rest = _table_processes(profile, summary)
    for pair in shown:
        yield _states_row(pair[0]["name"], [pair], columns)
    if rest:
        yield _states_row(_more(rest), rest, columns)


def _oversubscribed(profile: Profile, summary: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Each host whose processes waited for a CPU more than OVERSUBSCRIBED of the time."""
    hosts: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for proc, totals in zip(profile.processes, summary["processes"]):
        hosts.setdefault(proc.get("host") or "?", []).append((proc, totals))
    for host, procs in sorted(hosts.items()):
        waiting = [
            p["name"]
            for p, t in procs
            if t["samples"] >= OVERSUBSCRIBED_SAMPLES and t.get("cpu_wait", 0.0) > OVERSUBSCRIBED * t["seconds"]
        ]
        if waiting:
            yield {
                "host": host,
                "waiting": waiting,
                "percent": f"{100 * OVERSUBSCRIBED:.0f}",
                "processes": len(procs),
                "threads": sum(t["task_threads"] for _, t in procs),
                "cores": max(p["stats"].get("cores") or 0 for p, _ in procs),
            }


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
            *_split(p, columns),
            int(count),
            float(secs),
            _top(p["top"]),
        ]
    untagged = summary["untagged"]
    yield [
        "(no task)",
        float(untagged["seconds"]),
        float(100 * untagged["seconds"] / total),
        *_split(untagged, columns),
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


def _activity_graphs(profile: Profile, summary: dict[str, Any]) -> list[dict[str, Any]]:
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


def _lead_by(profile: Profile) -> str:
    """The grouping of the leading graph: task keys or spans if asked for, else task prefixes."""
    return profile.by if profile.by in ("task", "span") else "prefix"


def _graph(svg: str | None, title: str, summary: str) -> dict[str, Any]:
    return {"svg": svg, "title": title, "summary": summary}


def _graphs(profile: Profile, summary: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
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
        "spans": [[name, float(s["seconds"]), *_split(s, columns), _top(s["top"])] for name, s in spans],
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


def _process_graphs(profile: Profile, summary: dict[str, Any]) -> dict[str, Any]:
    """A graph per process, the busiest first, at most MAX_PROCESS_GRAPHS."""
    busiest, processes = _busiest(summary), profile.processes
    names = {i: processes[i]["name"] for i in busiest[:MAX_PROCESS_GRAPHS]}
    svgs = profile.process_flamegraph_svgs({i: f"Process {name}" for i, name in names.items()})
    graphs = [_graph(svgs[i], name, f"Flame graph of {name}, raw stacks") for i, name in names.items()]
    return {"process_graphs": graphs, "more_processes": max(len(busiest) - MAX_PROCESS_GRAPHS, 0)}


AGGREGATE_ABOVE = 200_000  # samples; a report of more reads an aggregated copy: same totals, minutes less


def _for_views(profile: Profile) -> Profile:
    # Collected with aggregate=True, its samples are already at most one per aggregate.
    large = profile.n_samples > AGGREGATE_ABOVE and not profile.metadata.get("aggregate")
    return profile.aggregated(keys=True) if large else profile


def _speedscope(profile: Profile) -> str:
    """The speedscope file to download, in base64; none for an empty profile."""
    return base64.b64encode(profile.to_bytes(compress=True)).decode() if profile.n_samples else ""


def _report(profile: Profile, title: str) -> dict[str, Any]:
    """What the report template shows."""
    raw, profile = profile, _for_views(profile)
    with ThreadPoolExecutor(1) as pool:
        # The slowest part of a large cluster's report, written in Rust without the GIL
        # while the rest is drawn.
        speedscope = pool.submit(_speedscope, profile)
        return {**_figures(raw, profile, title), "speedscope": speedscope.result()}


def _figures(raw: Profile, profile: Profile, title: str) -> dict[str, Any]:
    """What the report template shows but the speedscope file; `profile` is `raw` or
    its aggregated copy."""
    summary = profile.summary()
    columns = _columns(profile)
    return {
        "title": title,
        # From the raw samples: finer than an aggregated copy's 10 s cells.
        "timeline": timeline.charts(raw),
        "summary": summary,
        # Whether the speedscope file's samples are aggregated.
        "aggregated": profile is not raw or bool(raw.metadata.get("aggregate")),
        "overview": _overview(profile, summary),
        "processes": list(_processes(profile, summary)),
        "split_header": ["CPU s", *columns.values()],
        "free_threaded": "gil" not in columns,
        "states": list(_states(profile, summary, columns)),
        "oversubscribed": list(_oversubscribed(profile, summary)),
        "missing": [[k, v] for k, v in (profile.metadata.get("missing") or {}).items()],
        "prefixes": list(_prefixes(summary, profile.metadata.get("tasks") or {}, columns)),
        **_graphs(profile, summary, columns),
        "functions": [[f["name"], _where(f), float(f["seconds"]), *_split(f, columns)] for f in summary["top"]],
        "everything": ["every sample", float(summary["seconds"]), *_split(summary, columns)],
        "idle_sampled": any(p["stats"]["config"]["idle"] for p in profile.processes),
    }


def _where(function: dict[str, Any]) -> str:
    """A function's file, or a native one's library marked as such."""
    if function.get("is_native"):
        return f"{function['file']} (native)"  # a library, named below site-packages
    return os.path.basename(function["file"])


def render_html(profile: Profile, title: str = "dask-pyspy report") -> str:
    """The whole report as one HTML page that needs no network."""
    return render("report.html", **_report(profile, title))


REFRESH_CHOICES = (0, 5, 30)
WINDOWS = (10, 30, 60, 300, 900)  # seconds the dashboard page links to


def render_dashboard(
    profile: Profile, window: tuple[float, float], last: float | None, stacks: str, refresh: int = 0
) -> str:
    """The scheduler dashboard's page: a window picker, auto-refresh, live stacks, then the
    report; `window` (Unix seconds) is the last `last` seconds, or a chosen range where None."""
    shown = f"last {last:g} s" if last is not None else f"{when(window[0])} to {when(window[1])}"
    return render(
        "dashboard.html",
        **_report(profile, f"dask-pyspy: {shown} of the cluster"),
        shown=f"the last {last:g} seconds" if last is not None else f"{shown} ({window[1] - window[0]:.0f} s)",
        stacks=stacks,
        refresh=refresh,
        refresh_choices=REFRESH_CHOICES,
        windows=WINDOWS,
    )


def render_notebook(profile: Profile) -> str:
    """A compact view for Jupyter: the headline numbers and the whole-cluster flame graph."""
    profile = _for_views(profile)
    summary = profile.summary()
    headline = [
        len(profile.processes),
        summary["samples"],
        float(summary["seconds"]),
        summary["prefixes"][0]["prefix"] if summary["prefixes"] else "-",
    ]
    return render("notebook.html", headline=headline, lead=profile.flamegraph_svg("dask-pyspy", by=_lead_by(profile)))
