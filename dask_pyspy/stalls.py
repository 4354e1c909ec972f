"""Event-loop stalls: stretches in which a server's event loop did not get back to its
poll for at least `pyspy.stall-threshold`, each explained from the samples inside it.

A stall is a dict:

- `process`: the process as profiles name it, `address`: its server's (None for a
  process that is no server), `thread`: the loop's thread;
- `start` (Unix seconds), `duration` (seconds);
- `activity`: what the loop ran for most of it ("worker: gather", ...);
- `states`: the loop thread's sampled seconds by state ("cpu-gil", "gil-wait", "blocked", ...);
- `stack`: its most sampled stack's innermost frames, innermost first;
- `call`: the system call it was blocked in most, if it was;
- `gil_holders`: while it waited for the GIL, who held it, most first: dicts of
  `thread`, `task_key`, `prefix`, `activity`, `function` (the innermost) and `seconds`;
- `holders`: "known", or why holders cannot be (free-threaded; py-spy's reader).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

SCHEDULER_PREFIX = "scheduler "
SHOWN_S = 0.05  # a part of a stall shorter than this is left out of its description


def address_of(process: str) -> str | None:
    """The server address in a process's name ("scheduler tcp://...", a worker's address)."""
    address = process[len(SCHEDULER_PREFIX) :] if process.startswith(SCHEDULER_PREFIX) else process
    return address if "://" in address else None


def of_processes(processes: Iterable[tuple[str, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    """The explained stalls of each (process name, `stats["stalls"]`), longest first."""
    out = []
    for name, stalls in processes:
        address = address_of(name)
        for stall in (stalls or {}).get("explained", ()):
            out.append({"process": name, "address": address, **stall, "holders": (stalls or {}).get("holders")})
    return sorted(out, key=lambda s: -s["duration"])


def narrowed(stalls: list[dict[str, Any]], min_duration: float = 0.0, limit: int | None = None) -> list[dict[str, Any]]:
    kept = [s for s in stalls if s["duration"] >= min_duration]
    return kept if limit is None else kept[:limit]


def _holder(h: dict[str, Any]) -> str:
    if h.get("task_key"):
        who = f"task {h['task_key']}"
    elif h.get("activity"):
        who = h["activity"]
    else:
        who = f"thread {h['thread']}"
    return f"{who} in `{h['function']}`"


def parts(stall: dict[str, Any]) -> list[tuple[float, str]]:
    """What the loop's thread did in the stall, as (seconds, phrase), most first."""
    states = stall.get("states") or {}
    out: list[tuple[float, str]] = []
    gil = states.get("gil-wait", 0.0)
    if gil:
        holders = stall.get("gil_holders") or []
        if holders:
            held = _holder(holders[0]) + (f" (and {len(holders) - 1} more)" if len(holders) > 1 else "")
        elif stall.get("holders") in (None, "known"):
            held = "a thread not sampled"  # this reader marks holders; none in this stall's ticks
        else:
            held = f"an unknown thread ({stall['holders']})"
        out.append((gil, f"waiting for the GIL held by {held}"))
    running = states.get("cpu-gil", 0.0) + states.get("cpu", 0.0)
    if running:
        where = f" at `{stall['stack'][0]}`" if stall.get("stack") else ""
        out.append((running, f"running {stall.get('activity') or 'the event loop'}{where}"))
    blocked = states.get("blocked", 0.0) + states.get("native", 0.0)
    if blocked:
        call = f" in {stall['call']}" if stall.get("call") else ""
        out.append((blocked, f"blocked{call} in {stall.get('activity') or 'the event loop'}"))
    if states.get("cpu-wait"):
        out.append((states["cpu-wait"], "waiting for a CPU"))
    return sorted((p for p in out if p[0] >= SHOWN_S), key=lambda p: -p[0])


def describe(stall: dict[str, Any]) -> str:
    """One line: '2.1 s stall: 1.9 s waiting for the GIL held by task ... in `f (x.py:3)`; ...'."""
    said = "; ".join(f"{seconds:.1f} s {phrase}" for seconds, phrase in parts(stall))
    return f"{stall['duration']:.1f} s stall: {said or 'not sampled'}"


def table(stalls: list[dict[str, Any]]) -> str:
    """A plain-text table, one stall a line, longest first."""
    if not stalls:
        return "No event-loop stalls in that window."
    rows = [("start", "duration", "process", "what held the loop")]
    for s in stalls:
        at = time.strftime("%H:%M:%S", time.localtime(s["start"])) + f".{int(s['start'] % 1 * 1000):03d}"
        said = "; ".join(f"{sec:.2f} s {phrase}" for sec, phrase in parts(s)) or "not sampled"
        rows.append((at, f"{s['duration']:.2f} s", s["process"], said))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows)
