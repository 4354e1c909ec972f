"""A profile's summary in words: the window, where task time went, what task threads
were doing, the longest event-loop stall, and each warning with its fix.

The report opens with it, `dask pyspy record` and the demo print it, and
`Profile.summary()` prints as it, so all three tell the same story from this code.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dask_pyspy import stalls
from dask_pyspy.render import tables
from dask_pyspy.render.pages import when
from dask_pyspy.stalls import address_of
from dask_pyspy.states import STATES

TOP_PREFIXES = 3
SHOWN_STATE = 0.005  # of task time: smaller states are left out of the sentence
LOST_WARNING = 0.01  # of thread reads
NAMED = 3  # processes named in a warning; the rest are counted


@dataclass
class Alert:
    """One sentence of what went wrong, with its fix; `about`: the details are the
    sampler's own figures, in the report's "About this profile"."""

    text: str
    about: bool = False


@dataclass
class Findings:
    """What a profile found, sentence by sentence: `tasks` introduces `prefixes`, a
    line per busy task prefix."""

    window: str
    tasks: str = ""
    prefixes: list[str] = field(default_factory=list)
    states: str = ""
    stall: str = ""
    warnings: list[Alert] = field(default_factory=list)

    def text(self) -> str:
        """The findings as a short text block, a sentence or a list item a line."""
        lines = [self.window, *([self.tasks] if self.tasks else [])]
        lines += [f"  {p}" for p in self.prefixes]
        lines += [s for s in (self.states, self.stall) if s]
        lines += [f"Warning: {w.text}" for w in self.warnings]
        return "\n".join(lines)


class Summary(dict[str, Any]):
    """A profile's totals (per process, task prefix, span, activity, function and
    thread state), which print as its findings in words (`.findings`)."""

    def __init__(self, totals: dict[str, Any], findings: Findings) -> None:
        super().__init__(totals)
        self.findings = findings

    def __str__(self) -> str:
        return self.findings.text()

    __repr__ = __str__


def function_file(function: dict[str, Any]) -> str:
    """A summary function's file, or a native one's library marked as such."""
    if function.get("is_native"):
        return f"{function['file']} (native)"  # a library, named below site-packages
    return os.path.basename(function["file"])


def window(metadata: dict[str, Any], totals: dict[str, Any]) -> tuple[float | None, float | None]:
    """The collection window where known, else the first and last sample's times."""
    start, stop = metadata.get("window") or [totals["first"], totals["last"]]
    return start, stop


def find(totals: dict[str, Any], metadata: dict[str, Any], processes: list[dict[str, Any]]) -> Findings:
    """The findings of a profile from its totals (`Profile.summary()`'s dict), metadata
    and processes."""
    task = _task_totals(totals)
    prefixes = totals["prefixes"][:TOP_PREFIXES]
    no_gil = tables.free_threaded(processes)
    return Findings(
        window=_window(totals, metadata, processes),
        tasks=f"Tasks ran {task['seconds']:.1f} thread-seconds; the busiest task prefixes:" if prefixes else "",
        prefixes=[_prefix(p, task["seconds"], no_gil) for p in prefixes],
        states=_states(task, totals, no_gil),
        stall=_longest_stall(processes),
        warnings=list(_warnings(totals, metadata, processes)),
    )


def _window(totals: dict[str, Any], metadata: dict[str, Any], processes: list[dict[str, Any]]) -> str:
    start, stop = window(metadata, totals)
    first, last = when(start), when(stop)
    span = f"{first} to {last[11:] if first[:10] == last[:10] else last}"  # the date once, if one
    duration = f"{stop - start:.1f} s, " if start is not None and stop is not None else ""
    threads = sum(p["threads"] for p in totals["processes"])
    return (
        f"Profiled {duration}{span}: {count(len(processes), 'process', 'es')}, {count(threads, 'thread')}, "
        f"{count(totals['samples'], 'sample')}."
    )


def count(n: int, noun: str, plural: str = "s") -> str:
    """`n` and its noun, plural but for one: "1 thread", "2,134 samples"."""
    return f"{n:,} {noun}{'' if n == 1 else plural}"


DOING = {  # by state, what a thread was doing
    "gil": "running Python (holding the GIL)",
    "no_gil": "on a CPU without the GIL",
    "gil_wait": "waiting for the GIL",
    "cpu_wait": "waiting for a CPU",
    "native": "waiting for native threads (BLAS, arrow)",
    "blocked": "blocked (I/O, locks, sleeps)",
}
WAITS = ("gil_wait", "cpu_wait", "native", "blocked")
ON_CPU = "on a CPU"  # running Python or C alike, where there is no GIL


def _prefix(prefix: dict[str, Any], task_seconds: float, no_gil: bool) -> str:
    """`prefix: 49% of task time, most in f (file.py); 91% running Python (holding the GIL)`."""
    line = f"{prefix['prefix']}: {100 * prefix['seconds'] / (task_seconds or 1.0):.0f}% of task time"
    if prefix["top"]:
        top = prefix["top"][0]
        line += f", most in {top['name']} ({function_file(top)})"
    seconds = {phrase: prefix.get(k, 0.0) for k, phrase in DOING.items()}
    if no_gil:
        seconds[ON_CPU] = seconds.pop(DOING["gil"]) + seconds.pop(DOING["no_gil"])
    phrase = max(seconds, key=seconds.__getitem__)
    if seconds[phrase]:
        line += f"; {100 * seconds[phrase] / (prefix['seconds'] or 1.0):.0f}% {phrase}"
    return line


def _task_totals(totals: dict[str, Any]) -> dict[str, float]:
    """Seconds in tasks, in all and by state: every sample's less those outside tasks."""
    return {k: totals.get(k, 0.0) - totals["untagged"].get(k, 0.0) for k in ("seconds", *STATES)}


def _states(task: dict[str, float], totals: dict[str, Any], no_gil: bool) -> str:
    """What task threads (or, with no task time, all threads) did, as shares of their time."""
    of, who = (task, "Task threads") if task["seconds"] > 0 else (totals, "Threads")
    if of["seconds"] <= 0:
        return ""
    share = {k: of.get(k, 0.0) / of["seconds"] for k in STATES}
    on_cpu = f"{100 * (share['gil'] + share['no_gil']):.0f}% of their time {ON_CPU}"
    if not no_gil:
        on_cpu += f" ({100 * share['gil']:.0f}% holding the GIL)"
    waits = [f"{100 * share[k]:.0f}% {DOING[k]}" for k in WAITS if share[k] >= SHOWN_STATE]
    return f"{who} spent {', '.join([on_cpu, *waits])}."


def _longest_stall(processes: list[dict[str, Any]]) -> str:
    explained = stalls.of_processes((p["name"], (p.get("stats") or {}).get("stalls")) for p in processes)
    if not explained:
        return ""
    longest = explained[0]
    held = "; ".join(f"{seconds:.1f} s {phrase}" for seconds, phrase in stalls.parts(longest)) or "no sample inside it"
    return f"The longest event-loop stall was {longest['duration']:.1f} s in {named(longest['process'])}: {held}."


def named(process: str) -> str:
    """A process's name with its kind: a worker's name is its address alone."""
    return f"worker {process}" if address_of(process) == process else process


def _names(names: list[str]) -> str:
    shown = ", ".join(map(named, names[:NAMED]))
    return shown + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


def _warnings(totals: dict[str, Any], metadata: dict[str, Any], processes: list[dict[str, Any]]) -> Iterator[Alert]:
    if not totals["samples"]:
        yield Alert("No samples in this window: was the plugin running, and did the window cover the work?")
    for o in tables.oversubscribed(processes, totals):
        yield Alert(_oversubscribed(o))
    yield from _rate_warnings(processes)
    yield from _sampler_warnings(processes)
    missing = metadata.get("missing") or {}
    if missing:
        yield Alert(
            f"Missing: {_names(list(missing))} could not be sampled or did not answer; each one's reason is "
            "listed, and a profile collected again may hold them.",
            about=True,
        )


def _oversubscribed(o: dict[str, Any]) -> str:
    """A host whose processes waited for a CPU, and why: too many task threads, or others' load."""
    cores = o["cores"]
    on = count(cores, "core") if cores else "an unknown number of cores"
    said = (
        f"Oversubscribed: on {o['host']}, {_names(o['waiting'])} waited for a CPU more than {o['percent']}% of the "
        f"time they were ready to run; {count(o['processes'], 'process', 'es')} ran "
        f"{count(o['threads'], 'task thread')} there on {on}"
    )
    if cores and o["threads"] < cores:
        return said + ", so other programs took the CPUs: give the cluster a host of its own, or fewer neighbours."
    return said + ": fewer workers or threads per worker (or fewer BLAS threads) would let them run instead."


def _rate_warnings(processes: list[dict[str, Any]]) -> Iterator[Alert]:
    """The budget that held the rate down, with the budget the requested rate needs; a
    sampler that fell behind."""
    held = [p for p in processes if tables.held_by_budget(p["stats"])]
    if held:
        stats = [p["stats"] for p in held]
        per_tick, needed = max(tables.budget_needed(s) for s in stats)
        rates = sorted(s["achieved_rate"] for s in stats)
        yield Alert(
            f"The CPU budget ({100 * stats[0]['config']['cpu_budget']:g}% of a core) held "
            f"{_names([p['name'] for p in held])} to {_range(rates)} Hz of the "
            f"{max(s['requested_rate'] for s in stats):g} asked for: a tick costs up to {1e6 * per_tick:.0f} µs "
            f"here, so that rate needs {needed:g}%; raise it with {tables.BUDGET_OPTION}.",
            about=True,
        )
    behind = [p for p in processes if tables.fell_behind(p["stats"])]
    if behind:
        rates = sorted(p["stats"]["achieved_rate"] for p in behind)
        yield Alert(
            f"The sampling thread of {_names([p['name'] for p in behind])} fell behind its schedule "
            f"({_range(rates)} Hz): the machine was busy; the samples are unbiased, only fewer.",
            about=True,
        )


def _range(rates: list[float]) -> str:
    low, high = f"{rates[0]:.0f}", f"{rates[-1]:.0f}"
    return low if low == high else f"{low}-{high}"


def _sampler_warnings(processes: list[dict[str, Any]]) -> Iterator[Alert]:
    """Reads lost past LOST_WARNING, and sampler errors."""
    lossy = [p["name"] for p in processes if _lost_share(p["stats"]) > LOST_WARNING]
    if lossy:
        yield Alert(
            f"Samples lost: {_names(lossy)} left out more than {100 * LOST_WARNING:g}% of thread reads, stacks "
            "that kept changing while they were copied (usually a machine short of CPU); the rest are not biased "
            "by it.",
            about=True,
        )
    failing = [f"{p['name']} ({failed})" for p in processes if (failed := tables.errors(p["stats"]))]
    if failing:
        yield Alert(f"Sampler errors: {_names(failing)}.", about=True)


def _lost_share(stats: dict[str, Any]) -> float:
    lost, reads = tables.lost_reads(stats)
    return lost / max(reads, 1)
