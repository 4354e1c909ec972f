"""The native benchmark's children: native_child.py runs each measurement in a process of its
own (py-spy records the agreement runs from outside), and what a run's stats say: lost reads,
native signals, fidelity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

CHILD = os.path.join(os.path.dirname(__file__), "native_child.py")
PYSPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
# The child imports numpy after setting this too; here it also holds for its start-up.
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
PYSPY_RATE = 50

Doc = dict[str, Any]


def run_child(args: dict[str, Any], timeout: float = 600, python: str = sys.executable) -> dict[str, Any]:
    """native_child.py's result for `args`, run by `python` (another interpreter: native_merge)."""
    done = subprocess.run([python, CHILD, json.dumps(args)], capture_output=True, text=True, env=ENV, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"native_child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


@dataclass
class Recording:
    """One agreement run: dask-pyspy's profile and stats, and py-spy's profile if it ran."""

    doc: Doc
    stats: dict[str, Any]
    #: dask-pyspy's samples of threads on a CPU or waiting for one.
    running: Doc
    pyspy: Doc | None = None
    complaint: str = ""

    @property
    def captured(self) -> float:
        """The share of the kept samples that carry native frames."""
        return self.stats["native"]["merged"] / max(self.stats["store"]["samples_recorded"], 1)


def record(layout: str, seconds: float, tmp: str, with_pyspy: bool) -> Recording:
    """The workload recorded by dask-pyspy inside it for about `seconds`, and by py-spy
    --native from outside at the same time if `with_pyspy`."""
    ours = os.path.join(tmp, f"{layout}-{with_pyspy}-ours.json")
    running = os.path.join(tmp, f"{layout}-{with_pyspy}-ours-running.json")
    theirs = os.path.join(tmp, f"{layout}-pyspy.json") if with_pyspy else None
    out, complaint = recorded({"layout": layout, "out": ours, "running": running}, seconds, theirs)
    with open(ours) as f, open(running) as g:
        got = Recording(json.load(f), json.loads(out.splitlines()[-1])["stats"], json.load(g))
    got.pyspy, got.complaint = None if complaint else pyspy_doc(theirs), complaint
    return got


def pyspy_alone(layout: str, seconds: float, tmp: str) -> tuple[Doc | None, str]:
    """The workload recorded by py-spy --native alone (dask-pyspy not sampling), and why not."""
    theirs = os.path.join(tmp, f"{layout}-pyspy-alone.json")
    _, complaint = recorded({"layout": layout}, seconds, theirs)
    return None if complaint else pyspy_doc(theirs), complaint


def pyspy_doc(path: str | None) -> Doc | None:
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        doc: Doc = json.load(f)
    return doc


def recorded(args: dict[str, Any], seconds: float, pyspy_out: str | None) -> tuple[str, str]:
    """Runs the agreement child with `args` for about `seconds`, with py-spy recording it
    into `pyspy_out` if given: the child's stdout, and py-spy's complaint if it failed."""
    child = subprocess.Popen(
        [sys.executable, CHILD, json.dumps({"mode": "agreement", **args})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert child.stdin is not None and child.stdout is not None
    complaint = ""
    try:
        assert child.stdout.readline().strip() == "ready", "the agreement child did not start"
        if pyspy_out is not None:
            spy = subprocess.run(
                [PYSPY, "record", "--native", "--rate", str(PYSPY_RATE), "--pid", str(child.pid)]
                + ["--duration", str(round(seconds)), "--format", "speedscope", "--output", pyspy_out],
                capture_output=True,
                text=True,
                timeout=seconds + 120,
            )
            complaint = spy.stderr.strip()[-300:] if spy.returncode != 0 else ""
        else:
            time.sleep(seconds)
        child.stdin.write("stop\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    if child.returncode != 0:
        raise RuntimeError(f"agreement child ({args['layout']}) exited with {child.returncode}")
    return out, complaint


def cost_run(native: bool, seconds: float, budget: float | None = None) -> dict[str, float]:
    stats = run_child({"mode": "cost", "native": native, "seconds": seconds, "budget": budget})["stats"]
    out = {
        "rate": stats["achieved_rate"],
        "cpu": stats["cpu_fraction"],
        "throttled": stats["throttled_ticks"] / max(stats["ticks"], 1),
        **lost_reads(stats),
    }
    if native:
        n = stats["native"]
        # The last two medians: a baseline that signalled on request also gave its round trip first.
        out.update(zip(("unwind", "symbols"), n["median_us"][-2:]))
        out.update({k: float(n.get(k, 0)) for k in ("captures", "spared", "no_capture", "merged", "mismatched")})
    return out


#: What native capture did, by the names of the build at hand: timers on the threads'
#: CPU clocks (captures ...), or signals on request in a baseline (asked ...).
COUNTED = (
    *("captures", "spared", "exact", "lent", "no_capture", "not_signalled", "busy"),
    *("asked", "answered", "timed_out", "blocked", "blocked_lately", "still_pending"),
)


def signals(n: dict[str, Any]) -> str:
    """What native capture did with the threads it considered, as counts."""
    return ", ".join(f"{k.replace('_', ' ')} {n[k]}" for k in COUNTED if k in n)


def lost_reads(stats: dict[str, Any]) -> dict[str, float]:
    r = stats["reader_stats"]
    return {"lost": float(r.get("lost_reads", 0)), "reads": float(r.get("thread_reads", 0))}


@dataclass
class Fidelity:
    """One run's lost reads and native mismatches."""

    run: str
    lost: float
    reads: float
    mismatched: float | None  # None: native capture off
    merged: float
    rate: str

    @classmethod
    def of(cls, run: str, stats: dict[str, Any]) -> Fidelity:
        n = stats.get("native")
        return cls(
            run,
            **lost_reads(stats),
            mismatched=n["mismatched"] if n else None,
            merged=n["merged"] if n else 0,
            rate=f"{stats['achieved_rate']:.1f}",
        )

    @property
    def lost_share(self) -> float:
        return self.lost / self.reads if self.reads else 0.0

    def row(self) -> list[object]:
        mismatched = "-" if self.mismatched is None else f"{self.mismatched:.0f} / {self.merged:.0f}"
        return [self.run, f"{100 * self.lost_share:.2f}% ({self.lost:.0f} of {self.reads:.0f})", mismatched, self.rate]
