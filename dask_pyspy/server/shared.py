"""What a scheduler's and a worker's halves share: their hold on the process sampler,
their RPC handlers' names, and the answer to a request the caller got wrong."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from distributed import Scheduler, Worker

from dask_pyspy._loop import off_loop
from dask_pyspy.options import SamplerOptions
from dask_pyspy.sampler import Sampler, process_sampler
from dask_pyspy.server.activities import Hooks
from dask_pyspy.server.arrow import ArrowPool
from dask_pyspy.server.stalls import StallWatch

logger = logging.getLogger(__name__)

PLUGIN_NAME = "pyspy"
HANDLERS = ("pyspy_profile", "pyspy_size", "pyspy_dump", "pyspy_configure", "pyspy_stalls")


class SamplerHold:
    """A server's hold on the process sampler, and the hooks that name its event loop's
    activities while it holds one. A sampler that cannot run turns sampling off in this
    server, with the reason; the server keeps running.

    The hold goes when the server stops, however it ends: `close()` stops it, and a
    server stopped with `stop()` alone (distributed's tests do so) never closes its
    plugins."""

    def __init__(self, server: Scheduler | Worker) -> None:
        self.server = server
        self.sampler: Sampler | None = None
        self.error: str | None = None
        self.hooks: Hooks | None = None
        self.stalls: StallWatch | None = None
        self.arrow: ArrowPool | None = None
        self._releasing: set[asyncio.Task[None]] = set()
        self._release_when_stopped()

    def _release_when_stopped(self) -> None:
        stop = self.server.stop

        def stop_and_release(*args: Any, **kwargs: Any) -> Any:
            try:
                return stop(*args, **kwargs)
            finally:
                self._server_stopped()

        self.server.stop = stop_and_release  # type: ignore[method-assign]

    def _server_stopped(self) -> None:
        if not self._let_go():
            return
        try:
            task = asyncio.get_running_loop().create_task(off_loop(process_sampler.release))
        except RuntimeError:  # stopped outside its loop: let go here
            process_sampler.release()
            return
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def apply(self, opts: SamplerOptions) -> None:
        """Hold the sampler, running with `opts`: acquired the first time, reconfigured after."""
        try:
            if self.sampler is None:
                self.sampler = await off_loop(process_sampler.acquire, opts)
                self.hooks = Hooks(self.server, self.sampler.native)
                self.stalls = StallWatch(self.sampler)
                self.arrow = ArrowPool(self.sampler)
            else:
                await off_loop(process_sampler.configure, opts)
            self.error = None
        except Exception as e:  # an unreadable interpreter must not take the server down
            logger.error("dask-pyspy: sampling is off in this process: %s", e)
            self.error = f"{type(e).__name__}: {e}"
            await self.release()

    async def release(self) -> None:
        if self._let_go():
            await off_loop(process_sampler.release)

    def _let_go(self) -> bool:
        """Removes the hooks, the stall watch and arrow's notes and drops the sampler; true if this hold had one, whose
        process-wide hold the caller then releases."""
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        if self.stalls is not None:
            self.stalls.remove()
            self.stalls = None
        if self.arrow is not None:
            self.arrow.remove()
            self.arrow = None
        held, self.sampler = self.sampler is not None, None
        return held


def install_handlers(server: Scheduler | Worker, handlers: dict[str, Callable[..., Any]]) -> None:
    server.handlers.update(handlers)


def remove_handlers(server: Scheduler | Worker) -> None:
    for name in HANDLERS:
        server.handlers.pop(name, None)


def rejected(error: ValueError) -> dict[str, str]:
    """The answer to a request the caller got wrong: returned rather than raised, so the
    server logs one line instead of an error with a traceback."""
    logger.info("dask-pyspy: rejected a request: %s", error)
    return {"error": str(error)}
