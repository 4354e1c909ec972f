"""The report's tables per process: each sampler's health, the time by thread state,
hosts short of CPUs; and the thread-state columns every table of the report shares."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from dask_pyspy.states import STATES


def lost_reads(stats: dict[str, Any]) -> tuple[int, int]:
    """Thread-reads left out (stacks that kept changing through every re-read, or a whole
    failed tick), and reads."""
    reader = stats.get("reader_stats") or {}
    # Profiles saved before re-reads were counted dropped reads as "torn_reads".
    lost = reader.get("lost_reads", reader.get("torn_reads", 0)) + stats["failed_ticks"]
    return lost, reader.get("thread_reads") or stats["ticks"]


def _lost(lost: int, reads: int, title: str = "") -> dict[str, str]:
    """Reads left out as a rate, with `title` (the last whole-tick error) as its tooltip."""
    return {"text": f"{100 * lost / max(reads, 1):.1f}%", "title": title}


def errors(stats: dict[str, Any]) -> str:
    """Real failures only: a panic, or the fast reader not used where it was wanted
    (py-spy's reader is 3.9's and 3.10's by design)."""
    reader = stats.get("reader_stats") or {}
    fallback = not reader.get("fallback_expected") and reader.get("fallback_reason")
    return "; ".join(e for e in (stats.get("panic"), fallback and f"fast reader not used: {fallback}") if e)


def budget_needed(stats: dict[str, Any]) -> tuple[float, float]:
    """What a tick cost here (seconds), and the budget the requested rate needs, in
    percent rounded up to 0.5: at that cost, and at least the budget scaled by the rate
    asked over the rate it held the sampler to, as the first ticks (each code object read
    once) are paid from the budget too: at a mean cost within 1% a 15 s demo got 87 Hz."""
    per_tick = stats["cpu_s"] / max(stats["ticks"], 1)
    rate, achieved = stats["requested_rate"], stats["achieved_rate"]
    at_cost = 100 * per_tick * rate
    held = 100 * stats["config"]["cpu_budget"] * rate / achieved if achieved > 0 else at_cost
    return per_tick, math.ceil(2 * max(at_cost, held)) / 2


def held_by_budget(stats: dict[str, Any]) -> bool:
    """Whether the budget kept the rate below 90% of the requested one."""
    return stats["achieved_rate"] < 0.9 * stats["requested_rate"] and bool(stats["throttled_ticks"])


def fell_behind(stats: dict[str, Any]) -> bool:
    """Whether the rate fell below 90% of the requested one with no budget to blame."""
    return stats["achieved_rate"] < 0.9 * stats["requested_rate"] and not stats["throttled_ticks"]


BUDGET_OPTION = "PySpyPlugin(cpu_budget=...) or dask config pyspy.cpu-budget"


def _budget_for(stats: dict[str, Any]) -> str:
    per_tick, needed = budget_needed(stats)
    return f"a tick costs {1e6 * per_tick:.0f} µs here, so {stats['requested_rate']:g} Hz needs {needed:g}%;"


def _rate_note(stats: dict[str, Any]) -> str:
    """Why the achieved rate is below the requested one, and what to do about it."""
    if held_by_budget(stats):
        budget = 100 * stats["config"]["cpu_budget"]
        return (
            f"held to the CPU budget ({budget:g}% of a core) on {stats['throttled_ticks']:,} of "
            f"{stats['ticks']:,} ticks: {_budget_for(stats)} raise it with {BUDGET_OPTION}, or ask for a lower rate"
        )
    return "the sampling thread fell behind its schedule (a busy machine)" if fell_behind(stats) else ""


MAX_PROCESS_ROWS = 20  # per-process tables show the busiest; one line sums the rest
Pair = tuple[dict[str, Any], dict[str, Any]]  # a process and its totals in the summary


def busiest(summary: dict[str, Any]) -> list[int]:
    """Indices of the summary's processes, the most sampled seconds first."""
    return sorted(range(len(summary["processes"])), key=lambda i: -summary["processes"][i]["seconds"])


def _table_processes(processes: list[dict[str, Any]], summary: dict[str, Any]) -> tuple[list[Pair], list[Pair]]:
    """The processes a table lists, with their totals, and the rest: all, in the profile's
    order, up to MAX_PROCESS_ROWS; else the busiest MAX_PROCESS_ROWS, busiest first."""
    pairs = list(zip(processes, summary["processes"]))
    if len(pairs) <= MAX_PROCESS_ROWS:
        return pairs, []
    order = busiest(summary)
    shown = set(order[:MAX_PROCESS_ROWS])
    return [pairs[i] for i in order[:MAX_PROCESS_ROWS]], [p for i, p in enumerate(pairs) if i not in shown]


def _more(rest: list[Pair]) -> str:
    return f"+ {len(rest):,} more processes"


def process_rows(processes: list[dict[str, Any]], summary: dict[str, Any]) -> Iterator[list[Any]]:
    """A row per process: its sampler's rate, cost, losses and errors; then the rest
    summed, if there are more than MAX_PROCESS_ROWS."""
    shown, rest = _table_processes(processes, summary)
    for proc, totals in shown:
        s = proc["stats"]
        failed = errors(s)
        yield [
            proc["name"],
            proc["pid"],
            s.get("reader") or "-",
            totals["threads"],
            totals["samples"],
            float(s["requested_rate"]),
            float(s["achieved_rate"]),
            _rate_note(s),
            float(100 * s["cpu_fraction"]),
            _lost(*lost_reads(s), s.get("last_error") or ""),
            s["store"]["samples_evicted"],
            {"text": failed, "class": "warn"} if failed else "",
        ]
    if rest:
        yield _processes_rest(rest)


def _processes_rest(rest: list[Pair]) -> list[Any]:
    """The rest's sums; rates and costs per process do not sum, so they are left out."""
    stats = [p["stats"] for p, _ in rest]
    lost, reads = (sum(column) for column in zip(*map(lost_reads, stats)))
    failing = sum(bool(errors(s)) for s in stats)
    return [
        _more(rest),
        "",
        "",
        sum(t["threads"] for _, t in rest),
        sum(t["samples"] for _, t in rest),
        "",
        "",
        "",
        "",
        _lost(lost, reads),
        sum(s["store"]["samples_evicted"] for s in stats),
        {"text": f"{failing:,} with errors", "class": "warn"} if failing else "",
    ]


# Free-threaded processes run Python without a GIL: running Python or C is one state
# there, and nothing waits for a GIL.
FREE_THREADED_STATES = {"on_cpu": "on CPU", **{k: STATES[k] for k in ("cpu_wait", "native", "blocked")}}
SUMMED = {"on_cpu": ("gil", "no_gil")}


def free_threaded(processes: list[dict[str, Any]]) -> bool:
    """Every process ran on a free-threaded build with its GIL off."""
    readers = [p["stats"].get("reader_stats") or {} for p in processes]
    return bool(readers) and all(r.get("free_threaded") and not r.get("gil_enabled") for r in readers)


def state_columns(processes: list[dict[str, Any]]) -> dict[str, str]:
    return FREE_THREADED_STATES if free_threaded(processes) else STATES


OVERSUBSCRIBED = 0.2  # a process waiting this share of its ready time for a CPU is told so,
OVERSUBSCRIBED_SAMPLES = 50  # once it has this many samples of ready time


def split(row: dict[str, Any], columns: dict[str, str]) -> list[Any]:
    """CPU seconds, then the share of wall time in each state of `columns`."""
    wall = row["seconds"] or 1.0
    seconds = [sum(row.get(s, 0.0) for s in SUMMED.get(k, (k,))) for k in columns]
    return [float(row["cpu"]), *(f"{100 * s / wall:.0f}%" for s in seconds)]


def _window_cpu(proc: dict[str, Any], key: str) -> float:
    return float((proc["stats"].get("window_cpu") or {}).get(key, 0.0))


def _states_row(name: str, pairs: list[Pair], columns: dict[str, str]) -> list[Any]:
    """The time by thread state of `pairs` together, and the CPU of their native threads."""
    totals = {k: sum(t.get(k, 0.0) for _, t in pairs) for k in ("seconds", "cpu", *STATES)}
    return [
        name,
        float(totals["seconds"]),
        *split(totals, columns),
        sum(_window_cpu(p, "process_cpu_s") for p, _ in pairs),
        sum(_window_cpu(p, "native_cpu_s") for p, _ in pairs),
    ]


def state_rows(
    processes: list[dict[str, Any]], summary: dict[str, Any], columns: dict[str, str]
) -> Iterator[list[Any]]:
    """Each process's time by thread state, and the CPU of its native threads; then
    the rest together, if there are more than MAX_PROCESS_ROWS."""
    shown, rest = _table_processes(processes, summary)
    for pair in shown:
        yield _states_row(pair[0]["name"], [pair], columns)
    if rest:
        yield _states_row(_more(rest), rest, columns)


def _waited_for_a_cpu(t: dict[str, Any]) -> bool:
    """Whether a process's threads waited for a CPU more than OVERSUBSCRIBED of the time
    they were ready to run (on a CPU or waiting for one): blocked threads sampled beside
    them (py-spy's reader keeps more) do not thin it out."""
    ready = sum(t.get(k, 0.0) for k in ("gil", "no_gil", "cpu_wait"))
    ready_samples = t["samples"] * ready / (t["seconds"] or 1.0)
    return ready_samples >= OVERSUBSCRIBED_SAMPLES and t.get("cpu_wait", 0.0) > OVERSUBSCRIBED * ready


def oversubscribed(processes: list[dict[str, Any]], summary: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Each host whose processes waited for a CPU more than OVERSUBSCRIBED of the time
    they were ready to run."""
    hosts: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for proc, totals in zip(processes, summary["processes"]):
        hosts.setdefault(proc.get("host") or "?", []).append((proc, totals))
    for host, procs in sorted(hosts.items()):
        waiting = [p["name"] for p, t in procs if _waited_for_a_cpu(t)]
        if waiting:
            yield {
                "host": host,
                "waiting": waiting,
                "percent": f"{100 * OVERSUBSCRIBED:.0f}",
                "processes": len(procs),
                "threads": sum(t["task_threads"] for _, t in procs),
                "cores": max(p["stats"].get("cores") or 0 for p, _ in procs),
            }
