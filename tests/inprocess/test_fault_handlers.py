"""The fast reader copies memory with plain loads, under a fault handler of its own that
passes every fault it did not cause to the handler before it: the application's own
handlers, installed before or after the sampler, still see their faults, and the
process's dispositions are as they were once the sampler stops."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the fast reader reads 3.11 and later")

CHILD = """
import faulthandler, json, sys, threading, time
from dask_pyspy import Sampler

def caught():
    with open("/proc/self/status") as f:
        mask = int(next(l for l in f if l.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> 10 & 1)  # SIGSEGV is signal 11: bit 10

def spin(stop):
    while not stop.is_set():
        sum(range(100))

report = {"caught_before": caught()}
if BEFORE:
    faulthandler.enable()
stop = threading.Event()
t = threading.Thread(target=spin, args=(stop,))
t.start()
s = Sampler(rate=200, cpu_budget=1.0)
s.start()
if AFTER:
    faulthandler.enable()
deadline = time.monotonic() + 60
while s.stats()["ticks"] < 20 and time.monotonic() < deadline:
    time.sleep(0.05)
stats = s.stats()
report.update(ticks=stats["ticks"], failed=stats["failed_ticks"], reads_by=stats["reader_stats"]["reads_by"],
              caught_while=caught())
if not CRASH:
    s.stop()
    report["caught_after"] = caught()
stop.set()
t.join()
print(json.dumps(report), flush=True)
if CRASH:
    import ctypes
    ctypes.string_at(0)  # a fault of the application's own
"""


def run(before: bool = False, after: bool = False, crash: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    code = f"BEFORE, AFTER, CRASH = {before}, {after}, {crash}\n{CHILD}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-2000:]
    return done, json.loads(lines[-1])


def test_reads_are_copies_and_the_disposition_comes_back():
    done, r = run()
    assert done.returncode == 0, done.stderr[-2000:]
    assert r["reads_by"] == "copy" and r["ticks"] >= 20 and r["failed"] == 0, r
    assert not r["caught_before"] and r["caught_while"] and not r["caught_after"], r


@pytest.mark.parametrize("before", [False, True], ids=["default", "faulthandler-first"])
def test_a_fault_of_the_application_meets_its_own_fate(before):
    """Without a handler, the default action (killed by SIGSEGV); with faulthandler
    installed first, its report, as without the sampler."""
    done, r = run(before=before, crash=True)
    assert r["reads_by"] == "copy", r
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert ("Fatal Python error: Segmentation fault" in done.stderr) == before, done.stderr[-2000:]


def test_a_handler_installed_after_the_sampler_wins():
    """faulthandler, enabled once the sampler runs, replaces our handler: the reader
    goes back to the system call, and the application's fault is faulthandler's."""
    done, r = run(after=True, crash=True)
    assert r["reads_by"] == "process_vm_readv" and r["ticks"] >= 20 and r["failed"] == 0, r
    assert done.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr[-2000:]
