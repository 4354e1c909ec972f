"""The `/pyspy/` pages on the scheduler's dashboard: flame graph of the last N seconds and live stacks."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tornado import web

from dask_pyspy._loop import off_loop
from dask_pyspy.client import StackDump
from dask_pyspy.profile import Profile
from dask_pyspy.report import render_dashboard

if TYPE_CHECKING:
    from dask_pyspy.plugin import PySpyPlugin

DEFAULT_LAST = 30.0
MAX_LAST = 24 * 3600.0


class _Page(web.RequestHandler):
    def initialize(self, plugin: PySpyPlugin) -> None:
        self.plugin = plugin

    async def _stacks(self) -> str:
        return str(StackDump(await self.plugin.dump()))


class ProfilePage(_Page):
    async def get(self) -> None:
        try:
            last = float(self.get_argument("last", str(DEFAULT_LAST)))
        except ValueError:
            last = -1.0
        if not 0 < last <= MAX_LAST:
            raise web.HTTPError(400, reason=f"last must be a number of seconds in (0, {MAX_LAST:g}]")
        data = await self.plugin.profile(start=time.time() - last)
        stacks = await self._stacks()
        html = await off_loop(lambda: render_dashboard(Profile.from_wire(data), last, stacks))
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(html)


class StacksPage(_Page):
    async def get(self) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.write(await self._stacks())


def add_routes(scheduler: Any, plugin: PySpyPlugin) -> bool:
    """Add the pages to a running scheduler's dashboard; False when it has none."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    app.add_handlers(r".*", [(r"/pyspy/?", ProfilePage, {"plugin": plugin}), (r"/pyspy/dump", StacksPage, {"plugin": plugin})])
    return True
