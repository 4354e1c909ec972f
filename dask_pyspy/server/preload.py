"""Preload hooks: `dask scheduler --preload dask_pyspy`, `dask worker --preload dask_pyspy`
(the package re-exports them)."""

from __future__ import annotations

from typing import Any

from distributed import Scheduler, Worker

from dask_pyspy import config
from dask_pyspy.server.scheduler import PySpyPlugin
from dask_pyspy.server.shared import PLUGIN_NAME
from dask_pyspy.server.worker import PySpyWorkerPlugin, WorkerProfiler


async def dask_setup(server: Any) -> None:
    """Preload hook: `dask scheduler --preload dask_pyspy`, `dask worker --preload dask_pyspy`."""
    if isinstance(server, Scheduler):
        server.add_plugin(PySpyPlugin())  # its start() is awaited when the scheduler starts
    elif isinstance(server, Worker):
        # The scheduler's plugin, of the same name, replaces this one, so a worker holds one
        # plugin of ours however it was set up. The preload's own hold on the profiler, until
        # dask_teardown, keeps the profiler (task log, tags) through that replacement.
        opts = config.sampler_options()
        await WorkerProfiler.of(server).attach(opts)
        await server.plugin_add(PySpyWorkerPlugin(opts), name=PLUGIN_NAME)


async def dask_teardown(server: Any) -> None:
    """Preload hook at close (after the worker's plugins are gone): the preload's hold goes."""
    profiler = WorkerProfiler.held(server) if isinstance(server, Worker) else None
    if profiler is not None:  # None on a worker whose dask_setup failed
        await profiler.detach()
