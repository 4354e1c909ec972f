"""What the HTML pages (report, diff, dashboard) share: one jinja2 environment over the
templates shipped in the package, with autoescape on, and the flame-graph frames.

Each page is one self-contained file: the templates inline their CSS and JS.
"""

from __future__ import annotations

import base64
import datetime
import os
import re
from typing import Any

import jinja2

# Graphs are icicles (roots on top); deeper stacks scroll inside their frame.
MAX_FRAME_HEIGHT = 640


def flame_frame(svg: str | None) -> dict[str, Any] | None:
    """An SVG as its frame's height and data: URL (no markup of the graph's own reaches
    the page); None for no samples."""
    if svg is None:
        return None
    height = re.search(r'<svg[^>]*\sheight="(\d+)"', svg)
    return {
        "height": min(int(height.group(1)) + 20, MAX_FRAME_HEIGHT) if height else MAX_FRAME_HEIGHT,
        "src": "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode(),
    }


def when(t: float | None) -> str:
    """A Unix time as local date and time to the second; "-" for none."""
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def number(v: float) -> str:
    """Table figures: floats to the millisecond, both with thousands separators."""
    return f"{v:,.3f}" if isinstance(v, float) else f"{v:,}"


ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("dask_pyspy.render", "templates"),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)
ENV.filters.update(flame=flame_frame, number=number, basename=os.path.basename)


def render(template: str, **context: Any) -> str:
    """A page (or fragment) from templates/, every value in `context` escaped as it is shown."""
    return ENV.get_template(template).render(**context)
