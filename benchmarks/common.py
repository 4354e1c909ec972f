"""Interleaved runs, statistics and the results file."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import dask
import distributed

import dask_pyspy

READERS = ("fast", "pyspy")
# The free-threaded interpreter ci/matrix.sh builds, in its venv in the sid root.
ROOTS = os.environ.get("DASK_PYSPY_ROOTS", "/var/cache/dask-pyspy-roots")
FREE_THREADED_PYTHON = "/opt/venv-3.13t/bin/python"


@dataclass
class Section:
    title: str
    intro: str = ""
    tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        parts = [f"## {self.title}", self.intro, *self.tables, *(f"- {n}" for n in self.notes)]
        return "\n\n".join(p for p in parts if p)


def sampler_tid() -> int | None:
    """The native id of this process's sampling thread, if one runs."""
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith("dask-pyspy-samp"):
                return int(tid)
    return None


def in_root(suite: str, python: str, args: list[str], timeout: float = 900) -> str:
    """Runs `python ARGS` (a path inside the `suite` root of ci/matrix.sh, as root, through
    chroot) from a copy of this checkout's benchmarks/ in the root, and gives its stdout."""
    from benchmarks import ROOT as CHECKOUT

    root = os.path.join(ROOTS, suite)
    if not os.path.lexists(root + python):  # a link into the root
        raise RuntimeError(f"no interpreter at {root}{python}: ci/matrix.sh builds it")
    dest = os.path.join(root, "opt", "t")
    subprocess.run(["rm", "-rf", dest], check=True)
    os.makedirs(dest)
    subprocess.run(f"tar -c --exclude=__pycache__ benchmarks | tar -x -C {dest}", shell=True, cwd=CHECKOUT, check=True)
    for m in ("proc", "dev", "sys"):
        if not os.path.ismount(os.path.join(root, m)):
            subprocess.run(["mount", "--bind", f"/{m}", os.path.join(root, m)], check=True)
    cmd = ["chroot", root, "/usr/bin/env", "-C", "/opt/t", python, *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timeout).stdout


def in_free_threaded_root(args: list[str], timeout: float = 900) -> str:
    """`in_root` for the free-threaded interpreter ci/matrix.sh builds in the sid root."""
    return in_root("sid", FREE_THREADED_PYTHON, args, timeout)


def run_for(threads: list[threading.Thread], stop: threading.Event, seconds: float) -> None:
    """Starts `threads`, lets them run `seconds`, then stops them (`stop`) and joins them."""
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()


def interleave(contenders: dict[str, Callable[[], dict[str, float]]], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Runs A B C A B C ...; each call returns named measurements."""
    out: dict[str, dict[str, list[float]]] = {name: {} for name in contenders}
    for r in range(rounds):
        for name, run in contenders.items():
            print(f"  round {r + 1}/{rounds}: {name}", flush=True)
            for metric, value in run().items():
                out[name].setdefault(metric, []).append(value)
    return out


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """median (min-max)"""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(header: list[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "?"


def cpu_kind() -> str:
    """The CPU's make and family ("Intel Xeon", "AMD EPYC"): what a system call costs differs
    between kinds far more than within one."""
    model = cpu_model().split("@")[0]
    for word in ("(R)", "(TM)", " Processor", " CPU"):
        model = model.replace(word, "")
    return " ".join(model.split()) or "?"


def machine() -> str:
    try:
        pyspy = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "py-spy"), "--version"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        pyspy = "py-spy CLI not installed"
    return table(
        ["what", "value"],
        [
            ["date", datetime.datetime.now().isoformat(timespec="seconds")],
            ["machine", f"{os.cpu_count()} cores, {cpu_model()}, {platform.platform()}"],
            ["load average at start (1, 5, 15 min)", ", ".join(f"{x:.1f}" for x in os.getloadavg())],
            ["python", sys.version.split()[0]],
            ["dask / distributed", f"{dask.__version__} / {distributed.__version__}"],
            ["dask-pyspy", dask_pyspy.__version__],
            ["py-spy CLI", pyspy],
        ],
    )


def kept_sections(path: str) -> dict[str, str]:
    """The sections an earlier run wrote, by name, so a partial run keeps the others."""
    try:
        with open(path) as f:
            return sections_of(f.read())
    except FileNotFoundError:
        return {}


def sections_of(text: str) -> dict[str, str]:
    chunks = text.split("<!-- section: ")[1:]
    return {c.split(" -->", 1)[0]: "<!-- section: " + c.rstrip() for c in chunks}


def write_section(path: str, name: str, markdown: str) -> None:
    """Puts section `name` into the results at `path`, over its earlier text or after the others."""
    with open(path) as f:
        text = f.read()
    head = text.split("<!-- section: ")[0].rstrip()
    sections = sections_of(text)
    sections[name] = f"<!-- section: {name} -->\n{markdown}"
    with open(path, "w") as f:
        f.write("\n\n".join([head, *sections.values()]) + "\n")
