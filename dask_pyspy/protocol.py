"""What the scheduler's handlers and their callers (the client, the dashboard) share:
the event topic the handlers log to, and how their replies read."""

from __future__ import annotations

from typing import Any

from dask_pyspy import states
from dask_pyspy.model import Profile

# The scheduler's event topic where its handlers' "start" and "close" are logged, so a
# client can ask whether they are there: calling a missing one logs a traceback there.
EVENT_TOPIC = "dask-pyspy"


def assemble(reply: dict[str, Any], by: str = "thread", weight: str = "wall") -> Profile:
    """The profile of a scheduler's `pyspy_profile` reply: the processes' parts merged
    here, in the caller's process, and narrowed to the span it asked for."""
    merged = Profile.merge_wire(reply["parts"], by=by, weight=weight, spans=reply["spans"], **reply["metadata"])
    span = reply["metadata"].get("span")
    return merged if span is None else merged.only_span(span)


class StackDump(dict):
    """Live stacks of every thread in every process; `str()` prints them like `py-spy dump`,
    each thread's state named as the report names it."""

    def __str__(self) -> str:
        lines: list[str] = []
        for proc in self["processes"].values():
            lines.append(f"Process {proc['process']} (pid {proc['pid']}, {proc.get('reader') or 'no'} reader)")
            for th in proc["threads"]:
                task = f" task {th['task']}" if th["task"] else ""
                lines.append(f"Thread {th['ident']:#x} ({_state(th)}): {th['name'] or ''!r}{task}")
                lines.extend(f"    {_where(f)}" for f in th["frames"])
            lines.append("")
        for name, error in self["missing"].items():
            lines.append(f"Missing {name}: {error}")
        return "\n".join(lines)


def _state(thread: dict[str, Any]) -> str:
    """The thread's state as the report names it, and whether it holds the GIL where
    that name does not say so (a thread blocked in C that kept it stops all others)."""
    said = states.name(thread["state"])
    return f"{said}, holding the GIL" if thread["owns_gil"] and thread["state"] != "cpu-gil" else said


def _where(frame: dict[str, Any]) -> str:
    """`name (file:line)`, as py-spy dump writes it; a native frame with its library."""
    if frame.get("native"):
        return f"{frame['name']} ({frame['file']})"
    return f"{frame['name']} ({frame['file']}:{frame['line']})"
