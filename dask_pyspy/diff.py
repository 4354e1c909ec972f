"""Differential profiles: what changed from a base profile to a new one, and the
self-contained HTML page that shows it (the flame graphs as in reports)."""

from __future__ import annotations

import os
from html import escape
from pathlib import Path
from typing import Any, Iterator

from dask_pyspy.model import check_writable, write_atomic
from dask_pyspy.report import SCRIPT, _table, flame_details, flame_iframe, page_head

GRAPH_NOTE = (
    "Frames are as wide as the new profile's time and coloured by their change from the base, "
    "once the base is scaled to the new profile's total, so runs of different lengths compare: "
    "<b style='color:#c00'>red grew</b>, <b style='color:#00c'>blue shrank</b>, the deeper the colour "
    "the larger the change. Hover a frame for its time and its change as a share of the whole. "
    "Frames are functions (name and file, lines ignored)."
)

BY_PREFIX_NOTE = " Task stacks start at the task's own code, under their task prefix."

TABLE_NOTE = (
    "Seconds are sampled thread-seconds, not scaled: <i>change s</i> is new minus base. "
    "<i>change %</i> is that change relative to the base's seconds for the row (<i>new</i> where the "
    "base had none). <i>share change</i> is the change of the row's share of all sampled time, in "
    "percentage points: the scaled view the graph's colours show."
)


def check_output(path: str | os.PathLike) -> Path:
    """Fail before any work if `path` is no .html file or cannot be written."""
    if not os.fspath(path).lower().endswith(".html"):
        raise ValueError(f"path must end in .html (a diff is an HTML page), got {os.fspath(path)!r}")
    return check_writable(path)


class ProfileDiff:
    """What changed from a base profile to a new one: `new.diff(base)`.

    `svg`: inferno's differential flame graph, frames as wide as the new profile's
    time and coloured by their change from the base once the base is scaled to the
    new profile's total (red grew, blue shrank), so runs of different lengths
    compare; `base_svg` is as wide as the base, so what shrank or vanished shows.
    Frames are functions (name and file, lines ignored), grouped by task prefix when
    either profile has tasks (`by`).

    `functions` (self time, by name and file) and `prefixes` (task prefixes,
    "(no task)" for the rest) are {"gained": rows, "lost": rows}, the 15 largest
    changes each way, largest first. A row: `name`, `file` (None for prefixes),
    `base_seconds`, `new_seconds`, `seconds` (new - base, not scaled), `change_pct`
    (that change as a percentage of the row's base seconds; None where the base had
    none) and `share_points` (the change of the row's share of all sampled time, in
    percentage points: the scaled view the graph's colours show).
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.by: str = data["by"]
        self.base_seconds: float = data["base_seconds"]
        self.new_seconds: float = data["new_seconds"]
        self.functions: dict[str, list[dict[str, Any]]] = data["functions"]
        self.prefixes: dict[str, list[dict[str, Any]]] = data["prefixes"]
        self.svg: str | None = data["svg"]
        self.base_svg: str | None = data["base_svg"]

    def to_html(self, title: str = "dask-pyspy diff", base: str = "base", new: str = "new") -> str:
        """A self-contained HTML page: the graphs and tables; `base` and `new` name the profiles."""
        parts = [page_head(title), f"<h1>{escape(title)}</h1>", *_sections(self, base, new), f"<script>{SCRIPT}</script></body></html>"]
        return "\n".join(parts)

    def save(self, path: str | os.PathLike, title: str = "dask-pyspy diff", base: str = "base", new: str = "new") -> Path:
        """Write the HTML page (`to_html`) to `path`, which must end in .html."""
        path = check_output(path)
        write_atomic(path, self.to_html(title, base, new).encode())
        return path

    def __repr__(self) -> str:
        top = self.functions["gained"][:1]
        most = f", most gained: {top[0]['name']} +{top[0]['seconds']:.3f} s" if top else ""
        return f"<ProfileDiff {self.base_seconds:.1f} -> {self.new_seconds:.1f} thread-s{most}>"


def _change_table(rows: list[dict[str, Any]], function: bool) -> str:
    def row(r: dict[str, Any]) -> list[Any]:
        pct = "new" if r["change_pct"] is None else f"{r['change_pct']:+,.1f}%"
        where = [(f'<span title="{escape(r["file"])}">{escape(os.path.basename(r["file"]))}</span>',)] if function else []
        return [r["name"], *where, float(r["base_seconds"]), float(r["new_seconds"]), f"{r['seconds']:+,.3f}", pct,
                f"{r['share_points']:+.2f} pp"]

    header = ["function", "file"] if function else ["task prefix"]
    return _table(header + ["base s", "new s", "change s", "change %", "share change"], [row(r) for r in rows])


def _changes(title: str, ranked: dict[str, list[dict[str, Any]]], function: bool) -> Iterator[str]:
    for way in ("gained", "lost"):
        yield f"<h3>{escape(title)} that {way} most</h3>"
        rows = ranked[way]
        yield _change_table(rows, function) if rows else f"<p>None {way} time.</p>"


def _sections(diff: ProfileDiff, base: str, new: str) -> Iterator[str]:
    yield _table(["profile", "file", "sampled thread-seconds"],
                 [["base", base, float(diff.base_seconds)], ["new", new, float(diff.new_seconds)]])
    yield "<h2>What changed</h2>"
    yield f"<p><small>{GRAPH_NOTE}{BY_PREFIX_NOTE if diff.by == 'prefix' else ''}</small></p>"
    yield flame_iframe(diff.svg, "Differential flame graph")
    yield flame_details(diff.base_svg, "Base profile", "The base profile's shape: what shrank or vanished")
    yield "<h2>Biggest changes</h2>"
    yield f"<p><small>{TABLE_NOTE}</small></p>"
    yield from _changes("Functions (self time)", diff.functions, function=True)
    yield from _changes("Task prefixes", diff.prefixes, function=False)
