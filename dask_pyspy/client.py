"""What a client calls: collect a cluster-wide profile, record a block, dump live stacks."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any

from distributed import Client, default_client
from distributed.core import PooledRPCCall, rpc

from dask_pyspy import config, options, stalls
from dask_pyspy._loop import off_loop
from dask_pyspy.files import check_writable, file_kind
from dask_pyspy.memory import MemoryProfile
from dask_pyspy.model import Profile
from dask_pyspy.protocol import EVENT_TOPIC, StackDump, assemble

logger = logging.getLogger(__name__)

NO_PLUGIN = (
    "no dask-pyspy plugin on this cluster's scheduler: run "
    "client.register_plugin(dask_pyspy.PySpyPlugin()) or start the scheduler with --preload dask_pyspy"
)


async def _has_plugin(scheduler: rpc | PooledRPCCall) -> bool:
    """Whether the scheduler's handlers are installed, asked without calling one:
    distributed logs a call to an unknown op with a traceback."""
    events = await scheduler.events(topic=EVENT_TOPIC)
    return bool(events) and events[-1][1].get("action") == "start"


async def _call(client: Client, op: str, **kwargs: Any) -> Any:
    scheduler = client.scheduler
    if scheduler is None:  # an asynchronous client that was never awaited
        raise RuntimeError(f"the client is not connected to a scheduler: start it before {op}")
    try:
        if not await _has_plugin(scheduler):
            raise RuntimeError(NO_PLUGIN)
        reply = await getattr(scheduler, op)(**kwargs)
    except OSError as e:  # includes distributed's CommClosedError
        raise OSError(f"lost the connection to the scheduler during {op}: {e}") from e
    if reply is None:  # distributed answers an unknown op with nothing (the plugin closed since)
        raise RuntimeError(NO_PLUGIN)
    if isinstance(reply, dict) and "error" in reply:  # the scheduler rejected the request
        raise ValueError(reply["error"])
    return reply


async def _get_profile(client: Client, shown: dict[str, Any], **kwargs: Any) -> Profile:
    reply = await _call(client, "pyspy_profile", **kwargs)
    prof = await off_loop(assemble, reply, shown["by"], shown["weight"])
    return prof if shown["native"] else prof.python_only()


def _window(start: float | None, stop: float | None, last: float | None) -> tuple[float | None, float | None]:
    """A request's window: `start` and `stop`, or the `last` seconds up to now."""
    seconds = options.last(last)
    if seconds is not None:
        if start is not None or stop is not None:
            raise ValueError("give either last or start/stop, not both")
        stop = time.time()
        start = stop - seconds
    return options.window(start, stop)


def _request(
    workers: int | list[str] | None = None,
    scheduler: bool = True,
    start: float | None = None,
    stop: float | None = None,
    last: float | None = None,
    by: str | None = None,
    timeout: float | None = None,
    span: str | list[str] | tuple[str, ...] | None = None,
    weight: str | None = None,
    aggregate: bool = False,
    native: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checks a profile request; returns how exports show it and the scheduler's arguments."""
    shown = {
        "by": options.by(config.get("by") if by is None else by),
        "weight": options.weight(config.get("weight") if weight is None else weight),
        "native": options.flag("native", native),
    }
    options.workers(workers)
    start, stop = _window(start, stop, last)
    timeout = None if timeout is None else options.seconds("timeout", timeout)
    request = dict(
        workers=workers, scheduler=options.flag("scheduler", scheduler), start=start, stop=stop, timeout=timeout
    )
    return shown, dict(request, span=options.span(span), aggregate=options.flag("aggregate", aggregate))


def get_profile(
    client: Client | None = None,
    workers: int | list[str] | None = None,
    scheduler: bool = True,
    start: float | None = None,
    stop: float | None = None,
    last: float | None = None,
    by: str | None = None,
    timeout: float | None = None,
    span: str | list[str] | tuple[str, ...] | None = None,
    weight: str | None = None,
    aggregate: bool = False,
    native: bool = True,
) -> Profile:
    """The cluster's profile of a time window, merged over every selected process.

    A request whose profile would exceed config `pyspy.max-result` is refused
    before anything is sent. Workers that fail, time out or send an unusable
    profile are named in `profile.metadata["missing"]`.

    Args:
        client: the client (default: the current one).
        workers: None (all), a number of workers picked at random, or addresses.
        scheduler: whether to include the scheduler's own samples.
        start: the window's start in Unix seconds (None: open); or give `last`.
        stop: the window's end in Unix seconds (None: open); or give `last`.
        last: the last so many seconds (not with `start` or `stop`).
        by: default grouping of exports, "thread", "task", "prefix", "span" or "activity"
            (time outside tasks by the scheduler's or worker's event-loop activity).
        timeout: seconds (> 0) to wait for each worker (default: config `pyspy.timeout`).
        span: only the samples of one dask span and the spans nested in it: a name (every
            span of that name), a span id, or a path of names outermost first. A name or path
            no span on the scheduler has raises ValueError.
        weight: what a sample weighs in exports, "wall" or "cpu" time.
        aggregate: each process sends counts per (thread, stack, task prefix, span)
            instead of every sample, so the size grows with distinct stacks, not time: for
            big clusters and long windows. Reports and flame graphs are the same; task keys
            give way to their prefix and there is no timeline (speedscope's time order).
        native: False leaves native (C) frames out of the stacks, for the Python-only
            picture (the servers capture them with the sampler option `native`).
    """
    client = client or default_client()
    shown, kwargs = _request(workers, scheduler, start, stop, last, by, timeout, span, weight, aggregate, native)
    return client.sync(_get_profile, client, shown, **kwargs)


SUFFIXES = {
    "html": ".html",
    "speedscope": ".json",
    "speedscope.gz": ".json.gz",
    "pprof": ".pb.gz",
    "pyspy": ".pyspy.gz",
}


def save_or_keep(profile: Profile, path: str | os.PathLike) -> None:
    """Save; if that fails, keep the profile in a temporary file and say where."""
    try:
        profile.save(path)
    except ValueError:  # nothing to keep: an empty profile
        raise
    except Exception as e:
        fd, kept = tempfile.mkstemp(prefix="dask-pyspy-", suffix=SUFFIXES[file_kind(path)])
        os.close(fd)
        profile.save(kept)
        logger.error("dask-pyspy: could not save the profile to %s (%s); kept it at %s", path, e, kept)
        raise OSError(
            f"could not save the profile to {os.fspath(path)!r}: {e}; it was kept at {kept!r} and on .profile"
        ) from e


class profile:
    """Record the block's window of the whole cluster and save it on exit.

    >>> with dask_pyspy.profile("out.speedscope.json.gz") as rec:  # doctest: +SKIP
    ...     x.compute()
    >>> rec.profile  # doctest: +SKIP

    The path is checked on entry, before the workload runs; if saving fails on
    exit the profile is kept (on `.profile` and in a temporary file).
    """

    def __init__(self, path: str | os.PathLike | None = None, client: Client | None = None, **kwargs: Any) -> None:
        if "start" in kwargs or "stop" in kwargs or "last" in kwargs:
            raise ValueError("profile() records the block's own window: start, stop and last are not allowed")
        _request(**kwargs)  # bad options fail now, not after the workload
        self.path = path
        self.client = client
        self.kwargs = kwargs
        self.profile: Profile | None = None

    def __enter__(self) -> profile:
        if self.path is not None:
            check_writable(self.path)
        self.client = self.client or default_client()
        self.start = time.time()
        return self

    def __exit__(self, *exc: Any) -> None:
        client, shown, kwargs = self._window()
        self._finish(client.sync(_get_profile, client, shown, **kwargs))

    async def __aenter__(self) -> profile:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        client, shown, kwargs = self._window()
        self._finish(await _get_profile(client, shown, **kwargs))

    def _window(self) -> tuple[Client, dict[str, Any], dict[str, Any]]:
        """The block's window, ending now, as a request to the client chosen on entry."""
        self.stop = time.time()
        assert self.client is not None, "set by __enter__"
        return (self.client, *_request(start=self.start, stop=self.stop, **self.kwargs))

    def _finish(self, prof: Profile) -> None:
        self.profile = prof
        if self.path is not None:
            save_or_keep(prof, self.path)


class pyspy_report(profile):
    """Like `distributed.performance_report`: on exit, write one self-contained HTML report.

    >>> with dask_pyspy.pyspy_report("report.html"):  # doctest: +SKIP
    ...     x.compute()
    """

    def __init__(
        self, filename: str | os.PathLike = "dask-pyspy-report.html", client: Client | None = None, **kwargs: Any
    ) -> None:
        if file_kind(filename) != "html":
            raise ValueError(f"filename must end in .html, got {os.fspath(filename)!r}")
        super().__init__(filename, client=client, **kwargs)


async def _dump(client: Client, **kwargs: Any) -> StackDump:
    return StackDump(await _call(client, "pyspy_dump", **kwargs))


def dump(client: Client | None = None, workers: int | list[str] | None = None, scheduler: bool = True) -> StackDump:
    """Every thread's current stack on every worker (and the scheduler), with its task."""
    client = client or default_client()
    options.workers(workers)
    return client.sync(_dump, client, workers=workers, scheduler=options.flag("scheduler", scheduler))


async def _stalls(client: Client, min_duration: float, limit: int | None, **kwargs: Any) -> list[dict[str, Any]]:
    reply = await _call(client, "pyspy_stalls", min_duration=min_duration, limit=limit, **kwargs)
    if reply["missing"]:
        logger.warning("dask-pyspy: stalls missing from %s", reply["missing"])
    return stalls.narrowed(stalls.of_processes(reply["processes"].items()), min_duration, limit)


def get_stalls(
    client: Client | None = None,
    start: float | None = None,
    stop: float | None = None,
    last: float | None = None,
    min_duration: float = 0.0,
    workers: int | list[str] | None = None,
    scheduler: bool = True,
    limit: int | None = 100,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """The cluster's event-loop stalls in a window, longest first, each explained: the
    loop's activity, stack and time by state and, while it waited for the GIL, who
    held it (see `dask_pyspy.stalls` for the keys). Workers that cannot answer are
    logged and left out.

    Args:
        client: the client (default: the current one).
        start: the window's start in Unix seconds (None: open); or give `last`.
        stop: the window's end in Unix seconds (None: open); or give `last`.
        last: the last so many seconds (not with `start` or `stop`; default: all kept).
        min_duration: only stalls at least this long (seconds); the servers' threshold is
            config `pyspy.stall-threshold`.
        workers: as for `get_profile`.
        scheduler: as for `get_profile`.
        limit: at most so many (None: all).
        timeout: as for `get_profile`.
    """
    client = client or default_client()
    start, stop = _window(start, stop, last)
    options.workers(workers)
    request = dict(
        start=start,
        stop=stop,
        workers=workers,
        scheduler=options.flag("scheduler", scheduler),
        timeout=None if timeout is None else options.seconds("timeout", timeout),
    )
    min_duration = options.duration_at_least("min_duration", min_duration)
    return client.sync(_stalls, client, min_duration, options.limit(limit), **request)


async def _memory(client: Client, **kwargs: Any) -> MemoryProfile:
    reply = await _call(client, "pyspy_memory", **kwargs)
    if reply["missing"]:
        logger.warning("dask-pyspy: memory counts missing from %s", reply["missing"])
    return MemoryProfile(reply["processes"], reply["missing"])


def get_memory(
    client: Client | None = None,
    start: float | None = None,
    stop: float | None = None,
    last: float | None = None,
    workers: int | list[str] | None = None,
    scheduler: bool = True,
    timeout: float | None = None,
) -> MemoryProfile:
    """What each task prefix allocated, holds and held at most, in every process whose
    sampler tracks memory (option `memory`, on by default): since it started, or
    in a window (to the second): bytes allocated in it, in use at its end and the most
    in use in it. Stacks (`MemoryProfile.processes[name]["sites"]`) are always since
    the sampler started. Workers that cannot answer are logged and listed in
    `MemoryProfile.missing`.

    Args:
        client: the client (default: the current one).
        start: the window's start in Unix seconds (None: open); or give `last`.
        stop: the window's end in Unix seconds (None: open); or give `last`.
        last: the last so many seconds (not with `start` or `stop`; default: since started).
        workers: as for `get_profile`.
        scheduler: as for `get_profile`.
        timeout: as for `get_profile`.
    """
    client = client or default_client()
    start, stop = _window(start, stop, last)
    options.workers(workers)
    request = dict(
        start=start,
        stop=stop,
        workers=workers,
        scheduler=options.flag("scheduler", scheduler),
        timeout=None if timeout is None else options.seconds("timeout", timeout),
    )
    return client.sync(_memory, client, **request)


def _pyspy_profile(self: Client, **kwargs: Any) -> Profile:
    return get_profile(client=self, **kwargs)


def _pyspy_dump(self: Client, **kwargs: Any) -> StackDump:
    return dump(client=self, **kwargs)


def _pyspy_stalls(self: Client, **kwargs: Any) -> list[dict[str, Any]]:
    return get_stalls(client=self, **kwargs)


def _pyspy_memory(self: Client, **kwargs: Any) -> MemoryProfile:
    return get_memory(client=self, **kwargs)


_pyspy_profile.__doc__ = get_profile.__doc__
_pyspy_memory.__doc__ = get_memory.__doc__
_pyspy_stalls.__doc__ = get_stalls.__doc__
_pyspy_dump.__doc__ = dump.__doc__
# Methods added to distributed's Client, which does not declare them.
Client.pyspy_profile = _pyspy_profile  # type: ignore[attr-defined]
Client.pyspy_dump = _pyspy_dump  # type: ignore[attr-defined]
Client.pyspy_stalls = _pyspy_stalls  # type: ignore[attr-defined]
Client.pyspy_memory = _pyspy_memory  # type: ignore[attr-defined]
