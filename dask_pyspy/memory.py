"""Memory per task: what each task prefix allocated, holds and held at most, in each
process that samples with `memory=True` (see `SamplerOptions.memory`)."""

from __future__ import annotations

from typing import Any

TOTALS = ("allocated", "in_use", "peak")
OUTSIDE = "(outside tasks)"  # how views name prefix None


class MemoryProfile:
    """Sampled allocations per process since its sampler started, by task prefix.

    Bytes are estimates from samples (one every ~512 KiB allocated on average), each
    standing for the bytes it was drawn from. `in_use` is what the sampled blocks not
    freed yet stand for; `peak` the most of it at any time.

    Attributes:
        processes: by process name (``"worker tcp://..."``, ``"scheduler tcp://..."``),
            what it counted: ``prefixes`` (a list of ``{"prefix", "allocated",
            "in_use", "peak"}``; prefix None is allocation outside tasks), ``dropped``
            (samples past the cap of blocks kept), ``mean_bytes`` and ``tracking``.
        missing: processes that could not say, and why.
    """

    def __init__(self, processes: dict[str, dict[str, Any]], missing: dict[str, str] | None = None) -> None:
        self.processes = processes
        self.missing = missing or {}

    def by_prefix(self) -> dict[str | None, dict[str, float]]:
        """Per task prefix (None: outside tasks), bytes allocated, in use and at peak,
        summed over the processes; a process's peak is its own, so their sum is at
        least the cluster's peak. Largest in use first."""
        out: dict[str | None, dict[str, float]] = {}
        for counted in self.processes.values():
            for row in counted.get("prefixes", ()):
                totals = out.setdefault(row["prefix"], dict.fromkeys(TOTALS, 0.0))
                for name in TOTALS:
                    totals[name] += row[name]
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["in_use"]))

    def __repr__(self) -> str:
        held = sum(t["in_use"] for t in self.by_prefix().values())
        return f"<MemoryProfile: {len(self.processes)} processes, {held / 2**20:,.1f} MiB in use by sampled blocks>"
