"""The report's section on memory per task: per process, its resident memory split
into what distributed manages (task results it holds), what task prefixes allocated
and still hold beyond those results, and the rest; per task prefix, bytes allocated,
in use and at peak.

It reads each process's `stats["memory"]` (sampled allocations, `memory=True`),
`stats["managed"]` (a worker's results in memory, by prefix) and its series' last
resident memory; processes that tracked nothing are left out, and a profile with none
gets no section.
"""

from __future__ import annotations

from typing import Any

from dask_pyspy.memory import TOTALS

MIB = 2**20
OUTSIDE = "(outside tasks)"
MAX_PREFIXES = 20  # prefix rows, most in use first


def _mib(n: float) -> int:
    return round(n / MIB)


def _last_rss(stats: dict[str, Any]) -> float | None:
    """The process's resident memory at the window's last step that read it."""
    rss = [r for r in (stats.get("series") or {}).get("rss") or () if r is not None]
    return rss[-1] if rss else None


def _process_row(name: str, stats: dict[str, Any]) -> tuple[list[Any], dict[str, float]]:
    """One process's split, and its prefixes' bytes in use beyond the results it holds."""
    managed: dict[str, float] = stats.get("managed") or {}
    beyond = {
        row["prefix"]: max(row["in_use"] - managed.get(row["prefix"], 0.0), 0.0) for row in stats["memory"]["prefixes"]
    }
    held, attributed = sum(managed.values()), sum(beyond.values())
    rss = _last_rss(stats)
    rest = None if rss is None else rss - held - attributed
    shown = "\u2014" if rest is None else _mib(max(rest, 0.0))
    return [name, "\u2014" if rss is None else _mib(rss), _mib(held), _mib(attributed), shown], beyond


def section(processes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the report's memory section shows, or None where no process tracked memory."""
    tracked = [(p["name"], p["stats"]) for p in processes if (p.get("stats") or {}).get("memory")]
    if not tracked:
        return None
    rows: list[list[Any]] = []
    prefixes: dict[str | None, dict[str, float]] = {}
    for name, stats in tracked:
        row, beyond = _process_row(name, stats)
        rows.append(row)
        managed = stats.get("managed") or {}
        for counted in stats["memory"]["prefixes"]:
            p = counted["prefix"]
            totals = prefixes.setdefault(p, dict.fromkeys((*TOTALS, "managed", "beyond"), 0.0))
            for k in TOTALS:
                totals[k] += counted[k]
            totals["managed"] += managed.get(p, 0.0)
            totals["beyond"] += beyond[p]
    ranked = sorted(prefixes.items(), key=lambda kv: -kv[1]["in_use"])
    return {
        "processes": rows,
        "prefixes": [
            [OUTSIDE if p is None else p, *(_mib(t[k]) for k in (*TOTALS, "managed", "beyond"))]
            for p, t in ranked[:MAX_PREFIXES]
        ],
        "more_prefixes": max(len(ranked) - MAX_PREFIXES, 0),
        "over_resident": [row[0] for row in rows if isinstance(row[1], int) and row[2] + row[3] > row[1]],
        "mean_kib": round(tracked[0][1]["memory"]["mean_bytes"] / 1024),
        "dropped": sum(stats["memory"]["dropped"] for _, stats in tracked),
    }
