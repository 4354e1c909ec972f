"""Memory per task: what each task prefix allocated, holds and held at most, in each
process that samples with `memory=True` (see `SamplerOptions.memory`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dask_pyspy import _native
from dask_pyspy.files import check_writable, file_kind, write_atomic

TOTALS = ("allocated", "in_use", "peak")
OUTSIDE: str = _native.OUTSIDE_TASKS  # how views name prefix None


class MemoryProfile:
    """Sampled allocations per process, by task prefix: since its sampler started, or
    in a window.

    Bytes are estimates from samples (one every ~512 KiB allocated on average), each
    standing for the bytes it was drawn from. `allocated` is what was allocated (in the
    window); `in_use` what the sampled blocks not freed yet stand for (at its end);
    `peak` the most of it at any time (in the window, to the second).

    Each sampled block also has its site: its task prefix and the Python stack that
    allocated it (on CPython 3.11+, where the fast reader runs). `speedscope()`,
    `to_pprof()`, `flamegraph_svg()` and `save()` show bytes by site.

    Attributes:
        processes: by process name (``"worker tcp://..."``, ``"scheduler tcp://..."``),
            what it counted: ``prefixes`` (a list of ``{"prefix", "allocated",
            "in_use", "peak"}``; prefix None is allocation outside tasks), ``window``
            (``[start, stop]`` in Unix seconds where one was asked for, else None:
            since the sampler started), ``sites`` (since the sampler started:
            a list of ``{"prefix", "frames", "note", "allocated", "in_use",
            "allocated_objects", "in_use_objects"}``, frames root first as
            ``{"name", "file", "line"}``; a row without frames stands for what its
            note says: stacks past the most kept, or blocks whose stack was not read),
            ``dropped`` (samples past the cap of blocks kept), ``mean_bytes`` and
            ``tracking``.
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

    def _sites(self) -> dict[str, dict[str, Any]]:
        return {name: {"sites": counted.get("sites") or []} for name, counted in self.processes.items()}

    def speedscope(self) -> dict[str, Any]:
        """The sites as a speedscope document (a dict): per process, a profile of bytes
        in use and one of bytes allocated, each stack under its task prefix."""
        return json.loads(self.to_bytes(compress=False))

    def to_bytes(self, compress: bool = True) -> bytes:
        """`speedscope()` as JSON bytes, gzip-compressed unless `compress=False`."""
        return _native.memory_speedscope(self._sites(), "dask-pyspy memory", bool(compress))

    def to_pprof(self) -> bytes:
        """The sites in pprof's format (gzipped protobuf), valued in ``alloc_objects``,
        ``alloc_space``, ``inuse_objects`` and ``inuse_space`` (the default), labelled
        ``task_prefix`` and ``process``: ``go tool pprof -sample_index=inuse_space x.pb.gz``."""
        return _native.memory_pprof(self._sites())

    def flamegraph_svg(self, title: str = "Bytes in use by task prefix") -> str | None:
        """A flame graph of the bytes in use, every process's stacks under their task
        prefix; None where no sampled block is held."""
        return _native.memory_flamegraph(self._sites(), title)

    def save(self, path: str | os.PathLike) -> Path:
        """Write speedscope (`.json`, `.json.gz`) or pprof (`.pb.gz`), by suffix; raises
        ValueError for other suffixes, or where no sampled allocation has a site."""
        path = check_writable(path)
        kind = file_kind(path)
        if kind not in ("speedscope", "speedscope.gz", "pprof"):
            raise ValueError(
                f"path must end in .json or .json.gz (speedscope) or .pb.gz (pprof) for a memory profile, "
                f"got {os.fspath(path)!r}"
            )
        if not any(site["allocated"] > 0 for c in self._sites().values() for site in c["sites"]):
            raise ValueError(
                f"cannot save {os.fspath(path)!r}: no sampled allocation was counted "
                "(does the plugin run with memory on, its default, and did tasks allocate since it started?)"
            )
        data = self.to_pprof() if kind == "pprof" else self.to_bytes(compress=kind == "speedscope.gz")
        write_atomic(path, data)
        return path

    def __repr__(self) -> str:
        held = sum(t["in_use"] for t in self.by_prefix().values())
        return f"<MemoryProfile: {len(self.processes)} processes, {held / 2**20:,.1f} MiB in use by sampled blocks>"
