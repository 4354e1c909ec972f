"""The in-process sampler: a Rust thread that reads this process's Python stacks."""

from __future__ import annotations

import math
import os
import socket
import threading
import weakref
from typing import Any

from dask_pyspy import _native, config, options
from dask_pyspy.model import Profile
from dask_pyspy.options import SamplerOptions

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


class Sampler:
    """Samples every Python thread of this process from a background Rust thread.

    `options` are `SamplerOptions`' fields by name (rate, idle, gil_only, cpu_budget,
    max_memory, recent, history_step, lines, function, reader, native: see there); those not
    given (or None) come from dask config `pyspy.*`. A bad one raises ValueError, an
    unknown name TypeError.

    Samples older than `recent` are folded into a history of `history_step` buckets:
    a profile over them has each task prefix's, span's and activity's time per stack,
    with the prefix as the task key. `Profile.processes[i]["stats"]["resolution"]`
    lists the stretches of the window at each step (0: raw).
    """

    def __init__(self, **options: Any) -> None:
        self.options = config.sampler_options(**options)
        self._native = _native.Sampler(self.options)
        _samplers.add(self)

    def configure(self, **changes: Any) -> None:
        """Apply new options (the constructor's arguments; others keep their value).

        The samples taken so far stay (the oldest fold or go if `max_memory` or
        `recent` shrinks below them); a running sampler restarts with the new options.
        """
        new = self.options.replace(**changes)
        if new == self.options:
            return
        running = self.is_running
        self.stop()
        try:
            self._native.configure(new)
            self.options = new
        finally:
            if running:
                self.start()

    def start(self) -> None:
        """Start sampling; raises RuntimeError if this interpreter cannot be read."""
        if os.environ.get("DASK_PYSPY_TESTING") == "unreadable":
            # Test switch: fail as a process whose memory py-spy cannot read would.
            raise RuntimeError("py-spy cannot read this Python process: simulated by DASK_PYSPY_TESTING=unreadable")
        self._native.start()
        _running.add(self)
        _watch_thread_starts()
        self.name_threads()

    def name_threads(self) -> None:
        """Name live threads in profiles; the fast reader reads no names itself. A forked
        child's thread keeps its parent's `native_id` (CPython never updates it), which on
        3.9 and 3.10 is the only native id the sampler has: the calling thread's is asked."""
        here = threading.current_thread()
        self._native.name_threads(
            [
                (t.ident, t.name, threading.get_native_id() if t is here else t.native_id)
                for t in threading.enumerate()
                if t.ident is not None
            ]
        )

    def stop(self) -> None:
        _running.discard(self)
        self._native.stop()

    @property
    def is_running(self) -> bool:
        return self._native.is_running

    def stats(self) -> dict[str, Any]:
        """Counters of the sampling thread and its store (rate achieved, CPU used, drops)."""
        return self._native.stats()

    def memory(self, start: float | None = None, stop: float | None = None) -> dict[str, Any]:
        """What memory tracking (`memory=True`) counted in this process since the sampler
        started, its prefixes narrowed to the window from `start` to `stop` (Unix
        seconds; to the second) where either is given: one of `MemoryProfile.processes`' values."""
        if start is None and stop is None:
            return self._native.memory()
        return self._native.memory(self._bounds(start, stop))

    def note_arrow_bytes(self, total: int) -> None:
        """What arrow's memory pool holds now (`pyarrow.total_allocated_bytes()`): kept in
        the series beside resident memory while memory is tracked, its growth since the
        last reading charged to the tasks running (it is read as tasks start and end too)."""
        self._native.note_arrow_bytes(total)

    def set_thread_tag(self, ident: int, key: str, prefix: str, span: str | None = None) -> None:
        """Mark thread `ident` as running task `key` (a repr) of task prefix `prefix`,
        in the dask span with id `span`."""
        self._native.set_thread_tag(ident, key, prefix, span)

    def clear_thread_tag(self, ident: int) -> None:
        self._native.clear_thread_tag(ident)

    @property
    def native(self) -> _native.Sampler:
        """The native sampler, for hooks that call it per message (see `activities`)."""
        return self._native

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
        span_ids: list[str] | None = None,
        process_stats: dict[str, Any] | None = None,
    ) -> bytes:
        """The window in the wire format (see `Profile.to_wire`) without a `Profile` in
        between; `aggregate` aggregates it (see `Profile.merge_wire`); `span_ids` keeps
        only the samples of tasks in those spans; `process_stats` joins the process's
        stats (what its server knows: a worker's managed memory)."""
        self._check_started()
        self.name_threads()
        bounds = self._bounds(start, stop)
        return self._native.export(bounds, aggregate, name, metadata, spans, span_ids, process_stats)

    def window_size(
        self, start: float | None, stop: float | None, aggregate: bool, span_ids: list[str] | None = None
    ) -> dict[str, int]:
        """What `export` would hold: samples taken, and the decoded profile's approximate bytes."""
        self._check_started()
        samples, size = self._native.window_size(self._bounds(start, stop), aggregate, span_ids)
        return {"samples": samples, "bytes": size}

    def stalls(
        self, start: float | None = None, stop: float | None = None, min_duration: float = 0.0, most: int = 100
    ) -> dict[str, Any]:
        """This process's event-loop stalls in the window, as a profile's
        `stats["stalls"]` holds them: `records` ([start, duration] each) and the `most`
        longest `explained` (see `dask_pyspy.stalls`)."""
        return self._native.stalls(self._bounds(start, stop), min_duration, most)

    def _check_started(self) -> None:
        if not self._native.has_started:
            raise RuntimeError("the sampler was never started: call start() before profile()")

    @staticmethod
    def _bounds(start: float | None, stop: float | None) -> tuple[float, float]:
        # An open end is open: "now" would cut a folded row that reaches past it by less
        # than its extent's unit.
        return 0.0 if start is None else start, math.inf if stop is None else stop

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
        sampler._native = _native.Sampler(sampler.options)
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

    def acquire(self, opts: SamplerOptions) -> Sampler:
        """The sampler, running with `opts`; hold it until `release()`."""
        with self._lock:
            sampler = self._run_with(opts)
            self._users += 1
            return sampler

    def configure(self, opts: SamplerOptions) -> Sampler:
        """New options for the sampler a user holds, applied at once."""
        with self._lock:
            return self._run_with(opts)

    def _run_with(self, opts: SamplerOptions) -> Sampler:
        if self._sampler is None:
            self._sampler = Sampler(**opts.to_dict())
        else:
            self._sampler.configure(**opts.to_dict())
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
