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

from dask_pyspy.profile import Profile

TOP_PREFIXES = 6

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
document.getElementById("download").addEventListener("click", function () {
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


def flame_iframe(svg: str | None, title: str, deferred: bool = False) -> str:
    """The SVG in its own frame; `deferred` frames load when their <details> opens (a
    flame graph laid out while hidden has no width to lay out in)."""
    if svg is None:
        return "<p>No samples.</p>"
    height = re.search(r'<svg[^>]*\sheight="(\d+)"', svg)
    data = base64.b64encode(svg.encode()).decode()
    source = "data-src" if deferred else "src"
    return (
        f'<iframe class="flame" title="{escape(title)}" height="{int(height.group(1)) + 20 if height else 600}" '
        f'{source}="data:image/svg+xml;base64,{data}"></iframe>'
    )


def flame_details(svg: str | None, title: str, summary: str) -> str:
    return f"<details><summary>{escape(summary)}</summary>{flame_iframe(svg, title, deferred=True)}</details>"


def _summary_section(profile: Profile, summary: dict[str, Any]) -> Iterator[str]:
    meta = profile.metadata
    window = meta.get("window") or [summary["first"], summary["last"]]
    duration = (window[1] - window[0]) if None not in window else 0.0
    yield _table(
        ["window", "duration (s)", "processes", "threads", "samples", "sampled thread-seconds"],
        [[f"{_when(window[0])} - {_when(window[1])}", float(duration), len(profile.processes),
          sum(p["threads"] for p in summary["processes"]), summary["samples"], float(summary["seconds"])]],
    )
    rows = []
    for proc, totals in zip(profile.processes, summary["processes"]):
        s = proc["stats"]
        errors = "; ".join(str(e) for e in (s.get("panic"), s.get("last_error")) if e)
        reader = s.get("reader") or "-"
        fallback = (s.get("reader_stats") or {}).get("fallback_reason")
        reader += f" (fast reader not used: {fallback})" if fallback else ""
        rows.append([proc["name"], proc["pid"], reader, totals["threads"], totals["samples"], float(s["requested_rate"]),
                     float(s["achieved_rate"]), float(100 * s["cpu_fraction"]), s["throttled_ticks"], s["failed_ticks"],
                     s["store"]["samples_evicted"], errors])
    yield _table(["process", "pid", "reader", "threads", "samples", "requested Hz", "achieved Hz", "sampler CPU %",
                  "throttled ticks", "failed ticks", "evicted samples", "errors"], rows)
    missing = meta.get("missing") or {}
    if missing:
        yield '<p class="warn">Missing from this profile:</p>'
        yield _table(["process", "reason"], [[k, v] for k, v in missing.items()])


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
        top = "<br>".join(f"{escape(f['name'])} <small>({escape(os.path.basename(f['file']))})</small> {f['seconds']:.3f} s"
                          for f in p["top"][:5])
        count, secs = wall.get(p["prefix"], [0, 0.0])
        rows.append([p["prefix"], float(p["seconds"]), float(100 * p["seconds"] / total), int(count), float(secs), (top,)])
    rows.append(["(no task)", float(summary["untagged_seconds"]), float(100 * summary["untagged_seconds"] / total), "", "", ""])
    yield _table(["task prefix", "sampled s", "% of samples", "tasks", "task wall s", "top functions (self time)"], rows)


def _states_section(summary: dict[str, Any], idle_sampled: bool) -> Iterator[str]:
    st = summary["states"]
    rows = [["running, holding the GIL", float(st["running_with_gil"])],
            ["running, not holding the GIL", float(st["running_without_gil"])]]
    if idle_sampled:
        rows += [["waiting, holding the GIL", float(st["waiting_holding_gil"])], ["waiting", float(st["waiting"])]]
    yield _table(["thread state", "seconds"], rows)
    if not idle_sampled:
        yield "<p>Waiting threads were not sampled (start the plugin with <code>idle=True</code> to see them).</p>"


def render_html(profile: Profile, title: str = "dask-pyspy report", header: str = "") -> str:
    """The whole report as one HTML page that needs no network; `header` is trusted HTML."""
    summary = profile.summary()
    idle_sampled = any(p["stats"]["config"]["idle"] for p in profile.processes)
    speedscope = base64.b64encode(profile.to_bytes(compress=True)).decode()
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><link rel='icon' href='data:,'><title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        header,
        '<p><button id="download">Download the speedscope profile</button> '
        "open it at speedscope.app or with the <code>speedscope</code> command, both work offline.</p>",
        "<h2>Summary</h2>", *_summary_section(profile, summary),
        "<h2>Whole cluster</h2>", flame_iframe(profile.flamegraph_svg("All processes"), "All processes"),
        "<h2>Task prefixes</h2>", *_prefix_section(summary, profile.metadata.get("tasks") or {}),
    ]
    for p in summary["prefixes"][:TOP_PREFIXES]:
        svg = profile.flamegraph_svg(f"Task prefix {p['prefix']}", prefix=p["prefix"])
        parts.append(flame_details(svg, p["prefix"], f"Flame graph of {p['prefix']} ({p['seconds']:.2f} s)"))
    parts.append("<h2>Processes</h2>")
    for i, proc in enumerate(profile.processes):
        svg = profile.flamegraph_svg(f"Process {proc['name']}", process=i)
        parts.append(flame_details(svg, proc["name"], f"Flame graph of {proc['name']}"))
    parts += [
        "<h2>GIL and idle</h2>", *_states_section(summary, idle_sampled),
        f'<script id="speedscope-data" type="application/octet-stream">{speedscope}</script>',
        f"<script>{SCRIPT}</script></body></html>",
    ]
    return "\n".join(parts)


def render_dashboard(profile: Profile, last: float, stacks: str) -> str:
    """The scheduler dashboard's page: a window picker, live stacks, then the report."""
    links = " ".join(f'<a href="?last={s}">{s} s</a>' for s in (10, 30, 60, 300, 900))
    header = (
        f"<p>Showing the last {last:g} seconds. Show the last: {links}</p>"
        f"<details><summary>Live stacks of every thread (<a href='dump'>as text</a>)</summary>"
        f"<pre>{escape(stacks)}</pre></details>"
    )
    return render_html(profile, title=f"dask-pyspy: last {last:g} s of the cluster", header=header)


def render_notebook(profile: Profile) -> str:
    """A compact view for Jupyter: the headline numbers and the whole-cluster flame graph."""
    summary = profile.summary()
    head = _table(["processes", "samples", "sampled thread-seconds", "top task prefix"],
                  [[len(profile.processes), summary["samples"], float(summary["seconds"]),
                    summary["prefixes"][0]["prefix"] if summary["prefixes"] else "-"]])
    return head + flame_iframe(profile.flamegraph_svg("dask-pyspy"), "dask-pyspy")
