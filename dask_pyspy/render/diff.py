"""The diff page: what changed from a base profile to a new one (`Profile.diff`, a
`ProfileDiff`), as a self-contained HTML page from templates/diff.html, its flame
graphs as in reports."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dask_pyspy.files import check_writable, write_atomic
from dask_pyspy.render.pages import render


def check_output(path: str | os.PathLike) -> Path:
    """Fail before any work if `path` is no .html file or cannot be written."""
    if not os.fspath(path).lower().endswith(".html"):
        raise ValueError(f"path must end in .html (a diff is an HTML page), got {os.fspath(path)!r}")
    return check_writable(path)


def _row(r: dict[str, Any], function: bool) -> list[Any]:
    pct = "new" if r["change_pct"] is None else f"{r['change_pct']:+,.1f}%"
    where = [{"text": os.path.basename(r["file"]), "title": r["file"]}] if function else []
    return [
        r["name"],
        *where,
        float(r["base_seconds"]),
        float(r["new_seconds"]),
        f"{r['seconds']:+,.3f}",
        pct,
        f"{r['share_points']:+.2f} pp",
    ]


def _rows(ranked: dict[str, list[dict[str, Any]]], function: bool) -> dict[str, list[list[Any]]]:
    return {way: [_row(r, function) for r in rows] for way, rows in ranked.items()}


def render_diff(diff: ProfileDiff, title: str, base: str, new: str) -> str:
    """The page: both profiles' totals, the differential and base graphs, and the biggest
    changes of functions and task prefixes; `base` and `new` name the profiles."""
    return render(
        "diff.html",
        title=title,
        base=base,
        new=new,
        diff=diff,
        functions=_rows(diff.functions, function=True),
        prefixes=_rows(diff.prefixes, function=False),
    )


class ProfileDiff:
    """What changed from a base profile to a new one: `new.diff(base)`.

    `svg`: inferno's differential flame graph, frames as wide as the new profile's
    time and coloured by their change from the base once the base is scaled to the
    new profile's total (red grew, blue shrank), so runs of different lengths
    compare; `base_svg` is as wide as the base, so what shrank or vanished shows.
    Frames are functions (name and file, lines ignored), grouped by task prefix when
    either profile has tasks (`by`).

    `functions` (self time, by name and file) and `prefixes` (task prefixes, time
    outside tasks by activity, "(no task)" for the rest) are {"gained": rows, "lost": rows}, the 15 largest
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
        return render_diff(self, title, base, new)

    def save(
        self, path: str | os.PathLike, title: str = "dask-pyspy diff", base: str = "base", new: str = "new"
    ) -> Path:
        """Write the HTML page (`to_html`) to `path`, which must end in .html."""
        path = check_output(path)
        write_atomic(path, self.to_html(title, base, new).encode())
        return path

    def __repr__(self) -> str:
        top = self.functions["gained"][:1]
        most = f", most gained: {top[0]['name']} +{top[0]['seconds']:.3f} s" if top else ""
        return f"<ProfileDiff {self.base_seconds:.1f} -> {self.new_seconds:.1f} thread-s{most}>"
