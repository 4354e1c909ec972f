"""Native merge on each interpreter (section `native_merge`): whether native captures
merge with the Python frames of their sample on every CPython this machine has, Debian's
stripped builds and pyenv's builds with symbols alike (issue 44's "merge right everywhere").

The same child (native_child.py's `merge`: 2 numpy matmul threads and a qsort calling back
a Python comparator) runs in each interpreter: pyenv's, in venvs under .cache/native-merge,
and ci/matrix.sh's Debian roots (as root, through chroot). Every GIL interpreter gets this
checkout's abi3 wheel (ci/wheel.sh); 3.13t keeps the cp313t wheel the matrix built last.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from benchmarks import ROOT as CHECKOUT
from benchmarks.common import FREE_THREADED_PYTHON, ROOTS, Section, in_root, table, verdict
from benchmarks.native.native_agreement import comparator_order
from benchmarks.native.native_coverage import thread_share
from benchmarks.native.native_runs import run_child

MISMATCHED_MAX = 0.02
PYENV_VERSIONS = os.path.join(os.environ.get("PYENV_ROOT", "/root/.pyenv"), "versions")
VENVS = os.path.join(CHECKOUT, ".cache", "native-merge")
#: ci/matrix.sh's interpreters: (suite, python inside the root, how it was built).
ROOTED = [
    ("bullseye", "/opt/venv-3.9/bin/python", "Debian bullseye's package (stripped)"),
    ("sid", "/opt/venv-3.13/bin/python", "Debian sid's package (stripped)"),
    ("sid", "/opt/venv-3.14/bin/python", "Debian sid's package (stripped)"),
    ("sid", "/opt/venv-3.15/bin/python", "Debian sid's package (stripped)"),
    ("sid", FREE_THREADED_PYTHON, "free-threaded, built from Debian's source by ci/matrix.sh"),
]


@dataclass
class Merge:
    """One interpreter's run."""

    interpreter: str
    build: str
    result: dict[str, Any]

    def row(self) -> list[object]:
        s = self.result["stats"]
        n = s["native"]
        doc = self.result["doc"]
        matmul = [thread_share(doc, f"work-{i}", "gemm") for i in (0, 1)]
        total, gemm = sum(t for t, _ in matmul), sum(g for _, g in matmul)
        order = comparator_order(doc, [])
        return [
            self.interpreter,
            self.build,
            s["reader"],
            n["captures"],
            n["exact"],
            f"{n['mismatched']} ({100 * self.mismatched_share:.1f}%)",
            f"{100 * gemm / total:.1f}%" if total else "-",
            f"{100 * order['in order'] / order['samples']:.1f}%" if order["samples"] else "-",
            f"{s['achieved_rate']:.1f}",
            verdict(self.mismatched_share <= MISMATCHED_MAX),
        ]

    @property
    def mismatched_share(self) -> float:
        n = self.result["stats"]["native"]
        return n["mismatched"] / max(n["captures"], 1)


def wheel() -> str:
    """This checkout's abi3 wheel, built by ci/wheel.sh."""
    out = subprocess.run(["bash", "ci/wheel.sh"], cwd=CHECKOUT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ci/wheel.sh could not build the wheel to measure:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def pyenv_python(version_dir: str, whl: str) -> str:
    """A venv of pyenv's interpreter with numpy and `whl` (made once, the wheel renewed)."""
    venv = os.path.join(VENVS, os.path.basename(version_dir))
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([os.path.join(version_dir, "bin", "python"), "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "numpy", whl], check=True)
    else:
        subprocess.run([python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", whl], check=True)
    return python


def version_of(version_dir: str) -> tuple[int, ...]:
    """(3, 10) of pyenv's .../versions/3.10.13; (0,) of a name that is no version (a venv)."""
    try:
        return tuple(int(p) for p in os.path.basename(version_dir).split(".")[:2])
    except ValueError:
        return (0,)


def in_pyenv(seconds: float, whl: str) -> list[Merge]:
    out = []
    for version, version_dir in sorted((version_of(d), d) for d in glob.glob(os.path.join(PYENV_VERSIONS, "3.*"))):
        if version < (3, 9):
            continue
        print(f"  pyenv {os.path.basename(version_dir)}", flush=True)
        python = pyenv_python(version_dir, whl)
        result = run_child({"mode": "merge", "seconds": seconds}, timeout=300, python=python)
        out.append(Merge(result["python"], "pyenv's build (symbols kept)", result))
    return out


def in_roots(seconds: float, whl: str) -> list[Merge]:
    out = []
    for suite, python, build in ROOTED:
        if not os.path.lexists(os.path.join(ROOTS, suite) + python):
            print(f"  no {python} in the {suite} root: ci/matrix.sh builds it", flush=True)
            continue
        print(f"  {suite} {python}", flush=True)
        if python != FREE_THREADED_PYTHON:
            os.makedirs(os.path.join(ROOTS, suite, "opt", "bench-wheel"), exist_ok=True)
            inside = os.path.join("/opt/bench-wheel", os.path.basename(whl))
            shutil.copy(whl, os.path.join(ROOTS, suite) + inside)
            in_root(suite, python, ["-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", inside])
        args = ["benchmarks/native/native_child.py", json.dumps({"mode": "merge", "seconds": seconds})]
        result = json.loads(in_root(suite, python, args, timeout=300).splitlines()[-1])
        out.append(Merge(result["python"] + ("t" if python == FREE_THREADED_PYTHON else ""), build, result))
    return out


def run(quick: bool) -> Section:
    seconds = 5.0 if quick else 10.0
    whl = wheel()
    merges = in_pyenv(seconds, whl) + in_roots(seconds, whl)
    section = Section(
        "Native merge on each interpreter",
        f"2 numpy matmul threads and a libc qsort calling back a Python comparator, {seconds:.0f} s at "
        "100 Hz with native=True (budget 0.2), in each interpreter this machine has: pyenv's builds "
        "(symbols kept) and the Debian roots of ci/matrix.sh (stripped). A capture is mismatched when "
        "its native stack and its sample's Python frames disagree: the sample keeps its Python frames.",
    )
    section.tables.append(
        table(
            [
                "CPython",
                "build",
                "reader",
                "captures",
                "exact (frames copied by the signal)",
                "mismatched",
                "matmul samples with gemm",
                "comparator samples in order",
                "achieved Hz",
                f"mismatched ≤ {100 * MISMATCHED_MAX:.0f}%",
            ],
            [m.row() for m in merges],
        )
    )
    if not merges:
        section.notes.append(f"No interpreter found: neither pyenv's ({PYENV_VERSIONS}) nor ci/matrix.sh's roots.")
        return section
    worst = max(merges, key=lambda m: m.mismatched_share)
    met = verdict(worst.mismatched_share <= MISMATCHED_MAX)
    section.notes.append(
        f"Target: mismatched ≤ {100 * MISMATCHED_MAX:.0f}% of captures on every interpreter. Worst "
        f"{100 * worst.mismatched_share:.1f}% ({worst.interpreter}): {met}."
    )
    section.notes.append(
        "Where the reader is py-spy's (CPython before 3.11), the signal copies no Python frames: a capture "
        "is merged with the frames the tick read a little later, and a thread whose Python stack moves "
        "between the two (the comparator's calls come and go in microseconds) mismatches."
    )
    return section
