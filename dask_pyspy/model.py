"""A sampled profile of one process or a whole cluster, and its files."""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar

from dask_pyspy import _native, config, metadata, options, stalls
from dask_pyspy.files import check_writable, file_kind, read_regular, write_atomic
from dask_pyspy.render.diff import ProfileDiff
from dask_pyspy.render.findings import Summary, find
from dask_pyspy.render.report import render_html, render_notebook

TIMELINE_MAX_WINDOW = 7 * 86400.0  # seconds; a longer collection window is not drawn whole


def task_totals(runs: Iterable[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """One process's `tasks` metadata from (prefix, wall seconds) runs: per prefix, the
    count of tasks and their seconds."""
    out: dict[str, dict[str, float]] = {}
    for prefix, seconds in runs:
        entry = out.setdefault(prefix, {"count": 0, "seconds": 0.0})
        entry["count"] += 1
        entry["seconds"] += seconds
    return out


Run = TypeVar("Run")


class RunLog(Generic[Run]):
    """The last `maxlen` task runs, appended by the threads that ran them and copied by
    the one that sums them (`task_totals`). Both under a lock: without a GIL
    (free-threaded builds) copying a deque is not atomic and raises "deque mutated
    during iteration"."""

    def __init__(self, maxlen: int | None) -> None:
        self._runs: deque[Run] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def append(self, run: Run) -> None:
        with self._lock:
            self._runs.append(run)

    def copy(self) -> list[Run]:
        with self._lock:
            return list(self._runs)


class Profile:
    """Samples of one or more processes, with their task tags and dask spans.

    `by` picks the default grouping of exports: "thread" (plain stacks), "task" or
    "prefix" (a root frame per task key or task prefix, so views group by task),
    "span" (root frames for the dask span path, then the task prefix), or "activity"
    (time outside tasks under its event-loop activity, task time under its prefix). `weight` picks
    what a sample weighs in them: "wall" time, or "cpu" time its thread used.
    """

    def __init__(self, native: _native.Profile, by: str = "thread", weight: str = "wall") -> None:
        self._native = native
        self.by = options.by(by)
        self.weight = options.weight(weight)

    def _derive(self, native: _native.Profile) -> Profile:
        return Profile(native, by=self.by, weight=self.weight)

    @classmethod
    def from_wire(cls, data: bytes, by: str = "thread", weight: str = "wall") -> Profile:
        """Read bytes made by `to_wire` (in this or another process)."""
        return cls(_native.Profile.from_wire(data), by=by, weight=weight)

    def to_wire(self) -> bytes:
        """Compact gzip bytes keeping every sample and tag, for sending between processes."""
        return self._native.to_wire()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """Read a profile `save()` wrote, by suffix.

        `.pyspy.gz` loads back exactly as saved: every sample with its time, thread
        state and CPU time, tags with their spans, processes, metadata and `by`.

        speedscope files (`.json`, `.json.gz`) keep what they hold: each thread's
        stacks and weights, thread names, task tags (by="task" the task keys, and
        their prefixes; by="prefix" the prefixes alone, which then stand for the keys
        too; by="span" the prefixes and span paths), processes, metadata and `by`. Not
        in them, so not loaded: sample times (all 0), thread states (all running), CPU
        time, and spans but for their paths by="span". speedscope files of other tools
        are refused, as they hold no processes or task tags.

        A file that is none of these, cut short or damaged, that is not a regular file,
        or whose metadata a report could not read, raises ValueError naming it and
        what is wrong; so does one whose load could take more than twice config
        `pyspy.max-result` (see the user guide, "Saving, loading, comparing"). A file
        that cannot be read raises OSError.
        """
        loadable = ".pyspy.gz, .json or .json.gz"
        try:
            kind = file_kind(path)
        except ValueError:  # its message names every suffix save() writes, not only these
            raise ValueError(f"cannot load {os.fspath(path)!r}: the path must end in {loadable}") from None
        unloadable = {"html": "a report", "pprof": "a pprof file"}
        if kind in unloadable:
            raise ValueError(
                f"cannot load {os.fspath(path)!r}: {unloadable[kind]} cannot be loaded, only {loadable} files"
            )
        limit = config.max_result()
        try:
            data = read_regular(path, limit)
            native, by = _native.Profile.from_file(data, speedscope=kind != "pyspy", max_result=limit)
            metadata.check(native.metadata(), native.processes())
        except ValueError as e:
            raise ValueError(f"cannot load {os.fspath(path)!r}: {e}") from None
        return cls(native, by=by)

    @property
    def metadata(self) -> dict[str, Any]:
        """The run's facts, such as per-process sampler stats (rate achieved, throttling, errors)."""
        meta = self._native.metadata()
        meta["processes"] = self.processes
        return meta

    @property
    def processes(self) -> list[dict[str, Any]]:
        return self._native.processes()

    def stalls(self, min_duration: float = 0.0, limit: int | None = None) -> list[dict[str, Any]]:
        """The event-loop stalls in this profile, longest first, each explained (see
        `dask_pyspy.stalls`): the longest 100 of each process, of at least `min_duration`
        seconds, at most `limit` of them."""
        min_duration = options.duration_at_least("min_duration", min_duration)
        limit = options.limit(limit)
        processes = ((p["name"], (p.get("stats") or {}).get("stalls")) for p in self.processes)
        return stalls.narrowed(stalls.of_processes(processes), min_duration, limit)

    @property
    def n_samples(self) -> int:
        return self._native.n_samples

    @property
    def keeps_times(self) -> bool:
        """Whether the profile says when its time went, as `timeline()` shows.

        Raw samples do; aggregated ones by the timeline cells they carry, which profiles
        aggregated by dask-pyspy before it kept them lack."""
        return self._native.has_timeline or not self.metadata.get("aggregate")

    @property
    def sampled_seconds(self) -> float:
        """Thread-seconds the samples stand for."""
        return self._native.total_seconds

    @classmethod
    def merge(
        cls,
        profiles: list[Profile],
        by: str = "thread",
        spans: dict[str, dict[str, list[str]]] | None = None,
        **metadata: Any,
    ) -> Profile:
        """One profile of several processes; a process seen twice is kept once.

        The `tasks` metadata of each part (per worker) is combined. `spans` names
        spans (as in `with_spans`), over what the parts knew.
        """
        return cls(_native.Profile.merge([p._native for p in profiles], metadata, spans or {}), by=by)

    @classmethod
    def merge_wire(
        cls,
        parts: dict[str, bytes],
        by: str = "thread",
        weight: str = "wall",
        spans: dict[str, dict[str, list[str]]] | None = None,
        **metadata: Any,
    ) -> Profile:
        """One profile of processes' `to_wire` bytes, by name, merged as each is decoded
        with the GIL released (as `merge` does for profiles). A part that cannot be
        decoded is left out and named, with why, in `metadata["missing"]`.

        Parts a worker aggregated (`pyspy_profile(aggregate=True)`) hold one sample per
        thread, stack, task prefix, span and thread state, with the time and count of
        the samples it stands for: task keys give way to their prefix, and sample
        times are the first of each. When the time went travels beside them, per
        thread, prefix, span and activity in 10 s steps, for `timeline()`.
        """
        native = _native.Profile.merge_wire(list(parts.items()), metadata, spans or {})
        return cls(native, by=by, weight=weight)

    def summary(self) -> Summary:
        """Totals as a dict: per process, per task prefix (with top functions), per thread
        state. It prints as the profile's findings in words (`.findings`): the window, the
        busiest task prefixes, what task threads did, the longest stall, any warning."""
        totals = self._native.summary()
        return Summary(totals, find(totals, self.metadata, self.processes))

    def timeline(self, step: float | None = None, by: str = "prefix") -> dict[str, Any]:
        """What ran when: wall and CPU seconds per time step, per process kind.

        `step`: seconds per step; None picks 1, 2, 5, 10, 15, 30 s, 1, 2, 5, 10, 15,
        30 min, 1, 2, 3, 6, 12 or 24 h, the first giving at most 300 steps over the
        profile (and its collection window where known, up to a week). Steps start at
        multiples of the step in Unix time. `by`: "prefix" splits task time by task
        prefix, "span" by span path ("(no span)" outside any). Time outside tasks is split by event-loop
        activity, "(no task)" where in none.

        Returns `{"step": s, "start": unix s, "steps": n, "kinds": {kind: {"processes",
        "wall": [..], "cpu": [..]}}, "series": [{"name", "kind", "group", "seconds",
        "wall": [..], "cpu": [..]}]}`: kinds are "scheduler" (processes whose name
        starts with it) and "worker" (every other), each with its totals per step;
        series, largest total wall `seconds` first, are one per kind and name, with
        `group` "prefix" or "span" (task time) or "activity" (outside tasks). Also
        `"processes": [{"name", "kind", "cpu": [..], "rss": [..]}]`: each process's CPU
        seconds and most resident memory (bytes) per step, as its sampler kept them
        each second; None in steps it was not seen. Where memory per task was tracked,
        a process also has `"in_use": [{"prefix", "bytes": [..]}]`, the most each task
        prefix held per step (prefix None: outside tasks).

        A thread's samples at one instant cover [time, time + their summed weight], each
        spread over the steps that overlap it: raw samples fall in the step of their
        time, and a coarse sample standing for a longer bucket spreads over the bucket;
        a folded history row's part spreads over where its samples fell.
        Every step's series add up to its kind's totals, and the steps to the profile's.
        An aggregated profile (`aggregated()`, `aggregate=True`) keeps no sample times;
        its timeline is drawn from the 10 s cells it carries instead: the default step is
        10 s or more, and a finer one shows each cell's time spread evenly over its 10 s.
        """
        if not self.keeps_times:
            raise ValueError("this profile was aggregated by a dask-pyspy that kept no timeline: it has no times")
        if step is not None:
            step = options.seconds("step", step)
        window = self._native.metadata().get("window")
        # The steps cover the window asked for, so quiet ends show as quiet; not an open
        # end (None), nor a window like start=0 whose steps would be mostly before any sample.
        bounds = None
        if window and None not in window and window[1] - window[0] <= TIMELINE_MAX_WINDOW:
            bounds = (float(window[0]), float(window[1]))
        return self._native.timeline(step=step, by=options.choice("by", by, ("prefix", "span")), bounds=bounds)

    def flamegraph_svg(
        self,
        title: str,
        by: str = "thread",
        prefix: str | None = None,
        process: int | None = None,
        tasks: bool | None = None,
        span: str | list[str] | tuple[str, ...] | None = None,
        weight: str | None = None,
        activity: str | None = None,
        stalls: bool = False,
    ) -> str | None:
        """An interactive flame graph (an icicle, roots on top); None if no sample matches.

        by="thread" shows raw stacks; "task", "prefix" or "span" roots them at their task
        key, prefix, or span path and prefix, and cuts the worker's machinery below each
        task's own code; "activity" roots time outside tasks at its event-loop activity
        (kind, then name) and task time at its prefix. A call cycle repeated in a row
        (recursion) is shown once. The samples can be narrowed to one task `prefix`, one
        `process` (an index into `processes`), one `span` (see `only_span`), to task time
        (`tasks=True`) or time outside tasks (`tasks=False`), and to time outside tasks
        in one `activity` (as `summary()["activities"]` names it, e.g.
        "scheduler: task-finished"). `stalls=True` keeps only time inside event-loop
        stalls: the loops' threads and the threads holding the GIL they waited for.
        `weight`: "wall" or "cpu" (default: the profile's).
        """
        if tasks is not None:
            options.flag("tasks", tasks)
        weight = options.weight(self.weight if weight is None else weight)
        return self._native.flamegraph_svg(
            title,
            by=options.by(by),
            weight=weight,
            prefix=prefix,
            process=process,
            tasks=tasks,
            span=options.span(span),
            activity=activity,
            stalls=options.flag("stalls", stalls),
        )

    def process_flamegraph_svgs(self, titles: dict[int, str]) -> dict[int, str | None]:
        """`flamegraph_svg(title, process=i)` of each process index `i` in `titles`, from
        one pass over the samples (a graph each reads them all once per process)."""
        svgs = self._native.process_flamegraph_svgs(list(titles.items()), weight=self.weight)
        return dict(zip(titles, svgs))

    def aggregated(self, keys: bool = False) -> Profile:
        """The same totals in fewer samples: one per thread, stack, task, span and
        thread state, with the time and count of the samples it stands for (as
        `pyspy_profile(aggregate=True)` sends them). Reports, flame graphs and
        summaries read the same; sample order, so speedscope's time order, is gone.
        Unless `keys`, task keys give way to their prefix."""
        return self._derive(self._native.aggregated(options.flag("keys", keys)))

    def python_only(self) -> Profile:
        """The same samples with their native (C) frames left out: the Python-only picture."""
        return self._derive(self._native.python_only())

    @property
    def has_native(self) -> bool:
        """Whether any sample has native frames (sampler option `native`)."""
        return self._native.has_native

    def only_process(self, index: int) -> Profile:
        """The samples of `self.processes[index]` alone."""
        return self._derive(self._native.only_process(index))

    def only_span(self, span: str | list[str] | tuple[str, ...]) -> Profile:
        """The samples of one dask span and the spans nested in it: `span` is a name
        (every span of that name), a span id, or a path of names outermost first."""
        chosen = options.span(span)
        if chosen is None:
            raise ValueError("span must be a span name or id, or a path of names, got None")
        return self._derive(self._native.only_span(chosen))

    def with_metadata(self, **extra: Any) -> Profile:
        return self._derive(self._native.with_metadata(extra))

    def with_spans(self, spans: dict[str, dict[str, list[str]]]) -> Profile:
        """A copy that knows these spans: {id: {"names": [...], "ids": [...]}}, outermost first."""
        return self._derive(self._native.with_spans(spans))

    @property
    def span_ids(self) -> list[str]:
        """Ids of the dask spans the samples ran in."""
        return self._native.span_ids()

    def speedscope(self, by: str | None = None, weight: str | None = None) -> dict[str, Any]:
        """The profile as a speedscope document (a dict)."""
        return json.loads(self.to_bytes(compress=False, by=by, weight=weight))

    def to_bytes(self, compress: bool = True, by: str | None = None, weight: str | None = None) -> bytes:
        """The speedscope document as JSON bytes, gzip-compressed unless `compress=False`."""
        by = options.by(self.by if by is None else by)
        weight = options.weight(self.weight if weight is None else weight)
        return self._native.speedscope(by=by, weight=weight, compress=options.flag("compress", compress))

    def to_pprof(self) -> bytes:
        """The profile in pprof's format (gzipped protobuf), for `go tool pprof`, Pyroscope or
        Grafana: one sample per stack, task and thread, in counts, wall and (where measured)
        CPU nanoseconds, labelled task_key, task_prefix, span, process and thread."""
        return self._native.pprof()

    def save(self, path: str | os.PathLike, by: str | None = None) -> Path:
        """Write speedscope (`.json`, `.json.gz`), dask-pyspy's own file (`.pyspy.gz`),
        pprof (`.pb.gz`) or an HTML report (`.html`), by suffix. `load()` reads back the
        first two.

        speedscope files open on the merged profile with the most task time (by="task":
        the whole cluster by task; "prefix": one per task prefix; "span": the whole
        cluster by span), then hold one profile per thread with its raw stacks, weighted
        as `self.weight` says. pprof files hold raw stacks, tasks and spans as labels
        (`by` and `weight` do not apply). An empty profile raises ValueError for both.
        `.pyspy.gz` (gzip JSON of {"format": "dask-pyspy profile", "version": 1, "by",
        "profile"}) keeps everything, and records `by`.
        """
        path = check_writable(path)
        kind = file_kind(path)
        if kind in ("speedscope", "speedscope.gz", "pprof") and not self.n_samples:
            raise ValueError(
                f"cannot save {os.fspath(path)!r}: the profile holds no samples (speedscope opens no empty profile, "
                "an empty pprof shows nothing); was the plugin running, and did the window cover the work? "
                "(an .html report can be saved)"
            )
        if kind == "html":
            data = self.to_html().encode()
        elif kind == "pprof":
            data = self.to_pprof()
        elif kind == "pyspy":
            data = self._native.to_file(options.by(self.by if by is None else by))
        else:
            data = self.to_bytes(compress=kind == "speedscope.gz", by=by)
        write_atomic(path, data)
        return path

    def diff(self, base: Profile) -> ProfileDiff:
        """What changed from `base` to this profile: a differential flame graph (time
        scaled per profile, so runs of different lengths compare) and the functions and
        task prefixes that gained or lost most; see `ProfileDiff`."""
        if not isinstance(base, Profile):
            raise TypeError(f"base must be a Profile, got {type(base).__name__}")
        return ProfileDiff(self._native.diff(base._native))

    def to_html(self, title: str = "dask-pyspy report") -> str:
        """A self-contained HTML report (summary, flame graphs, task prefixes, the raw profile)."""
        return render_html(self, title=title)

    def _repr_html_(self) -> str:
        return render_notebook(self)

    def __repr__(self) -> str:
        names = ", ".join(p["name"] for p in self.processes)
        return (
            f"<Profile {self.n_samples} samples, {self.sampled_seconds:.1f} thread-s, by={self.by!r}, "
            f"weight={self.weight!r}, processes: {names}>"
        )
