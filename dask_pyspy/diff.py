"""The diff page: what changed from a base profile to a new one (`Profile.diff`, a
`ProfileDiff`), as a self-contained HTML page from templates/diff.html, its flame
graphs as in reports."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dask_pyspy.pages import render
from dask_pyspy.model import ProfileDiff, check_writable


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
