"""The report's section on event-loop stalls: per process how many, how long in all and
the longest; the longest stalls, each with what held its loop; and the notes a reader
needs where holders could not be known or stalls were not all kept.

It reads each process's `stats["stalls"]` (see `dask_pyspy.stalls`); profiles saved
before stalls were watched have none, and get no section.
"""

from __future__ import annotations

import datetime
from typing import Any

from dask_pyspy.render.pages import when
from dask_pyspy.stalls import of_processes, parts

SHOWN = 20  # stalls listed, the longest
MAX_PROCESS_ROWS = 20  # processes listed, the most stalled; one line says how many more
STACK_FRAMES = 5  # of the loop's stack, innermost first
MOST_HOLDERS = 3  # GIL holders listed per stall
KNOWN = "known"  # a process's `holders`: else why not (the sampler's words)
NO_GIL = "no GIL"
NONE = "\u2014"

Stats = tuple[str, dict[str, Any]]  # a process's name and its `stats["stalls"]`


def of_profile(processes: list[dict[str, Any]]) -> list[Stats]:
    """Each process's stalls, where it carries them (older profiles do not)."""
    found = ((p["name"], (p.get("stats") or {}).get("stalls")) for p in processes)
    return [(name, s) for name, s in found if s]


def _clock(t: float) -> dict[str, str]:
    """A stall's start to the millisecond, its date in the tooltip."""
    return {"text": datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3], "title": when(t)}


def _holder(h: dict[str, Any]) -> dict[str, Any]:
    """Who held the GIL (a task key, else a loop's activity, else the thread), where, how long."""
    who = h.get("task_key") or h.get("activity") or f"thread {h['thread']}"
    return {"who": who, "function": h.get("function") or "?", "seconds": float(h["seconds"])}


def _holders(stall: dict[str, Any]) -> dict[str, Any]:
    held = stall.get("gil_holders") or []
    why = stall.get("holders")
    return {
        "shown": [_holder(h) for h in held[:MOST_HOLDERS]],
        "more": max(len(held) - MOST_HOLDERS, 0),
        "unknown": why if not held and why and why != KNOWN else None,
    }


def _row(stall: dict[str, Any]) -> dict[str, Any]:
    return {
        "start": _clock(stall["start"]),
        "seconds": float(stall["duration"]),
        "process": stall["process"],
        "activity": stall.get("activity") or NONE,
        "held": [f"{seconds:.2f} s {phrase}" for seconds, phrase in parts(stall)],
        "stack": list(stall.get("stack") or [])[:STACK_FRAMES],
        "holders": _holders(stall),
        "call": stall.get("call") or NONE,
    }


PROCESS_HEADER = ["process", "stalls", "stalled s", "longest s", "notes"]


def _notes(stats: dict[str, Any]) -> str:
    notes = []
    if stats.get("holders", KNOWN) != KNOWN:
        notes.append(f"GIL holders {stats['holders']}")
    if stats.get("dropped"):
        notes.append(f"{stats['dropped']:,} older stalls ({stats.get('dropped_s', 0.0):.1f} s) thinned out")
    if stats.get("lost"):
        notes.append(f"{stats['lost']:,} lost")
    return "; ".join(notes)


def _process_rows(stalled: list[Stats]) -> list[list[Any]]:
    """A row per stalled process, the most stalled first."""
    rows = []
    for name, stats in stalled:
        durations = [d for _, d in stats["records"]]
        # A window carries the longest 2,000 records, and the count and time of them all.
        count, total = stats.get("count", len(durations)), stats.get("stalled_s", sum(durations))
        rows.append([name, count, float(total), float(max(durations)), _notes(stats)])
    return sorted(rows, key=lambda r: -r[2])


def _threshold(stalled: list[Stats]) -> str:
    """The servers' threshold in ms, or their range where they differ."""
    ms = sorted({round(1000 * s["threshold"]) for _, s in stalled if s.get("threshold") is not None})
    if not ms:
        return "its threshold"
    return f"{ms[0]} ms" if len(ms) == 1 else f"{ms[0]}-{ms[-1]} ms"


def _unknown_holders(processes: list[Stats]) -> list[dict[str, Any]]:
    """Per reason, the stalled processes whose GIL holders could not be known."""
    by_reason: dict[str, list[str]] = {}
    for name, stats in processes:
        if stats.get("records") and stats.get("holders", KNOWN) != KNOWN:
            by_reason.setdefault(stats["holders"], []).append(name)
    return [
        {"reason": reason, "processes": names, "free_threaded": reason.startswith(NO_GIL)}
        for reason, names in by_reason.items()
    ]


def section(processes: list[Stats], graph: str | None) -> dict[str, Any] | None:
    """What the report's stall section shows, None if no process stalled in the window;
    `graph` is the flame graph of the time inside them."""
    stalled = [(name, s) for name, s in processes if s.get("records")]
    if not stalled:
        return None
    rows = _process_rows(stalled)
    explained = of_processes(stalled)
    return {
        "threshold": _threshold(stalled),
        "count": sum(r[1] for r in rows),
        "seconds": sum(r[2] for r in rows),
        "processes": rows[:MAX_PROCESS_ROWS],
        "more_processes": max(len(rows) - MAX_PROCESS_ROWS, 0),
        "process_header": PROCESS_HEADER,
        "stalls": [_row(s) for s in explained[:SHOWN]],
        "unknown_holders": _unknown_holders(stalled),
        "unwatched": [name for name, s in processes if not s.get("watched", True)],
        "graph": graph,
    }
