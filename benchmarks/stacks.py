"""Task functions with realistic stacks, for the collection benchmark (importable by worker processes).

Six task prefixes, each going through its own handful of functions (their own file names
and lines) along one of `VARIANTS` call paths, 6-26 frames below the task function, so a
task thread is 15-40 frames deep. The time goes in small sleeps with a little pure-Python
compute between them, at 3 stops along the path: 64 task threads then fit on 2 cores.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

PREFIXES = ("read_parquet", "parse_records", "merge_tables", "groupby_agg", "fit_model", "write_results")
STEPS = ("open", "decode", "validate", "transform", "dispatch")  # functions per prefix
VARIANTS = 48  # call paths per prefix
STOPS = 3  # depths along a path where the task spends time
SLICE = 0.02  # seconds of each sleep

# Two call sites per step: the same function is on the stack at either of two lines.
_STEP = """
def {name}(path, depth, seconds):
    if depth in path.stops:
        wait_io(seconds / STOPS)
    if depth == len(path.calls):
        return 0
    if depth % 2:
        return path.calls[depth](path, depth + 1, seconds)
    return path.calls[depth](path, depth + 1, seconds) + 1
"""

_TASK = """
def {prefix}(variant, seconds):
    path = PATHS[{prefix!r}][variant]
    return path.calls[0](path, 1, seconds)
"""


def checksum(n: int) -> int:
    return sum(i * i for i in range(n))


def wait_io(seconds: float) -> int:
    """Sleep in slices, with ~0.5% of the time in Python between them."""
    end = time.perf_counter() + seconds
    n = 0
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(SLICE, left))
        n += checksum(400)
    return n


class Path:
    def __init__(self, calls: list[Callable[..., int]], stops: set[int]) -> None:
        self.calls = calls
        self.stops = stops


def _module(prefix: str) -> dict[str, Any]:
    """The prefix's functions, compiled under a file name of their own as a library's would be."""
    namespace: dict[str, Any] = {"wait_io": wait_io, "STOPS": STOPS, "PATHS": PATHS, "__name__": __name__}
    source = "".join(_STEP.format(name=f"{prefix}_{step}") for step in STEPS) + _TASK.format(prefix=prefix)
    exec(compile(source, f"pipeline/{prefix}.py", "exec"), namespace)
    return namespace


def _paths(prefix: str, namespace: dict[str, Any]) -> list[Path]:
    rng = random.Random(prefix)  # the same paths in every process
    steps = [namespace[f"{prefix}_{step}"] for step in STEPS]
    paths = []
    for _ in range(VARIANTS):
        depth = rng.randint(6, 26)
        paths.append(Path([rng.choice(steps) for _ in range(depth)], set(rng.sample(range(1, depth + 1), STOPS))))
    return paths


PATHS: dict[str, list[Path]] = {}
TASKS: dict[str, Callable[[int, float], int]] = {}
for _prefix in PREFIXES:
    _ns = _module(_prefix)
    PATHS[_prefix] = _paths(_prefix, _ns)
    # A module attribute, so the task function pickles by reference.
    TASKS[_prefix] = globals()[_prefix] = _ns[_prefix]
