"""The report's section on memory per task: per process, its resident memory split
into what distributed manages (task results it holds), what task prefixes allocated
and still hold beyond those results, and the rest; per task prefix, bytes allocated,
in use and at peak; and a flame graph of the bytes in use by stack.

It reads each process's `stats["memory"]` (sampled allocations, `memory=True`),
`stats["managed"]` (a worker's results in memory, by prefix) and its series' last
resident memory; processes that tracked nothing are left out, and a profile with none
gets no section.
"""

from __future__ import annotations

from typing import Any

from dask_pyspy.memory import OUTSIDE, TOTALS, MemoryProfile

MIB = 2**20
MAX_PREFIXES = 20  # prefix rows, most in use first
COLUMNS = (*TOTALS, "managed", "beyond")  # the prefix table's figures, in order
NONE = "\u2014"  # a figure not known


def _mib(n: float) -> int:
    return round(n / MIB)


def _last(stats: dict[str, Any], series: str) -> float | None:
    """The process's `series` ("rss", "arrow") at the window's last step that read it."""
    values = [v for v in (stats.get("series") or {}).get(series) or () if v is not None]
    return values[-1] if values else None


def _by_prefix(stats: dict[str, Any]) -> dict[str | None, dict[str, float]]:
    """A process's `COLUMNS` per task prefix: its totals, its results in memory, and
    what it holds beyond them."""
    managed: dict[str, float] = stats.get("managed") or {}
    out = {}
    for row in stats["memory"]["prefixes"]:
        results = managed.get(row["prefix"], 0.0)
        beyond = max(row["in_use"] - results, 0.0)
        out[row["prefix"]] = {**{k: row[k] for k in TOTALS}, "managed": results, "beyond": beyond}
    return out


def _process_row(name: str, stats: dict[str, Any], beyond: float) -> list[Any]:
    """One process's resident memory split into results, `beyond` them, and the rest;
    and what arrow's pool held, which bypasses the allocators sampled."""
    held = sum((stats.get("managed") or {}).values())
    rss, arrow = _last(stats, "rss"), _last(stats, "arrow")
    rest = NONE if rss is None else _mib(max(rss - held - beyond, 0.0))
    return [
        name,
        NONE if rss is None else _mib(rss),
        _mib(held),
        _mib(beyond),
        rest,
        NONE if arrow is None else _mib(arrow),
    ]


def section(processes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the report's memory section shows, or None where no process tracked memory."""
    tracked = [(p["name"], p["stats"]) for p in processes if (p.get("stats") or {}).get("memory")]
    if not tracked:
        return None
    rows: list[list[Any]] = []
    prefixes: dict[str | None, dict[str, float]] = {}
    for name, stats in tracked:
        mine = _by_prefix(stats)
        rows.append(_process_row(name, stats, sum(t["beyond"] for t in mine.values())))
        for p, t in mine.items():
            into = prefixes.setdefault(p, dict.fromkeys(COLUMNS, 0.0))
            for k in COLUMNS:
                into[k] += t[k]
    ranked = sorted(prefixes.items(), key=lambda kv: -kv[1]["in_use"])
    return {
        "processes": rows,
        "prefixes": [[OUTSIDE if p is None else p, *(_mib(t[k]) for k in COLUMNS)] for p, t in ranked[:MAX_PREFIXES]],
        "more_prefixes": max(len(ranked) - MAX_PREFIXES, 0),
        "over_resident": [row[0] for row in rows if isinstance(row[1], int) and row[2] + row[3] > row[1]],
        "graph": MemoryProfile({name: stats["memory"] for name, stats in tracked}).flamegraph_svg(),
        "mean_kib": round(tracked[0][1]["memory"]["mean_bytes"] / 1024),
        "dropped": sum(stats["memory"]["dropped"] for _, stats in tracked),
    }
