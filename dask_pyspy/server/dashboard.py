"""The `/pyspy/` pages on the scheduler's dashboard: timeline and flame graphs of the last N
seconds (or of a chosen `start=` to `stop=`), and live stacks."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Protocol

from tornado import web

from dask_pyspy._loop import off_loop
from dask_pyspy.protocol import StackDump, assemble
from dask_pyspy.render.report import REFRESH_CHOICES, render_dashboard

DEFAULT_LAST = 30.0
MAX_LAST = 24 * 3600.0
STALLS_SHOWN = 20  # the longest of each process explained; the page lists the longest of all


class Handlers(Protocol):
    """The scheduler's handlers the pages call (`dask_pyspy.server.scheduler.ClusterProfiler`'s),
    named here so the pages need no import of the scheduler's code."""

    async def profile(self, *, start: float, stop: float) -> dict[str, Any]: ...

    async def dump(self) -> dict[str, Any]: ...

    async def stalls(self, *, start: float, stop: float, limit: int | None) -> dict[str, Any]: ...


class _Page(web.RequestHandler):
    def initialize(self, plugin: Handlers) -> None:
        self.plugin = plugin

    async def _stacks(self) -> str:
        return str(StackDump(await self.plugin.dump()))


def _unix(name: str, given: str) -> float:
    try:
        value = float(given)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise web.HTTPError(400, reason=f"{name} must be a time in Unix seconds, got {given!r}")
    return value


class ProfilePage(_Page):
    def _window(self) -> tuple[float, float, float | None]:
        """`(start, stop, last)`: `start=` and `stop=` (Unix seconds; stop defaults to
        now), else the `last=` seconds, which is None for a chosen range."""
        now = time.time()
        start, stop = self.get_argument("start", None), self.get_argument("stop", None)
        if start is None and stop is None:
            try:
                last = float(self.get_argument("last", str(DEFAULT_LAST)))
            except ValueError:
                last = -1.0
            if not 0 < last <= MAX_LAST:
                raise web.HTTPError(400, reason=f"last must be a number of seconds in (0, {MAX_LAST:g}]")
            return now - last, now, last
        if start is None:
            raise web.HTTPError(400, reason="stop= needs start= (Unix seconds) too")
        first, until = _unix("start", start), now if stop is None else _unix("stop", stop)
        if not first < until <= first + MAX_LAST:
            raise web.HTTPError(
                400,
                reason=f"stop must be after start and at most {MAX_LAST:g} s after it, got start={start} stop={stop}",
            )
        return first, until, None

    async def get(self) -> None:
        start, stop, last = self._window()
        refresh = self.get_argument("refresh", "0")
        if refresh not in {str(r) for r in REFRESH_CHOICES}:
            raise web.HTTPError(
                400, reason=f"refresh must be one of {', '.join(map(str, REFRESH_CHOICES))} seconds (0: off)"
            )
        reply, stalls = await asyncio.gather(
            self.plugin.profile(start=start, stop=stop), self.plugin.stalls(start=start, stop=stop, limit=STALLS_SHOWN)
        )
        if "error" in reply:
            raise web.HTTPError(400, reason=reply["error"])
        stacks = await self._stacks()
        # A stalls request that failed leaves the page the stalls the profile carries.
        stalled = None if "error" in stalls else stalls["processes"]
        html = await off_loop(
            lambda: render_dashboard(assemble(reply), (start, stop), last, stacks, int(refresh), stalled)
        )
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(html)


class StacksPage(_Page):
    async def get(self) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.write(await self._stacks())


MENU_ENTRY = {"url": "pyspy", "name": "Py-Spy Profile"}


def _link_from_menu(app: Any) -> bool:
    """List the page in the "More..." menu of distributed's dashboard pages.

    distributed has no API for extra pages; its Bokeh pages share one dict of
    template variables whose "plots" list fills that menu, reachable from each page's
    handler. Without Bokeh (or if that changes) the page is only reachable by URL.
    """
    for bokeh in getattr(app, "applications", []):
        for page in getattr(bokeh, "applications", {}).values():
            for handler in getattr(getattr(page, "application", None), "handlers", []):
                args: tuple[Any, ...] = getattr(getattr(handler, "_func", None), "args", ())
                plots = args[1].get("plots") if len(args) > 1 and isinstance(args[1], dict) else None
                if isinstance(plots, list):
                    if MENU_ENTRY not in plots:
                        plots.append(MENU_ENTRY)
                    return True
    return False


def add_routes(scheduler: Any, plugin: Handlers) -> bool:
    """Add the pages to a running scheduler's dashboard; False when it has none."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    app.add_handlers(
        r".*", [(r"/pyspy/?", ProfilePage, {"plugin": plugin}), (r"/pyspy/dump", StacksPage, {"plugin": plugin})]
    )
    _link_from_menu(app)
    return True
