"""The in-process sampler: a Rust thread that reads this process's Python stacks."""

from __future__ import annotations

import os
import socket
import sysconfig
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

from dask_pyspy import _native, options
from dask_pyspy.profile import Profile

_running: weakref.WeakSet[Sampler] = weakref.WeakSet()
_samplers: weakref.WeakSet[Sampler] = weakref.WeakSet()


class _ActiveThreads(dict):
    """`threading._active` that also names each thread in the running samplers as it
    starts, and forgets the name as it ends (a new thread may reuse its ident).

    The fast reader reads no thread names, and a thread may end before anyone asks
    for a profile; `threading` records every thread here, under its own lock.
    """

    def __setitem__(self, ident: int, thread: threading.Thread) -> None:
        super().__setitem__(ident, thread)
        for sampler in list(_running):
            sampler._native.set_thread_name(ident, thread.name, thread.native_id)

    def __delitem__(self, ident: int) -> None:
        super().__delitem__(ident)
        self._forget(ident)

    def pop(self, ident: int, *default: Any) -> Any:
        self._forget(ident)
        return super().pop(ident, *default)

    @staticmethod
    def _forget(ident: int) -> None:
        for sampler in list(_running):
            sampler._native.clear_thread_name(ident)


def _watch_thread_starts() -> None:
    lock = getattr(threading, "_active_limbo_lock", None)
    if lock is None or not isinstance(getattr(threading, "_active", None), dict):
        return  # another threading: names then come from profile() and dump() only
    with lock:
        if not isinstance(threading._active, _ActiveThreads):  # type: ignore[attr-defined]
            threading._active = _ActiveThreads(threading._active)  # type: ignore[attr-defined]


def _checked(
    rate: Any, idle: Any, gil_only: Any, cpu_budget: Any, max_memory: Any, lines: Any, function: Any, reader: Any
) -> dict[str, Any]:
    """Sampler options with their types checked; the native sampler checks their ranges."""
    return dict(
        rate=options.number("rate", rate),
        idle=options.flag("idle", idle),
        gil_only=options.flag("gil_only", gil_only),
        cpu_budget=options.number("cpu_budget", cpu_budget),
        max_memory=options.integer("max_memory", max_memory),
        lines=options.flag("lines", lines),
        function=options.flag("function", function),
        reader=options.reader(reader),
    )


class Sampler:
    """Samples every Python thread of this process from a background Rust thread.

    Parameters
    ----------
    rate: samples per second, in (0, 10000].
    idle: also keep samples of threads that are waiting (off CPU, not holding the GIL).
    gil_only: only sample the thread that holds the GIL.
    cpu_budget: largest fraction of one core the sampler may use, in (0, 1];
        past it the interval stretches and samples are weighted by the time they stand for.
    max_memory: cap on the sample store in bytes (at least 1 MiB); the oldest samples go first.
    lines: record line numbers; off gives function-level profiles at ~25% less cost.
    function: aggregate by each function's first line (``py-spy record --function``).
    reader: ``"auto"`` (the fast reader where its self-check at start passes, else
        py-spy's), ``"fast"`` (our own reader; RuntimeError where it cannot work) or
        ``"pyspy"`` (py-spy's reader, ~8 syscalls per frame). ``stats()["reader"]``
        says which one runs, ``stats()["reader_stats"]["fallback_reason"]`` why.
    """

    def __init__(
        self,
        rate: float = 100,
        idle: bool = False,
        gil_only: bool = False,
        cpu_budget: float = 0.01,
        max_memory: int = 64 * 2**20,
        lines: bool = True,
        function: bool = False,
        reader: str = "auto",
    ) -> None:
        self.options = _checked(rate, idle, gil_only, cpu_budget, max_memory, lines, function, reader)
        self._native = _native.Sampler(SimpleNamespace(**self.options))
        _samplers.add(self)

    def configure(self, **changes: Any) -> None:
        """Apply new options (the constructor's arguments; others keep their value).

        The samples taken so far stay (the oldest go if `max_memory` shrinks below
        them); a running sampler restarts with the new options.
        """
        options.known("sampler options", changes, self.options)
        new = _checked(**{**self.options, **changes})
        if new == self.options:
            return
        running = self.is_running
        self.stop()
        try:
            self._native.configure(SimpleNamespace(**new))
            self.options = new
        finally:
            if running:
                self.start()

    def start(self) -> None:
        """Start sampling; raises RuntimeError if this interpreter cannot be read."""
        if os.environ.get("DASK_PYSPY_TESTING") == "unreadable":
            # Test switch: fail as a process whose memory py-spy cannot read would.
            raise RuntimeError("py-spy cannot read this Python process: simulated by DASK_PYSPY_TESTING=unreadable")
        if sysconfig.get_config_var("Py_GIL_DISABLED"):
            raise RuntimeError(
                "dask-pyspy cannot sample a free-threaded (no-GIL) CPython build: "
                "neither its reader nor py-spy's reads one; use a standard CPython 3.9-3.15"
            )
        self._native.start()
        _running.add(self)
        _watch_thread_starts()
        self.name_threads()

    def name_threads(self) -> None:
        """Name live threads in profiles; the fast reader reads no names itself."""
        self._native.name_threads([(t.ident, t.name, t.native_id) for t in threading.enumerate() if t.ident is not None])

    def stop(self) -> None:
        _running.discard(self)
        self._native.stop()

    @property
    def is_running(self) -> bool:
        return self._native.is_running

    def stats(self) -> dict[str, Any]:
        """Counters of the sampling thread and its store (rate achieved, CPU used, drops)."""
        return self._native.stats()

    def set_thread_tag(self, ident: int, key: str, prefix: str, span: str | None = None) -> None:
        """Mark thread `ident` as running task `key` (a repr) of task prefix `prefix`,
        in the dask span with id `span`."""
        self._native.set_thread_tag(ident, key, prefix, span)

    def clear_thread_tag(self, ident: int) -> None:
        self._native.clear_thread_tag(ident)

    def set_thread_name(self, ident: int, name: str) -> None:
        """Name thread `ident` in profiles, over its Python name (e.g. to add a worker address)."""
        self._native.set_thread_name(ident, name)

    def profile(
        self,
        start: float | None = None,
        stop: float | None = None,
        by: str = "thread",
        name: str | None = None,
    ) -> Profile:
        """The samples taken between `start` and `stop` (Unix seconds; None: open end)."""
        start, stop = options.window(start, stop)
        options.by(by)
        self._check_started()
        self.name_threads()
        native = self._native.profile(self._bounds(start, stop), name or f"{socket.gethostname()}:{os.getpid()}")
        return Profile(native, by=by)

    def export(
        self,
        start: float | None,
        stop: float | None,
        aggregate: bool,
        name: str,
        metadata: dict[str, Any],
        spans: dict[str, dict[str, list[str]]],
    ) -> bytes:
        """The window in the wire format (see `Profile.to_wire`) without a `Profile` in
        between; `aggregate` folds it (see `Profile.merge_wire`)."""
        self._check_started()
        self.name_threads()
        return self._native.export(self._bounds(start, stop), aggregate, name, metadata, spans)

    def window_size(self, start: float | None, stop: float | None, aggregate: bool) -> dict[str, int]:
        """What `export` would hold: samples taken, and the decoded profile's approximate bytes."""
        self._check_started()
        samples, size = self._native.window_size(self._bounds(start, stop), aggregate)
        return {"samples": samples, "bytes": size}

    def _check_started(self) -> None:
        if not self._native.has_started:
            raise RuntimeError("the sampler was never started: call start() before profile()")

    @staticmethod
    def _bounds(start: float | None, stop: float | None) -> tuple[float, float]:
        return 0.0 if start is None else start, time.time() if stop is None else stop

    def dump(self) -> dict[str, Any]:
        """Every thread's stack now (leaf first), with its task and state."""
        self.name_threads()
        return self._native.dump()


def _after_fork_in_child() -> None:
    """A forked child has no sampling thread, and the locks it held stay held: every
    sampler starts over there, stopped, empty and startable. The child's work is its
    own, so nothing restarts by itself."""
    _running.clear()
    for sampler in list(_samplers):
        # The old native sampler, once dropped, leaks its state rather than touch it.
        sampler._native = _native.Sampler(SimpleNamespace(**sampler.options))
    process_sampler._after_fork_in_child()


class ProcessSampler:
    """The one sampler of this process, shared by every server in it (scheduler, workers).

    Each user acquires it and releases it when done; it samples while anyone holds it.
    The last options asked for apply; its store outlives a stop and a change of
    options, so a re-registered plugin keeps the history.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sampler: Sampler | None = None
        self._users = 0

    def acquire(self, opts: dict[str, Any]) -> Sampler:
        """The sampler, running with `opts`; hold it until `release()`."""
        with self._lock:
            sampler = self._run_with(opts)
            self._users += 1
            return sampler

    def configure(self, opts: dict[str, Any]) -> Sampler:
        """New options for the sampler a user holds, applied at once."""
        with self._lock:
            return self._run_with(opts)

    def _run_with(self, opts: dict[str, Any]) -> Sampler:
        if self._sampler is None:
            self._sampler = Sampler(**opts)
        else:
            self._sampler.configure(**opts)
        if not self._sampler.is_running:
            self._sampler.start()
        return self._sampler

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0 and self._sampler is not None:
                self._sampler.stop()

    @property
    def sampler(self) -> Sampler | None:
        return self._sampler

    def _after_fork_in_child(self) -> None:
        # A thread that held the lock at the fork does not exist in the child.
        self._lock = threading.Lock()
        self._users = 0


process_sampler = ProcessSampler()
os.register_at_fork(after_in_child=_after_fork_in_child)
