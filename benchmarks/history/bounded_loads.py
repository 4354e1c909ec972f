"""Bounded loads (issue 21): a gzip bomb named `.pyspy.gz` is refused by `Profile.load`
and by `dask-pyspy diff` without first taking the memory it would decompress to."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import Section, table, verdict
from dask_pyspy import Sampler

GB = 10  # of zeros, as the target says
MEMBER = 1 << 20  # decompressed bytes per gzip member
PEAK_MIB = 200  # the target: peak RSS of the refusing process

# A refusal is the uncaught ValueError: its last line is what the user reads.
LOAD = "import sys; from dask_pyspy import Profile; Profile.load(sys.argv[1])"


def write_bomb(path: str) -> None:
    """`GB` GB of zeros as concatenated gzip members of 1 MiB each (~1 KB apiece), which
    gzip, Python and dask-pyspy read as one file."""
    member = gzip.compress(bytes(MEMBER), 9)
    with open(path, "wb") as f:
        for _ in range(GB * 10**9 // MEMBER):
            f.write(member)


def write_good(path: str) -> None:
    sampler = Sampler(rate=200, idle=True)
    sampler.start()
    deadline = time.time() + 60
    while sampler.stats()["store"]["samples_held"] < 20 and time.time() < deadline:
        sum(range(10_000))
    sampler.stop()
    sampler.profile(0, time.time()).save(path)


# Runs the code in argv[1] with the rest as its argv, then prints the process's peak RSS
# (VmHWM, which exec resets; ru_maxrss would count the forking benchmark's own pages).
PEAK = """
import atexit, sys
def peak():
    with open("/proc/self/status") as f:
        print("peak-kib", next(line.split()[1] for line in f if line.startswith("VmHWM:")), file=sys.stderr)
atexit.register(peak)
code, sys.argv = sys.argv[1], sys.argv[1:]
exec(code)
"""

DIFF = "import runpy; runpy.run_module('dask_pyspy', run_name='__main__')"


def measured(code: str, *args: str) -> tuple[str, float, float]:
    """What `code` said (its last line but the peak), its wall seconds and peak RSS in MiB."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, code, *args], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - began
    lines = (done.stdout + done.stderr).strip().splitlines()
    peak = next(int(line.split()[1]) for line in lines if line.startswith("peak-kib"))
    said = [line for line in lines if not line.startswith("peak-kib")]
    return (said[-1] if said else ""), wall, peak / 1024


def run(quick: bool) -> Section:
    with tempfile.TemporaryDirectory() as tmp:
        bomb, good = os.path.join(tmp, "bomb.pyspy.gz"), os.path.join(tmp, "good.pyspy.gz")
        write_bomb(bomb)
        write_good(good)
        size = os.path.getsize(bomb)
        cases = {
            "import dask_pyspy (the interpreter alone)": ("import dask_pyspy",),
            "Profile.load(bomb)": (LOAD, bomb),
            "dask-pyspy diff good bomb": (DIFF, "diff", good, bomb, "-o", os.path.join(tmp, "diff.html")),
        }
        results = {name: measured(*case) for name, case in cases.items()}
    rows = [[name, f"{wall:.2f}", f"{peak:.0f}", said[:160]] for name, (said, wall, peak) in results.items()]
    refusals = [results["Profile.load(bomb)"], results["dask-pyspy diff good bomb"]]
    refused = all("cannot load" in said and "decompresses to more than" in said for said, _, _ in refusals)
    peak = max(p for _, _, p in refusals)
    return Section(
        "Bounded loads (issue 21)",
        f"A gzip bomb named `.pyspy.gz`: {GB} GB of zeros in {size / 2**20:.1f} MiB (1 MiB gzip members, "
        "concatenated), loaded by a fresh process each way, under the default config (`pyspy.max-result` 512 "
        "MiB). Peak RSS = the process's VmHWM at its exit.",
        [table(["process", "wall s", "peak RSS MiB", "what it said"], rows)],
        [
            f"Target (issue 21): a {GB} GB-of-zeros gzip bomb named `.pyspy.gz` is refused with peak RSS < "
            f"{PEAK_MIB} MiB. Refused by both: {'yes' if refused else 'NO'}; peak {peak:.0f} MiB: "
            f"{verdict(refused and peak < PEAK_MIB)}.",
        ],
    )
