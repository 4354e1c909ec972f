"""Self-contained HTML reports: summary, flame graphs, task prefixes, the raw profile.

Flame graphs are rendered in Rust (inferno) and each sits in its own iframe, so
their scripts (zoom, search) do not collide. Every name from user code is escaped.
"""

from __future__ import annotations

import base64
import datetime
import os
import re
from html import escape
from typing import Any, Iterator

from dask_pyspy.model import Profile

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; }
td, th { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.warn { color: #a40; }
iframe.flame { width: 100%; border: 1px solid #ddd; }
details { margin: .5em 0; }
button { font-size: 1em; padding: .3em .8em; }
"""

SCRIPT = """
document.querySelectorAll("details").forEach(function (d) {
  d.addEventListener("toggle", function () {
    var f = d.querySelector("iframe[data-src]");
    if (d.open && f && !f.src) f.src = f.dataset.src;
  });
});
var download = document.getElementById("download");
if (download) download.addEventListener("click", function () {
  var raw = atob(document.getElementById("speedscope-data").textContent.trim());
  var bytes = new Uint8Array(raw.length);
  for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  var a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([bytes], {type: "application/gzip"}));
  a.download = "profile.speedscope.json.gz";
  document.body.appendChild(a); a.click(); a.remove();
});
"""


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    """A table; str cells are escaped, float cells right-aligned, `(html,)` tuples inserted as is."""

    def cell(v: Any) -> str:
        if isinstance(v, tuple):
            return f"<td>{v[0]}</td>"
        if isinstance(v, float):
            return f'<td class="n">{v:,.3f}</td>'
        if isinstance(v, int):
            return f'<td class="n">{v:,}</td>'
        return f"<td>{escape(str(v))}</td>"

    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


# Graphs are icicles (roots on top); deeper stacks scroll inside their frame.
MAX_FRAME_HEIGHT = 640


def flame_iframe(svg: str | None, title: str, deferred: bool = False) -> str:
    """The SVG in its own frame; `deferred` frames load when their <details> opens (a
    flame graph laid out while hidden has no width to lay out in)."""
    if svg is None:
        return "<p>No samples.</p>"
    height = re.search(r'<svg[^>]*\sheight="(\d+)"', svg)
    height = min(int(height.group(1)) + 20, MAX_FRAME_HEIGHT) if height else MAX_FRAME_HEIGHT
    data = base64.b64encode(svg.encode()).decode()
    source = "data-src" if deferred else "src"
    return (
        f'<iframe class="flame" title="{escape(title)}" height="{height}" '
        f'{source}="data:image/svg+xml;base64,{data}"></iframe>'
    )


def flame_details(svg: str | None, title: str, summary: str) -> str:
    return f"<details><summary>{escape(summary)}</summary>{flame_iframe(svg, title, deferred=True)}</details>"


def _lost(stats: dict[str, Any]) -> tuple[str, str]:
    """Thread-reads left out (stacks that kept changing through every re-read, or a whole
    failed tick), as a rate; the last whole-tick error as a tooltip."""
    reader = stats.get("reader_stats") or {}
    reads = reader.get("thread_reads") or stats["ticks"]
    # Profiles saved before re-reads were counted dropped reads as "torn_reads".
    lost = reader.get("lost_reads", reader.get("torn_reads", 0)) + stats["failed_ticks"]
    return f"{100 * lost / max(reads, 1):.1f}%", stats.get("last_error") or ""


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
        return (f"held to the CPU budget ({budget:g}% of a core) on {stats['throttled_ticks']:,} of "
                f"{stats['ticks']:,} ticks: raise it with PySpyPlugin(cpu_budget=...) or "
                f"dask config pyspy.cpu-budget, or ask for a lower rate")
    return "the sampling thread fell behind its schedule (a busy machine)"


def _summary_section(profile: Profile, summary: dict[str, Any]) -> Iterator[str]:
    meta = profile.metadata
    window = meta.get("window") or [summary["first"], summary["last"]]
    duration = (window[1] - window[0]) if None not in window else 0.0
    yield _table(
        ["window", "duration (s)", "processes", "threads", "samples", "sampled thread-seconds"],
        [[f"{_when(window[0])} - {_when(window[1])}", float(duration), len(profile.processes),
          sum(p["threads"] for p in summary["processes"]), summary["samples"], float(summary["seconds"])]],
    )
    if not summary["samples"]:
        yield '<p class="warn">No samples in this window: was the plugin running, and did the window cover the work?</p>'
    rows = []
    for proc, totals in zip(profile.processes, summary["processes"]):
        s = proc["stats"]
        lost, last_error = _lost(s)
        errors = _errors(s)
        rows.append([proc["name"], proc["pid"], s.get("reader") or "-", totals["threads"], totals["samples"],
                     float(s["requested_rate"]), float(s["achieved_rate"]), _rate_note(s), float(100 * s["cpu_fraction"]),
                     (f'<span title="{escape(last_error)}">{lost}</span>',), s["store"]["samples_evicted"],
                     (f'<span class="warn">{escape(errors)}</span>',) if errors else ""])
    yield _table(["process", "pid", "reader", "threads", "samples", "requested Hz", "achieved Hz", "why lower",
                  "sampler CPU %", "samples lost", "evicted samples", "errors"], rows)
    yield ("<p><small>Samples lost: a thread whose stack changed while it was copied is read again at once, "
           "up to three times in the same tick; one still changing after that is left out of the tick rather "
           "than shown wrong. Normally 0.0%.</small></p>")
    yield from _states_section(profile, summary)
    missing = meta.get("missing") or {}
    if missing:
        yield '<p class="warn">Missing from this profile (could not be sampled or did not answer):</p>'
        yield _table(["process", "reason"], [[k, v] for k, v in missing.items()])


# Thread states, as the summary names them, and their column headings.
STATES = {"gil": "on CPU, GIL", "no_gil": "on CPU, no GIL", "cpu_wait": "waiting for a CPU",
          "gil_wait": "waiting for the GIL", "native": "native threads", "blocked": "blocked"}
SPLIT_HEADER = ["CPU s", *STATES.values()]
SPLIT_NOTE = (
    "<p><small>Wall time by what the thread was doing at each sample, from the kernel's own figures: "
    "<b>on CPU, GIL</b>: running Python (or C that kept the GIL); "
    "<b>on CPU, no GIL</b>: C code that released it (a numpy kernel, compression); "
    "<b>waiting for a CPU</b>: ready to run but every core was busy, so the machine is oversubscribed "
    "(more busy threads than cores, or other programs); "
    "<b>waiting for the GIL</b>: ready to run Python while another thread held the GIL; "
    "<b>native threads</b>: waiting on a lock while threads Python does not know (BLAS, arrow, other C++ pools) "
    "used the CPU, so usually waiting for that work; "
    "<b>blocked</b>: I/O, a lock, a sleep. CPU s is the CPU time the threads themselves used.</small></p>"
)
OVERSUBSCRIBED = 0.2  # a process waiting this share of its time for a CPU is told so,
OVERSUBSCRIBED_SAMPLES = 50  # once it has this many samples


def _split(row: dict[str, Any]) -> list[Any]:
    """CPU seconds, then the share of wall time in each state."""
    wall = row["seconds"] or 1.0
    return [float(row["cpu"]), *(f"{100 * row.get(k, 0.0) / wall:.0f}%" for k in STATES)]


def _states_section(profile: Profile, summary: dict[str, Any]) -> Iterator[str]:
    """Each process's time by thread state, the CPU of its native threads, and a plain
    warning where processes wait for CPUs."""
    rows = []
    for proc, totals in zip(profile.processes, summary["processes"]):
        cpu = proc["stats"].get("window_cpu") or {}
        rows.append([proc["name"], float(totals["seconds"]), *_split(totals),
                     float(cpu.get("process_cpu_s", 0.0)), float(cpu.get("native_cpu_s", 0.0))])
    yield _table(["process", "sampled s", *SPLIT_HEADER, "process CPU s", "native threads CPU s"], rows)
    yield ("<p><small>Native threads CPU s: CPU time of the threads Python does not know (BLAS, arrow and "
           "other C/C++ pools), measured per process as its CPU time less its Python threads'.</small></p>")
    yield from _oversubscribed(profile, summary)


def _oversubscribed(profile: Profile, summary: dict[str, Any]) -> Iterator[str]:
    """One warning per host whose processes waited for a CPU more than OVERSUBSCRIBED of the time."""
    hosts: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for proc, totals in zip(profile.processes, summary["processes"]):
        hosts.setdefault(proc.get("host") or "?", []).append((proc, totals))
    for host, procs in sorted(hosts.items()):
        waiting = [p["name"] for p, t in procs
                   if t["samples"] >= OVERSUBSCRIBED_SAMPLES and t.get("cpu_wait", 0.0) > OVERSUBSCRIBED * t["seconds"]]
        if not waiting:
            continue
        threads = sum(t["task_threads"] for _, t in procs)
        cores = max(p["stats"].get("cores") or 0 for p, _ in procs)
        yield (f'<p class="warn">Oversubscribed: on {escape(host)}, {escape(", ".join(waiting[:5]))}'
               f'{" and others" if len(waiting) > 5 else ""} spent more than {100 * OVERSUBSCRIBED:.0f}% of '
               f"their sampled time waiting for a CPU. {len(procs)} processes ran {threads} task threads there "
               f"on {cores or 'an unknown number of'} cores. Fewer workers or threads per worker "
               "(or fewer BLAS threads) would let each run instead of wait.</p>")


def _top(functions: list[dict[str, Any]]) -> tuple[str]:
    return ("<br>".join(f"{escape(f['name'])} <small>({escape(os.path.basename(f['file']))})</small> {f['seconds']:.3f} s"
                        for f in functions[:5]),)


def _prefix_section(summary: dict[str, Any], tasks: dict[str, dict[str, dict[str, float]]]) -> Iterator[str]:
    wall: dict[str, list[float]] = {}
    for per_worker in tasks.values():
        for prefix, t in per_worker.items():
            w = wall.setdefault(prefix, [0, 0.0])
            w[0] += t["count"]
            w[1] += t["seconds"]
    total = summary["seconds"] or 1.0
    rows = []
    for p in summary["prefixes"]:
        count, secs = wall.get(p["prefix"], [0, 0.0])
        rows.append([p["prefix"], float(p["seconds"]), float(100 * p["seconds"] / total), *_split(p), int(count), float(secs), _top(p["top"])])
    untagged = summary["untagged"]
    rows.append(["(no task)", float(untagged["seconds"]), float(100 * untagged["seconds"] / total), *_split(untagged), "", "", _top(untagged["top"])])
    yield _table(["task prefix", "sampled s", "% of samples", *SPLIT_HEADER, "tasks", "task wall s", "top functions (self time)"], rows)


def _functions_section(summary: dict[str, Any], idle_sampled: bool) -> Iterator[str]:
    rows = [[f["name"], os.path.basename(f["file"]), float(f["seconds"]), *_split(f)] for f in summary["top"]]
    yield _table(["function", "file", "self s", *SPLIT_HEADER], rows)
    rows = [["every sample", float(summary["seconds"]), *_split(summary)]]
    yield _table(["", "sampled s", *SPLIT_HEADER], rows)
    yield SPLIT_NOTE
    if not summary["cpu_measured"]:
        yield "<p>No CPU time was measured in this profile (a reader that does not measure it).</p>"
    if not idle_sampled:
        yield ("<p>Threads running a task are sampled while they wait; other waiting threads are not "
               "(start the plugin with <code>idle=True</code> to see them).</p>")


def _spans_section(profile: Profile, summary: dict[str, Any]) -> Iterator[str]:
    """One row and one graph per dask span, each with the spans nested in it."""
    yield "<h2>Spans</h2>"
    yield ("<p><small>Task time per <code>distributed.span</code>, each with the spans nested in it; "
           "tasks outside any span are in the <code>default</code> span.</small></p>")
    rows = [[" / ".join(s["path"]), float(s["seconds"]), *_split(s), _top(s["top"])] for s in summary["spans"]]
    yield _table(["span", "sampled s", *SPLIT_HEADER, "top functions (self time)"], rows)
    for s in summary["spans"]:
        name = " / ".join(s["path"])
        svg = profile.flamegraph_svg(f"Span {name}", by="prefix", span=s["path"])
        yield flame_details(svg, name, f"Flame graph of span {name} ({s['seconds']:.2f} s)")


GROUPS = {"task": "task", "prefix": "task prefix", "span": "span"}


def _lead_by(profile: Profile) -> str:
    """The grouping of the leading graph: task keys or spans if asked for, else task prefixes."""
    return profile.by if profile.by in ("task", "span") else "prefix"


def _graphs_section(profile: Profile, summary: dict[str, Any]) -> Iterator[str]:
    """The whole cluster by task (or prefix), then one graph per prefix and per process."""
    by = _lead_by(profile)
    untagged = 100 * summary["untagged"]["seconds"] / (summary["seconds"] or 1.0)
    what = "CPU time" if profile.weight == "cpu" else "time"
    yield f"<h2>Task {what} across the cluster, by {GROUPS[by]}</h2>"
    yield ("<p><small>Stacks start at each task's own code (the worker's execution machinery is cut; "
           "the raw stacks are under Processes and in the speedscope file). A call cycle repeated "
           "in a row (recursion) is shown once.</small></p>")
    yield flame_iframe(profile.flamegraph_svg(f"Task {what} by {GROUPS[by]}", by=by, tasks=True), f"Task {what}")
    yield flame_details(profile.flamegraph_svg("Outside tasks", tasks=False), "Outside tasks",
                        f"Time outside tasks ({untagged:.0f}% of samples: event loops, communication, "
                        "deserialising and importing, the scheduler)")
    yield flame_details(profile.flamegraph_svg("All processes by thread"), "All processes by thread",
                        "Whole cluster by thread, raw stacks")
    yield "<h2>Task prefixes</h2>"
    yield from _prefix_section(summary, profile.metadata.get("tasks") or {})
    for p in summary["prefixes"]:
        svg = profile.flamegraph_svg(f"Task prefix {p['prefix']}", by="prefix", prefix=p["prefix"])
        yield flame_details(svg, p["prefix"], f"Flame graph of {p['prefix']} ({p['seconds']:.2f} s)")
    if summary["spans"]:
        yield from _spans_section(profile, summary)
    yield from _processes_section(profile, summary)


MAX_PROCESS_GRAPHS = 32  # a 1000-worker report stays a page, not a thousand graphs


def _processes_section(profile: Profile, summary: dict[str, Any]) -> Iterator[str]:
    """A graph per process, the busiest first, at most MAX_PROCESS_GRAPHS."""
    yield "<h2>Processes</h2>"
    busiest = sorted(range(len(profile.processes)), key=lambda i: -summary["processes"][i]["seconds"])
    for i in busiest[:MAX_PROCESS_GRAPHS]:
        name = profile.processes[i]["name"]
        yield flame_details(profile.flamegraph_svg(f"Process {name}", process=i), name, f"Flame graph of {name}, raw stacks")
    if len(busiest) > MAX_PROCESS_GRAPHS:
        yield (f"<p>And {len(busiest) - MAX_PROCESS_GRAPHS} less busy processes: their samples are in the graphs "
               "above and in the speedscope file; <code>profile.only_process(i)</code> picks one.</p>")


FOLD_ABOVE = 200_000  # samples; a report of more reads a folded copy: same totals, minutes less


def _for_views(profile: Profile) -> Profile:
    return profile.aggregated(keys=True) if profile.n_samples > FOLD_ABOVE else profile


def _download(profile: Profile, folded: bool) -> tuple[str, str]:
    """The button and the embedded speedscope file; neither for an empty profile."""
    if not profile.n_samples:
        return "", ""
    data = base64.b64encode(profile.to_bytes(compress=True)).decode()
    order = (" Its samples are folded by stack, so its time order is not the run's; a profile collected without "
             "<code>aggregate=True</code> and saved with <code>profile.save('out.speedscope.json.gz')</code> keeps it."
             if folded else "")
    button = ('<p><button id="download">Download the speedscope profile</button> '
              f"open it at speedscope.app or with the <code>speedscope</code> command, both work offline.{order}</p>")
    return button, f'<script id="speedscope-data" type="application/octet-stream">{data}</script>'



def page_head(title: str) -> str:
    """A page up to its <body>: no favicon request (the page needs no network), the shared style."""
    return f"<!DOCTYPE html><html><head><meta charset='utf-8'><link rel='icon' href='data:,'><title>{escape(title)}</title><style>{STYLE}</style></head><body>"


def render_html(profile: Profile, title: str = "dask-pyspy report", header: str = "") -> str:
    """The whole report as one HTML page that needs no network; `header` is trusted HTML."""
    raw, profile = profile, _for_views(profile)
    summary = profile.summary()
    idle_sampled = any(p["stats"]["config"]["idle"] for p in profile.processes)
    button, data = _download(profile, folded=profile is not raw or bool(raw.metadata.get("aggregate")))
    parts = [
        page_head(title),
        f"<h1>{escape(title)}</h1>",
        header,
        button,
        "<h2>Summary</h2>", *_summary_section(profile, summary),
        *_graphs_section(profile, summary),
        "<h2>Functions: CPU and thread states</h2>", *_functions_section(summary, idle_sampled),
        data,
        f"<script>{SCRIPT}</script></body></html>",
    ]
    return "\n".join(parts)


REFRESH_CHOICES = (0, 5, 30)

DASHBOARD_SCRIPT = """
var refresh = document.getElementById("refresh");
refresh.addEventListener("change", function () {
  var q = new URLSearchParams(location.search); q.set("refresh", refresh.value); location.search = q.toString();
});
if (+refresh.value > 0) setTimeout(function () { location.reload(); }, 1000 * refresh.value);
"""


def render_dashboard(profile: Profile, last: float, stacks: str, refresh: int = 0) -> str:
    """The scheduler dashboard's page: a window picker, auto-refresh, live stacks, then the report."""
    links = " ".join(f'<a href="?last={s}&amp;refresh={refresh}">{s} s</a>' for s in (10, 30, 60, 300, 900))
    choices = "".join(f'<option value="{r}"{" selected" if r == refresh else ""}>{f"every {r} s" if r else "off"}</option>'
                      for r in REFRESH_CHOICES)
    header = (
        f"<p>Showing the last {last:g} seconds. Show the last: {links}. "
        f'<label>Refresh: <select id="refresh">{choices}</select></label></p>'
        f"<details><summary>Live stacks of every thread (<a href='dump'>as text</a>)</summary>"
        f"<pre>{escape(stacks)}</pre></details><script>{DASHBOARD_SCRIPT}</script>"
    )
    return render_html(profile, title=f"dask-pyspy: last {last:g} s of the cluster", header=header)


def render_notebook(profile: Profile) -> str:
    """A compact view for Jupyter: the headline numbers and the whole-cluster flame graph."""
    profile = _for_views(profile)
    summary = profile.summary()
    head = _table(["processes", "samples", "sampled thread-seconds", "top task prefix"],
                  [[len(profile.processes), summary["samples"], float(summary["seconds"]),
                    summary["prefixes"][0]["prefix"] if summary["prefixes"] else "-"]])
    return head + flame_iframe(profile.flamegraph_svg("dask-pyspy", by=_lead_by(profile)), "dask-pyspy")
